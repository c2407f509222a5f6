// Fused elementwise layers for the CPU decode path, where per-op dispatch costs as much as the math:
// RMSNorm (with the residual add folded in), neox-style RoPE in place, SiLU-and-mul, and the KV-cache write.
// Arithmetic is fp32; bf16 results are rounded to nearest even once per output.
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t w = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
inline void store(float* dst, float v) { *dst = v; }
inline void store(c10::BFloat16* dst, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  u += 0x7FFF + ((u >> 16) & 1);
  dst->x = static_cast<uint16_t>(u >> 16);
}
inline float round_like(float, float v) { return v; }
inline float round_like(c10::BFloat16, float v) {
  c10::BFloat16 r;
  store(&r, v);
  return to_float(r);
}

#ifdef __AVX512F__
// bf16 rows, 16 values at a time: the scalar paths' arithmetic (fp32, round to nearest even once per output) in
// AVX-512 registers. A bf16 prefill step spends 9-10% of its time in these loops otherwise (make step-breakdown).
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, bf16_bits(v));
}

// One bf16 row of rms_norm: the residual add (stored rounded), the sum of squares, the scaled output.
void rms_norm_row(c10::BFloat16* o, const c10::BFloat16* x, c10::BFloat16* r, const c10::BFloat16* w, int64_t dim,
                  float eps) {
  const c10::BFloat16* src = x;
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    __m512 v = load_bf16(x + i, m);
    if (r) {
      v = bf16_round(_mm512_add_ps(load_bf16(r + i, m), v));
      store_bf16(r + i, v, m);
    }
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  if (r) src = r;
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / dim + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    const __m512 v = bf16_round(_mm512_mul_ps(load_bf16(src + i, m), inv));
    store_bf16(o + i, _mm512_mul_ps(load_bf16(w + i, m), v), m);
  }
}

// One bf16 row of silu_and_mul.
// Four vectors at a time: one vector's silu is a chain of ~25 dependent operations, and four independent chains
// keep both vector units busy (1.43 -> 2.16 G elements/s on one thread of a Xeon with AMX, 3.34 -> 4.17 on two).
void silu_and_mul_row(c10::BFloat16* dst, const c10::BFloat16* g, const c10::BFloat16* u, int64_t inter) {
  int64_t i = 0;
  for (; i + 64 <= inter; i += 64) {
    __m512 r[4];
    for (int j = 0; j < 4; ++j) r[j] = silu_mul16(load_bf16(g + i + 16 * j, 0xFFFF), load_bf16(u + i + 16 * j, 0xFFFF));
    for (int j = 0; j < 4; ++j) store_bf16(dst + i + 16 * j, r[j], 0xFFFF);
  }
  for (; i < inter; i += 16) {
    const __mmask16 m = tail_mask(inter - i);
    store_bf16(dst + i, silu_mul16(load_bf16(g + i, m), load_bf16(u + i, m)), m);
  }
}
#endif

template <typename F>
void dispatch(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, name, " supports float32 and bfloat16, got ", t.scalar_type());
  }
}

// out = w * norm(x); with a residual: residual += x first and the norm reads the sum (stored rounded, as
// transformers adds in the model dtype). Rows of x and out may be strided; the last dim is contiguous.
void rms_norm(at::Tensor& out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "rms_norm takes [rows, hidden] tensors");
  const int64_t rows = x.size(0), dim = x.size(1);
  dispatch(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    T* rp = residual.has_value() ? residual->data_ptr<T>() : nullptr;
    const T* wp = weight.data_ptr<T>();
    const int64_t xs = x.stride(0), os = out.stride(0), rs = residual.has_value() ? residual->stride(0) : 0;
    tokenline::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (int64_t r = begin; r < end; ++r) {
          rms_norm_row(op + r * os, xp + r * xs, rp ? rp + r * rs : nullptr, wp, dim, static_cast<float>(eps));
        }
        return;
      }
#endif
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * xs;
        T* src = const_cast<T*>(xr);
        if (rp) {
          T* rr = rp + r * rs;
          for (int64_t i = 0; i < dim; ++i) store(rr + i, to_float(rr[i]) + to_float(xr[i]));
          src = rr;
        }
        float sq = 0.f;
        for (int64_t i = 0; i < dim; ++i) {
          const float v = to_float(src[i]);
          sq += v * v;
        }
        const float inv = 1.f / std::sqrt(sq / dim + static_cast<float>(eps));
        T* o = op + r * os;
        for (int64_t i = 0; i < dim; ++i) {
          store(o + i, to_float(wp[i]) * round_like(T{}, to_float(src[i]) * inv));
        }
      }
    });
  });
}

