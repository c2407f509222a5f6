// Decode attention over a paged KV cache on CPU: one query token per sequence, K/V read in place through the block
// table (no gathered copy), softmax in fp32, GQA groups sharing each K/V read.
//
// Two key layouts. Plain: k_cache [blocks, kv_heads, block_size, head_dim], like V. Packed (bf16, blocks of a
// multiple of 16 tokens, AVX512-BF16): k_cache [blocks, kv_heads, head_dim / 2, block_size, 2], so one 64-byte
// load holds a pair of dimensions of 16 tokens and a vdpbf16ps adds q . k for those 16 tokens at once, with no
// horizontal sum per token (the plain layout's cost at batch 32).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "thread_pool.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <algorithm>
#include <atomic>
#include <vector>

namespace {

inline void load_row(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }

inline void load_row(const c10::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < d; ++i) {
    uint32_t w = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &w, sizeof(f));
    dst[i] = f;
  }
}

inline void load_row(const c10::Half* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i]);
}

// In place, fp32, each of `rows` rows of length `len`.
void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

// Runs body(begin, end) over items [0, costs.size()) split into contiguous ranges of about equal cost. The rows of
// a causal prefill grow in length: split by count, the thread given the last rows would do most of the work (3/4 of
// it on two threads at 256 tokens).
template <typename F>
void parallel_over_costs(const std::vector<int64_t>& costs, const F& body) {
  const int64_t items = static_cast<int64_t>(costs.size());
  const int64_t parts = std::min<int64_t>(items, 4 * static_cast<int64_t>(at::get_num_threads()));
  if (parts <= 1) {
    if (items) body(0, items);
    return;
  }
  std::vector<int64_t> cum(items + 1, 0);  // cum[i]: the cost of items before i
  for (int64_t i = 0; i < items; ++i) cum[i + 1] = cum[i] + costs[i];
  const int64_t total = cum[items];
  auto start_of = [&](int64_t part) {
    return static_cast<int64_t>(std::lower_bound(cum.begin(), cum.end(), total * part / parts) - cum.begin());
  };
  tokenline::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    const int64_t begin = std::min(start_of(pb), items), end = pe == parts ? items : std::min(start_of(pe), items);
    if (begin < end) body(begin, end);
  });
}

constexpr int64_t kItemCost = 16;  // tokens' worth of work per item besides its keys and values

// Items (sequence b, KV head h) = b * num_kv_heads + h, each costing its length plus kItemCost.
template <typename F>
void parallel_over_sequences(int64_t batch, int64_t num_kv_heads, const int64_t* seq_lens, const F& body) {
  std::vector<int64_t> costs(batch * num_kv_heads);
  for (int64_t i = 0; i < static_cast<int64_t>(costs.size()); ++i)
    costs[i] = std::max<int64_t>(seq_lens[i / num_kv_heads], 0) + kItemCost;
  parallel_over_costs(costs, body);
}

template <typename scalar_t>
void decode_kernel(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, scalar_t* out, int64_t out_stride, int64_t batch, int64_t num_heads,
                   int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t max_blocks, double scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  parallel_over_sequences(batch, num_kv_heads, seq_lens, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q + b * q_stride + (h * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
        for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] *= static_cast<float>(scale);
      }
      // Pass 1: every score, reading each K row once for the whole GQA group.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t offset = table[t / block_size] * block_stride + (h * block_size + t % block_size) * head_dim;
        load_row(k_cache + offset, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
          for (int64_t i = 0; i < head_dim; ++i) s += qg[i] * row[i];
          scores[g * len + t] = s;
        }
      }
      softmax_rows(scores.data(), group, len);
      // Pass 2: the weighted sum of V rows, again one read per row for the group.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t offset = table[t / block_size] * block_stride + (h * block_size + t % block_size) * head_dim;
        load_row(v_cache + offset, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          float* ag = acc.data() + g * head_dim;
          const float p = scores[g * len + t];
          for (int64_t i = 0; i < head_dim; ++i) ag[i] += p * row[i];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        store_row(acc.data() + g * head_dim, out + b * out_stride + (h * group + g) * head_dim, head_dim);
      }
    }
  });
}


