// All-reduce and gather between the tensor-parallel ranks of one CPU engine, through a shared-memory region.
//
// gloo sends every all-reduce through loopback TCP and a worker thread: 0.5-1 ms each on 2 busy cores, 60 of them
// a step for a 30-layer model. Here each rank copies its part into its own slot, publishes a sequence number, and
// waits until every rank has published the same one: spinning for a few microseconds (ranks doing the same work
// arrive together), then asleep on a futex, so that a waiting rank never takes the CPU from the one it waits for
// (cores are often shared). Then each sums the slots in rank order in fp32, so every rank gets the same bits. Two slots alternate, so a rank may write the next one
// while slower ones still read this one; every operation waits for every rank, which is what makes that safe.
//
// Region: [world lines of 64 bytes: int64 sequence, int64 pid, int32 futex word, int32 sleepers]
//         [2][world][slot_elems] fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kSpins = 1000;  // ~30 us of pause instructions before sleeping
constexpr long kSleepNs = 20 * 1000 * 1000;  // a sleeping waiter checks the peer's life and the deadline this often

struct alignas(kLine) RankLine {
  int64_t sequence;
  int64_t pid;
  int32_t word;  // the sequence's low 32 bits: what sleepers wait on
  int32_t sleepers;
};

long futex(int32_t* word, int op, int32_t value, const timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

RankLine* lines(const at::Tensor& region) { return reinterpret_cast<RankLine*>(region.data_ptr<uint8_t>()); }

float* slot(const at::Tensor& region, int64_t world, int64_t slot_elems, int64_t parity, int64_t rank) {
  auto* base = reinterpret_cast<float*>(region.data_ptr<uint8_t>() + world * kLine);
  return base + (parity * world + rank) * slot_elems;
}

void check_region(const at::Tensor& region, int64_t rank, int64_t world, int64_t slot_elems) {
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous(), "the region must be contiguous bytes");
  TORCH_CHECK(0 <= rank && rank < world, "rank out of range");
  TORCH_CHECK(region.numel() >= world * kLine + 2 * world * slot_elems * int64_t(sizeof(float)),
              "the shared-memory region is too small for ", world, " ranks");
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A rank's process is gone once it no longer exists or is a zombie (a child of ours not reaped yet).
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char state = 0;
  const int read = std::fscanf(f, "%*d (%*[^)]) %c", &state);
  std::fclose(f);
  return read == 1 && state == 'Z';
}

// Publishes `sequence` for `rank`, then waits until every rank has published it (or fails, naming the rank).
void barrier(RankLine* line, int64_t rank, int64_t world, int64_t sequence, double timeout_s) {
  RankLine& mine = line[rank];
  __atomic_store_n(&mine.sequence, sequence, __ATOMIC_SEQ_CST);
  __atomic_store_n(&mine.word, static_cast<int32_t>(sequence), __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&mine.sleepers, __ATOMIC_SEQ_CST) > 0) futex(&mine.word, FUTEX_WAKE, INT32_MAX, nullptr);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t j = 0; j < world; ++j) {
    RankLine& peer = line[j];
    for (int64_t spins = 0; __atomic_load_n(&peer.sequence, __ATOMIC_ACQUIRE) < sequence && spins < kSpins; ++spins)
      cpu_relax();
    while (__atomic_load_n(&peer.sequence, __ATOMIC_SEQ_CST) < sequence) {
      __atomic_add_fetch(&peer.sleepers, 1, __ATOMIC_SEQ_CST);
      const int32_t seen = __atomic_load_n(&peer.word, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(&peer.sequence, __ATOMIC_SEQ_CST) < sequence) {
        const timespec nap{0, kSleepNs};
        futex(&peer.word, FUTEX_WAIT, seen, &nap);  // returns at once if the peer published meanwhile
      }
      __atomic_sub_fetch(&peer.sleepers, 1, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(&peer.sequence, __ATOMIC_SEQ_CST) >= sequence) break;
      const int64_t pid = __atomic_load_n(&peer.pid, __ATOMIC_RELAXED);
      TORCH_CHECK(!process_gone(pid), "tensor-parallel rank ", j, " (pid ", pid, ") is gone");
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "tensor-parallel rank ", j, " did not reach the ",
                  "collective within ", timeout_s, " s");
    }
  }
}

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

