// The kernels' own worker threads, in place of OpenMP's for tokenline::parallel_for.
//
// at::parallel_for (OpenMP) cuts a range into one piece per thread and waits at its end for the last: where another
// process takes one of the cores for a while (the ingress, Ray, the load client beside a served replica), the other
// thread finishes its half and waits for the rest of that while, at every operator of the step. Here each thread's
// piece is a run of chunks it takes in order from the front (so that a kernel's prefetch of the next weights still
// runs ahead of it), and a thread whose own run is done takes the chunks left at the back of another's: a thread
// switched out holds up the operator by at most the chunk it was in, not its whole piece.
//
// Workers spin a little after each operator for the next (a decode step calls ~200 of them back to back), then sleep
// on a futex; the caller runs chunks too. A parallel_for inside a chunk runs inline. Off (kernel_pool(0), or
// TOKENLINE_KERNEL_POOL=0 in the environment), parallel_for is at::parallel_for.
#pragma once

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define TOKENLINE_PAUSE() _mm_pause()
#else
#define TOKENLINE_PAUSE() std::this_thread::yield()
#endif

namespace tokenline {

namespace pool_detail {

constexpr int kMaxThreads = 64;
constexpr int64_t kChunksPerThread = 4;  // a thread's piece in this many chunks: finer lets another take more over
constexpr std::chrono::microseconds kSpin{100};  // a worker's wait for the next operator before it sleeps

inline int futex_wait(std::atomic<uint32_t>* addr, uint32_t seen) {
  return static_cast<int>(syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, seen, nullptr,
                                  nullptr, 0));
}
inline void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

// One parallel_for: `chunks` chunks of `size` items from `begin`; thread t owns chunks [first(t), first(t + 1)),
// kept as (front, back) in one word so that its owner (from the front) and another thread (from the back) never
// take the same chunk.
struct Job {
  void (*call)(const void*, int64_t, int64_t);
  const void* fn;
  int64_t begin, end, size, chunks;
  int threads;
  std::atomic<uint64_t> range[kMaxThreads];
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;

  int64_t first(int t) const { return chunks * t / threads; }
  static uint64_t pack(uint32_t front, uint32_t back) { return (static_cast<uint64_t>(back) << 32) | front; }