#if defined(__AVX512F__) || defined(__AVX2__)
__attribute__((always_inline)) inline void prefetch_block(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// Asks for `bytes` from p into L2 (nothing where p is nullptr): a pass's share of the block ahead between reads.
__attribute__((always_inline)) inline void prefetch_share(const char* p, int64_t bytes) {
  if (p == nullptr) return;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

constexpr int64_t kAhead = 4;  // blocks a pass asks for ahead of the one it reads (2 and 4 did alike; 1 and 8 less)

// The blocks one (sequence, KV head) reads, in order: its keys' blocks, then its values'. Each pass asks for the
// block kAhead places on in that order: one head's part of a block (2 KB at head_dim 64) lasts less than memory's
// latency at the rate a thread reads it, so a block asked for one ahead arrived late (11 GB/s on one thread), and
// the values' first blocks, and the keys' of the first pass, were not asked for at all (decode attention at batch
// 8-32, 1 and 2 threads: 10-17% faster than one block ahead). Called inside the loops that hold the accumulators
// in registers: it must inline, since a call would spill them (and did: 40% slower).
// The packed-key passes ask for the block ahead (`ahead`) a few lines at a time between their reads, into L2,
// rather than all 32 lines at once into L1 (`fetch`): a thread that asks for a block at once waits on line fill
// buffers its own reads need. Decode attention alone (16 rows of 310 tokens, 30 layers, one thread, blocks
// scattered through the pool): 7.5% faster than `fetch` (14.39 against 15.55 ms), 9.5% with each sequence's blocks
// in order; into L1 a few lines at a time, 4.6% and 6.5%.
struct KVStream {
  const char* k;  // this head's part of block 0 of the pool, keys and values (the same shape in either layout)
  const char* v;
  int64_t stride;  // bytes from one block of the pool to the next
  int64_t bytes;  // one head's part of a block, K or V
  const int64_t* table;
  int64_t blocks;  // the sequence's
  // Block i of the stream (this head's part), or nullptr past its end.
  __attribute__((always_inline)) inline const char* ahead(int64_t i) const {
    if (i < blocks) return k + table[i] * stride;
    if (i < 2 * blocks) return v + table[i - blocks] * stride;
    return nullptr;
  }
  __attribute__((always_inline)) inline void fetch(int64_t i) const {
    if (const char* p = ahead(i)) prefetch_block(p, bytes);
  }
  inline void start() const {
    for (int64_t i = 0; i < kAhead; ++i) fetch(i);
  }
};
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TOKENLINE_ATTENTION_AVX2 1
// CPUs with AVX2 and FMA but not AVX-512 (AMD Zen 2/3, older Intel): bf16 K/V in the plain layout, widened to fp32
// 8 values at a time. Scores: 4 tokens x up to 3 query heads of the GQA group at once (12 sums of 8 lanes), each K
// chunk loaded and widened once for the heads, then the 12 sums reduced to 12 scores by horizontal adds. Values: a
// run of 4 chunks (32 dims) of each head's output in registers while every V row of the sequence streams by. The
// generic kernel above took each token's dot product alone, with a horizontal sum per token and head: 2.4x slower at
// batch 32 on a Zen 3. K and V blocks are asked for ahead as the AVX-512 kernels do (KVStream, a share at a time):
// without it, a profile showed the value rows' loads and whole-block prefetches waiting on memory, and 30 layers at
// 32 x 300 tokens took 51 ms on one Zen 3 thread, 29 with it (kernel_ab).

// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of G query heads (fp32, scaled; qf + g * head_dim) against the keys of tokens [0, len) of one
// (sequence, KV head), into scores[g * len + t]. C: head_dim / 8. The tokens are walked block by block of the table:
// a division and a table read a token (t / block_size, t % block_size: an integer division is ~15 cycles on Zen 3,
// as long as the FMAs of a token) cost as much as the token's arithmetic. The blocks are kv's; with `ask_ahead` (the
// first run of heads) it asks for the stream's block kAhead on, the rows of it that match the 4 tokens read here.
template <int C, int G>
void avx2_scores(const float* qf, const KVStream& kv, bool ask_ahead, int64_t block_size, int64_t len, float* scores,
                 int64_t score_stride) {
  constexpr int64_t head_dim = 8 * C, row_bytes = head_dim * sizeof(c10::BFloat16);
  for (int64_t start = 0, blk = 0; start < len; start += block_size, ++blk) {
    const char* ahead = ask_ahead ? kv.ahead(blk + kAhead) : nullptr;
    const auto* base = reinterpret_cast<const c10::BFloat16*>(kv.ahead(blk));
    const int64_t n = std::min<int64_t>(block_size, len - start);
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
      prefetch_share(ahead ? ahead + t0 * row_bytes : nullptr, 4 * row_bytes);
      const c10::BFloat16* rows[4];
      for (int i = 0; i < 4; ++i) rows[i] = base + std::min<int64_t>(t0 + i, n - 1) * head_dim;  // past n: again
      __m256 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        __m256 qv[G];
#pragma GCC unroll 3
        for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(qf + g * head_dim + 8 * c);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m256 k = widen8_bf16(rows[i] + 8 * c);
#pragma GCC unroll 3
          for (int g = 0; g < G; ++g) acc[g][i] = _mm256_fmadd_ps(qv[g], k, acc[g][i]);
        }
      }
      alignas(16) float four[4];
      const int64_t valid = std::min<int64_t>(4, n - t0);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) {
        _mm_store_ps(four, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
        std::memcpy(scores + g * score_stride + start + t0, four, valid * sizeof(float));
      }
    }
  }
}

// out_g[d] = sum_t p[g * len + t] * v[t][d] for G heads, 32 dims (4 chunks) at a time. `ask_ahead`: as for the
// scores, a row of the values' block kAhead on with each row read by the first run of 32 dims.
template <int C, int G>
void avx2_values(const float* p, const KVStream& kv, bool ask_ahead, int64_t block_size, int64_t len, int64_t p_stride,
                 float* acc_out) {
  constexpr int64_t head_dim = 8 * C, row_bytes = head_dim * sizeof(c10::BFloat16);
  for (int c0 = 0; c0 < C; c0 += 4) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t start = 0, blk = 0; start < len; start += block_size, ++blk) {  // block by block, as the scores
      const char* ahead = ask_ahead && c0 == 0 ? kv.ahead(kv.blocks + blk + kAhead) : nullptr;
      const auto* row = reinterpret_cast<const c10::BFloat16*>(kv.ahead(kv.blocks + blk)) + 8 * c0;
      const int64_t end = std::min<int64_t>(start + block_size, len);
      for (int64_t t = start; t < end; ++t, row += head_dim) {
        prefetch_share(ahead ? ahead + (t - start) * row_bytes : nullptr, row_bytes);
        __m256 w[G];
#pragma GCC unroll 3
        for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(p + g * p_stride + t);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256 v = widen8_bf16(row + 8 * j);
#pragma GCC unroll 3
          for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(w[g], v, acc[g][j]);
        }
      }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc_out + g * head_dim + 8 * (c0 + j), acc[g][j]);
  }
}

// f(std::integral_constant<int, G>, g0) for the query heads of a GQA group in runs of G = 3 from g0, the last run
// of what is left (1 or 2).
template <typename F>
inline void for_head_runs(int64_t group, const F& f) {
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    switch (std::min<int64_t>(3, group - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      default: f(std::integral_constant<int, 3>{}, g0); break;
    }
  }
}

template <int C>
void decode_kernel_avx2(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                        const c10::BFloat16* v_cache, const int64_t* block_tables, const int64_t* seq_lens,
                        c10::BFloat16* out, int64_t out_stride, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                        int64_t block_size, int64_t max_blocks, double scale) {
  constexpr int64_t head_dim = 8 * C;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  parallel_over_sequences(batch, num_kv_heads, seq_lens, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      const int64_t head_offset = h * block_size * head_dim;
      if (len <= 0) {  // nothing to attend to: zeros, as the generic kernel gives
        std::fill(acc.begin(), acc.end(), 0.f);
      } else {
        scores.resize(group * len);
        for (int64_t g = 0; g < group; ++g) {
          load_row(q + b * q_stride + (h * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
          for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] *= static_cast<float>(scale);
        }
        // The keys' blocks, then the values', asked for kAhead blocks ahead by the first run of heads.
        const int64_t head_bytes = block_size * head_dim * static_cast<int64_t>(sizeof(c10::BFloat16));
        const KVStream kv{reinterpret_cast<const char*>(k_cache + head_offset),
                          reinterpret_cast<const char*>(v_cache + head_offset),
                          block_stride * static_cast<int64_t>(sizeof(c10::BFloat16)), head_bytes, table,
                          (len + block_size - 1) / block_size};
        kv.start();
        for_head_runs(group, [&](auto heads, int64_t g0) {
          avx2_scores<C, decltype(heads)::value>(qf.data() + g0 * head_dim, kv, g0 == 0, block_size, len,
                                                 scores.data() + g0 * len, len);
        });
        softmax_rows(scores.data(), group, len);
        for_head_runs(group, [&](auto heads, int64_t g0) {
          avx2_values<C, decltype(heads)::value>(scores.data() + g0 * len, kv, g0 == 0, block_size, len, len,
                                                 acc.data() + g0 * head_dim);
        });
      }
      for (int64_t g = 0; g < group; ++g) {
        store_row(acc.data() + g * head_dim, out + b * out_stride + (h * group + g) * head_dim, head_dim);
      }
    }
  });
}
#endif  // AVX2 without AVX-512

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Where one KV head of one block lives, and what a sequence's decode reads.
struct PagedSeq {
  const int64_t* table;
  int64_t len;
  int64_t block_size;
  int64_t kv_head;
  int64_t num_kv_heads;
};

