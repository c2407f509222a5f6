// One token per row of fp32 logits, in one native call per step: greedy rows take the argmax, the others draw from
// softmax(logits / temperature) by inverting the row's cumulative weights at a uniform draw, on two levels as
// engine/sampler.py's sample_from does (blocks of kBlock weights summed in fp32, the draw placed among the blocks on
// their cumulative sums in float64, then inside its block on the block's own float64 cumulative sum, scaled to the
// block's share of the draw). The weights are exp((x - max) / T), never normalised: the inversion needs only their
// sums. torch's ops did the same in five passes over the row and a [rows, vocab] temporary each (the division by the
// temperature, max, exp, sum and division of the softmax, the block sums), and its argmax is a scalar loop: 1.0 ms
// for 16 rows of SmolLM2's 49,152 logits on one thread, where a decode step of 16 rows takes ~34.
//
// Exactness: a token keeps its share of its block exactly and a block its fp32 sum (within about 1e-6 of its
// weight); a token of weight 0 (a banned token's -inf, or a weight under e^-87 of the top token's, under fp32's
// smallest normal) is never drawn. A NaN among the logits makes the row's token its first NaN's index, as torch's
// argmax gives; a +inf the first +inf's.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 1024;  // as engine/sampler.py's CDF_BLOCK
constexpr float kMinExponent = -87.f;  // e^-87 ~ 1.6e-38, just above fp32's smallest normal: weights below are 0

// The build runs under -ffast-math, which lets the compiler assume no NaN or infinity: std::isnan, std::isinf and
// an unordered compare may fold to false. These read the bits.
inline uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}
inline bool is_nan(float v) { return (bits_of(v) & 0x7FFFFFFFu) > 0x7F800000u; }
inline bool is_inf(float v) { return (bits_of(v) & 0x7FFFFFFFu) == 0x7F800000u; }
inline bool is_pos_inf(float v) { return bits_of(v) == 0x7F800000u; }

struct RowMax {
  float value;
  int64_t special;  // the index of the first NaN, or of the first +inf; -1 where there is none
};

#ifdef __AVX512F__

RowMax row_max(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = neg_inf, m1 = neg_inf;
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf_bits = _mm512_set1_epi32(0x7F800000);
  __m512i widest = _mm512_setzero_si512();  // the largest |x| bit pattern per lane: past inf's, a NaN
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    widest = _mm512_max_epu32(widest, _mm512_and_si512(_mm512_castps_si512(a), abs_mask));
    widest = _mm512_max_epu32(widest, _mm512_and_si512(_mm512_castps_si512(b), abs_mask));
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 a = _mm512_mask_loadu_ps(neg_inf, m, x + i);
    widest = _mm512_max_epu32(widest, _mm512_and_si512(_mm512_castps_si512(a), abs_mask));
    m0 = _mm512_max_ps(m0, a);
  }
  if (_mm512_cmpgt_epu32_mask(widest, inf_bits)) {
    for (int64_t j = 0; j < n; ++j)
      if (is_nan(x[j])) return {x[j], j};
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  if (is_pos_inf(top)) {
    for (int64_t j = 0; j < n; ++j)
      if (x[j] == top) return {top, j};
  }
  return {top, -1};
}

int64_t first_equal(const float* x, int64_t n, float value) {
  const __m512 v = _mm512_set1_ps(value);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = _mm512_mask_cmp_ps_mask(tail_mask(n - i), _mm512_maskz_loadu_ps(tail_mask(n - i), x + i), v,
                                                _CMP_EQ_OQ);
    if (m) return i + __builtin_ctz(m);
  }
  return 0;
}

