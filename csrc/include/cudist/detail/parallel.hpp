/// @file detail/parallel.hpp
/// @brief How the kernels split their work over a thread_pool (private).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "../thread_pool.hpp"
#include "store.hpp"

namespace cudist {
namespace detail {

/// Bytes of each buffer handled per inner block: small enough that the block's temporaries stay
/// in L1 next to the streams, big enough to amortise the per-block loop over replicas.
#ifndef CUDIST_BLOCK_BYTES
#define CUDIST_BLOCK_BYTES 4096
#endif
constexpr std::size_t kBlockBytes = CUDIST_BLOCK_BYTES;
/// Below this many bytes moved in all, a kernel runs inline on the caller: even a spinning worker
/// costs more than it saves. Adjustable through cudist::set_parallel_thresholds().
inline std::atomic<std::size_t> parallel_min_bytes{std::size_t{1} << 20};
/// The same when no worker is spinning (thread_pool::warm()): a blocked worker takes tens of
/// microseconds to wake on a VM (measured on 2 vCPUs, 4 replicas all-reduced in place: 4 x 512 KiB
/// took 42 us on the caller alone and 73 us with the worker woken; 4 x 1 MiB, 145 us and 123 us).
inline std::atomic<std::size_t> cold_parallel_min_bytes{std::size_t{8} << 20};
/// Each thread gets at least this many bytes moved.
constexpr std::size_t kMinBytesPerThread = std::size_t{256} << 10;
/// From this many bytes written in all, outputs are written with streaming stores: the data
/// cannot stay in cache anyway, and streaming saves the reads-for-ownership. Adjustable (for
/// benchmarks) through cudist::set_streaming_threshold().
inline std::atomic<std::size_t> stream_min_bytes{std::size_t{16} << 20};

/// Runs ``fn(begin, end, stream)`` over ``[0, count)`` elements, inline when small, else on
/// ``pool`` in chunks of whole blocks (``block`` elements), fencing streaming stores per chunk.
///
/// ``bytes_moved`` is the total traffic (reads + writes) and ``bytes_written`` the writes.
template <class F>
void run_blocks(thread_pool* pool, std::size_t count, std::size_t block, std::size_t bytes_moved,
                std::size_t bytes_written, F&& fn) {
  if (count == 0) return;
  const bool stream = bytes_written >= stream_min_bytes.load(std::memory_order_relaxed);
  const std::size_t warm_min = parallel_min_bytes.load(std::memory_order_relaxed);
  if (pool == nullptr || pool->size() <= 1 || bytes_moved < warm_min) {
    fn(std::size_t{0}, count, stream);
    if (stream) store_fence();
    return;
  }
  // A call that could use the pool: marked, so the pool knows whether calls come close together.
  struct mark {
    thread_pool* p;
    bool open = true;
    explicit mark(thread_pool* q) : p(q) { p->call_started(); }
    void end_now() {
      p->call_ended();
      open = false;
    }
    ~mark() {
      if (open) p->call_ended();
    }
  } marked(pool);
  if (bytes_moved < cold_parallel_min_bytes.load(std::memory_order_relaxed) && !pool->warm()) {
    // Worth the workers only if they are spinning; if calls come close together, they will be:
    // woken once this call is done, so that they spin through the gap to the next one (woken at its
    // start, they would spin through this call instead, and stop before the next one when this call
    // and the gap together outlast their spin: measured, 64 leaves of 1 MiB in all on 4 replicas
    // through strategy.run, every call on its caller alone, 220 us each).
    fn(std::size_t{0}, count, stream);
    if (stream) store_fence();
    marked.end_now();
    pool->wake();
    return;
  }
  const unsigned threads = static_cast<unsigned>(
      std::max<std::size_t>(1, std::min<std::size_t>(pool->size(), bytes_moved / kMinBytesPerThread)));
  // A few chunks per thread so a preempted thread's share gets picked up by the others.
  const std::size_t chunks = std::size_t{threads} * 4;
  pool->parallel_for(
      count, chunks, block,
      [&](std::size_t b, std::size_t e) {
        fn(b, e, stream);
        if (stream) store_fence();
      },
      threads);
}

/// True when the byte ranges [a, a+n) and [b, b+n) overlap without being the same range.
inline bool partial_overlap(const void* a, const void* b, std::size_t n) noexcept {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x != y && x < y + n && y < x + n;
}

}  // namespace detail

/// Sets how many bytes a kernel must move in all (reads + writes) before it splits its work over
/// its pool: ``warm_bytes`` when a worker is spinning (thread_pool::warm()), ``cold_bytes`` when the
/// workers would have to be woken (a cold threshold below the warm one counts as the warm one).
/// Returns the previous pair. Process-wide; for benchmarks and tests.
inline std::pair<std::size_t, std::size_t> set_parallel_thresholds(std::size_t warm_bytes, std::size_t cold_bytes) noexcept {
  return {detail::parallel_min_bytes.exchange(warm_bytes, std::memory_order_relaxed),
          detail::cold_parallel_min_bytes.exchange(cold_bytes, std::memory_order_relaxed)};
}

/// Sets how many bytes a kernel must write in all before it uses non-temporal (streaming)
/// stores; returns the previous value. 0 streams always, SIZE_MAX never. Process-wide.
inline std::size_t set_streaming_threshold(std::size_t bytes) noexcept {
  return detail::stream_min_bytes.exchange(bytes, std::memory_order_relaxed);
}

}  // namespace cudist