// Pass 1, plain key layout: scores[g * row + t] = scale * q_g . k_t, each K row read once for the group.
template <typename scalar_t, int NV>
void plain_key_scores(const scalar_t* q_heads, const scalar_t* k_cache, const PagedSeq& seq, const KVStream& kv,
                      int64_t group, float scale, float* scores, int64_t row) {
  constexpr int64_t head_dim = 16 * NV;
  constexpr int kMaxGroup = 16;
  const int64_t block_stride = seq.num_kv_heads * seq.block_size * head_dim;
  __m512 qv[kMaxGroup][NV];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = _mm512_mul_ps(load16(q_heads + g * head_dim + 16 * j), vscale);
  for (int64_t t0 = 0; t0 < seq.len; t0 += seq.block_size) {
    const scalar_t* kb = k_cache + seq.table[t0 / seq.block_size] * block_stride + seq.kv_head * seq.block_size * head_dim;
    kv.fetch(t0 / seq.block_size + kAhead);
    const int64_t n = std::min(seq.block_size, seq.len - t0);
    for (int64_t t = 0; t < n; ++t) {
      __m512 kr[NV];
      for (int j = 0; j < NV; ++j) kr[j] = load16(kb + t * head_dim + 16 * j);
      for (int64_t g = 0; g < group; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kr[0]);
        for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[g][j], kr[j], a);
        scores[g * row + t0 + t] = _mm512_reduce_add_ps(a);
      }
    }
  }
}

#ifdef __AVX512BF16__
// Scores of GT query heads against 16 tokens: GT x 4 independent vdpbf16ps chains sharing each key load (one head's
// 4 chains alone would wait on the instruction's latency more than they compute). `ahead` (nullptr: nothing):
// `share` bytes from ahead + step * share are asked for at each of the pairs / 4 steps.
template <int NV, int GT>
inline void packed_chunk_scores(const uint32_t* kb, int64_t bs, const uint32_t* q_pairs, __m512 vscale, float* out,
                                int64_t row, const char* ahead, int64_t share) {
  constexpr int64_t pairs = 8 * NV;  // head_dim / 2
  __m512 acc[GT][4];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 4) {
    prefetch_share(ahead == nullptr ? nullptr : ahead + p / 4 * share, share);
    __m512i kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_si512(kb + (p + c) * bs);
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < 4; ++c)
        acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)kv[c],
                                     (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[g * pairs + p + c])));
  }
  for (int g = 0; g < GT; ++g) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_add_ps(acc[g][2], acc[g][3]));
    _mm512_storeu_ps(out + g * row, _mm512_mul_ps(sum, vscale));
  }
}

// Pass 1, packed key layout: 16 tokens' scores per vdpbf16ps, the group's heads in tiles of up to 4.
// scores[g * row + t] for t < round_up(len, 16); lanes past len are never read.
template <int NV>
void packed_key_scores(const c10::BFloat16* q_heads, const c10::BFloat16* k_cache, const PagedSeq& seq,
                       const KVStream& kv, int64_t group, float scale, float* scores, int64_t row) {
  constexpr int64_t pairs = 8 * NV;  // head_dim / 2
  const int64_t bs = seq.block_size;
  const int64_t block_words = seq.num_kv_heads * pairs * bs;  // 32-bit words: a bf16 pair each
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(k_cache) + seq.kv_head * pairs * bs;
  const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q_heads);
  const __m512 vscale = _mm512_set1_ps(scale);
  const uint32_t* block_keys = keys;
  const char* ahead = nullptr;
  // The block kAhead on, a 16-token chunk's share of it per chunk, over the chunk's pairs / 4 steps.
  const int64_t chunk_share = kv.bytes / (bs / 16), share = chunk_share / (pairs / 4);
  int64_t offset = bs, block = -1;  // counters instead of divisions
  for (int64_t t0 = 0; t0 < seq.len; t0 += 16, offset += 16) {
    if (offset == bs) {
      offset = 0;
      block_keys = keys + seq.table[++block] * block_words;
      ahead = kv.ahead(block + kAhead);
    }
    const uint32_t* kb = block_keys + offset;
    const char* chunk_ahead = ahead == nullptr ? nullptr : ahead + offset / 16 * chunk_share;
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const uint32_t* qg = q_pairs + g0 * pairs;
      float* out = scores + g0 * row + t0;
      const char* a = g0 == 0 ? chunk_ahead : nullptr;  // the first tile of heads asks for it
      switch (std::min<int64_t>(4, group - g0)) {
        case 1: packed_chunk_scores<NV, 1>(kb, bs, qg, vscale, out, row, a, share); break;
        case 2: packed_chunk_scores<NV, 2>(kb, bs, qg, vscale, out, row, a, share); break;
        case 3: packed_chunk_scores<NV, 3>(kb, bs, qg, vscale, out, row, a, share); break;
        default: packed_chunk_scores<NV, 4>(kb, bs, qg, vscale, out, row, a, share); break;
      }
    }
  }
}
#endif

// How a pass asks for the block kAhead on: all at once (KVStream::fetch), a token's share at a time
// (KVStream::ahead), or not at all (a later tile of heads: the first asked for it).
enum class Ahead { kBlocks, kShares, kNone };

// Pass 2 for GT query heads of a group: out_g = sum_t p_g[t] v_t, the GT x NV accumulators held in registers
// (a runtime-sized set spills to the stack, where every update waits on a store).
template <typename scalar_t, int NV, int GT>
void weighted_values(const scalar_t* v_cache, const PagedSeq& seq, const KVStream& kv, const float* probs,
                     int64_t row, scalar_t* out_heads, Ahead how) {
  constexpr int64_t head_dim = 16 * NV;
  const int64_t block_stride = seq.num_kv_heads * seq.block_size * head_dim;
  __m512 acc[GT][NV];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
  // One flat loop over tokens: with a loop per block inside a loop over blocks, GCC keeps the accumulators on the
  // stack between blocks.
  const int64_t head_offset = seq.kv_head * seq.block_size * head_dim;
  const scalar_t* vb = v_cache;
  int64_t offset = seq.block_size, block = -1;  // counters, not t % block_size: a division per token costs more
  const char* ahead = nullptr;
  const int64_t share = kv.bytes / seq.block_size;
  for (int64_t t = 0; t < seq.len; ++t, ++offset) {
    if (offset == seq.block_size) {
      offset = 0;
      vb = v_cache + seq.table[++block] * block_stride + head_offset;
      if (how == Ahead::kShares) ahead = kv.ahead(kv.blocks + block + kAhead);
      else if (how == Ahead::kBlocks) kv.fetch(kv.blocks + block + kAhead);
    }
    prefetch_share(ahead == nullptr ? nullptr : ahead + offset * share, share);
    __m512 vr[NV];
    for (int j = 0; j < NV; ++j) vr[j] = load16(vb + offset * head_dim + 16 * j);
    for (int g = 0; g < GT; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * row + t]);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vr[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GT; ++g) {
    alignas(64) float out_row[head_dim];
    for (int j = 0; j < NV; ++j) _mm512_store_ps(out_row + 16 * j, acc[g][j]);
    store_row(out_row, out_heads + g * head_dim, head_dim);
  }
}

// Query heads in tiles of at most 4 (head_dim 64) or 2 (128): 16 accumulators, the rest for V rows. `shares`: the
// first tile asks for the blocks ahead a token's share at a time (packed keys' passes), else every tile a block at
// once.
template <typename scalar_t, int NV>
void weighted_values_tiled(const scalar_t* v_cache, const PagedSeq& seq, const KVStream& kv, const float* probs,
                           int64_t row, int64_t group, scalar_t* out_heads, bool shares) {
  constexpr int64_t head_dim = 16 * NV;
  constexpr int kTile = NV == 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < group; g0 += kTile) {
    const float* p = probs + g0 * row;
    scalar_t* o = out_heads + g0 * head_dim;
    const Ahead how = !shares ? Ahead::kBlocks : g0 == 0 ? Ahead::kShares : Ahead::kNone;
    switch (std::min<int64_t>(kTile, group - g0)) {
      case 1: weighted_values<scalar_t, NV, 1>(v_cache, seq, kv, p, row, o, how); break;
      case 2: weighted_values<scalar_t, NV, 2>(v_cache, seq, kv, p, row, o, how); break;
      case 3: weighted_values<scalar_t, NV, (kTile >= 3 ? 3 : 1)>(v_cache, seq, kv, p, row, o, how); break;
      default: weighted_values<scalar_t, NV, kTile>(v_cache, seq, kv, p, row, o, how); break;
    }
  }
}

// One row's attention for one KV head with head_dim = 16 * NV, vectorised: scores, softmax, weighted values; the
// next block is prefetched while the current one is read (blocks of a sequence are scattered through the pool).
template <typename scalar_t, int NV, bool PackedKeys>
void decode_item(const scalar_t* q_heads, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                 int64_t len, int64_t h, int64_t group, int64_t num_kv_heads, int64_t block_size, double scale,
                 scalar_t* out_heads, std::vector<float>& scores) {
  constexpr int64_t head_dim = 16 * NV;
  const PagedSeq seq{table, len, block_size, h, num_kv_heads};
  const int64_t row = (seq.len + 15) / 16 * 16;
  scratch(scores, group * row);
  // Both layouts keep one head's part of a block contiguous, block_size * head_dim values.
  const int64_t head_part = block_size * head_dim, stride = num_kv_heads * head_part * sizeof(scalar_t);
  const KVStream kv{reinterpret_cast<const char*>(k_cache + h * head_part),
                    reinterpret_cast<const char*>(v_cache + h * head_part), stride,
                    head_part * static_cast<int64_t>(sizeof(scalar_t)), seq.table,
                    (seq.len + block_size - 1) / block_size};
  kv.start();
  if constexpr (PackedKeys) {
#ifdef __AVX512BF16__
    packed_key_scores<NV>(q_heads, k_cache, seq, kv, group, static_cast<float>(scale), scores.data(), row);
#endif
  } else {
    plain_key_scores<scalar_t, NV>(q_heads, k_cache, seq, kv, group, static_cast<float>(scale), scores.data(), row);
  }
  for (int64_t g = 0; g < group; ++g) softmax_rows(scores.data() + g * row, 1, seq.len);
  weighted_values_tiled<scalar_t, NV>(v_cache, seq, kv, scores.data(), row, group, out_heads, PackedKeys);
}

// Attention with plain keys: every row on its own, items (row, KV head). Packed keys: token_rows_packed.
template <typename scalar_t, int NV>
void decode_kernel_avx512(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int64_t* block_tables, const int64_t* seq_lens, scalar_t* out, int64_t out_stride,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                          int64_t max_blocks, double scale) {
  constexpr int64_t head_dim = 16 * NV;
  const int64_t group = num_heads / num_kv_heads;
  parallel_over_sequences(batch, num_kv_heads, seq_lens, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      decode_item<scalar_t, NV, false>(q + b * q_stride + h * group * head_dim, k_cache, v_cache,
                                       block_tables + b * max_blocks, seq_lens[b], h, group, num_kv_heads, block_size,
                                       scale, out + b * out_stride + h * group * head_dim, scores);
    }
  });
}

#ifdef __AVX512BF16__
// Prefill rows as query tiles. Row by row, a prompt chunk's attention runs both products on one query head at a
// time, the weighted values as fp32 FMAs on value rows converted per query row: ~230-280 GFLOP/s on two Zen 5
// cores, a quarter of what vdpbf16ps gives the linears. A tile holds 16 query vectors (a row's head each) in the
// 16 lanes of a register, so both products are vdpbf16ps with one operand broadcast from memory:
//   scores: lane q of S[t] += (q_q[2i], q_q[2i+1]) . (k_t[2i], k_t[2i+1]), the key pair broadcast from the packed
//           key cache as it lies;
//   values: lane q of O[d] += (p_q[2j], p_q[2j+1]) . (v_2j[d], v_2j+1[d]), the probabilities rounded to bf16 pairs
//           (as GPU flash attention rounds them) and the value pairs interleaved once per 16-token chunk for every
//           query vector of the tile.
// The softmax is online (flash attention's running max and sum per lane), with no horizontal reduction: each
// chunk's 16 scores per lane are 16 registers.
constexpr int64_t kTileRows = 16;
constexpr int64_t kMinRun = 8;  // rows of one sequence below this go row by row

struct TileScratch {
  std::vector<uint32_t> qt;  // [sub-tile][pair][16 lanes]: the tile's query vectors' bf16 pairs, transposed
  std::vector<uint32_t> vp;  // [token pair][head_dim]: the chunk's value rows interleaved in pairs
  std::vector<float> o;      // [sub-tile][head_dim][16 lanes], fp32
  std::vector<float> m, l;   // [sub-tile][16 lanes]: running max and sum
  std::vector<int32_t> len;  // [sub-tile][16 lanes]: each query vector's causal length
  std::vector<float> row;    // one query vector's output before rounding
};

inline __m512i bf16_pairs(__m512 lo, __m512 hi) {  // lane q: (bf16(lo[q]), bf16(hi[q])) in one 32-bit word
  const __m512i l = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  const __m512i h = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

// One 16-token chunk for one sub-tile of 16 query vectors: scores, online softmax, weighted values.
template <int NV>
inline void tile_chunk(const uint32_t* qt, const uint32_t* kb, int64_t bs, const uint32_t* vp, int64_t t0,
                       __m512 vscale, const int32_t* len, float* m, float* l, float* o) {
  constexpr int64_t head_dim = 16 * NV, pairs = 8 * NV;
  __m512 sc[16];
  for (int t = 0; t < 16; ++t) sc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + p * 16);
    const uint32_t* kp = kb + p * bs;
    for (int t = 0; t < 16; ++t)
      sc[t] = _mm512_dpbf16_ps(sc[t], qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(kp[t])));
  }
  const __m512i lens = _mm512_loadu_si512(len);
  const __m512 floor = _mm512_set1_ps(-1e30f);
  __m512 mx = _mm512_loadu_ps(m);
  const __m512 m_old = mx;
  __mmask16 valid[16];
  for (int t = 0; t < 16; ++t) {
    valid[t] = _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(static_cast<int>(t0 + t)));
    sc[t] = _mm512_mask_mul_ps(floor, valid[t], sc[t], vscale);
    mx = _mm512_max_ps(mx, sc[t]);
  }
  const __m512 alpha = exp512(_mm512_sub_ps(m_old, mx));
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l), alpha);
  for (int t = 0; t < 16; ++t) {
    sc[t] = _mm512_maskz_mov_ps(valid[t], exp512(_mm512_sub_ps(sc[t], mx)));
    sum = _mm512_add_ps(sum, sc[t]);
  }
  _mm512_storeu_ps(m, mx);
  _mm512_storeu_ps(l, sum);
  __m512bh pp[8];
  for (int j = 0; j < 8; ++j) pp[j] = (__m512bh)bf16_pairs(sc[2 * j], sc[2 * j + 1]);
  for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
    __m512 acc[16];
    for (int d = 0; d < 16; ++d) acc[d] = _mm512_mul_ps(_mm512_loadu_ps(o + (d0 + d) * 16), alpha);
    for (int j = 0; j < 8; ++j) {
      const uint32_t* vj = vp + j * head_dim + d0;
      for (int d = 0; d < 16; ++d)
        acc[d] = _mm512_dpbf16_ps(acc[d], pp[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(vj[d])));
    }
    for (int d = 0; d < 16; ++d) _mm512_storeu_ps(o + (d0 + d) * 16, acc[d]);
  }
}

// vp[j][d] = (v_2j[d], v_2j+1[d]) in one 32-bit word for token pairs j < token_pairs: a chunk's values as both
// query-tile kernels' weighted values read them (each probability pair of a query meets a value pair). row(t): token
// t's value row of head_dim bf16, or nullptr past the chunk's tokens (zeros: weighted by 0, and no NaN from a
// block's unwritten slots).
template <typename Row>
inline void interleave_value_pairs(uint32_t* vp, int64_t token_pairs, int64_t head_dim, const Row& row) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < token_pairs; ++j) {
    const uint16_t* a = row(2 * j);
    const uint16_t* b = row(2 * j + 1);
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d))) : zero;
      const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d))) : zero;
      _mm512_storeu_si512(vp + j * head_dim + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENLINE_ATTENTION_AMX 1
// The same query tiles on AMX (Sapphire Rapids and later Xeons), flash attention over chunks of 32 tokens: a tile
// of 16 query vectors (rows of the A tile, head_dim / 32 k steps) against the packed keys as they lie (a block's 16
// dimension pairs of 16 tokens are one B tile, 64-byte rows, block_size * 4 bytes apart) gives the 16 x 32 scores
// in two C tiles; the online softmax runs on them in AVX-512 and writes the probabilities, rounded to bf16, as one A
// tile, which meets the chunk's values interleaved in pairs of tokens (B tiles of 16 dimensions) in the output's C
// tiles. Each sub-tile of 16 query vectors runs through all its chunks in turn (the unit's values are interleaved
// once, for every sub-tile), so that at head_dim 64 its output stays in four C tiles from the first chunk to the last.
// The softmax does as little as it can per chunk:
//   - a row's max is raised only when a score passes it by more than kLazyMax (then its sum and output are rescaled,
//     the output tiles stored and loaded again): probabilities up to e^8 against a stale max lose nothing in fp32,
//     and a row's scores rarely climb that far after its first chunk, so most chunks neither reduce nor rescale;
//   - the scale is folded into the exponent (one fused multiply-subtract, then 2^x);
//   - only the chunks that reach past a row's own length are masked;
//   - each row's sum stays 16 partial sums until the end.
//   tiles: 0 A (queries or probabilities), 1 B (keys or values), 2-3 the chunk's scores, 4-7 the output.
std::atomic<bool> g_attention_amx{true};  // attention_amx(0) turns the tiles off (the vdpbf16ps tiles then)

inline bool attention_amx_on() { return amx_permitted() && g_attention_amx.load(std::memory_order_relaxed); }

constexpr float kLazyMax = 8.f;  // natural-log units of the scaled scores

// 2^x (x clamped at -126 below): 2^n * 2^f, f in [-0.5, 0.5], 2^f by its Taylor series to f^4, within 5e-5: the
// probabilities are rounded to bf16 (4e-3) before they meet the values.
inline __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));    // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));    // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

struct AmxScratch {
  // The tiles' sources start on a cache line (LineVector, vec_math.h): rows straddling two lines load 2-3x slower.
  LineVector<c10::BFloat16> qa;  // [sub-tile][16][head_dim]: the query vectors as the A tile's rows
  LineVector<uint32_t> vp;       // [chunk][16 token pairs][head_dim]: the unit's values interleaved in pairs
  LineVector<float> o;           // [16][head_dim], fp32: a sub-tile's output where it is not in tiles
  LineVector<float> sums;        // [16][16]: each row's 16 partial sums
  std::vector<int32_t> len;      // [sub-tile][16]
  alignas(64) float s[16 * 32];  // one chunk's scores of one sub-tile
  alignas(64) uint16_t p[16 * 32];  // its probabilities, bf16
};

inline void configure_attention_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The output's four C tiles (tiles 4-7) to and from 64 dimensions of 16 rows, head_dim apart.
template <int64_t kHeadDim>
inline void store_output_tiles(float* o) {
  _tile_stored(4, o, kHeadDim * 4);
  _tile_stored(5, o + 16, kHeadDim * 4);
  _tile_stored(6, o + 32, kHeadDim * 4);
  _tile_stored(7, o + 48, kHeadDim * 4);
}
template <int64_t kHeadDim>
inline void load_output_tiles(const float* o) {
  _tile_loadd(4, o, kHeadDim * 4);
  _tile_loadd(5, o + 16, kHeadDim * 4);
  _tile_loadd(6, o + 32, kHeadDim * 4);
  _tile_loadd(7, o + 48, kHeadDim * 4);
}

