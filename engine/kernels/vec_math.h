// Vector math shared by the CPU kernels' translation units. The functions are inline: each unit that includes the
// header compiles them into its loops.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

// Scratch whose data starts on a 64-byte line: a tile load (or a 64-byte vector load) whose rows straddle two cache
// lines runs 2-3x slower, and malloc aligns only to 16 bytes.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// A scratch vector's storage for at least n elements. Grows only: resize() after a smaller call would fill the
// elements past the smaller size with zeros again, each call (tile_copy alternates 576- and 1,536-wide x).
template <typename V>
inline typename V::value_type* scratch(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

#ifdef __AVX512F__
#include <immintrin.h>

#include <cstdint>

// The first n lanes (all 16 from n = 16 on): a masked load or store of a row's tail.
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// exp(x) to about 2 ulp over fp32's range: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, then
// 2^n by scalef (which saturates to inf and flushes to 0 past the range).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The bf16 bits of v (round to nearest even), 16 of them.
inline __m256i bf16_bits(__m512 v) {
#ifdef __AVX512BF16__
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // one instruction
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

// v rounded to bf16 and back to fp32.
inline __m512 bf16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}

// silu(g) * u for bf16 values g and u (in fp32 lanes), silu rounded to bf16 before the product: silu_and_mul's
// arithmetic, shared with the linear kernel that computes it straight from gate/up's sums. Its plain products and
// sums are the explicitly rounded forms: under -ffast-math the compiler may reorder _mm512_mul_ps and _mm512_add_ps
// (they are vector arithmetic to it) differently where each caller inlines them, and the two then disagree in the
// last bit, which flips a bf16 rounding tie.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 e = exp512(_mm512_sub_round_ps(_mm512_setzero_ps(), g, kNearest));
  const __m512 d = _mm512_add_round_ps(_mm512_set1_ps(1.f), e, kNearest);
  __m512 inv = _mm512_rcp14_ps(d);  // 1 / d to 14 bits, then one Newton step (about 23 bits), not a division:
  inv = _mm512_fmadd_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(1.f)), inv);  // inv + inv (1 - d inv)
  return _mm512_mul_round_ps(bf16_round(_mm512_mul_round_ps(g, inv, kNearest)), u, kNearest);
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

// 8 bf16 values (16 bytes at p, any alignment) widened to fp32: a bf16 is the high half of its fp32.
inline __m256 widen8_bf16(const void* p) {
  const __m128i raw = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The bf16 bits of 8 fp32 values, rounded to nearest even as bf16_bits is (AVX2 has no conversion instruction).
inline __m128i bf16_bits8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// Linux lends a process the 8 KB of tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// ldtilecfg's 64 bytes (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif
