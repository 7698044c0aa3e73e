/// @file thread_pool.hpp
/// @brief A persistent pool of worker threads for data-parallel loops.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#define CUDIST_HAVE_GETPID 1
#endif

namespace cudist {

/// A persistent pool that runs ``fn(begin, end)`` over sub-ranges of ``[0, n)``.
///
/// The calling thread takes part in every loop, so a pool of size 1 has no worker threads and a
/// loop with a single chunk never touches another thread. Thread t of a loop (the caller is 0,
/// worker w is w) starts on the t-th contiguous share of the chunks, so a buffer processed by
/// loop after loop stays in the same core's cache; a thread done with its share takes chunks from
/// the others' through their atomic counters, so a thread that the OS preempts does not hold the
/// others up.
///
/// One loop runs at a time per pool. A loop started while another is running (from another
/// thread) does not wait: it runs serially on its caller, so concurrent callers never deadlock
/// and still overlap. After ``fork()`` the child runs every loop serially (the parent's workers
/// do not exist there).
///
/// Waking a blocked thread costs tens of microseconds on a virtual machine whose other vCPU went
/// idle (measured on the project's 2-vCPU machines: 4 x 256 KiB reduced to one took 40 us on 2
/// threads whose worker had to be woken, 13 us on the caller alone and 9 us on 2 threads with the
/// worker spinning). So the caller of a loop spins (up to kCallerSpinNs) for its workers' last
/// pieces, and while loops come close together (calls_are_close()) the workers spin, yielding the
/// CPU to any runnable thread, for up to spin_time() for the next one before they block. warm()
/// says whether a worker is spinning now, so a kernel can stay on its caller when the workers would
/// have to be woken for too little work, and wake() starts their spin ahead of a loop.
class thread_pool {
 public:
  /// How long workers spin after a loop unless $CUDIST_POOL_SPIN_US says otherwise.
  static constexpr long long kDefaultSpinNs = 200'000;
  /// How long the caller of a loop spins for its workers' last pieces before it blocks.
  static constexpr long long kCallerSpinNs = 1'000'000;

  /// Creates a pool of ``threads`` threads in all, the caller included (0: hardware threads).
  explicit thread_pool(unsigned threads = 0) : spin_ns_(default_spin_ns()) { start(threads); }
  ~thread_pool() { stop(); }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  /// Number of threads a loop can use, the caller included.
  unsigned size() const noexcept { return size_.load(std::memory_order_relaxed); }

  /// Changes the number of threads (0: hardware threads); waits for a running loop to finish.
  /// If the system refuses a thread, the pool goes back to its previous size (else to the caller
  /// alone) and the error propagates: no thread of the failed attempt keeps running.
  void resize(unsigned threads) {
    std::lock_guard<std::mutex> busy(run_mutex_);
    const unsigned before = size();
    stop();
    try {
      start(threads);
    } catch (...) {
      try {
        start(before);
      } catch (...) {
        start(1);  // the caller alone: starts no thread, cannot fail
      }
      throw;
    }
  }

  /// The number of hardware threads (at least 1).
  static unsigned hardware_threads() noexcept { return std::max(1u, std::thread::hardware_concurrency()); }

  /// How long (nanoseconds) a worker spins for the next loop after one, while calls come close
  /// together, before it blocks; 0 blocks at once.
  long long spin_time() const noexcept { return spin_ns_.load(std::memory_order_relaxed); }

  /// Sets spin_time() (negative counts as 0); returns the previous value. Takes effect from each
  /// worker's next spin.
  long long set_spin_time(long long ns) noexcept {
    return spin_ns_.exchange(std::max(0LL, ns), std::memory_order_relaxed);
  }

  /// Loops this pool has run on more than one thread since it was created (for tests and tuning).
  unsigned long long parallel_loops() const noexcept { return generation_.load(std::memory_order_relaxed); }

  /// Marks the start of a call that may use the pool (a kernel), for the spin rule: records the
  /// time since the previous call ended (calls_are_close()).
  void call_started() noexcept {
    last_gap_ns_.store(now_ns() - last_end_ns_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }

  /// Marks the end of a call that call_started() marked the start of.
  void call_ended() noexcept { last_end_ns_.store(now_ns(), std::memory_order_relaxed); }

  /// Whether calls come soon enough after each other for spinning to pay: the last gap between
  /// two calls (call_started / call_ended) was at most spin_time(). Workers spin after a loop, and
  /// wake() starts their spin, only then: after a kernel that ends a burst (one all-reduce per
  /// training step), a spinning worker would only take a core from the step's own compute
  /// (measured: the MLP step on 2 replica threads, 4.2-4.4 ms without spinning, 5.2-5.9 ms with
  /// workers spinning 200 us after every kernel).
  bool calls_are_close() const noexcept {
    return last_gap_ns_.load(std::memory_order_relaxed) <= spin_time();
  }

  /// True when a worker is spinning now, so a loop would start on it without waking anything.
  bool warm() const noexcept { return spinning_.load(std::memory_order_relaxed) > 0; }

  /// Wakes the blocked workers into their spin (for spin_time()) without giving them work, so that
  /// a loop started soon after finds them warm. Does nothing when one is warm already, when calls
  /// are not close together, after fork(), or when spin_time() is 0.
  void wake() {
    if (warm() || spin_time() <= 0 || !calls_are_close() || forked()) return;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      if (sleepers_ == 0) return;
      ++kicks_;
    }
    cv_.notify_all();
  }

  /// Runs ``fn(begin, end)`` over ``[0, n)`` in ``chunks`` pieces whose bounds are multiples of
  /// ``align`` (except the last end), using at most ``max_threads`` threads (0: all of them).
  ///
  /// ``fn`` must be safe to call concurrently on disjoint ranges. Returns after every piece ran.
  /// If ``fn`` throws, the pieces not yet started are skipped, the loop waits for the running
  /// ones, and the first exception is rethrown on the caller.
  template <class F>
  void parallel_for(std::size_t n, std::size_t chunks, std::size_t align, F&& fn, unsigned max_threads = 0) {
    if (n == 0) return;
    align = std::max<std::size_t>(align, 1);
    std::size_t step = (n + std::max<std::size_t>(chunks, 1) - 1) / std::max<std::size_t>(chunks, 1);
    step = (step + align - 1) / align * align;
    const std::size_t nchunks = (n + step - 1) / step;
    std::unique_lock<std::mutex> busy(run_mutex_, std::defer_lock);
    if (nchunks <= 1 || size() <= 1 || max_threads == 1 || forked() || !busy.try_lock()) {
      fn(std::size_t{0}, n);
      return;
    }
    // Counted under run_mutex_, which resize() takes too: a count read before could include
    // workers that a concurrent resize() has since stopped, and the loop would wait for them forever.
    unsigned threads = static_cast<unsigned>(workers_.size()) + 1;
    if (max_threads != 0) threads = std::min(threads, max_threads);
    threads = static_cast<unsigned>(std::min<std::size_t>(threads, nchunks));
    if (threads <= 1) {
      busy.unlock();
      fn(std::size_t{0}, n);
      return;
    }
    job_state job(threads);
    job.n = n;
    job.step = step;
    for (unsigned t = 0; t < threads; ++t) {
      job.shares[t].next.store(nchunks * t / threads, std::memory_order_relaxed);
      job.shares[t].end = nchunks * (t + 1) / threads;
    }
    job.ctx = &fn;
    job.call = [](void* ctx, std::size_t b, std::size_t e) { (*static_cast<std::remove_reference_t<F>*>(ctx))(b, e); };
    bool sleepers = false;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      job_ = &job;
      job.pending.store(threads - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      sleepers = sleepers_ > 0;
    }
    if (sleepers) cv_.notify_all();  // spinning workers see the generation change by themselves
    work(job, 0);
    // The workers' last pieces end about when the caller's do: spin rather than block, so that the
    // caller's return does not wait for a wake-up either (it has nothing else to do meanwhile).
    spin_until([&] { return job.pending.load(std::memory_order_acquire) == 0; }, kCallerSpinNs);
    std::unique_lock<std::mutex> lk(mutex_);
    done_cv_.wait(lk, [&] { return job.pending.load(std::memory_order_relaxed) == 0; });
    job_ = nullptr;
    if (job.error) std::rethrow_exception(job.error);
  }

  /// The process-wide pool the kernels use by default (created on first use, never destroyed,
  /// so that no thread is joined while the process exits).
  static thread_pool& global() {
    static thread_pool* pool = new thread_pool(0);
    return *pool;
  }

  /// One pause of a spin-wait loop (PAUSE on x86, YIELD on ARM; nothing elsewhere).
  static void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
  }

  /// Spins until ``done()`` or ``ns`` nanoseconds have passed; returns done(). Yields the CPU
  /// every few checks, so a spinning thread never holds up a runnable one (a replica thread, a
  /// BLAS thread) for longer than one time slice.
  template <class P>
  static bool spin_until(P&& done, long long ns) {
    if (done()) return true;
    if (ns <= 0) return false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    for (unsigned i = 1;; ++i) {
      cpu_relax();
      if (done()) return true;
      if (i % 64 == 0) {
        if (std::chrono::steady_clock::now() >= deadline) return done();
        std::this_thread::yield();
      }
    }
  }

 private:
  struct alignas(64) share {  // one cache line each: the counters are hit by different threads
    std::atomic<std::size_t> next{0};
    std::size_t end = 0;
  };

  struct job_state {
    explicit job_state(unsigned t) : threads(t), shares(new share[t]) {}
    unsigned threads;
    std::unique_ptr<share[]> shares;  // thread t's chunks first, then the others'
    std::size_t n = 0, step = 0;
    void* ctx = nullptr;
    void (*call)(void*, std::size_t, std::size_t) = nullptr;
    std::atomic<unsigned> pending{0};  // written under mutex_; read without it by a spinning caller
    std::exception_ptr error;          // the first exception fn threw; guarded by error_mutex
    std::mutex error_mutex;
  };

  // Never throws: an exception escaping a worker thread would call std::terminate.
  static void work(job_state& job, unsigned self) noexcept {
    for (unsigned k = 0; k < job.threads; ++k) {
      share& sh = job.shares[(self + k) % job.threads];
      for (;;) {
        const std::size_t c = sh.next.fetch_add(1, std::memory_order_relaxed);
        if (c >= sh.end) break;
        const std::size_t b = c * job.step;
        try {
          job.call(job.ctx, b, std::min(job.n, b + job.step));
        } catch (...) {
          std::lock_guard<std::mutex> lk(job.error_mutex);
          if (!job.error) job.error = std::current_exception();
          for (unsigned t = 0; t < job.threads; ++t)  // start no further pieces
            job.shares[t].next.store(job.shares[t].end, std::memory_order_relaxed);
        }
      }
    }
  }

  static long long now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  static long long default_spin_ns() noexcept {
    if (const char* v = std::getenv("CUDIST_POOL_SPIN_US")) {
      char* end = nullptr;
      const long long us = std::strtoll(v, &end, 10);
      if (end != v && *end == '\0' && us >= 0) return us * 1000;
    }
    return kDefaultSpinNs;
  }

  void start(unsigned threads) {
    if (threads == 0) threads = hardware_threads();
    stopping_ = false;
    stop_flag_.store(false, std::memory_order_relaxed);
#ifdef CUDIST_HAVE_GETPID
    pid_ = ::getpid();
#endif
    try {
      workers_.reserve(threads - 1);
      for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
    } catch (...) {
      // A refused thread (std::system_error) or no memory: end the ones started (a joinable
      // std::thread destroyed would terminate the process; left running they would leak).
      stop();
      throw;
    }
    size_.store(threads, std::memory_order_relaxed);
  }

  void stop() {
    if (forked()) {
      // The workers live in the parent only: joining or detaching them here is undefined, and
      // destroying a joinable std::thread terminates, so leak their handles.
      new std::vector<std::thread>(std::move(workers_));
      workers_.clear();
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mutex_);
      stopping_ = true;
      stop_flag_.store(true, std::memory_order_relaxed);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  bool forked() const noexcept {
#ifdef CUDIST_HAVE_GETPID
    return ::getpid() != pid_;
#else
    return false;
#endif
  }

  /// Worker ``index`` (1 .. size()-1) takes part in the loops of at least index + 1 threads.
  void worker_loop(unsigned index) {
    unsigned long long seen = 0, kicked = 0;
    bool spin = false;  // no loop has run yet: nothing to expect soon
    std::unique_lock<std::mutex> lk(mutex_);
    for (;;) {
      if (spin && spin_time() > 0 && calls_are_close()) {
        lk.unlock();
        spinning_.fetch_add(1, std::memory_order_relaxed);
        spin_until([&] { return generation_.load(std::memory_order_acquire) != seen || stop_flag_.load(std::memory_order_relaxed); },
                   spin_time());
        spinning_.fetch_sub(1, std::memory_order_relaxed);
        lk.lock();
      }
      auto ready = [&] { return stopping_ || generation_.load(std::memory_order_relaxed) != seen || kicks_ != kicked; };
      if (!ready()) {
        ++sleepers_;
        cv_.wait(lk, ready);
        --sleepers_;
      }
      if (stopping_) return;
      kicked = kicks_;
      spin = true;  // a loop just ran, or wake() asked: another may come soon
      const unsigned long long gen = generation_.load(std::memory_order_relaxed);
      if (gen == seen) continue;  // woken by wake()
      seen = gen;
      // A loop of fewer threads, or one already over (this worker was not part of it): job_ is
      // only ever a loop that waits for each of its workers, so it cannot end under a member.
      job_state* job = job_;
      if (job == nullptr || index >= job->threads) continue;
      lk.unlock();
      work(*job, index);
      lk.lock();
      // The job is the caller's: it may be gone once pending reaches 0 (the caller spins on it).
      if (job->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) done_cv_.notify_one();
    }
  }

  std::mutex run_mutex_;  // one loop at a time
  std::mutex mutex_;      // guards the fields below
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  job_state* job_ = nullptr;
  // Changed under mutex_ (with job_); read without it by spinning workers, which then take mutex_
  // to join the loop.
  std::atomic<unsigned long long> generation_{0};
  unsigned sleepers_ = 0;         // workers blocked on cv_
  unsigned long long kicks_ = 0;  // wake() calls that found sleepers
  bool stopping_ = false;
  std::atomic<bool> stop_flag_{false};  // stopping_, for spinning workers
  std::atomic<unsigned> spinning_{0};
  std::atomic<long long> spin_ns_;
  std::atomic<long long> last_end_ns_{0};                   // when the last marked call ended
  std::atomic<long long> last_gap_ns_{LLONG_MAX};           // idle time before the last marked call
  std::atomic<unsigned> size_{1};
#ifdef CUDIST_HAVE_GETPID
  pid_t pid_ = 0;
#endif
};

}  // namespace cudist