template <int NV>
void prefill_tile_amx(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                      const c10::BFloat16* v_cache, const int64_t* table, int64_t first_len, int64_t rows, int64_t h,
                      int64_t group, int64_t num_kv_heads, int64_t block_size, float scale, c10::BFloat16* out,
                      int64_t out_stride, AmxScratch& s) {
  constexpr int64_t head_dim = 16 * NV, pairs = 8 * NV, ksteps = head_dim / 32;
  constexpr bool kOutputInTiles = head_dim == 64;  // else the output lives in s.o, 64 dimensions at a time in tiles
  const int64_t nq = rows * group, subs = (nq + 15) / 16;
  scratch(s.qa, subs * 16 * head_dim);
  scratch(s.len, subs * 16);
  scratch(s.o, 16 * head_dim);
  scratch(s.sums, 16 * 16);
  for (int64_t lane = 0; lane < subs * 16; ++lane) {  // lanes past nq repeat the last vector; their results are dropped
    const int64_t v = std::min(lane, nq - 1), r = v / group, g = v % group;
    std::memcpy(s.qa.data() + lane * head_dim, q + r * q_stride + (h * group + g) * head_dim, head_dim * 2);
    s.len[lane] = static_cast<int32_t>(first_len + r);
  }
  const int64_t last_len = first_len + rows - 1, chunks = (last_len + 31) / 32;
  const int64_t block_k = num_kv_heads * pairs * block_size;  // 32-bit words (bf16 pairs) of a block of K
  const int64_t block_v = num_kv_heads * block_size * head_dim;
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(k_cache) + h * pairs * block_size;
  const int64_t k_row_bytes = block_size * 4;
  scratch(s.vp, chunks * 16 * head_dim);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t t0 = c * 32, n = std::min<int64_t>(32, last_len - t0);  // tokens past n: zero values
    interleave_value_pairs(s.vp.data() + c * 16 * head_dim, 16, head_dim, [&](int64_t t) -> const uint16_t* {
      if (t >= n) return nullptr;  // a chunk may cross a block
      return reinterpret_cast<const uint16_t*>(v_cache) + table[(t0 + t) / block_size] * block_v +
             (h * block_size + (t0 + t) % block_size) * head_dim;
    });
  }
  configure_attention_tiles();
  const float to_exp2 = scale * 1.44269504088896341f;  // scale * log2(e): e^(scale x) = 2^(to_exp2 x)
  const __m512 vexp = _mm512_set1_ps(to_exp2), floor = _mm512_set1_ps(-1e30f);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i sixteen = _mm512_set1_epi32(16);
  const float lazy = kLazyMax / scale;  // in the raw scores' units
  float* const o = s.o.data();
  float* const sums = s.sums.data();
  for (int64_t sub = 0; sub < subs; ++sub) {
    const c10::BFloat16* qa = s.qa.data() + sub * 16 * head_dim;
    const int32_t* len = s.len.data() + sub * 16;  // ascending over the lanes
    alignas(64) float m[16];  // each row's max (raw scores), -inf until its first visible score
    for (int r = 0; r < 16; ++r) m[r] = -INFINITY;
    std::fill(sums, sums + 256, 0.f);
    if constexpr (kOutputInTiles) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
    } else {
      std::fill(o, o + 16 * head_dim, 0.f);
    }
    for (int64_t t0 = 0; t0 < len[15]; t0 += 32) {
      const int64_t n = std::min<int64_t>(32, last_len - t0);
      const uint32_t* vp = s.vp.data() + (t0 / 32) * 16 * head_dim;
      const uint32_t* kb[2];  // the two halves' keys (a half past the sequence reads the first half's: masked)
      for (int c = 0; c < 2; ++c) {
        const int64_t t = c * 16 < n ? t0 + c * 16 : t0;
        kb[c] = keys + table[t / block_size] * block_k + t % block_size;
      }
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < ksteps; ++k) {
        _tile_loadd(0, qa + k * 32, head_dim * 2);
        _tile_loadd(1, kb[0] + k * 16 * block_size, k_row_bytes);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kb[1] + k * 16 * block_size, k_row_bytes);
        _tile_dpbf16ps(3, 0, 1);
      }
      _tile_stored(2, s.s, 128);
      _tile_stored(3, s.s + 16, 128);
      const bool masked = t0 + 32 > len[0];  // some row sees fewer than the chunk's 32 tokens
      __mmask16 vis[16][2];
      uint32_t raise = 0;  // rows whose max goes up
      for (int r = 0; r < 16; ++r) {
        __m512 s0 = _mm512_load_ps(s.s + r * 32), s1 = _mm512_load_ps(s.s + r * 32 + 16);
        if (masked) {
          const __m512i limit = _mm512_set1_epi32(static_cast<int>(len[r] - t0));
          vis[r][0] = _mm512_cmpgt_epi32_mask(limit, iota);
          vis[r][1] = _mm512_cmpgt_epi32_mask(limit, _mm512_add_epi32(iota, sixteen));
          s0 = _mm512_mask_mov_ps(floor, vis[r][0], s0);
          s1 = _mm512_mask_mov_ps(floor, vis[r][1], s1);
          _mm512_store_ps(s.s + r * 32, s0);
          _mm512_store_ps(s.s + r * 32 + 16, s1);
        }
        if (_mm512_cmp_ps_mask(_mm512_max_ps(s0, s1), _mm512_set1_ps(m[r] + lazy), _CMP_GT_OQ))
          raise |= 1u << r;
      }
      if (raise) {  // new maxima: the sums and the output rescaled to them
        if constexpr (kOutputInTiles) store_output_tiles<head_dim>(o);
        for (int r = 0; r < 16; ++r) {
          if (!(raise >> r & 1)) continue;
          const float row_max = _mm512_reduce_max_ps(
              _mm512_max_ps(_mm512_load_ps(s.s + r * 32), _mm512_load_ps(s.s + r * 32 + 16)));
          const __m512 alpha = exp2_512(_mm512_set1_ps((m[r] - row_max) * to_exp2));
          m[r] = row_max;
          _mm512_store_ps(sums + r * 16, _mm512_mul_ps(_mm512_load_ps(sums + r * 16), alpha));
          for (int64_t d = 0; d < head_dim; d += 16)
            _mm512_store_ps(o + r * head_dim + d, _mm512_mul_ps(_mm512_load_ps(o + r * head_dim + d), alpha));
        }
        if constexpr (kOutputInTiles) load_output_tiles<head_dim>(o);
      }
      for (int r = 0; r < 16; ++r) {
        // p = e^(scale (s - m)) = 2^(s to_exp2 - m to_exp2)
        const __m512 bias = _mm512_set1_ps(m[r] * to_exp2);
        __m512 p0 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(s.s + r * 32), vexp, bias));
        __m512 p1 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(s.s + r * 32 + 16), vexp, bias));
        if (masked) {  // a masked score's 2^x is 0 unless the row has seen no token yet: zeroed by its mask
          p0 = _mm512_maskz_mov_ps(vis[r][0], p0);
          p1 = _mm512_maskz_mov_ps(vis[r][1], p1);
        }
        _mm512_store_ps(sums + r * 16, _mm512_add_ps(_mm512_load_ps(sums + r * 16), _mm512_add_ps(p0, p1)));
        _mm512_store_si512(s.p + r * 32, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
      _tile_loadd(0, s.p, 64);
      for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        if constexpr (!kOutputInTiles) load_output_tiles<head_dim>(o + d0);
        _tile_loadd(1, vp + d0, head_dim * 4);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, vp + d0 + 16, head_dim * 4);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, vp + d0 + 32, head_dim * 4);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, vp + d0 + 48, head_dim * 4);
        _tile_dpbf16ps(7, 0, 1);
        if constexpr (!kOutputInTiles) store_output_tiles<head_dim>(o + d0);
      }
    }
    if constexpr (kOutputInTiles) store_output_tiles<head_dim>(o);
    for (int64_t lane = 0; lane < 16 && sub * 16 + lane < nq; ++lane) {
      const int64_t v = sub * 16 + lane, r = v / group, g = v % group;
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(sums + lane * 16)));
      alignas(64) float row[head_dim];
      for (int64_t d = 0; d < head_dim; d += 16)
        _mm512_store_ps(row + d, _mm512_mul_ps(_mm512_load_ps(o + lane * head_dim + d), inv));
      store_row(row, out + r * out_stride + (h * group + g) * head_dim, head_dim);
    }
  }
}
#endif