// Rotates the q and k heads of a fused qkv activation [tokens, (hq + 2 * hk) * d] in place.
void rotary_embedding(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                      int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary_embedding takes a [tokens, width] qkv tensor");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "cos_sin must be fp32 [pos, d]");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  const int64_t tokens = qkv.size(0), half = head_dim / 2, heads = num_q_heads + num_kv_heads;
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  dispatch(qkv, "rotary_embedding", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* base = qkv.data_ptr<T>();
    const int64_t stride = qkv.stride(0);
    tokenline::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = table + pp[t] * head_dim;  // [cos(half) | sin(half)]
        const float* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
          T* x = base + t * stride + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
            store(x + i, x1 * cos[i] - x2 * sin[i]);
            store(x + i + half, x2 * cos[i] + x1 * sin[i]);
          }
        }
      }
    });
  });
}

// out[t] = silu(gate_up[t, :I]) * gate_up[t, I:]
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && out.is_contiguous(), "silu_and_mul: 2-D tensors");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  dispatch(gate_up, "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = gate_up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    tokenline::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (int64_t t = begin; t < end; ++t) {
          silu_and_mul_row(o + t * inter, in + t * 2 * inter, in + t * 2 * inter + inter, inter);
        }
        return;
      }
#endif
      for (int64_t t = begin; t < end; ++t) {
        const T* g = in + t * 2 * inter;
        const T* u = g + inter;
        T* dst = o + t * inter;
        for (int64_t i = 0; i < inter; ++i) {
          const float gv = to_float(g[i]);
          // exp(-gv) past fp32 would be inf, and inf under -ffast-math gives NaN: 88 keeps it finite (silu ~ -0).
          store(dst + i, round_like(T{}, gv / (1.f + std::exp(std::min(-gv, 88.f)))) * to_float(u[i]));
        }
      }
    });
  });
}

// Writes each new token's K and V ([tokens, kv_heads, d], rows may be strided) into [blocks, kv_heads, block, d]
// caches at the given slots; a 5-D k_cache is the packed key layout [blocks, kv_heads, d / 2, block, 2]
// (engine/kernels/paged_attention_cpu.cpp).
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const bool packed_keys = k_cache.dim() == 5;
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v must be [tokens, kv_heads, head_dim] with contiguous heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slot mapping must be int64");
  const int64_t tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t block_size = v_cache.size(2), block_stride = num_kv_heads * block_size * head_dim;
  TORCH_CHECK(!packed_keys || (k.scalar_type() == at::kBFloat16 && head_dim % 2 == 0),
              "the packed key layout holds bf16 pairs");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  dispatch(k, "write_kv_cache", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    const int64_t ks = k.stride(0), vs = v.stride(0);
    tokenline::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t block = sp[t] / block_size, offset = sp[t] % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t dst = block * block_stride + (h * block_size + offset) * head_dim;
          std::memcpy(vc + dst, vp + t * vs + h * head_dim, head_dim * sizeof(T));
          if (packed_keys) {  // pair p of this token goes to word (h * d/2 + p) * block + offset of its block
            const uint32_t* src = reinterpret_cast<const uint32_t*>(kp + t * ks + h * head_dim);
            uint32_t* words = reinterpret_cast<uint32_t*>(kc + block * block_stride) + h * (head_dim / 2) * block_size;
            for (int64_t p = 0; p < head_dim / 2; ++p) words[p * block_size + offset] = src[p];
          } else {
            std::memcpy(kc + dst, kp + t * ks + h * head_dim, head_dim * sizeof(T));
          }
        }
      }
    });
  });
}

// For the tests: parallel_for over [0, n) in pieces of at least `grain`, each item recording which thread ran it
// (0: the caller) in out[item, 0] and how often it ran in out[item, 1]; items below `slow_below` sleep `sleep_us`
// each, so that the thread that owns them falls behind and the others take its chunks.
at::Tensor pool_trace(int64_t n, int64_t grain, int64_t slow_below, int64_t sleep_us) {
  at::Tensor out = at::zeros({n, 2}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<std::atomic<int64_t>> runs(n);
  std::mutex names_mutex;
  std::vector<std::thread::id> names{std::this_thread::get_id()};
  tokenline::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    int64_t me;
    {
      std::lock_guard<std::mutex> lock(names_mutex);
      auto it = std::find(names.begin(), names.end(), std::this_thread::get_id());
      me = it - names.begin();
      if (it == names.end()) names.push_back(std::this_thread::get_id());
    }
    for (int64_t i = begin; i < end; ++i) {
      if (i < slow_below) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      o[i * 2] = me;
      runs[i].fetch_add(1);
    }
  });
  for (int64_t i = 0; i < n; ++i) o[i * 2 + 1] = runs[i].load();
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("kernel_pool(int on=-1) -> bool", &tokenline::kernel_pool);  // thread_pool.h
  m.def("pool_trace(int n, int grain, int slow_below=0, int sleep_us=0) -> Tensor", &pool_trace);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int num_q_heads, int num_kv_heads, "
        "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("write_kv_cache", c10::DispatchKey::CPU, &write_kv_cache);
}
