/// @file thread_pool.hpp
/// @brief A persistent pool of worker threads for data-parallel loops.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#define CUDIST_HAVE_GETPID 1
#endif

namespace cudist {

/// A persistent pool that runs ``fn(begin, end)`` over sub-ranges of ``[0, n)``.
///
/// The calling thread takes part in every loop, so a pool of size 1 has no worker threads and a
/// loop with a single chunk never touches another thread. Work is handed out in chunks through an
/// atomic counter, so a thread that the OS preempts does not hold the others up.
///
/// One loop runs at a time per pool. A loop started while another is running (from another
/// thread) does not wait: it runs serially on its caller, so concurrent callers never deadlock
/// and still overlap. After ``fork()`` the child runs every loop serially (the parent's workers
/// do not exist there).
class thread_pool {
 public:
  /// Creates a pool of ``threads`` threads in all, the caller included (0: hardware threads).
  explicit thread_pool(unsigned threads = 0) { start(threads); }
  ~thread_pool() { stop(); }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  /// Number of threads a loop can use, the caller included.
  unsigned size() const noexcept { return size_.load(std::memory_order_relaxed); }

  /// Changes the number of threads (0: hardware threads); waits for a running loop to finish.
  void resize(unsigned threads) {
    std::lock_guard<std::mutex> busy(run_mutex_);
    stop();
    start(threads);
  }

  /// The number of hardware threads (at least 1).
  static unsigned hardware_threads() noexcept { return std::max(1u, std::thread::hardware_concurrency()); }

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
    job_state job;
    job.n = n;
    job.step = step;
    job.nchunks = nchunks;
    job.ctx = &fn;
    job.call = [](void* ctx, std::size_t b, std::size_t e) { (*static_cast<std::remove_reference_t<F>*>(ctx))(b, e); };
    {
      std::lock_guard<std::mutex> lk(mutex_);
      job_ = &job;
      job.pending = threads - 1;
      wanted_ = threads - 1;
      ++generation_;
    }
    cv_.notify_all();
    work(job);
    std::unique_lock<std::mutex> lk(mutex_);
    done_cv_.wait(lk, [&] { return job.pending == 0; });
    job_ = nullptr;
    if (job.error) std::rethrow_exception(job.error);
  }

  /// The process-wide pool the kernels use by default (created on first use, never destroyed,
  /// so that no thread is joined while the process exits).
  static thread_pool& global() {
    static thread_pool* pool = new thread_pool(0);
    return *pool;
  }

 private:
  struct job_state {
    std::size_t n = 0, step = 0, nchunks = 0;
    std::atomic<std::size_t> next{0};
    void* ctx = nullptr;
    void (*call)(void*, std::size_t, std::size_t) = nullptr;
    unsigned pending = 0;        // guarded by mutex_
    std::exception_ptr error;    // the first exception fn threw; guarded by error_mutex
    std::mutex error_mutex;
  };

  // Never throws: an exception escaping a worker thread would call std::terminate.
  static void work(job_state& job) noexcept {
    for (;;) {
      const std::size_t c = job.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= job.nchunks) break;
      const std::size_t b = c * job.step;
      try {
        job.call(job.ctx, b, std::min(job.n, b + job.step));
      } catch (...) {
        std::lock_guard<std::mutex> lk(job.error_mutex);
        if (!job.error) job.error = std::current_exception();
        job.next.store(job.nchunks, std::memory_order_relaxed);  // start no further pieces
      }
    }
  }

  void start(unsigned threads) {
    if (threads == 0) threads = hardware_threads();
    stopping_ = false;
#ifdef CUDIST_HAVE_GETPID
    pid_ = ::getpid();
#endif
    workers_.reserve(threads - 1);
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
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

  void worker_loop() {
    unsigned long long seen = 0;
    std::unique_lock<std::mutex> lk(mutex_);
    for (;;) {
      cv_.wait(lk, [&] { return stopping_ || (generation_ != seen && wanted_ > 0); });
      if (stopping_) return;
      seen = generation_;
      --wanted_;
      job_state* job = job_;
      lk.unlock();
      work(*job);
      lk.lock();
      if (--job->pending == 0) done_cv_.notify_one();
    }
  }

  std::mutex run_mutex_;  // one loop at a time
  std::mutex mutex_;      // guards the fields below
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  job_state* job_ = nullptr;
  unsigned long long generation_ = 0;
  unsigned wanted_ = 0;
  bool stopping_ = false;
  std::atomic<unsigned> size_{1};
#ifdef CUDIST_HAVE_GETPID
  pid_t pid_ = 0;
#endif
};

}  // namespace cudist