// Attention of `rows` consecutive rows of one sequence (causal lengths first_len, first_len + 1, ...) for KV head h:
// the rows' group query heads are the tile's rows * group query vectors, in sub-tiles of 16. table: the last row's
// block table, which holds every row's keys.
template <int NV>
void prefill_tile(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                  const c10::BFloat16* v_cache, const int64_t* table, int64_t first_len, int64_t rows, int64_t h,
                  int64_t group, int64_t num_kv_heads, int64_t block_size, float scale, c10::BFloat16* out,
                  int64_t out_stride, TileScratch& s) {
  constexpr int64_t head_dim = 16 * NV, pairs = 8 * NV;
  const int64_t nq = rows * group, subs = (nq + 15) / 16;
  scratch(s.qt, subs * pairs * 16);
  scratch(s.len, subs * 16);
  s.o.assign(subs * head_dim * 16, 0.f);
  s.m.assign(subs * 16, -1e30f);
  s.l.assign(subs * 16, 0.f);
  scratch(s.vp, 8 * head_dim);
  scratch(s.row, head_dim);
  for (int64_t lane = 0; lane < subs * 16; ++lane) {  // lanes past nq repeat the last vector; their results are dropped
    const int64_t v = std::min(lane, nq - 1), r = v / group, g = v % group;
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(q + r * q_stride + (h * group + g) * head_dim);
    uint32_t* dst = s.qt.data() + (lane / 16) * pairs * 16 + lane % 16;
    for (int64_t p = 0; p < pairs; ++p) dst[p * 16] = qp[p];
    s.len[lane] = static_cast<int32_t>(first_len + r);
  }
  const int64_t last_len = first_len + rows - 1;
  const int64_t block_k = num_kv_heads * pairs * block_size;  // 32-bit words (bf16 pairs) of a block of K
  const int64_t block_v = num_kv_heads * block_size * head_dim;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < last_len; t0 += 16) {
    const int64_t block = table[t0 / block_size], offset = t0 % block_size;
    const uint32_t* kb = reinterpret_cast<const uint32_t*>(k_cache) + block * block_k + h * pairs * block_size +
                         offset;
    const uint16_t* vb = reinterpret_cast<const uint16_t*>(v_cache) + block * block_v +
                         (h * block_size + offset) * head_dim;
    const int64_t n = std::min<int64_t>(16, last_len - t0);  // tokens past n: zero values (weighted by 0)
    interleave_value_pairs(s.vp.data(), 8, head_dim,
                           [&](int64_t t) { return t < n ? vb + t * head_dim : nullptr; });  // one block
    for (int64_t sub = 0; sub < subs; ++sub)
      tile_chunk<NV>(s.qt.data() + sub * pairs * 16, kb, block_size, s.vp.data(), t0, vscale, s.len.data() + sub * 16,
                     s.m.data() + sub * 16, s.l.data() + sub * 16, s.o.data() + sub * head_dim * 16);
  }
  for (int64_t v = 0; v < nq; ++v) {
    const int64_t r = v / group, g = v % group, sub = v / 16, lane = v % 16;
    const float* o = s.o.data() + sub * head_dim * 16 + lane;
    const float inv = 1.f / s.l[v];
    for (int64_t d = 0; d < head_dim; ++d) s.row[d] = o[d * 16] * inv;
    store_row(s.row.data(), out + r * out_stride + (h * group + g) * head_dim, head_dim);
  }
}