template <typename F>
void dispatch(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "shared-memory collectives take float32, bfloat16 or float16");
  }
}

void shm_register(const at::Tensor& region, int64_t rank, int64_t world, int64_t slot_elems) {
  check_region(region, rank, world, slot_elems);
  __atomic_store_n(&lines(region)[rank].pid, static_cast<int64_t>(getpid()), __ATOMIC_RELEASE);
}

// x (contiguous) becomes the sum over the ranks of their x, chunk by chunk.
void shm_all_reduce(at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t world, int64_t slot_elems,
                    double timeout_s) {
  check_region(region, rank, world, slot_elems);
  TORCH_CHECK(x.is_contiguous(), "shm_all_reduce takes a contiguous tensor");
  RankLine* line = lines(region);
  const int64_t n = x.numel();
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* data = x.data_ptr<T>();
    for (int64_t start = 0; start < n; start += slot_elems) {
      const int64_t len = std::min(slot_elems, n - start);
      const int64_t sequence = line[rank].sequence + 1;
      const int64_t parity = sequence & 1;
      to_float(data + start, slot(region, world, slot_elems, parity, rank), len);
      barrier(line, rank, world, sequence, timeout_s);
      at::parallel_for(0, len, 16384, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          float sum = 0.f;
          for (int64_t j = 0; j < world; ++j) sum += slot(region, world, slot_elems, parity, j)[i];
          data[start + i] = static_cast<T>(sum);
        }
      });
    }
  });
}

// Rank 0's out [world, n] (fp32) receives every rank's x (fp32, contiguous, the same n everywhere).
void shm_gather(const at::Tensor& x, at::Tensor& out, const at::Tensor& region, int64_t rank, int64_t world,
                int64_t slot_elems, double timeout_s) {
  check_region(region, rank, world, slot_elems);
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "shm_gather takes a contiguous float32 tensor");
  const int64_t n = x.numel();
  TORCH_CHECK(rank != 0 || (out.is_contiguous() && out.scalar_type() == at::kFloat && out.numel() == world * n),
              "rank 0's out must be a contiguous float32 [world, n]");
  RankLine* line = lines(region);
  const float* src = x.data_ptr<float>();
  for (int64_t start = 0; start < n; start += slot_elems) {
    const int64_t len = std::min(slot_elems, n - start);
    const int64_t sequence = line[rank].sequence + 1;
    const int64_t parity = sequence & 1;
    std::memcpy(slot(region, world, slot_elems, parity, rank), src + start, len * sizeof(float));
    barrier(line, rank, world, sequence, timeout_s);
    if (rank == 0) {
      float* dst = out.data_ptr<float>();
      for (int64_t j = 0; j < world; ++j)
        std::memcpy(dst + j * n + start, slot(region, world, slot_elems, parity, j), len * sizeof(float));
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("shm_register(Tensor region, int rank, int world, int slot_elems) -> ()");
  m.def("shm_all_reduce(Tensor(a!) x, Tensor region, int rank, int world, int slot_elems, float timeout_s) -> ()");
  m.def("shm_gather(Tensor x, Tensor(a!) out, Tensor region, int rank, int world, int slot_elems, "
        "float timeout_s) -> ()");
  m.impl("shm_register", c10::DispatchKey::CPU, &shm_register);
  m.impl("shm_all_reduce", c10::DispatchKey::CPU, &shm_all_reduce);
  m.impl("shm_gather", c10::DispatchKey::CPU, &shm_gather);
}