// w[i] = exp((x[i] - top) * inv_t) for i < n (0 under the exponent floor), and their fp32 sum.
inline float block_weights(const float* x, int64_t n, float top, float inv_t, float* w) {
  const __m512 vtop = _mm512_set1_ps(top), vinv = _mm512_set1_ps(inv_t), floor = _mm512_set1_ps(kMinExponent);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vtop), vinv);
    const __m512 b = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), vtop), vinv);
    const __m512 ea = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, floor, _CMP_GE_OQ), exp512(a));
    const __m512 eb = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, floor, _CMP_GE_OQ), exp512(b));
    if (w) {
      _mm512_storeu_ps(w + i, ea);
      _mm512_storeu_ps(w + i + 16, eb);
    }
    s0 = _mm512_add_ps(s0, ea);
    s1 = _mm512_add_ps(s1, eb);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vtop), vinv);
    const __m512 ea = _mm512_maskz_mov_ps(m & _mm512_cmp_ps_mask(a, floor, _CMP_GE_OQ), exp512(a));
    if (w) _mm512_mask_storeu_ps(w + i, m, ea);
    s0 = _mm512_add_ps(s0, ea);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}
#else
RowMax row_max(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    if (is_nan(x[j])) return {x[j], j};
    top = std::max(top, x[j]);
  }
  if (is_pos_inf(top)) {
    for (int64_t j = 0; j < n; ++j)
      if (x[j] == top) return {top, j};
  }
  return {top, -1};
}

int64_t first_equal(const float* x, int64_t n, float value) {
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == value) return j;
  return 0;
}

inline float block_weights(const float* x, int64_t n, float top, float inv_t, float* w) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = (x[i] - top) * inv_t;
    const float e = a >= kMinExponent ? std::exp(a) : 0.f;
    if (w) w[i] = e;
    sum += e;
  }
  return sum;
}
#endif

// The drawn index of one row at uniform u in [0, 1).
int64_t draw_row(const float* x, int64_t vocab, float top, float inv_t, double u, std::vector<double>& cdf,
                 std::vector<double>& inner, std::vector<float>& w) {
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  cdf.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += block_weights(x + b * kBlock, std::min(kBlock, vocab - b * kBlock), top, inv_t, nullptr);
    cdf[b] = total;
  }
  const double target = u * total;
  int64_t block = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
  block = std::min(block, blocks - 1);
  while (block > 0 && cdf[block] == cdf[block - 1]) --block;  // past the end by rounding: the last block of weight
  const double start = block ? cdf[block - 1] : 0.0;
  const int64_t n = std::min(kBlock, vocab - block * kBlock);
  w.resize(kBlock);
  const double block_sum = block_weights(x + block * kBlock, n, top, inv_t, w.data());
  if (block_sum <= 0.0) return block * kBlock;  // unreachable for a finite top: the top token weighs 1
  const double share = std::min(std::max((target - start) / (cdf[block] - start), 0.0), 1.0);
  // Every partial sum stored, so that -ffast-math cannot reassociate the sum the search below walks.
  inner.resize(kBlock);
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) inner[i] = acc += w[i];
  // The draw inside the block stays below its total, so it lands where the cumulative weight steps up: on a token
  // of positive weight.
  const double rest = std::min(share * inner[n - 1], std::nextafter(inner[n - 1], 0.0));
  return block * kBlock + (std::upper_bound(inner.begin(), inner.begin() + n, rest) - inner.begin());
}

// out[b] <- row b's token: its argmax where temperature[b] <= 0, else a draw at uniform[b].
void sample_rows(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature,
                 const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_rows: logits must be fp32 [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_rows: an empty vocabulary");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == rows,
              "sample_rows: out must be int64 [rows]");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == rows,
              "sample_rows: temperature must be fp32 [rows]");
  TORCH_CHECK(uniform.scalar_type() == at::kDouble && uniform.is_contiguous() && uniform.numel() == rows,
              "sample_rows: uniform must be float64 [rows]");
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float* temp = temperature.data_ptr<float>();
  const double* u = uniform.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  tokenline::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf, inner;
    std::vector<float> w;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      const RowMax m = row_max(row, vocab);
      if (m.special >= 0) {
        o[r] = m.special;
      } else if (temp[r] <= 0.f || is_inf(m.value)) {  // greedy, or every token banned (-inf): index 0
        o[r] = first_equal(row, vocab, m.value);
      } else {
        o[r] = draw_row(row, vocab, m.value, 1.f / temp[r], u[r], cdf, inner, w);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("sample_rows(Tensor(a!) out, Tensor logits, Tensor temperature, Tensor uniform) -> ()");
  m.impl("sample_rows", c10::DispatchKey::CPU, &sample_rows);
}