// Attention over token rows with packed keys: runs of at least kMinRun rows that are consecutive positions of one
// sequence (each row's causal length one more than the last's, the same blocks) go in tiles of kTileRows rows;
// every other row (a decode, a short chunk) goes alone, and so does every row without query_tiles (its bits then
// do not depend on the rows beside it). Rows of two requests that share a prefix but not the chunk's blocks start
// a new run.
template <int NV>
void token_rows_packed(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                       const c10::BFloat16* v_cache, const int64_t* block_tables, const int64_t* seq_lens,
                       c10::BFloat16* out, int64_t out_stride, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                       int64_t block_size, int64_t max_blocks, double scale, bool query_tiles) {
  constexpr int64_t head_dim = 16 * NV;
  const int64_t group = num_heads / num_kv_heads;
  auto blocks_of = [&](int64_t len) { return std::min<int64_t>((len + block_size - 1) / block_size, max_blocks); };
  struct Unit {
    int64_t row, rows;  // rows == 1: a row alone
  };
  std::vector<Unit> units;
  for (int64_t b = 0; b < batch;) {
    int64_t e = b + 1;
    while (query_tiles && e < batch && seq_lens[e] == seq_lens[e - 1] + 1 && seq_lens[e - 1] > 0 &&
           std::memcmp(block_tables + e * max_blocks, block_tables + (e - 1) * max_blocks,
                       blocks_of(seq_lens[e]) * sizeof(int64_t)) == 0)
      ++e;
    if (e - b >= kMinRun) {
      for (int64_t r = b; r < e; r += kTileRows) units.push_back({r, std::min(kTileRows, e - r)});
    } else {
      for (int64_t r = b; r < e; ++r) units.push_back({r, 1});
    }
    b = e;
  }
  std::vector<int64_t> costs;
  costs.reserve(units.size() * num_kv_heads);
  for (const Unit& u : units) {
    // A tile does a row's work in about a third of the row kernel's time.
    const int64_t work = u.rows == 1 ? std::max<int64_t>(seq_lens[u.row], 0)
                                     : u.rows * (seq_lens[u.row] + u.rows / 2) / 3;
    for (int64_t h = 0; h < num_kv_heads; ++h) costs.push_back(work + kItemCost);
  }
#ifdef TOKENLINE_ATTENTION_AMX
  const bool amx = attention_amx_on();
#endif
  parallel_over_costs(costs, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    TileScratch scratch;
#ifdef TOKENLINE_ATTENTION_AMX
    AmxScratch amx_scratch;
#endif
    for (int64_t item = begin; item < end; ++item) {
      const Unit& u = units[item / num_kv_heads];
      const int64_t h = item % num_kv_heads;
      if (u.rows == 1) {
        decode_item<c10::BFloat16, NV, true>(q + u.row * q_stride + h * group * head_dim, k_cache, v_cache,
                                              block_tables + u.row * max_blocks, seq_lens[u.row], h, group,
                                              num_kv_heads, block_size, scale,
                                              out + u.row * out_stride + h * group * head_dim, scores);
      } else {
#ifdef TOKENLINE_ATTENTION_AMX
        if (amx) {
          prefill_tile_amx<NV>(q + u.row * q_stride, q_stride, k_cache, v_cache,
                               block_tables + (u.row + u.rows - 1) * max_blocks, seq_lens[u.row], u.rows, h, group,
                               num_kv_heads, block_size, static_cast<float>(scale), out + u.row * out_stride,
                               out_stride, amx_scratch);
          continue;
        }
#endif
        prefill_tile<NV>(q + u.row * q_stride, q_stride, k_cache, v_cache,
                         block_tables + (u.row + u.rows - 1) * max_blocks, seq_lens[u.row], u.rows, h, group,
                         num_kv_heads, block_size, static_cast<float>(scale), out + u.row * out_stride, out_stride,
                         scratch);
      }
    }
  });
}
#endif
#endif

bool packed_keys_supported(c10::ScalarType dtype, int64_t block_size, int64_t head_dim, int64_t group) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return dtype == at::kBFloat16 && block_size % 16 == 0 && (head_dim == 64 || head_dim == 128) && group <= 16;
#else
  return false;
#endif
}

// Whether bf16 rows in the plain layout, a prompt's rows as well as decodes, run on the AVX2 kernel here (CPUs
// without AVX-512, where keys are not packed): CpuAttention then gives it every new token of a step as a row.
bool plain_token_rows_supported(int64_t head_dim) {
#ifdef TOKENLINE_ATTENTION_AVX2
  return head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

bool packed_keys_supported_op(int64_t block_size, int64_t head_dim, int64_t group) {
  return packed_keys_supported(at::kBFloat16, block_size, head_dim, group);
}

// out [batch, heads * head_dim] (rows may be strided) <- attention of q [batch, heads, head_dim] (heads contiguous).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, bool query_tiles) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [batch, heads, head_dim]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(1) == q.size(1) * q.size(2),
              "out must be [batch, heads * head_dim]");
  TORCH_CHECK(v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous: V [blocks, kv_heads, block_size, head_dim], K like V or packed "
              "[blocks, kv_heads, head_dim / 2, block_size, 2]");
  const bool packed_keys = k_cache.dim() == 5;
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "q, out and caches must share a dtype");
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = v_cache.size(1), block_size = v_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(v_cache.size(3) == head_dim, "head_dim mismatch between q and the cache");
  TORCH_CHECK(!packed_keys || (k_cache.size(1) == num_kv_heads && k_cache.size(2) * 2 == head_dim &&
                               k_cache.size(3) == block_size && k_cache.size(4) == 2),
              "a packed k_cache must be [blocks, kv_heads, head_dim / 2, block_size, 2]");
  TORCH_CHECK(!packed_keys || packed_keys_supported(q.scalar_type(), block_size, head_dim, num_heads / num_kv_heads),
              "packed keys need bf16, block_size a multiple of 16, head_dim 64 or 128, a GQA group <= 16 and "
              "AVX512-BF16");
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
#ifdef __AVX512F__
    if constexpr (!std::is_same_v<scalar_t, c10::Half>) {
      if (num_heads / num_kv_heads <= 16 && (head_dim == 64 || head_dim == 128)) {
#ifdef __AVX512BF16__
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (packed_keys) {
            auto kernel = head_dim == 64 ? token_rows_packed<4> : token_rows_packed<8>;
            kernel(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                   bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), out.stride(0),
                   batch, num_heads, num_kv_heads, block_size, bt.size(1), scale, query_tiles);
            return;
          }
        }
#endif
        auto kernel = head_dim == 64 ? decode_kernel_avx512<scalar_t, 4> : decode_kernel_avx512<scalar_t, 8>;
        kernel(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
               bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), out.stride(0), batch,
               num_heads, num_kv_heads, block_size, bt.size(1), scale);
        return;
      }
    }
#endif
#ifdef TOKENLINE_ATTENTION_AVX2
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (!packed_keys && (head_dim == 64 || head_dim == 128)) {
        auto kernel = head_dim == 64 ? decode_kernel_avx2<8> : decode_kernel_avx2<16>;
        kernel(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
               bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), out.stride(0), batch,
               num_heads, num_kv_heads, block_size, bt.size(1), scale);
        return;
      }
    }
#endif
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), out.stride(0), batch, num_heads, num_kv_heads, head_dim,
                            block_size, bt.size(1), scale);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16");
  }
}

// Whether prompt rows' query tiles run on AMX: `on` 0 or 1 sets it, a negative value leaves it; returns the value
// in effect (false where the build or the CPU has no AMX).
bool attention_amx(int64_t on) {
#ifdef TOKENLINE_ATTENTION_AMX
  if (on >= 0) g_attention_amx.store(on != 0, std::memory_order_relaxed);
  return attention_amx_on();
#else
  (void)on;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(tokenline, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, bool query_tiles=True) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def("packed_keys_supported(int block_size, int head_dim, int group) -> bool", &packed_keys_supported_op);
  m.def("plain_token_rows_supported(int head_dim) -> bool", &plain_token_rows_supported);
  m.def("attention_amx(int on=-1) -> bool", &attention_amx);
}
