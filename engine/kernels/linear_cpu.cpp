// bf16 linear layers for CPU decode: y = x W^T (+ b), with W packed once so that AVX512-BF16 dot products
// (vdpbf16ps) accumulate 16 outputs per instruction with no horizontal sums.
//
// Packed layout: [N/16 blocks][K/2 pairs][16 outputs][2 k], so one 64-byte load holds the next k pair of 16 output
// rows and each k pair of x is a 32-bit broadcast. Decode is bandwidth-bound (each weight is read once per step);
// a block of 16 outputs is one contiguous stream, and MR rows of x share every weight load, so a small batch costs
// little more than one row. Larger batches re-read a group's weights from L2 for each MR rows.
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TOKENLINE_HAS_BF16_DOT 1
#endif

namespace {

constexpr int64_t kBlock = 16;  // outputs per packed block (one zmm of fp32)

// [N, K] row-major -> [ceil(N/16), K/2, 16, 2]; rows past N are zero.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_linear_weight takes a bf16 [N, K]");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack_linear_weight needs an even K, got ", weight.size(1));
  auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlock - 1) / kBlock, pairs = k / 2;
  auto packed = at::zeros({blocks, pairs, kBlock, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < kBlock && b * kBlock + r < n; ++r) {
        const uint16_t* row = src + (b * kBlock + r) * k;
        uint16_t* out = dst + b * pairs * kBlock * 2 + r * 2;
        for (int64_t p = 0; p < pairs; ++p) {
          out[p * kBlock * 2] = row[2 * p];
          out[p * kBlock * 2 + 1] = row[2 * p + 1];
        }
      }
  });
  return packed;
}

#ifdef TOKENLINE_HAS_BF16_DOT

inline void store_out(c10::BFloat16* dst, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store_out(float* dst, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(dst, mask, v); }

// MR rows of x times NR blocks of 16 outputs, over the whole K.
template <int MR, int NR, typename out_t>
inline void micro_kernel(const uint32_t* const* x, const uint32_t* w, int64_t pairs, const float* bias,
                         out_t* const* out, int64_t n_valid) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t block_stride = pairs * kBlock;  // in 32-bit words
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w + j * block_stride + p * kBlock);
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[i][p]));
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[j], (__m512bh)xv);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t valid = std::min<int64_t>(kBlock, n_valid - j * kBlock);
    if (valid <= 0) break;
    const __mmask16 mask = valid >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kBlock) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) store_out(out[i] + j * kBlock, _mm512_add_ps(acc[i][j], b), mask);
  }
}

template <int NR, typename out_t>
void rows_times_blocks(int64_t mr, const uint32_t* const* x, const uint32_t* w, int64_t pairs, const float* bias,
                       out_t* const* out, int64_t n_valid) {
  switch (mr) {
    case 1: micro_kernel<1, NR>(x, w, pairs, bias, out, n_valid); break;
    case 2: micro_kernel<2, NR>(x, w, pairs, bias, out, n_valid); break;
    case 3: micro_kernel<3, NR>(x, w, pairs, bias, out, n_valid); break;
    case 4: micro_kernel<4, NR>(x, w, pairs, bias, out, n_valid); break;
    case 5: micro_kernel<5, NR>(x, w, pairs, bias, out, n_valid); break;
    default: micro_kernel<6, NR>(x, w, pairs, bias, out, n_valid); break;
  }
}

template <typename out_t>
void packed_linear_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out,
                        int64_t n) {
  constexpr int64_t kMaxRows = 6;
  const int64_t m = x.size(0), pairs = packed.size(1), blocks = packed.size(0);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const int64_t x_stride = x.stride(0) / 2;
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  out_t* op = out.data_ptr<out_t>();
  const int64_t o_stride = out.stride(0);
  // Enough block ranges to balance the threads; each range keeps its weights hot across the rows of x.
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(4, blocks / (2 * at::get_num_threads())));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += 4) {
      const int64_t nr = std::min<int64_t>(4, end - b0);
      const uint32_t* w = wp + b0 * pairs * kBlock;
      const int64_t n_valid = n - b0 * kBlock;
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int64_t mr = std::min<int64_t>(kMaxRows, m - r0);
        const uint32_t* xs[kMaxRows];
        out_t* os[kMaxRows];
        for (int64_t i = 0; i < mr; ++i) {
          xs[i] = xp + (r0 + i) * x_stride;
          os[i] = op + (r0 + i) * o_stride + b0 * kBlock;
        }
        const float* bb = bias ? bias + b0 * kBlock : nullptr;
        switch (nr) {
          case 1: rows_times_blocks<1>(mr, xs, w, pairs, bb, os, n_valid); break;
          case 2: rows_times_blocks<2>(mr, xs, w, pairs, bb, os, n_valid); break;
          case 3: rows_times_blocks<3>(mr, xs, w, pairs, bb, os, n_valid); break;
          default: rows_times_blocks<4>(mr, xs, w, pairs, bb, os, n_valid); break;
        }
      }
    }
  });
}

#endif  // TOKENLINE_HAS_BF16_DOT

bool packed_linear_supported() {
#ifdef TOKENLINE_HAS_BF16_DOT
  return true;
#else
  return false;
#endif
}

// out [M, N] (bf16 or fp32; rows may be strided) = x [M, K] (bf16, rows strided, last dim contiguous) W^T + bias.
void packed_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(packed_linear_supported(), "packed_linear needs AVX512-BF16 (built with -march=native)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 && x.stride(0) % 2 == 0,
              "packed_linear takes a bf16 [M, K] x with contiguous, even-aligned rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2 && packed.is_contiguous(),
              "packed_linear takes a weight from pack_linear_weight");
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), "x has K=", x.size(1), ", the weight ", 2 * packed.size(1));
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == n,
              "out must be [M, N]");
  TORCH_CHECK(n <= packed.size(0) * kBlock, "n is larger than the packed weight");
  at::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
#ifdef TOKENLINE_HAS_BF16_DOT
  if (out.scalar_type() == at::kFloat) {
    packed_linear_impl<float>(x, packed, bp, out, n);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "out must be bf16 or fp32");
    packed_linear_impl<c10::BFloat16>(x, packed, bp, out, n);
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.def("packed_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int n) -> ()");
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
  m.def("packed_linear_supported() -> bool", &packed_linear_supported);
}
