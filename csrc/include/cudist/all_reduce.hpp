/// @file all_reduce.hpp
/// @brief Collectives over N same-size replica buffers in host memory: all_reduce, reduce_to_one,
/// broadcast, all_gather.
///
/// Every kernel makes one pass over memory (each input element read once, each output element
/// written once), split over a thread_pool when the buffers are large and run inline on the caller
/// when they are small. The reduction order is fixed (replica 0, 1, ..., N-1) and nothing is
/// reassociated, so results are bit-identical to NumPy's ``((b0 + b1) + b2) + ...`` whatever the
/// thread count. Buffers that are exactly the same memory may be passed more than once; buffers
/// that partially overlap are handled through a temporary copy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "detail/arith.hpp"
#include "detail/bf16_line.hpp"
#include "detail/parallel.hpp"
#include "detail/store.hpp"
#include "half.hpp"
#include "reduce_op.hpp"
#include "thread_pool.hpp"

namespace cudist {

namespace detail {

/// Reduces the K elements at ``i`` of the ``n_in`` inputs into ``res``. Compile-time trip counts,
/// so the partial sums of the line live in vector registers.
template <class T, std::size_t K>
inline void reduce_line(const T* const* in, std::size_t n_in, std::size_t i, bool mean,
                        typename arith<T>::acc_t cnt, T* res) noexcept {
#ifdef CUDIST_BF16_SSE2
  if constexpr (std::is_same<T, bfloat16>::value) {
#ifdef CUDIST_BF16_AVX2
    if (bf16_use_avx2()) {
      reduce_line_bf16_avx2<K>(in, n_in, i, mean, cnt, res);
      return;
    }
#endif
    reduce_line_bf16<K>(in, n_in, i, mean, cnt, res);
    return;
  }
#endif
  using A = arith<T>;
  typename A::acc_t acc[K];
  const T* p0 = in[0] + i;
  prefetch(p0);
  for (std::size_t k = 0; k < K; ++k) acc[k] = A::load(p0[k]);
  for (std::size_t r = 1; r < n_in; ++r) {
    const T* p = in[r] + i;
    prefetch(p);
    for (std::size_t k = 0; k < K; ++k) acc[k] = A::add(acc[k], A::load(p[k]));
  }
  if (mean) {
    for (std::size_t k = 0; k < K; ++k) acc[k] = A::div_n(acc[k], cnt);
  }
  for (std::size_t k = 0; k < K; ++k) res[k] = A::store(acc[k]);
}

/// Reduces elements [begin, end) of the ``n_in`` inputs and writes the result to the ``n_out``
/// outputs.
///
/// It works one cache line of every stream at a time, so the reads and writes of all N streams stay
/// interleaved as in a per-element loop (every hardware prefetch stream stays busy). With
/// streaming, it first advances with ordinary stores to where out[0] starts a cache line, then
/// reduces two lines at a time and writes them with non-temporal stores to every output that is
/// line-aligned there too (whole lines at once: measured ~1.3x faster than reducing a 4 KiB block
/// first and streaming it out afterwards; outputs offset differently from out[0] get ordinary
/// stores, since partial non-temporal lines are very slow).
template <class T>
void reduce_range(const T* const* in, std::size_t n_in, T* const* out, std::size_t n_out, reduce_op op,
                  std::size_t begin, std::size_t end, bool stream) {
  using A = arith<T>;
  constexpr std::size_t K = kLineBytes / sizeof(T);
  const auto cnt = A::count(n_in);
  const bool mean = op == reduce_op::mean;
  auto one = [&](std::size_t i) {
    auto a = A::load(in[0][i]);
    for (std::size_t r = 1; r < n_in; ++r) a = A::add(a, A::load(in[r][i]));
    if (mean) a = A::div_n(a, cnt);
    const T v = A::store(a);
    for (std::size_t o = 0; o < n_out; ++o) out[o][i] = v;
  };
  std::size_t i = begin;
  const auto mis = reinterpret_cast<std::uintptr_t>(out[0] + i) & (kLineBytes - 1);
  if (stream && mis % sizeof(T) == 0) {
    const std::size_t head = std::min<std::size_t>(mis ? (kLineBytes - mis) / sizeof(T) : 0, end - i);
    for (const std::size_t stop = i + head; i < stop; ++i) one(i);
    alignas(64) T res[2 * K];
    for (; i + 2 * K <= end; i += 2 * K) {
      reduce_line<T, K>(in, n_in, i, mean, cnt, res);
      reduce_line<T, K>(in, n_in, i + K, mean, cnt, res + K);
      for (std::size_t o = 0; o < n_out; ++o) {
        T* d = out[o] + i;
        if (line_aligned(d)) {
          stream_lines<2>(d, res);
        } else {
          store_line<T, K>(d, res);
          store_line<T, K>(d + K, res + K);
        }
      }
    }
  }
  alignas(64) T res[K];
  for (; i + K <= end; i += K) {
    reduce_line<T, K>(in, n_in, i, mean, cnt, res);
    for (std::size_t o = 0; o < n_out; ++o) store_line<T, K>(out[o] + i, res);
  }
  for (; i < end; ++i) one(i);
}

template <class T>
bool any_partial_overlap(const T* const* a, std::size_t na, const T* const* b, std::size_t nb,
                         std::size_t count) noexcept {
  for (std::size_t i = 0; i < na; ++i)
    for (std::size_t j = 0; j < nb; ++j)
      if (partial_overlap(a[i], b[j], count * sizeof(T))) return true;
  return false;
}

}  // namespace detail

/// Copies ``src`` into each of the ``n`` buffers ``dsts`` (``count`` elements each).
///
/// @param src    source buffer; may be one of ``dsts``.
/// @param dsts   destination buffers.
/// @param n      number of destinations.
/// @param count  elements per buffer.
/// @param pool   pool to parallelise over, or nullptr to run on the caller.
template <class T>
void broadcast(const T* src, T* const* dsts, std::size_t n, std::size_t count,
               thread_pool* pool = &thread_pool::global()) {
  if (n == 0 || count == 0) return;
  std::vector<T> snapshot;
  if (detail::any_partial_overlap(&src, 1, dsts, n, count)) {
    snapshot.assign(src, src + count);
    src = snapshot.data();
  }
  constexpr std::size_t B = detail::kBlockBytes / sizeof(T);
  const std::size_t bytes = count * sizeof(T);
  // The destination the blocks line up with when streaming (the first that is not the source).
  const T* ref = nullptr;
  for (std::size_t o = 0; o < n && ref == nullptr; ++o)
    if (dsts[o] != src) ref = dsts[o];
  detail::run_blocks(pool, count, B, bytes * (n + 1), bytes * n, [&](std::size_t b, std::size_t e, bool stream) {
    std::size_t s = b;
    if (stream && ref != nullptr) {
      // Streamed blocks start a cache line of ``ref`` (and of every destination at the same offset
      // in its line, as NumPy's large arrays all are: 16 bytes past a line). Otherwise each block
      // would begin and end with a partial line written by ordinary stores, whose read for
      // ownership stalls the streaming stores queued behind it: a 512 MiB copy at 16 bytes past a
      // line ran at 30 GB/s against 50 GB/s aligned (2 threads, 2 MiB pages).
      const auto mis = reinterpret_cast<std::uintptr_t>(ref + s) & (detail::kLineBytes - 1);
      if (mis != 0 && mis % sizeof(T) == 0) {
        const std::size_t head = std::min<std::size_t>((detail::kLineBytes - mis) / sizeof(T), e - s);
        for (std::size_t o = 0; o < n; ++o)
          if (dsts[o] != src) std::memcpy(dsts[o] + s, src + s, head * sizeof(T));
        s += head;
      }
    }
    // Block by block, so the source is read from memory once and copied from cache N times.
    for (; s < e; s += B) {
      const std::size_t len = std::min(B, e - s);
      for (std::size_t o = 0; o < n; ++o)
        if (dsts[o] != src) detail::copy_block(dsts[o] + s, src + s, len * sizeof(T), stream);
    }
  });
}

/// Reduces the ``n`` buffers ``bufs`` elementwise into ``out``.
///
/// @param bufs   input buffers, ``count`` elements each.
/// @param n      number of buffers (at least 1).
/// @param count  elements per buffer.
/// @param op     reduce_op::sum or reduce_op::mean.
/// @param out    output buffer; may be one of ``bufs``.
/// @param pool   pool to parallelise over, or nullptr to run on the caller.
template <class T>
void reduce_to_one(const T* const* bufs, std::size_t n, std::size_t count, reduce_op op, T* out,
                   thread_pool* pool = &thread_pool::global()) {
  if (n == 0 || count == 0) return;
  if (detail::any_partial_overlap(bufs, n, &out, 1, count)) {
    std::vector<T> tmp(count);
    reduce_to_one(bufs, n, count, op, tmp.data(), pool);
    std::memcpy(out, tmp.data(), count * sizeof(T));
    return;
  }
  constexpr std::size_t B = detail::kBlockBytes / sizeof(T);
  const std::size_t bytes = count * sizeof(T);
  T* outs[1] = {out};
  bool out_is_input = false;
  for (std::size_t i = 0; i < n; ++i) out_is_input |= bufs[i] == out;
  detail::run_blocks(pool, count, B, bytes * (n + 1), out_is_input ? 0 : bytes,
                     [&](std::size_t b, std::size_t e, bool stream) {
                       detail::reduce_range<T>(bufs, n, outs, 1, op, b, e, stream);
                     });
}

/// All-reduce in place: every one of the ``n`` buffers becomes the reduction of all of them.
///
/// Fused: one pass reads the N inputs and writes the N outputs of each element, so the memory
/// traffic is 2 * n * count * sizeof(T) bytes.
///
/// @param bufs   the replica buffers, ``count`` elements each; read and written.
/// @param n      number of buffers.
/// @param count  elements per buffer.
/// @param op     reduce_op::sum or reduce_op::mean.
/// @param pool   pool to parallelise over, or nullptr to run on the caller.
template <class T>
void all_reduce(T* const* bufs, std::size_t n, std::size_t count, reduce_op op,
                thread_pool* pool = &thread_pool::global()) {
  if (n <= 1 || count == 0) return;  // one replica: its sum and its mean are itself
  const T* const* in = const_cast<const T* const*>(bufs);
  if (detail::any_partial_overlap(in, n, in, n, count)) {
    // Reduce everything before writing anything; then write in buffer order, as NumPy would.
    std::vector<T> tmp(count);
    reduce_to_one(in, n, count, op, tmp.data(), pool);
    for (std::size_t o = 0; o < n; ++o) std::memcpy(bufs[o], tmp.data(), count * sizeof(T));
    return;
  }
  constexpr std::size_t B = detail::kBlockBytes / sizeof(T);
  const std::size_t bytes = count * sizeof(T);
  // Never streaming: every line written was just read, so it is in cache already, and a
  // non-temporal store to a cached line costs an eviction instead of saving a read.
  detail::run_blocks(pool, count, B, 2 * n * bytes, 0, [&](std::size_t b, std::size_t e, bool) {
    detail::reduce_range<T>(in, n, bufs, n, op, b, e, false);
  });
}

/// All-reduce out of place: every one of the ``n`` outputs becomes the reduction of the ``n``
/// inputs.
///
/// Fused: one pass reads each input element once and writes each output element once, so the
/// memory traffic is 2 * n * count * sizeof(T) bytes; large outputs that are not inputs are written
/// with streaming stores (no read for ownership). ``out[i] == in[i]`` for every i is the in-place
/// all_reduce; an output may also be exactly an input. Outputs that partially overlap an input or
/// another output are handled through a temporary copy (everything is reduced before anything is
/// written, then the outputs are written in order, as NumPy would).
///
/// @param in     the input buffers, ``count`` elements each; only read.
/// @param out    the output buffers, ``count`` elements each.
/// @param n      number of inputs and of outputs.
/// @param count  elements per buffer.
/// @param op     reduce_op::sum or reduce_op::mean.
/// @param pool   pool to parallelise over, or nullptr to run on the caller.
template <class T>
void all_reduce(const T* const* in, T* const* out, std::size_t n, std::size_t count, reduce_op op,
                thread_pool* pool = &thread_pool::global()) {
  if (n == 0 || count == 0) return;
  bool in_place = true;
  for (std::size_t i = 0; i < n && in_place; ++i) in_place = in[i] == out[i];
  if (in_place) {
    all_reduce(out, n, count, op, pool);
    return;
  }
  const T* const* outs_c = const_cast<const T* const*>(out);
  if (detail::any_partial_overlap(in, n, outs_c, n, count) || detail::any_partial_overlap(outs_c, n, outs_c, n, count)) {
    std::vector<T> tmp(count);
    reduce_to_one(in, n, count, op, tmp.data(), pool);
    for (std::size_t o = 0; o < n; ++o) std::memcpy(out[o], tmp.data(), count * sizeof(T));
    return;
  }
  bool out_is_input = false;
  for (std::size_t o = 0; o < n && !out_is_input; ++o)
    for (std::size_t i = 0; i < n; ++i) out_is_input |= in[i] == outs_c[o];
  constexpr std::size_t B = detail::kBlockBytes / sizeof(T);
  const std::size_t bytes = count * sizeof(T);
  // Streaming only when no output is an input: an input's lines were just read into cache.
  detail::run_blocks(pool, count, B, 2 * n * bytes, out_is_input ? 0 : n * bytes,
                     [&](std::size_t b, std::size_t e, bool stream) {
                       detail::reduce_range<T>(in, n, out, n, op, b, e, stream);
                     });
}

/// Batched all-reduce: ``n_segs`` independent all-reduces (segments, e.g. the leaves of a nest)
/// in one dispatch over the thread pool.
///
/// Segment ``s`` has ``counts[s]`` elements per buffer; its inputs are ``in[s * n + r]`` and its
/// outputs ``out[s * n + r]`` for replica ``r < n``. Each segment follows all_reduce(in, out, ...)
/// (outputs may be exactly their inputs; partial overlaps within a segment go through a temporary),
/// but the segments share one parallel loop over their concatenated elements, so many small leaves
/// cost one dispatch, not one each. Buffers of different segments must not overlap (except that a
/// buffer may be read by several segments).
///
/// @param in      ``n_segs * n`` input pointers, segment-major.
/// @param out     ``n_segs * n`` output pointers, segment-major.
/// @param n       number of replicas.
/// @param counts  elements per buffer of each segment.
/// @param n_segs  number of segments.
/// @param op      reduce_op::sum or reduce_op::mean.
/// @param pool    pool to parallelise over, or nullptr to run on the caller.
template <class T>
void batch_all_reduce(const T* const* in, T* const* out, std::size_t n, const std::size_t* counts, std::size_t n_segs,
                      reduce_op op, thread_pool* pool = &thread_pool::global()) {
  if (n == 0 || n_segs == 0) return;
  // Segments that need special handling (partial overlaps, or in place over one replica) are done
  // on their own first; the others join the shared loop. `flags`: 0 skip, 1 plain, 2 streamable.
  std::vector<unsigned char> flags(n_segs, 0);
  std::vector<std::size_t> offset(n_segs + 1, 0);
  std::size_t written = 0;
  for (std::size_t s = 0; s < n_segs; ++s) {
    const std::size_t count = counts[s];
    offset[s + 1] = offset[s];
    if (count == 0) continue;
    const T* const* si = in + s * n;
    T* const* so = out + s * n;
    const T* const* so_c = const_cast<const T* const*>(so);
    bool in_place = true;
    for (std::size_t r = 0; r < n && in_place; ++r) in_place = si[r] == so[r];
    if (in_place && n == 1) continue;  // one replica in place: nothing to do
    if (detail::any_partial_overlap(si, n, so_c, n, count) || detail::any_partial_overlap(so_c, n, so_c, n, count)) {
      all_reduce<T>(si, so, n, count, op, pool);  // through a temporary
      continue;
    }
    bool out_is_input = in_place;
    for (std::size_t o = 0; o < n && !out_is_input; ++o)
      for (std::size_t r = 0; r < n; ++r) out_is_input |= si[r] == so_c[o];
    flags[s] = out_is_input ? 1 : 2;
    if (!out_is_input) written += n * count * sizeof(T);
    offset[s + 1] = offset[s] + count;
  }
  const std::size_t total = offset[n_segs];
  if (total == 0) return;
  constexpr std::size_t B = detail::kBlockBytes / sizeof(T);
  detail::run_blocks(pool, total, B, 2 * n * total * sizeof(T), written, [&](std::size_t b, std::size_t e, bool stream) {
    std::size_t s = static_cast<std::size_t>(std::upper_bound(offset.begin(), offset.end(), b) - offset.begin()) - 1;
    while (b < e) {
      while (offset[s + 1] == offset[s] || offset[s + 1] <= b) ++s;  // skip empty and finished segments
      const std::size_t lo = b - offset[s];
      const std::size_t hi = std::min(e, offset[s + 1]) - offset[s];
      detail::reduce_range<T>(in + s * n, n, out + s * n, n, op, lo, hi, stream && flags[s] == 2);
      b = offset[s] + hi;
    }
  });
}

/// Batched reduce-to-one into one packed output: ``n_segs`` independent reductions (segments, e.g.
/// the leaves of a nest) in one dispatch over the thread pool, their results back to back in ``out``.
///
/// Segment ``s`` has ``counts[s]`` elements per input; its inputs are ``in[s * n + r]`` for replica
/// ``r < n``, and its result goes to ``out + counts[0] + ... + counts[s - 1]``. Each input element is
/// read once and each output element written once: (n + 1) * total elements moved, where an
/// all-reduce into n outputs moves 2 * n * total. The arithmetic is reduce_to_one()'s, element for
/// element. Inputs may overlap ``out``: then everything is reduced into a temporary first.
///
/// @param in      ``n_segs * n`` input pointers, segment-major.
/// @param n       number of replicas (at least 1).
/// @param counts  elements per input of each segment.
/// @param n_segs  number of segments.
/// @param op      reduce_op::sum or reduce_op::mean.
/// @param out     the packed output: ``counts[0] + ... + counts[n_segs - 1]`` elements.
/// @param pool    pool to parallelise over, or nullptr to run on the caller.
template <class T>
void batch_reduce_to_one(const T* const* in, std::size_t n, const std::size_t* counts, std::size_t n_segs,
                         reduce_op op, T* out, thread_pool* pool = &thread_pool::global()) {
  if (n == 0 || n_segs == 0) return;
  std::vector<std::size_t> offset(n_segs + 1, 0);
  for (std::size_t s = 0; s < n_segs; ++s) offset[s + 1] = offset[s] + counts[s];
  const std::size_t total = offset[n_segs];
  if (total == 0) return;
  const T* out_c = out;
  for (std::size_t s = 0; s < n_segs; ++s) {
    if (counts[s] == 0) continue;
    for (std::size_t r = 0; r < n; ++r) {
      const auto a = reinterpret_cast<std::uintptr_t>(in[s * n + r]), o = reinterpret_cast<std::uintptr_t>(out_c);
      if (a < o + total * sizeof(T) && o < a + counts[s] * sizeof(T)) {
        std::vector<T> tmp(total);
        batch_reduce_to_one(in, n, counts, n_segs, op, tmp.data(), pool);
        std::memcpy(out, tmp.data(), total * sizeof(T));
        return;
      }
    }
  }
  constexpr std::size_t B = detail::kBlockBytes / sizeof(T);
  detail::run_blocks(pool, total, B, (n + 1) * total * sizeof(T), total * sizeof(T),
                     [&](std::size_t b, std::size_t e, bool stream) {
                       std::size_t s = static_cast<std::size_t>(
                                           std::upper_bound(offset.begin(), offset.end(), b) - offset.begin()) - 1;
                       while (b < e) {
                         while (offset[s + 1] <= b) ++s;  // skip empty and finished segments
                         const std::size_t hi = std::min(e, offset[s + 1]) - offset[s];
                         T* const o = out + offset[s];
                         detail::reduce_range<T>(in + s * n, n, &o, 1, op, b - offset[s], hi, stream);
                         b = offset[s] + hi;
                       }
                     });
}

/// Convenience overload over a vector of buffer pointers.
template <class T>
void all_reduce(const std::vector<T*>& bufs, std::size_t count, reduce_op op,
                thread_pool* pool = &thread_pool::global()) {
  all_reduce(bufs.data(), bufs.size(), count, op, pool);
}

/// Convenience overload over equally sized vectors (one per replica).
template <class T>
void all_reduce(std::vector<std::vector<T>>& bufs, reduce_op op, thread_pool* pool = &thread_pool::global()) {
  if (bufs.empty()) return;
  std::vector<T*> ptrs;
  ptrs.reserve(bufs.size());
  for (auto& b : bufs) {
    if (b.size() != bufs[0].size()) throw std::invalid_argument("cudist::all_reduce: replica buffers differ in size");
    ptrs.push_back(b.data());
  }
  all_reduce(ptrs.data(), ptrs.size(), bufs[0].size(), op, pool);
}

/// Concatenates byte rows: buffer ``i`` holds ``outer`` rows of ``row_bytes[i]`` bytes, and output
/// row ``o`` is the concatenation of row ``o`` of every buffer in order.
///
/// ``fresh_output``: ``out``'s pages have never been written (just allocated), so ordinary stores
/// are used at every size. The first write to such a page faults and the kernel zeroes it into
/// the cache; a streaming store then evicts each zeroed line and writes it again (measured, 4 x
/// 16 MiB into fresh 2 MiB pages, interleaved: 9.6 ms streamed against 7.3 ms with ordinary stores;
/// into a buffer written before, streaming wins: 2.7-3.0 ms against 4.1 ms).
inline void all_gather_bytes(const void* const* bufs, std::size_t n, const std::size_t* row_bytes,
                             std::size_t outer, void* out, thread_pool* pool = &thread_pool::global(),
                             bool fresh_output = false) {
  std::vector<std::size_t> offset(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) offset[i + 1] = offset[i] + row_bytes[i];
  const std::size_t row = offset[n];
  const std::size_t total = row * outer;
  if (total == 0) return;
  auto* dst = static_cast<unsigned char*>(out);
  // Parallel over output bytes, so a gather along axis 0 (one row) splits as well as many rows.
  const std::size_t streamable = fresh_output ? 0 : total;  // bytes written, for the streaming rule
  detail::run_blocks(pool, total, detail::kBlockBytes, 2 * total, streamable, [&](std::size_t b, std::size_t e, bool stream) {
    std::size_t o = b / row, within = b % row;
    std::size_t i = static_cast<std::size_t>(std::upper_bound(offset.begin(), offset.end(), within) - offset.begin()) - 1;
    while (b < e) {
      while (offset[i + 1] == within) ++i;  // skip empty pieces
      const std::size_t piece = std::min(offset[i + 1] - within, e - b);
      const auto* src = static_cast<const unsigned char*>(bufs[i]) + o * row_bytes[i] + (within - offset[i]);
      detail::copy_block(dst + b, src, piece, stream);
      b += piece;
      within += piece;
      if (within == row) {
        within = 0;
        i = 0;
        ++o;
      }
    }
  });
}

/// Concatenates replica buffers along one axis, in replica order.
///
/// Buffer ``i`` is viewed as a C-order array of shape (outer, extents[i], inner); the output has
/// shape (outer, sum(extents), inner).
///
/// ``fresh_output``: as in all_gather_bytes().
template <class T>
void all_gather(const T* const* bufs, std::size_t n, const std::size_t* extents, std::size_t outer,
                std::size_t inner, T* out, thread_pool* pool = &thread_pool::global(), bool fresh_output = false) {
  std::vector<std::size_t> row_bytes(n);
  std::vector<const void*> ptrs(n);
  for (std::size_t i = 0; i < n; ++i) {
    row_bytes[i] = extents[i] * inner * sizeof(T);
    ptrs[i] = bufs[i];
  }
  all_gather_bytes(ptrs.data(), n, row_bytes.data(), outer, out, pool, fresh_output);
}

}  // namespace cudist
