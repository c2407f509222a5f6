// Decode attention over a paged KV cache ([blocks, kv_heads, block_size, head_dim]) on CPU: one query token per sequence, K/V read in place
// through the block table (no gathered copy), online softmax in fp32, GQA groups sharing each K/V read.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <algorithm>
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

template <typename scalar_t>
void decode_kernel(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, scalar_t* out, int64_t out_stride, int64_t batch, int64_t num_heads,
                   int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t max_blocks, double scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
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

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void prefetch_block(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// The same computation with head_dim = 16 * NV held in registers; the next block is prefetched while
// the current one is read (blocks of a sequence are scattered through the pool).
template <typename scalar_t, int NV>
void decode_kernel_avx512(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int64_t* block_tables, const int64_t* seq_lens, scalar_t* out, int64_t out_stride,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                          int64_t max_blocks, double scale) {
  constexpr int64_t head_dim = 16 * NV;
  constexpr int kMaxGroup = 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  const int64_t block_bytes = block_size * head_dim * static_cast<int64_t>(sizeof(scalar_t));
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    __m512 qv[kMaxGroup][NV], acc[kMaxGroup][NV];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(group * len);
      const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
      for (int64_t g = 0; g < group; ++g)
        for (int j = 0; j < NV; ++j)
          qv[g][j] = _mm512_mul_ps(load16(q + b * q_stride + (h * group + g) * head_dim + 16 * j), vscale);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const scalar_t* kb = k_cache + table[t0 / block_size] * block_stride + h * block_size * head_dim;
        if (t0 + block_size < len)
          prefetch_block(k_cache + table[t0 / block_size + 1] * block_stride + h * block_size * head_dim,
                         block_bytes);
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t t = 0; t < n; ++t) {
          __m512 kr[NV];
          for (int j = 0; j < NV; ++j) kr[j] = load16(kb + t * head_dim + 16 * j);
          for (int64_t g = 0; g < group; ++g) {
            __m512 a = _mm512_mul_ps(qv[g][0], kr[0]);
            for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[g][j], kr[j], a);
            scores[g * len + t0 + t] = _mm512_reduce_add_ps(a);
          }
        }
      }
      softmax_rows(scores.data(), group, len);
      for (int64_t g = 0; g < group; ++g)
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const scalar_t* vb = v_cache + table[t0 / block_size] * block_stride + h * block_size * head_dim;
        if (t0 + block_size < len)
          prefetch_block(v_cache + table[t0 / block_size + 1] * block_stride + h * block_size * head_dim,
                         block_bytes);
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t t = 0; t < n; ++t) {
          __m512 vr[NV];
          for (int j = 0; j < NV; ++j) vr[j] = load16(vb + t * head_dim + 16 * j);
          for (int64_t g = 0; g < group; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * len + t0 + t]);
            for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vr[j], acc[g][j]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        alignas(64) float row[head_dim];
        for (int j = 0; j < NV; ++j) _mm512_store_ps(row + 16 * j, acc[g][j]);
        store_row(row, out + b * out_stride + (h * group + g) * head_dim, head_dim);
      }
    }
  });
}
#endif

// out [batch, heads * head_dim] (rows may be strided) <- attention of q [batch, heads, head_dim] (heads contiguous).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [batch, heads, head_dim]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(1) == q.size(1) * q.size(2),
              "out must be [batch, heads * head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "q, out and caches must share a dtype");
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(k_cache.size(3) == head_dim, "head_dim mismatch between q and the cache");
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
#ifdef __AVX512F__
    if constexpr (!std::is_same_v<scalar_t, c10::Half>) {
      if (num_heads / num_kv_heads <= 16 && (head_dim == 64 || head_dim == 128)) {
        auto kernel = head_dim == 64 ? decode_kernel_avx512<scalar_t, 4> : decode_kernel_avx512<scalar_t, 8>;
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

}  // namespace

TORCH_LIBRARY(tokenline, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