  // The next chunk of thread t's own run, from its front; -1 when none is left.
  int64_t take_front(int t) {
    uint64_t r = range[t].load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = static_cast<uint32_t>(r), back = static_cast<uint32_t>(r >> 32);
      if (front >= back) return -1;
      if (range[t].compare_exchange_weak(r, pack(front + 1, back), std::memory_order_acq_rel)) return front;
    }
  }
  // The last chunk left in thread v's run, from its back; -1 when none is left.
  int64_t take_back(int v) {
    uint64_t r = range[v].load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = static_cast<uint32_t>(r), back = static_cast<uint32_t>(r >> 32);
      if (front >= back) return -1;
      if (range[v].compare_exchange_weak(r, pack(front, back - 1), std::memory_order_acq_rel)) return back - 1;
    }
  }
  void run_chunk(int64_t c) {
    if (!failed.load(std::memory_order_relaxed)) {
      const int64_t b = begin + c * size, e = std::min(end, b + size);
      try {
        call(fn, b, e);
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
    done.fetch_add(1, std::memory_order_acq_rel);
  }
  // Thread t's work: its own run, then what is left of the others'.
  void work(int t) {
    for (int64_t c; (c = take_front(t)) >= 0;) run_chunk(c);
    for (int i = 1; i < threads; ++i) {
      const int v = (t + i) % threads;
      for (int64_t c; (c = take_back(v)) >= 0;) run_chunk(c);
    }
  }
};

inline thread_local bool t_in_pool = false;  // inside a chunk: a nested parallel_for runs inline

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: its workers outlive static destruction at exit
    return *pool;
  }

  std::atomic<int> enabled{-1};  // -1: from TOKENLINE_KERNEL_POOL (default on)

  bool on() {
    int v = enabled.load(std::memory_order_relaxed);
    if (v < 0) {
      const char* env = std::getenv("TOKENLINE_KERNEL_POOL");
      v = env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1;
      enabled.store(v, std::memory_order_relaxed);
    }
    return v == 1;
  }

  // Runs job on `threads` threads (the caller and threads - 1 workers); returns when every chunk has run.
  void run(Job& job) {
    std::lock_guard<std::mutex> one_at_a_time(*mutex_);  // two engine threads in one process take turns
    ensure_workers(job.threads - 1);
    job_.store(&job, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&epoch_);
    t_in_pool = true;
    job.work(0);
    t_in_pool = false;
    const auto started = std::chrono::steady_clock::now();
    for (int i = 0; job.done.load(std::memory_order_acquire) < job.chunks; ++i) {
      // The last chunks are running on other threads; past a short spin, let the core go to whatever else waits
      // for it (perhaps what switched a worker out).
      if ((i & 63) == 63 && std::chrono::steady_clock::now() - started > kSpin) sched_yield();
      else TOKENLINE_PAUSE();
    }
    // No worker may touch the job once this returns: take it away, then wait for those inside to leave.
    job_.store(nullptr, std::memory_order_seq_cst);
    while (inside_.load(std::memory_order_seq_cst) > 0) TOKENLINE_PAUSE();
    if (job.failed.load()) std::rethrow_exception(job.error);
  }

 private:
  Pool() { pthread_atfork(nullptr, nullptr, [] { get().forked(); }); }

  // In a forked child: none of the parent's threads came along, and a lock one of them held stays held.
  void forked() {
    mutex_ = new std::mutex();  // the parent's may be held by a thread that is not here: left, not destroyed
    workers_ = 0;
    job_.store(nullptr);
    sleepers_.store(0);
    inside_.store(0);
  }

  void ensure_workers(int wanted) {
    wanted = std::min(wanted, kMaxThreads - 1);
    while (workers_ < wanted) {
      const int index = ++workers_;  // thread index: the caller is 0
      std::thread([this, index] { loop(index); }).detach();
    }
  }

  void loop(int index) {
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      const auto started = std::chrono::steady_clock::now();
      uint32_t now;
      for (int i = 0;; ++i) {
        now = epoch_.load(std::memory_order_acquire);
        if (now != seen) break;
        if ((i & 255) == 255 && std::chrono::steady_clock::now() - started > kSpin) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(&epoch_, seen);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        } else {
          TOKENLINE_PAUSE();
        }
      }
      seen = now;
      inside_.fetch_add(1, std::memory_order_seq_cst);
      Job* job = job_.load(std::memory_order_seq_cst);
      if (job != nullptr && index < job->threads) {
        t_in_pool = true;
        job->work(index);
        t_in_pool = false;
      }
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex* mutex_ = new std::mutex();
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> inside_{0};
  int workers_ = 0;
};

}  // namespace pool_detail

// f(b, e) over [begin, end) in pieces of at least `grain` items, as at::parallel_for, on at::get_num_threads()
// threads of the pool (see above).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  using pool_detail::Pool;
  if (begin >= end) return;
  grain = std::max<int64_t>(grain, 1);
  Pool& pool = Pool::get();
  if (!pool.on()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  const int threads = static_cast<int>(std::min<int64_t>(
      {static_cast<int64_t>(at::get_num_threads()), (n + grain - 1) / grain, pool_detail::kMaxThreads}));
  if (threads <= 1 || pool_detail::t_in_pool || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  pool_detail::Job job;
  job.call = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
  job.fn = &f;
  job.begin = begin;
  job.end = end;
  const int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, threads * pool_detail::kChunksPerThread);
  job.size = ((n + chunks - 1) / chunks + grain - 1) / grain * grain;
  job.chunks = (n + job.size - 1) / job.size;
  job.threads = static_cast<int>(std::min<int64_t>(threads, job.chunks));
  if (job.threads <= 1) {
    f(begin, end);
    return;
  }
  for (int t = 0; t < job.threads; ++t)
    job.range[t].store(pool_detail::Job::pack(static_cast<uint32_t>(job.first(t)),
                                              static_cast<uint32_t>(job.first(t + 1))),
                       std::memory_order_relaxed);
  pool.run(job);
}

// Whether parallel_for runs on the pool (1) or on at::parallel_for (0); `on` 0 or 1 sets it, a negative value
// leaves it.
inline bool kernel_pool(int64_t on) {
  auto& pool = pool_detail::Pool::get();
  if (on >= 0) pool.enabled.store(on ? 1 : 0);
  return pool.on();
}

}  // namespace tokenline
