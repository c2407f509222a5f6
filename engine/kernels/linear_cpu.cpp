// bf16 linear layers for CPU decode: y = x W^T (+ b), with W packed once so that AVX512-BF16 dot products
// (vdpbf16ps) accumulate 16 outputs per instruction with no horizontal sums.
//
// Packed layout: [N/16 blocks][K/2 pairs][16 outputs][2 k], so one 64-byte load holds the next k pair of 16 output
// rows and each k pair of x is a 32-bit broadcast. Decode is bandwidth-bound (each weight is read once per step);
// a block of 16 outputs is one contiguous stream, and MR rows of x share every weight load, so a small batch costs
// little more than one row. Larger batches re-read a group's weights from L2 for each MR rows.
//
// int8 weights (one fp32 scale per output row) use the same layout at one byte a weight: half the bytes a decode
// step streams. x is quantized per row to int16 (13 bits) and VNNI's vpdpwssd adds two int16 products per lane
// exactly as the weights stream in, so a row's result does not depend on its neighbours. vpdpwssd runs at half
// vdpbf16ps's rate here: from about 12 rows the bf16 kernel is faster (packed_linear_int8_max_rows). CPUs with AVX2
// but no AVX-512 run the same arithmetic with vpmaddwd (below).
#include <ATen/Functions.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TOKENLINE_HAS_BF16_DOT 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENLINE_HAS_AMX 1  // amx_permitted and TileConfig: vec_math.h
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENLINE_HAS_AVX2_LINEAR 1  // the same packed weights widened to fp32 as they stream (below)
#endif

namespace {

constexpr int64_t kBlock = 16;  // outputs per packed block (one zmm of fp32)

// int8 weights: x quantized per row to int16 of magnitude up to kXMax, two int16 products added to an int32 lane a
// k pair, exactly; sums of kInt16ChunkPairs k pairs cannot overflow (1024 * 2 * 127 * 8191 < 2^31), and each
// chunk's sums are added in fp32, in order, whatever the instruction set.
constexpr float kXMax = 8191.0f;
constexpr int64_t kInt16ChunkPairs = 1024;

// Blocks a thread takes at a time: enough block ranges to balance the threads, each of up to `group` blocks whose
// weights stay hot across the rows of x.
inline int64_t group_grain(int64_t blocks, int64_t group) {
  return std::max<int64_t>(1, std::min<int64_t>(group, blocks / (2 * at::get_num_threads())));
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// [N, K] row-major -> [ceil(N/16), K/2, 16, 2]; rows past N are zero.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_linear_weight takes a bf16 [N, K]");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack_linear_weight needs an even K, got ", weight.size(1));
  auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlock - 1) / kBlock, pairs = k / 2;
  auto packed = at::zeros({blocks, pairs, kBlock, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  tokenline::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
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

// A block group's weights, one k pair of 16 outputs at a time: bf16 as packed ...
struct Bf16Weights {
  const uint32_t* w;
  int64_t block_stride;  // 32-bit words
  __m512i pair(int j, int64_t p) const { return _mm512_loadu_si512(w + j * block_stride + p * kBlock); }
  const char* block(int64_t j) const { return reinterpret_cast<const char*>(w + j * block_stride); }
  int64_t block_bytes() const { return block_stride * 4; }
};

// ... int8 as packed (32 bytes in the same order), sign-extended to int16 pairs ...
struct Int8Weights {
  const int8_t* w;
  int64_t block_stride;  // bytes
  __m512i pair(int j, int64_t p) const {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * block_stride + p * 2 * kBlock)));
  }
  const char* block(int64_t j) const { return reinterpret_cast<const char*>(w + j * block_stride); }
  int64_t block_bytes() const { return block_stride; }
};

// Cache lines a kernel call asks for into L2 while it works on weights already there: [next, end), `step` bytes
// (whole lines) each k pair.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t step = 0;
  inline void advance() {
    if (next >= end) return;
    for (int64_t o = 0; o < step; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
    next += step;
  }
};

// vdpbf16ps: two bf16 products added to each fp32 lane.
struct Bf16Dot {
  using acc_t = __m512;
  static constexpr int64_t kChunkPairs = INT64_MAX;
  static acc_t zero() { return _mm512_setzero_ps(); }
  static acc_t dot(acc_t a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }
  static __m512 to_float(acc_t a) { return a; }
};

// vpdpwssd: two int16 products added to each int32 lane, exactly; weights |q| <= 127 and x |q| <= kXMax, so a
// chunk of kInt16ChunkPairs pairs cannot overflow.
struct Int16Dot {
  using acc_t = __m512i;
  static constexpr int64_t kChunkPairs = kInt16ChunkPairs;
  static acc_t zero() { return _mm512_setzero_si512(); }
  static acc_t dot(acc_t a, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(a, w, x); }
  static __m512 to_float(acc_t a) { return _mm512_cvtepi32_ps(a); }
};

// MR rows of x times NR blocks of 16 outputs, over the whole K; then out = sums * scale * x_scale + bias, where
// int8 weights have a scale per output and their int16 x one per row.
template <int MR, int NR, bool kFetch, typename Dot, typename Weights, typename out_t>
inline void micro_kernel(const uint32_t* const* x, const float* x_scale, const Weights& wt, int64_t pairs,
                         const float* scale, const float* bias, out_t* const* out, int64_t n_valid, Prefetch pf) {
  __m512 total[MR][NR];
  for (int64_t c0 = 0; c0 < pairs; c0 += Dot::kChunkPairs) {
    const int64_t c1 = c0 + std::min<int64_t>(Dot::kChunkPairs, pairs - c0);
    typename Dot::acc_t acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = Dot::zero();
    for (int64_t p = c0; p < c1; ++p) {
      if constexpr (kFetch) pf.advance();  // an instance of its own: with the check in every loop, tiles lost ~15%
      __m512i wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = wt.pair(j, p);
      for (int i = 0; i < MR; ++i) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[i][p]));
        for (int j = 0; j < NR; ++j) acc[i][j] = Dot::dot(acc[i][j], wv[j], xv);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        total[i][j] = c0 == 0 ? Dot::to_float(acc[i][j]) : _mm512_add_ps(total[i][j], Dot::to_float(acc[i][j]));
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t valid = std::min<int64_t>(kBlock, n_valid - j * kBlock);
    if (valid <= 0) break;
    const __mmask16 mask = valid >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kBlock) : _mm512_setzero_ps();
    const __m512 s = scale ? _mm512_maskz_loadu_ps(mask, scale + j * kBlock) : _mm512_set1_ps(1.0f);
    for (int i = 0; i < MR; ++i) {
      const __m512 si = x_scale ? _mm512_mul_ps(s, _mm512_set1_ps(x_scale[i])) : s;
      store_out(out[i] + j * kBlock, _mm512_fmadd_ps(total[i][j], si, b), mask);
    }
  }
}

template <int NR, bool kFetch, typename Dot, typename Weights, typename out_t>
void rows_times_blocks(int64_t mr, const uint32_t* const* x, const float* x_scale, const Weights& wt, int64_t pairs,
                       const float* scale, const float* bias, out_t* const* out, int64_t n_valid, const Prefetch& pf) {
  switch (mr) {
    case 1: micro_kernel<1, NR, kFetch, Dot>(x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    case 2: micro_kernel<2, NR, kFetch, Dot>(x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    case 3: micro_kernel<3, NR, kFetch, Dot>(x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    case 4: micro_kernel<4, NR, kFetch, Dot>(x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    case 5: micro_kernel<5, NR, kFetch, Dot>(x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    default: micro_kernel<6, NR, kFetch, Dot>(x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
  }
}

template <bool kFetch, typename Dot, typename Weights, typename out_t>
void rows_times_nr(int64_t nr, int64_t mr, const uint32_t* const* x, const float* x_scale, const Weights& wt,
                   int64_t pairs, const float* scale, const float* bias, out_t* const* out, int64_t n_valid,
                   const Prefetch& pf) {
  switch (nr) {
    case 1: rows_times_blocks<1, kFetch, Dot>(mr, x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    case 2: rows_times_blocks<2, kFetch, Dot>(mr, x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    case 3: rows_times_blocks<3, kFetch, Dot>(mr, x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
    default: rows_times_blocks<4, kFetch, Dot>(mr, x, x_scale, wt, pairs, scale, bias, out, n_valid, pf); break;
  }
}

constexpr int64_t kMaxRows = 6;
constexpr int64_t kGroup = 4;  // blocks of 16 outputs a thread streams at once
constexpr int64_t kPrefetchTiles = 64;  // row tiles (384 rows) up to which a group's later tiles fetch the next one

// The rows of x a kernel reads: k pairs as 32-bit words (bf16 or int16 pairs), and int16's scale per row.
struct Rows {
  const uint32_t* x;
  int64_t stride;  // 32-bit words
  const float* scale;
  int64_t m;
};

// Every row tile of x against one group of nr blocks starting at block b0, then `next_nr` blocks the same thread
// reads next. The first tile streams the group's weights from memory; the later tiles read them from L2, and
// meanwhile ask for the next group's, so that with more rows than one tile the stream from memory overlaps the
// arithmetic instead of preceding it (memory time + compute time -> the larger of the two).
template <typename Dot, typename Weights, typename out_t>
void rows_times_group(const Rows& rows, const Weights& wt, int64_t pairs, const float* scale, const float* bias,
                      at::Tensor& out, int64_t b0, int64_t nr, int64_t n, int64_t next_nr) {
  out_t* op = out.data_ptr<out_t>();
  const int64_t o_stride = out.stride(0);
  const float* sc = scale ? scale + b0 * kBlock : nullptr;
  const float* bb = bias ? bias + b0 * kBlock : nullptr;
  const int64_t tiles = (rows.m + kMaxRows - 1) / kMaxRows;
  const char* next = wt.block(nr);
  // Up to a CPU step's rows (its token budget is 320): 10-25% faster at 12-64 rows, 0.3-6% at 128-384. Past
  // that, x alone (1.2 MB at 384 rows of 1,536) outgrows L2 and the next group would evict it.
  const char* next_end = next + (tiles <= kPrefetchTiles ? next_nr * wt.block_bytes() : 0);
  // Each later tile asks for an equal share of the next group, whole cache lines each k pair.
  const int64_t share = tiles > 1 ? (next_end - next + tiles - 2) / (tiles - 1) : 0;
  const int64_t step = tiles > 1 ? (share + 64 * pairs - 1) / (64 * pairs) * 64 : 0;
  for (int64_t r0 = 0; r0 < rows.m; r0 += kMaxRows) {
    const int64_t mr = std::min<int64_t>(kMaxRows, rows.m - r0);
    Prefetch pf;
    if (r0 > 0 && step > 0) {
      pf.next = std::min(next_end, next + (r0 / kMaxRows - 1) * step * pairs);
      pf.end = std::min(next_end, pf.next + step * pairs);
      pf.step = step;
    }
    const uint32_t* xs[kMaxRows];
    out_t* os[kMaxRows];
    for (int64_t i = 0; i < mr; ++i) {
      xs[i] = rows.x + (r0 + i) * rows.stride;
      os[i] = op + (r0 + i) * o_stride + b0 * kBlock;
    }
    const float* xsc = rows.scale ? rows.scale + r0 : nullptr;
    const int64_t n_valid = n - b0 * kBlock;
    if (pf.next < pf.end) rows_times_nr<true, Dot>(nr, mr, xs, xsc, wt, pairs, sc, bb, os, n_valid, pf);
    else rows_times_nr<false, Dot>(nr, mr, xs, xsc, wt, pairs, sc, bb, os, n_valid, pf);
  }
}

// Calls tile(b0, nr, next_nr) for each group of up to kGroup blocks, the groups shared between the threads;
// next_nr: the blocks of the group the same thread takes next (0 for its last).
template <typename Tile>
void for_each_group(int64_t blocks, const Tile& tile) {
  tokenline::parallel_for(0, blocks, group_grain(blocks, kGroup), [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += kGroup) {
      const int64_t nr = std::min<int64_t>(kGroup, end - b0);
      tile(b0, nr, std::min<int64_t>(kGroup, std::max<int64_t>(0, end - b0 - nr)));
    }
  });
}

template <typename out_t>
void packed_linear_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out,
                        int64_t n) {
  const int64_t pairs = packed.size(1);
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  const Rows rows{reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>()), x.stride(0) / 2, nullptr, x.size(0)};
  for_each_group(packed.size(0), [&](int64_t b0, int64_t nr, int64_t next_nr) {
    rows_times_group<Bf16Dot, Bf16Weights, out_t>(rows, Bf16Weights{wp + b0 * pairs * kBlock, pairs * kBlock}, pairs,
                                                  nullptr, bias, out, b0, nr, n, next_nr);
  });
}

#ifdef TOKENLINE_HAS_AMX

// AMX tiles (Sapphire Rapids and later Xeons) on the same packed weights: a block's 16 k pairs of 16 outputs are
// one 1 KB B tile ([16 pairs][16 outputs][2 k], 64-byte rows) as they lie, a row tile of x (up to 16 rows by 32 k)
// the A tile, tdpbf16ps accumulates 16 x 16 fp32. The tiles do a block's arithmetic for 16 rows in the time the
// dot-product kernel does it for one, so a step of up to 16 rows streams its weights at the memory's rate, as one
// row does, and one of 64 costs less than twice that; oneDNN's kernels take 1.4-1.6x as long up to 16 rows. From 17
// rows two row tiles go against two blocks (amx_pairs_of_blocks): each weight tile loaded serves two row tiles, 2-23%
// less time than one row tile against four blocks at 17-48 rows; the linears alone fall behind oneDNN's from about
// 96 rows, but a prompt step stays in the one native call on them and runs 1.2-1.4x faster (README: the engine,
// Where the CPU has AMX).

// Rows of x from which packed_linear runs on AMX tiles (0: never); set by linear_amx_min_rows.
std::atomic<int64_t> g_amx_min_rows{-1};  // -1: not chosen yet (the default, kAmxMinRows, where the CPU permits)
constexpr int64_t kAmxMinRows = 1;  // at one row too: 20-22 against 22-24 ms for the model on one thread

int64_t amx_min_rows() {
  int64_t v = g_amx_min_rows.load(std::memory_order_relaxed);
  if (v < 0) v = amx_permitted() ? kAmxMinRows : 0;
  return v;
}

// Whether packed_linear takes a step of `rows` rows on AMX tiles: the CPU permits them, the rows reach
// amx_min_rows, and K is whole k tiles (16 pairs).
bool on_amx_tiles(int64_t rows, const at::Tensor& packed) {
  const int64_t amx_rows = amx_min_rows();
  return amx_rows > 0 && rows >= amx_rows && packed.size(1) % 16 == 0;
}

// Tiles 0-3: C, an accumulator of mt rows by 16 outputs for each of up to four blocks; 4: A (mt rows by 32 k);
// 5-7: B (16 k pairs by 16 outputs), taken in turn so that a load need not wait for the multiply before it.
inline void configure_tiles(int64_t mt) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(mt);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// One row tile (mt rows of x at x, `x_bytes` apart, each k tile 32 elements on) against NR blocks: sums to
// c [NR][16][16] fp32.
template <int NR>
inline void amx_tile_blocks(const uint16_t* x, int64_t x_bytes, const uint16_t* w,
                            int64_t block_elems, int64_t k_tiles, float* c) {
  _tile_zero(0);
  if constexpr (NR > 1) _tile_zero(1);
  if constexpr (NR > 2) _tile_zero(2);
  if constexpr (NR > 3) _tile_zero(3);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    _tile_loadd(4, x + kt * 32, x_bytes);
    const uint16_t* wk = w + kt * 512;  // 16 pairs of 16 outputs of 2 bf16
    _tile_loadd(5, wk, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NR > 1) {
      _tile_loadd(6, wk + block_elems, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NR > 2) {
      _tile_loadd(7, wk + 2 * block_elems, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NR > 3) {
      _tile_loadd(5, wk + 3 * block_elems, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NR > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NR > 2) _tile_stored(2, c + 512, 64);
  if constexpr (NR > 3) _tile_stored(3, c + 768, 64);
}

// Rows [r0, r0 + rows) of the outputs of blocks b0.. (nr of them) from their tiles c ([block][16 rows][16]).
template <typename out_t>
inline void store_tiles(const float* c, int64_t rows, int64_t nr, const float* bias, out_t* op, int64_t o_stride,
                        int64_t r0, int64_t b0, int64_t n) {
  for (int64_t j = 0; j < nr; ++j) {
    const int64_t col = (b0 + j) * kBlock, valid = std::min<int64_t>(kBlock, n - col);
    if (valid <= 0) break;
    const __mmask16 mask = valid >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i)
      store_out(op + (r0 + i) * o_stride + col, _mm512_add_ps(_mm512_load_ps(c + j * 256 + i * 16), b), mask);
  }
}

// Where the A tiles lie: x's own rows (k_step 32 elements, row_bytes its row stride), or the tile copy below
// ([row tile][k tile][16 rows][32 k]: k_step 512, row_bytes 64). The row tiles before `whole` start row_tile
// elements apart from x; the one at `whole` (a last partial tile of x's own rows) is a padded copy at `tail`.
struct ATiles {
  const uint16_t* x;
  int64_t k_step, row_bytes, row_tile, whole;
  const uint16_t* tail;
  const uint16_t* row_tile_at(int64_t rt) const { return rt < whole ? x + rt * row_tile : tail; }
};

// Lines [line, end) of up to two weight streams to ask for into L2, per_step of each a k step.
struct TilePrefetch {
  const char* const* streams;
  int64_t line, end, per_step;
  inline void step() {
    for (int64_t i = 0; i < per_step && line < end; ++i, ++line) {
      if (streams[0]) _mm_prefetch(streams[0] + line * 64, _MM_HINT_T1);
      if (streams[1]) _mm_prefetch(streams[1] + line * 64, _MM_HINT_T1);
    }
  }
};

// Two row tiles against two blocks (R, B in {1, 2}; the second `second` elements after the first) over k tiles
// [k0, k1): C tiles 0-3 = [row tile][block], A tiles
// 4-5, B tiles 6-7, each k step 2 + 2 tile loads for 4 multiplies (tile loads, not multiplies, bound this loop).
// The A tiles: x (and x2, the second row tile), each k tile k_step elements on, tile rows row_bytes apart (ATiles).
// The sums start from zero at k0 = 0, else from c; they go to c [R][B][16][16] fp32.
template <int R, int B>
inline void amx_tiles_2x2(const uint16_t* x, const uint16_t* x2, int64_t k_step, int64_t row_bytes, const uint16_t* w,
                          int64_t second, int64_t k0, int64_t k1, float* c, TilePrefetch& pf) {
  if (k0 == 0) {
    _tile_zero(0);
    if constexpr (B > 1) _tile_zero(1);
    if constexpr (R > 1) _tile_zero(2);
    if constexpr (R > 1 && B > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, c, 64);
    if constexpr (B > 1) _tile_loadd(1, c + 256, 64);
    if constexpr (R > 1) _tile_loadd(2, c + B * 256, 64);
    if constexpr (R > 1 && B > 1) _tile_loadd(3, c + 3 * 256, 64);
  }
  for (int64_t kt = k0; kt < k1; ++kt) {
    const uint16_t* wk = w + kt * 512;
    pf.step();
    _tile_loadd(4, x + kt * k_step, row_bytes);
    _tile_loadd(6, wk, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (B > 1) {
      _tile_loadd(7, wk + second, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (R > 1) {
      _tile_loadd(5, x2 + kt * k_step, row_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (B > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (B > 1) _tile_stored(1, c + 256, 64);
  if constexpr (R > 1) _tile_stored(2, c + B * 256, 64);
  if constexpr (R > 1 && B > 1) _tile_stored(3, c + 3 * 256, 64);
}

// store_tiles for up to two blocks; two whole blocks into bf16 as one 64-byte store a row (a line written whole,
// not in halves a block apart).
template <typename out_t>
inline void store_tile_pair(const float* c, int64_t rows, int64_t nb, const float* bias, out_t* op, int64_t o_stride,
                            int64_t r0, int64_t b0, int64_t n) {
  if constexpr (std::is_same_v<out_t, c10::BFloat16>) {
    const int64_t col = b0 * kBlock;
    if (nb == 2 && col + 2 * kBlock <= n) {
      const __m512 b_lo = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
      const __m512 b_hi = bias ? _mm512_loadu_ps(bias + col + kBlock) : _mm512_setzero_ps();
      for (int64_t i = 0; i < rows; ++i) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + i * 16), b_lo);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + 256 + i * 16), b_hi);
        _mm512_storeu_si512(op + (r0 + i) * o_stride + col, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
      return;
    }
  }
  store_tiles(c, rows, nb, bias, op, o_stride, r0, b0, n);
}

// x [M, K] copied tile by tile, [row tile of 16][k tile of 32][16 rows][32 k], rows padded with zeros to a multiple
// of 16, so that every tile is full and an A tile is 1 KB in one piece, as a B tile is; the copy starts on a cache
// line (tile rows straddling two lines load 2-3x slower). The calling thread's buffer, valid until its next call.
const uint16_t* tile_copy(const at::Tensor& x) {
  const int64_t m = x.size(0), k_tiles = x.size(1) / 32, row_tiles = (m + 15) / 16, tile_elems = 16 * 32;
  const int64_t a_rt = k_tiles * tile_elems, xs_stride = x.stride(0);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  thread_local LineVector<uint16_t> xbuf;
  uint16_t* xt = scratch(xbuf, row_tiles * a_rt);  // the workers below have their own thread_local
  tokenline::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rt = begin; rt < end; ++rt)
      for (int64_t kt = 0; kt < k_tiles; ++kt) {
        uint16_t* dst = xt + rt * a_rt + kt * tile_elems;
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t r = rt * 16 + i;
          if (r < m) std::memcpy(dst + i * 32, xs + r * xs_stride + kt * 32, 64);
          else std::memset(dst + i * 32, 0, 64);
        }
      }
  });
  return xt;
}

// The A tiles of x. Where its rows start on cache lines (64-byte aligned, a whole number of lines apart) each tile row
// is one whole line, and the tiles load from x as it lies: the copy's pass over x is saved (30 layers' four linears at
// 256 rows 14% faster on two threads; README). A last partial row tile is copied, padded with zero rows, into
// the calling thread's buffer at x's row stride (loading it from x would read past its rows). Other x: the copy.
ATiles a_tiles(const at::Tensor& x) {
  const int64_t m = x.size(0), k_tiles = x.size(1) / 32, stride = x.stride(0);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  if ((stride * 2) % 64 || reinterpret_cast<uintptr_t>(xs) % 64)
    return ATiles{tile_copy(x), 512, 64, k_tiles * 512, (m + 15) / 16, nullptr};
  const int64_t whole = m / 16, rest = m % 16;
  const uint16_t* tail = nullptr;
  if (rest) {
    thread_local LineVector<uint16_t> tbuf;
    uint16_t* t = scratch(tbuf, 16 * stride);
    std::memcpy(t, xs + whole * 16 * stride, (rest - 1) * stride * 2 + x.size(1) * 2);
    std::memset(t + rest * stride, 0, (16 - rest) * stride * 2);
    tail = t;
  }
  return ATiles{xs, 32, stride * 2, 16 * stride, whole, tail};
}

// Rows of x from which packed_linear takes two row tiles against two blocks (amx_pairs_of_blocks): every step of
// more than one row tile. (Up to 48 rows this once took 1.1-1.2x the time of one row tile against four blocks; since
// the next weights are fetched ahead and the copy's buffer stopped refilling with zeros, it takes 2-23% less.)
constexpr int64_t kPairsMinRows = 17;

// From kPairsMinRows rows: each thread takes two blocks at a time across every pair of row tiles of x (a_tiles;
// they stay in L2), K in chunks of at most 9 k tiles (18 KB of the pair's weights, which stay in L1 while the row
// tiles stream past); each pair of row tiles keeps its partial sums in `part` between chunks. kSiluMul: the pairs
// are gate block j and up block j (the second half of the outputs), and out [M, n / 2] gets silu(gate) * up,
// computed as silu_and_mul computes it on the bf16 values packed_linear would have stored (silu_mul16, vec_math.h).
template <typename out_t, bool kSiluMul>
void amx_pairs_of_blocks(const ATiles& a, int64_t m, int64_t k_tiles, const uint16_t* wp, int64_t block_elems,
                         int64_t blocks, const float* bias, out_t* op, int64_t o_stride, int64_t n) {
  const int64_t row_tiles = (m + 15) / 16, row_pairs = (row_tiles + 1) / 2;
  const int64_t chunks = (k_tiles + 8) / 9, chunk = (k_tiles + chunks - 1) / chunks;
  const int64_t half = blocks / 2, pairs_of_blocks = kSiluMul ? half : (blocks + 1) / 2;
  const int64_t second = kSiluMul ? half * block_elems : block_elems;  // from a pair's first block to its second
  const auto first_block = [&](int64_t bp) { return kSiluMul ? bp : bp * 2; };
  tokenline::parallel_for(0, pairs_of_blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local LineVector<float> part;
    float* const part_sums = scratch(part, row_pairs * 4 * 256);
    configure_tiles(16);
    for (int64_t bp = begin; bp < end; ++bp) {
      const int64_t b0 = first_block(bp), nb = kSiluMul ? 2 : std::min<int64_t>(2, blocks - b0);
      const uint16_t* w = wp + b0 * block_elems;
      for (int64_t k0 = 0; k0 < k_tiles; k0 += chunk) {
        const int64_t k1 = std::min<int64_t>(k_tiles, k0 + chunk);
        // The weights this thread takes next (the pair's next chunk, else the next pair's first) come from memory:
        // tile loads do not set off the hardware's prefetch, so each pair of row tiles asks for its share into L2.
        const char* next[2] = {nullptr, nullptr};
        int64_t next_lines = 0;
        if (k1 < k_tiles || bp + 1 < end) {
          const int64_t nb0 = k1 < k_tiles ? b0 : first_block(bp + 1), nk0 = k1 < k_tiles ? k1 : 0;
          const int64_t nk1 = std::min<int64_t>(k_tiles, nk0 + chunk);
          const uint16_t* nw = wp + nb0 * block_elems + nk0 * 512;
          next[0] = reinterpret_cast<const char*>(nw);
          if (kSiluMul || nb0 + 1 < blocks) next[1] = reinterpret_cast<const char*>(nw + second);
          next_lines = (nk1 - nk0) * 16;  // 1 KB a k tile
        }
        for (int64_t rp = 0; rp < row_pairs; ++rp) {
          const int64_t rt = rp * 2, nrt = std::min<int64_t>(2, row_tiles - rt);
          // Its share of the lines, a few each k step (a burst of prefetches would stall on the fill buffers).
          TilePrefetch pf{next, rp * next_lines / row_pairs, (rp + 1) * next_lines / row_pairs, 0};
          pf.per_step = (pf.end - pf.line + (k1 - k0) - 1) / (k1 - k0);
          const uint16_t *x1 = a.row_tile_at(rt), *x2 = nrt == 2 ? a.row_tile_at(rt + 1) : nullptr;
          float* c = part_sums + rp * 4 * 256;
          const int64_t ks = a.k_step, rb = a.row_bytes;
          if (nrt == 2 && nb == 2) amx_tiles_2x2<2, 2>(x1, x2, ks, rb, w, second, k0, k1, c, pf);
          else if (nrt == 2) amx_tiles_2x2<2, 1>(x1, x2, ks, rb, w, second, k0, k1, c, pf);
          else if (nb == 2) amx_tiles_2x2<1, 2>(x1, x2, ks, rb, w, second, k0, k1, c, pf);
          else amx_tiles_2x2<1, 1>(x1, x2, ks, rb, w, second, k0, k1, c, pf);
          if (k1 < k_tiles) continue;
          for (int64_t i = 0; i < nrt; ++i) {
            const float* ci = c + i * nb * 256;
            const int64_t rows = std::min<int64_t>(16, m - (rt + i) * 16), r0 = (rt + i) * 16;
            if constexpr (kSiluMul) {
              const int64_t col = b0 * kBlock;
              const __m512 bg = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
              const __m512 bu = bias ? _mm512_loadu_ps(bias + half * kBlock + col) : _mm512_setzero_ps();
              const auto act = [&](int64_t r) {
                const __m512 g = bf16_round(_mm512_add_ps(_mm512_load_ps(ci + r * 16), bg));
                const __m512 u = bf16_round(_mm512_add_ps(_mm512_load_ps(ci + 256 + r * 16), bu));
                return silu_mul16(g, u);
              };
              // Four rows at a time: one row's silu is a chain of ~25 dependent operations, and four
              // independent chains keep both vector units busy (silu_and_mul_row: 1.5x on one thread).
              int64_t r = 0;
              for (; r + 4 <= rows; r += 4) {
                __m512 y[4];
                for (int j = 0; j < 4; ++j) y[j] = act(r + j);
                for (int j = 0; j < 4; ++j) store_out(op + (r0 + r + j) * o_stride + col, y[j], (__mmask16)0xFFFF);
              }
              for (; r < rows; ++r) store_out(op + (r0 + r) * o_stride + col, act(r), (__mmask16)0xFFFF);
            } else {
              store_tile_pair(ci, rows, nb, bias, op, o_stride, r0, b0, n);
            }
          }
        }
      }
    }
    _tile_release();
  });
}

// Up to 16 rows: groups of four blocks shared between the threads against the one row tile of x, read as it lies
// (m rows `x_bytes` apart, the tiles configured to m rows): each group's weights streamed once.
template <typename out_t>
void amx_groups_of_four(const uint16_t* x, int64_t x_bytes, int64_t m, const uint16_t* wp, int64_t block_elems,
                        int64_t blocks, int64_t k_tiles, const float* bias, out_t* op, int64_t o_stride, int64_t n) {
  tokenline::parallel_for(0, blocks, group_grain(blocks, kGroup), [&](int64_t begin, int64_t end) {
    alignas(64) float c[kGroup * 256];
    configure_tiles(m);
    for (int64_t b0 = begin; b0 < end; b0 += kGroup) {
      const int64_t nr = std::min<int64_t>(kGroup, end - b0);
      const uint16_t* w = wp + b0 * block_elems;
      switch (nr) {
        case 1: amx_tile_blocks<1>(x, x_bytes, w, block_elems, k_tiles, c); break;
        case 2: amx_tile_blocks<2>(x, x_bytes, w, block_elems, k_tiles, c); break;
        case 3: amx_tile_blocks<3>(x, x_bytes, w, block_elems, k_tiles, c); break;
        default: amx_tile_blocks<4>(x, x_bytes, w, block_elems, k_tiles, c); break;
      }
      store_tiles(c, m, nr, bias, op, o_stride, 0, b0, n);
    }
    _tile_release();
  });
}

template <typename out_t>
void packed_linear_amx(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out, int64_t n) {
  const int64_t m = x.size(0), pairs = packed.size(1), k_tiles = pairs / 16;
  const int64_t block_elems = pairs * 2 * kBlock, blocks = packed.size(0);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  out_t* op = out.data_ptr<out_t>();
  const int64_t o_stride = out.stride(0);
  if (m < kPairsMinRows) {
    amx_groups_of_four(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), x.stride(0) * 2, m, wp,
                       block_elems, blocks, k_tiles, bias, op, o_stride, n);
    return;
  }
  amx_pairs_of_blocks<out_t, false>(a_tiles(x), m, k_tiles, wp, block_elems, blocks, bias, op, o_stride, n);
}

#endif  // TOKENLINE_HAS_AMX

inline __m512 bf16x16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Each row of x (bf16) as int16, scaled so that its largest |value| becomes kXMax; its scale goes to scales.
// 13 bits of magnitude relative to the row's largest: finer than bf16's 8 for all but the smallest values.
void quantize_rows(const at::Tensor& x, int16_t* q, float* scales) {
  const int64_t m = x.size(0), k = x.size(1), stride = x.stride(0);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  tokenline::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * stride;
      int16_t* dst = q + r * k;
      __m512 top = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(bf16x16_to_float(row + i)));
      float amax = _mm512_reduce_max_ps(top);
      for (; i < k; ++i) amax = std::max(amax, std::fabs(bf16_to_float(row[i])));
      const float scale = amax > 0 ? amax / kXMax : 1.0f;
      const __m512 inv = _mm512_set1_ps(1.0f / scale);
      scales[r] = scale;
      for (i = 0; i + 16 <= k; i += 16)  // rounds to nearest; saturates
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_float(row + i), inv))));
      for (; i < k; ++i) dst[i] = static_cast<int16_t>(std::nearbyint(bf16_to_float(row[i]) / scale));
    }
  });
}

template <typename out_t>
void packed_linear_int8_impl(const at::Tensor& x, const at::Tensor& packed, const float* scale, const float* bias,
                             at::Tensor& out, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(1), block_bytes = pairs * 2 * kBlock;
  const int8_t* wp = packed.data_ptr<int8_t>();
  // x to int16, the weights sign-extended as they stream in: half the bytes of bf16.
  thread_local std::vector<int16_t> xq;  // reused: a decode step makes ~7 such calls a layer
  thread_local std::vector<float> x_scales;
  int16_t* const q = scratch(xq, m * k);
  float* const q_scales = scratch(x_scales, m);
  quantize_rows(x, q, q_scales);
  const Rows rows{reinterpret_cast<const uint32_t*>(q), k / 2, q_scales, m};
  for_each_group(packed.size(0), [&](int64_t b0, int64_t nr, int64_t next_nr) {
    rows_times_group<Int16Dot, Int8Weights, out_t>(rows, Int8Weights{wp + b0 * block_bytes, block_bytes}, pairs,
                                                   scale, bias, out, b0, nr, n, next_nr);
  });
}

#endif  // TOKENLINE_HAS_BF16_DOT


#ifdef TOKENLINE_HAS_AVX2_LINEAR
// CPUs with AVX2 and FMA but no bf16 arithmetic (AMD Zen 2/3, Intel before Cooper Lake): the same packed weights,
// each k pair's 16 outputs (64 bytes) widened to fp32 in registers as they stream in, x widened to fp32 once a call,
// fp32 FMAs. torch's bf16 matmul runs at ~16 GFLOP/s on such CPUs, and its fp32 one (MKL) streams weights at a
// fraction of the memory's rate on AMD's; decode here reads half fp32's bytes at the memory's rate.
//
// A 32-bit word of the packed weight holds (k even, k odd) of one output: the even one is the word shifted left
// 16 bits, the odd one the word with its low half cleared. Every output sums its k pairs in the same order,
// even then odd, whatever the tile, so a row's result does not depend on how many rows share the call.

inline void avx2_store(float* dst, __m256 v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(dst, v);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    std::memcpy(dst, t, n * sizeof(float));
  }
}
inline void avx2_store(c10::BFloat16* dst, __m256 v, int64_t n) {  // rounded to nearest even, as store() is
  const __m128i half = bf16_bits8(v);
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), half);
  } else {
    alignas(16) uint16_t t[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), half);
    std::memcpy(dst, t, n * sizeof(uint16_t));
  }
}

// Row i's 8 outputs at `at` of a tile's sums (+ bias): the first `valid` of them, none where valid <= 0.
template <typename out_t>
__attribute__((noinline)) void avx2_store_sums(__m256 sums, const float* bias, out_t* out, int64_t valid) {
  if (valid <= 0) return;
  if (bias) {
    alignas(32) float t[8] = {};
    std::memcpy(t, bias, std::min<int64_t>(8, valid) * sizeof(float));
    sums = _mm256_add_ps(sums, _mm256_load_ps(t));
  }
  avx2_store(out, sums, std::min<int64_t>(8, valid));
}

// MR rows of x (fp32, `x_stride` floats apart) times NB blocks of 16 outputs over the whole K: MR * NB * 2
// accumulators of 8 outputs. out_i = sums + bias, the first n_valid outputs of the tile.
template <int MR, int NB, typename out_t>
inline void avx2_tile(const float* x, int64_t x_stride, const uint32_t* w, int64_t block_words, int64_t pairs,
                      const float* bias, out_t* out, int64_t o_stride, int64_t n_valid) {
  __m256 acc[MR][NB][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int j = 0; j < NB; ++j) {
      const uint32_t* wj = w + j * block_words + p * kBlock;
      for (int h = 0; h < 2; ++h) {
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 8 * h));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words, odd_mask));
        for (int i = 0; i < MR; ++i) {
          const float* xi = x + i * x_stride + 2 * p;
          acc[i][j][h] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xi + 1),
                                         _mm256_fmadd_ps(even, _mm256_broadcast_ss(xi), acc[i][j][h]));
        }
      }
    }
  }
#pragma GCC unroll 8  // as in avx2_panel_tile
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int64_t at = j * kBlock + 8 * h;
        avx2_store_sums(acc[i][j][h], bias ? bias + at : nullptr, out + i * o_stride + at, n_valid - at);
      }
}

// Up to 3 rows against up to 4 blocks: 3 x 2 blocks (12 of the 16 ymm registers hold sums, enough in flight
// for FMA's latency with each sum's two FMAs a k pair chained), 2 x 2, or 1 x up to 4 for a decode row.
template <typename out_t>
void avx2_rows_times_blocks(int64_t mr, int64_t nb, const float* x, int64_t x_stride, const uint32_t* w,
                            int64_t block_words, int64_t pairs, const float* bias, out_t* out, int64_t o_stride,
                            int64_t n_valid) {
  if (mr >= 2) {
    if (nb >= 2) {
      if (mr >= 3) return avx2_tile<3, 2>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
      return avx2_tile<2, 2>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
    }
    if (mr >= 3) return avx2_tile<3, 1>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
    return avx2_tile<2, 1>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
  }
  switch (nb) {
    case 1: return avx2_tile<1, 1>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
    case 2: return avx2_tile<1, 2>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
    case 3: return avx2_tile<1, 3>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
    default: return avx2_tile<1, 4>(x, x_stride, w, block_words, pairs, bias, out, o_stride, n_valid);
  }
}

constexpr int64_t kAvx2Group = 4;  // blocks a thread keeps hot in L1/L2 across every row of x

// Steps of this many rows or more widen each group's weights to fp32 once ([block][K][16], in L2) and run a 6 x 16
// fp32 tile on them (12 sums, one FMA each a k): the weights' shift and mask, paid once a group instead of once a
// row tile, and the sums no longer chained two FMAs a k pair. Every output still adds its k in order into one sum,
// so a row's result is the same bits on either path. On a 2-core Zen 3 (2 threads): 73-82 against 50-60 GFLOP/s
// at 8 rows, 137-174 against 62-108 at 32-256 (MKL's fp32 matmul: 98-161); at 2-6 rows the pair kernel is ahead.
constexpr int64_t kAvx2PanelRows = 8;

// The next group's packed weights, asked for into L2 while a group's tiles compute: one line every `every` k of a
// tile, from `p` up to `end` (the tile's share). Widened at once as each group started, the weights waited on
// memory with every FMA idle (a fifth of a batch-32 step on a Zen 3); asked for in a burst, the prefetches would
// wait on the fill buffers the tile's own loads need.
struct PanelAhead {
  const char* p;
  const char* end;
  int64_t every;
};

template <int MR, typename out_t>
inline void avx2_panel_tile(const float* x, int64_t x_stride, const float* w, int64_t k, const float* bias,
                            out_t* out, int64_t o_stride, int64_t n_valid, PanelAhead ahead) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < k; k0 += ahead.every) {
    if (ahead.p < ahead.end) {
      _mm_prefetch(ahead.p, _MM_HINT_T1);
      ahead.p += 64;
    }
    const int64_t k1 = std::min(k, k0 + ahead.every);
    for (int64_t kk = k0; kk < k1; ++kk) {
      const __m256 w0 = _mm256_loadu_ps(w + kk * kBlock), w1 = _mm256_loadu_ps(w + kk * kBlock + 8);
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * x_stride + kk);
        acc[i][0] = _mm256_fmadd_ps(w0, xv, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w1, xv, acc[i][1]);
      }
    }
  }
  // Each sum stored by value, at indices fixed at compile time: stored through a pointer to acc, or with a run-time
  // exit from these loops, GCC kept the sums in memory and stored every one of them each k (half the FMA rate).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
      avx2_store_sums(acc[i][h], bias ? bias + 8 * h : nullptr, out + i * o_stride + 8 * h, n_valid - 8 * h);
}

template <typename out_t>
void avx2_panel_rows(int64_t mr, const float* x, int64_t x_stride, const float* w, int64_t k, const float* bias,
                     out_t* out, int64_t o_stride, int64_t n_valid, PanelAhead ahead) {
  switch (mr) {
    case 1: return avx2_panel_tile<1>(x, x_stride, w, k, bias, out, o_stride, n_valid, ahead);
    case 2: return avx2_panel_tile<2>(x, x_stride, w, k, bias, out, o_stride, n_valid, ahead);
    case 3: return avx2_panel_tile<3>(x, x_stride, w, k, bias, out, o_stride, n_valid, ahead);
    case 4: return avx2_panel_tile<4>(x, x_stride, w, k, bias, out, o_stride, n_valid, ahead);
    case 5: return avx2_panel_tile<5>(x, x_stride, w, k, bias, out, o_stride, n_valid, ahead);
    default: return avx2_panel_tile<6>(x, x_stride, w, k, bias, out, o_stride, n_valid, ahead);
  }
}

// One block's packed weights [K/2][16][2] as fp32 [K][16].
inline void widen_block(const uint32_t* w, int64_t pairs, float* dst) {
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p)
    for (int h = 0; h < 2; ++h) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kBlock + 8 * h));
      _mm256_storeu_ps(dst + 2 * p * kBlock + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
      _mm256_storeu_ps(dst + (2 * p + 1) * kBlock + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(words, odd_mask)));
    }
}

// A decode-sized step's tiles: each thread takes groups of kAvx2Group blocks and runs every row of x against a
// group (its weights stay hot in L1/L2) in tiles of up to 3 rows, or 1 row, against up to `blocks_of_rows` (or
// `blocks_of_one`) blocks: tile(r0, rows, b, nb, n_valid), n_valid the outputs of the tile's blocks that exist.
template <typename Tile>
void for_each_avx2_tile(int64_t m, int64_t blocks, int64_t n, int64_t blocks_of_one, int64_t blocks_of_rows,
                        const Tile& tile) {
  tokenline::parallel_for(0, blocks, group_grain(blocks, kAvx2Group), [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += kAvx2Group) {
      const int64_t group = std::min<int64_t>(kAvx2Group, end - b0);
      for (int64_t r0 = 0; r0 < m;) {
        const int64_t rows = std::min<int64_t>(3, m - r0);
        const int64_t step = rows == 1 ? blocks_of_one : blocks_of_rows;
        for (int64_t j = 0; j < group; j += step) {
          const int64_t b = b0 + j, nb = std::min<int64_t>(step, group - j);
          tile(r0, rows, b, nb, std::min<int64_t>(n - b * kBlock, nb * kBlock));
        }
        r0 += rows;
      }
    }
  });
}

template <typename out_t>
void packed_linear_avx2(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out,
                        int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(1), blocks = packed.size(0);
  const int64_t block_words = pairs * kBlock;
  thread_local std::vector<float> xbuf;  // x in fp32, reused across calls
  float* const xf = scratch(xbuf, m * k);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  tokenline::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(xp + r * xs);
      float* dst = xf + r * k;
      int64_t i = 0;
      for (; i + 8 <= k; i += 8) {
        _mm256_storeu_ps(dst + i, widen8_bf16(src + i));
      }
      for (; i < k; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        std::memcpy(dst + i, &bits, sizeof(float));
      }
    }
  });
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  out_t* op = out.data_ptr<out_t>();
  const int64_t o_stride = out.stride(0);
  if (m >= kAvx2PanelRows) {
    tokenline::parallel_for(0, blocks, group_grain(blocks, kAvx2Group), [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> wbuf;  // a group's weights in fp32: 147 KB at K = 576
      float* const wf = scratch(wbuf, kAvx2Group * k * kBlock);
      const int64_t row_tiles = (m + 5) / 6;
      for (int64_t b0 = begin; b0 < end; b0 += kAvx2Group) {
        const int64_t nb = std::min<int64_t>(kAvx2Group, end - b0);
        for (int64_t j = 0; j < nb; ++j) widen_block(wp + (b0 + j) * block_words, pairs, wf + j * k * kBlock);
        // The next group of this thread's range, in equal shares of its lines over this group's tiles.
        const int64_t next = std::min<int64_t>(kAvx2Group, std::max<int64_t>(0, end - b0 - nb));
        const char* const ahead = reinterpret_cast<const char*>(wp + (b0 + nb) * block_words);
        const int64_t lines = next * block_words * 4 / 64, tiles = row_tiles * nb;
        const int64_t share = (lines + tiles - 1) / tiles;
        const int64_t every = share ? std::max<int64_t>(1, k / share) : k;
        for (int64_t r0 = 0, tile = 0; r0 < m; r0 += 6) {
          const int64_t mr = std::min<int64_t>(6, m - r0);
          for (int64_t j = 0; j < nb; ++j, ++tile) {
            const int64_t b = b0 + j;
            const int64_t first = std::min(lines, tile * share), last = std::min(lines, first + share);
            avx2_panel_rows(mr, xf + r0 * k, k, wf + j * k * kBlock, k, bias ? bias + b * kBlock : nullptr,
                            op + r0 * o_stride + b * kBlock, o_stride, n - b * kBlock,
                            PanelAhead{ahead + first * 64, ahead + last * 64, every});
          }
        }
      }
    });
    return;
  }
  for_each_avx2_tile(m, blocks, n, 4, 2, [&](int64_t r0, int64_t rows, int64_t b, int64_t nb, int64_t n_valid) {
    avx2_rows_times_blocks(rows, nb, xf + r0 * k, k, wp + b * block_words, block_words, pairs,
                           bias ? bias + b * kBlock : nullptr, op + r0 * o_stride + b * kBlock, o_stride, n_valid);
  });
}

// int8 weights on AVX2: the VNNI kernel's integer arithmetic with vpmaddwd (two int16 products added to each int32
// lane, exactly) and vpaddd. x is quantized per row to int16 as there; each k pair's 16 outputs (32 bytes) are
// sign-extended to int16 as they stream in, half the bytes of bf16's, which is what a decode step at a few rows
// waits for. The sums are finished as the VNNI kernel finishes them (each chunk's int32 sums converted and added in
// order, then one FMA: sums * (scale * x_scale) + bias), so a row's result does not depend on its neighbours.

// Each row of x (bf16) as int16, scaled so that its largest |value| becomes kXMax; its scale goes to scales.
void quantize_rows_avx2(const at::Tensor& x, int16_t* q, float* scales) {
  const int64_t m = x.size(0), k = x.size(1), stride = x.stride(0);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  tokenline::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * stride;
      int16_t* dst = q + r * k;
      __m256 top = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= k; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(widen8_bf16(row + i), magnitude));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top);
      float amax = 0.0f;
      for (float v : lanes) amax = std::max(amax, v);
      for (; i < k; ++i) amax = std::max(amax, std::fabs(bf16_to_float(row[i])));
      const float scale = amax > 0 ? amax / kXMax : 1.0f;
      const float inv_scale = 1.0f / scale;
      const __m256 inv = _mm256_set1_ps(inv_scale);
      scales[r] = scale;
      for (i = 0; i + 8 <= k; i += 8) {  // rounds to nearest; saturates
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(widen8_bf16(row + i), inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
      }
      for (; i < k; ++i) dst[i] = static_cast<int16_t>(std::nearbyint(bf16_to_float(row[i]) * inv_scale));
    }
  });
}

// Row i's 8 outputs of a tile: sums * (scale * x_scale) + bias, the first `valid` of them, none where valid <= 0.
template <typename out_t>
__attribute__((noinline)) void avx2_store_scaled(__m256 sums, const float* scale, float x_scale, const float* bias,
                                                 out_t* out, int64_t valid) {
  if (valid <= 0) return;
  const int64_t n = std::min<int64_t>(8, valid);
  alignas(32) float s[8] = {}, b[8] = {};
  std::memcpy(s, scale, n * sizeof(float));
  if (bias) std::memcpy(b, bias, n * sizeof(float));
  const __m256 si = _mm256_mul_ps(_mm256_load_ps(s), _mm256_set1_ps(x_scale));
  avx2_store(out, _mm256_fmadd_ps(sums, si, _mm256_load_ps(b)), n);
}

// Bytes ahead of each weight stream that a tile asks into L1 (8 k pairs of 16 outputs later): at one row,
// 0.57-0.60x bf16's time against 0.67x without.
constexpr int64_t kInt8Ahead = 512;

// One chunk of k pairs [c0, c1) of MR rows of int16 x (k pairs as 32-bit words, `x_stride` words apart) times NB
// blocks of 16 int8 outputs: MR * NB * 2 int32 sums of 8 outputs in registers, then converted and stored into
// `total` (first chunk) or added to it. A function of its own: inlined, GCC kept the totals in registers across
// the loop too and, short of them, one sum in memory, stored and reloaded every k pair (a third of the rate).
template <int MR, int NB>
__attribute__((noinline)) void avx2_int8_chunk(const uint32_t* x, int64_t x_stride, const int8_t* w,
                                               int64_t block_bytes, int64_t c0, int64_t c1, float* total) {
  static_assert(MR * NB <= 4, "at most 8 int32 sums");
  __m256i acc[MR][NB][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_si256();
  for (int64_t p = c0; p < c1; ++p) {
    __m256i xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_set1_epi32(static_cast<int>(x[i * x_stride + p]));
    for (int j = 0; j < NB; ++j) {
      const int8_t* wj = w + j * block_bytes + p * 2 * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(wj) + kInt8Ahead, _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 16 * h)));
        for (int i = 0; i < MR; ++i) acc[i][j][h] = _mm256_add_epi32(acc[i][j][h], _mm256_madd_epi16(wv, xv[i]));
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        float* t = total + ((i * NB + j) * 2 + h) * 8;
        const __m256 sums = _mm256_cvtepi32_ps(acc[i][j][h]);
        _mm256_store_ps(t, c0 == 0 ? sums : _mm256_add_ps(_mm256_load_ps(t), sums));
      }
}

// MR rows times NB blocks over the whole K, in chunks whose int32 sums cannot overflow; then the outputs.
template <int MR, int NB, typename out_t>
inline void avx2_int8_tile(const uint32_t* x, int64_t x_stride, const float* x_scale, const int8_t* w,
                           int64_t block_bytes, int64_t pairs, const float* scale, const float* bias, out_t* out,
                           int64_t o_stride, int64_t n_valid) {
  alignas(32) float total[MR * NB * 2 * 8];
  for (int64_t c0 = 0; c0 < pairs; c0 += kInt16ChunkPairs)
    avx2_int8_chunk<MR, NB>(x, x_stride, w, block_bytes, c0, c0 + std::min<int64_t>(kInt16ChunkPairs, pairs - c0),
                            total);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        const int64_t at = j * kBlock + 8 * h;
        avx2_store_scaled(_mm256_load_ps(total + ((i * NB + j) * 2 + h) * 8), scale + at, x_scale[i],
                          bias ? bias + at : nullptr, out + i * o_stride + at, n_valid - at);
      }
}

// Up to 3 rows against one block (at 4 x 1 and 2 x 2 GCC kept one sum in memory, stored and reloaded each k pair,
// and lost a third of the rate where the weights are in cache), or 1 row against up to 4 blocks: it keeps one sum
// in memory there too, but a lone row waits on the weights' stream, and four streams at once fetch more of it than
// two (30 layers' linears at one row: 0.56-0.57x bf16's time against 0.63-0.69x at 1 x 2).
template <typename out_t>
void avx2_int8_rows_times_blocks(int64_t mr, int64_t nb, const uint32_t* x, int64_t x_stride, const float* x_scale,
                                 const int8_t* w, int64_t block_bytes, int64_t pairs, const float* scale,
                                 const float* bias, out_t* out, int64_t o_stride, int64_t n_valid) {
#define TOKENLINE_INT8_TILE(MR, NB) \
  return avx2_int8_tile<MR, NB>(x, x_stride, x_scale, w, block_bytes, pairs, scale, bias, out, o_stride, n_valid)
  switch (mr) {
    case 1:
      if (nb >= 4) TOKENLINE_INT8_TILE(1, 4);
      if (nb == 3) TOKENLINE_INT8_TILE(1, 3);
      if (nb == 2) TOKENLINE_INT8_TILE(1, 2);
      TOKENLINE_INT8_TILE(1, 1);
    case 2: TOKENLINE_INT8_TILE(2, 1);
    default: TOKENLINE_INT8_TILE(3, 1);
  }
#undef TOKENLINE_INT8_TILE
}

template <typename out_t>
void packed_linear_int8_avx2(const at::Tensor& x, const at::Tensor& packed, const float* scale, const float* bias,
                             at::Tensor& out, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(1), block_bytes = pairs * 2 * kBlock;
  thread_local std::vector<int16_t> xq;  // reused: a decode step makes ~7 such calls a layer
  thread_local std::vector<float> x_scales;
  int16_t* const q = scratch(xq, m * k);
  float* const q_scales = scratch(x_scales, m);
  quantize_rows_avx2(x, q, q_scales);
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(q);
  const int8_t* wp = packed.data_ptr<int8_t>();
  out_t* op = out.data_ptr<out_t>();
  const int64_t o_stride = out.stride(0);
  for_each_avx2_tile(m, packed.size(0), n, 4, 1, [&](int64_t r0, int64_t rows, int64_t b, int64_t nb,
                                                     int64_t n_valid) {
    avx2_int8_rows_times_blocks(rows, nb, xw + r0 * (k / 2), k / 2, q_scales + r0, wp + b * block_bytes, block_bytes,
                                pairs, scale + b * kBlock, bias ? bias + b * kBlock : nullptr,
                                op + r0 * o_stride + b * kBlock, o_stride, n_valid);
  });
}
#endif  // TOKENLINE_HAS_AVX2_LINEAR

bool packed_linear_supported() {
#if defined(TOKENLINE_HAS_BF16_DOT) || defined(TOKENLINE_HAS_AVX2_LINEAR)
  return true;
#else
  return false;
#endif
}

// int8 weights run on AVX512-VNNI's int16 dot products, or on AVX2's vpmaddwd.
bool packed_linear_int8_supported() {
#if defined(TOKENLINE_HAS_BF16_DOT) || defined(TOKENLINE_HAS_AVX2_LINEAR)
  return true;
#else
  return false;
#endif
}

// Steps of up to this many rows run on the int8 weights, larger ones on the bf16 weights: where each kernel is
// ahead. With AVX512-BF16, vpdpwssd runs at half vdpbf16ps's rate: int8 wins while a step streams its weights from
// memory, to about 12 rows (Xeon, 2 cores). With AVX2 both sides are integer or fp32 arithmetic at about the same
// rate, and int8's half bytes win to 32-48 rows (EPYC Zen 3, 2 cores, 30 layers' linears of SmolLM2: 0.62-0.68x
// bf16's time at 1-16 rows, 0.91-0.93x at 32, 0.89-1.05x at 48).
int64_t packed_linear_int8_max_rows() {
#if defined(TOKENLINE_HAS_BF16_DOT)
  return 8;
#elif defined(TOKENLINE_HAS_AVX2_LINEAR)
  return 32;
#else
  return 0;
#endif
}

void check_linear_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed_linear_supported(), "packed_linear needs AVX512-BF16 and AVX512-VNNI, or AVX2 and FMA (built "
              "with -march=native)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 && x.stride(0) % 2 == 0,
              "packed_linear takes a bf16 [M, K] x with contiguous, even-aligned rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2 && packed.is_contiguous(),
              "packed_linear takes a weight packed as [N/16, K/2, 16, 2]");
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), "x has K=", x.size(1), ", the weight ", 2 * packed.size(1));
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == n,
              "out must be [M, N]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out must be bf16 or fp32");
  TORCH_CHECK(n <= packed.size(0) * kBlock, "n is larger than the packed weight");
}

// fp32 values of an optional vector (bias, scales), kept alive by `holder`.
const float* float_data(const c10::optional<at::Tensor>& t, at::Tensor& holder) {
  if (!t.has_value() || !t->defined()) return nullptr;
  holder = t->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

// out [M, N] (bf16 or fp32; rows may be strided) = x [M, K] (bf16, rows strided, last dim contiguous) W^T + bias.
void packed_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, int64_t n) {
  check_linear_args(out, x, packed, n);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "packed_linear takes a weight from pack_linear_weight");
  at::Tensor bias_f;
  const float* bp = float_data(bias, bias_f);
#ifdef TOKENLINE_HAS_AMX
  if (on_amx_tiles(x.size(0), packed)) {
    if (out.scalar_type() == at::kFloat) packed_linear_amx<float>(x, packed, bp, out, n);
    else packed_linear_amx<c10::BFloat16>(x, packed, bp, out, n);
    return;
  }
#endif
#ifdef TOKENLINE_HAS_BF16_DOT
  if (out.scalar_type() == at::kFloat) packed_linear_impl<float>(x, packed, bp, out, n);
  else packed_linear_impl<c10::BFloat16>(x, packed, bp, out, n);
#elif defined(TOKENLINE_HAS_AVX2_LINEAR)
  if (out.scalar_type() == at::kFloat) packed_linear_avx2<float>(x, packed, bp, out, n);
  else packed_linear_avx2<c10::BFloat16>(x, packed, bp, out, n);
#endif
}

// out [M, n / 2] = silu(gate) * up, where x W^T (+ bias) = [gate | up] is gate_up's [M, n]: from 17 rows on AMX
// tiles straight from the sums (gate/up's [M, n] never written, nor read back); otherwise packed_linear, then
// silu_and_mul. Either way the bits packed_linear and silu_and_mul would give.
void packed_linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(n % 2 == 0, "packed_linear_silu_mul: gate and up need n even, got ", n);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == n / 2 &&
                  out.scalar_type() == at::kBFloat16,
              "packed_linear_silu_mul: out must be a contiguous bf16 [M, n / 2]");
#ifdef TOKENLINE_HAS_AMX
  if (x.size(0) >= kPairsMinRows && on_amx_tiles(x.size(0), packed) && (n / 2) % kBlock == 0 &&
      packed.size(0) * kBlock == n && packed.scalar_type() == at::kBFloat16) {
    check_linear_args(out, x, packed, n / 2);
    at::Tensor bias_f;
    const float* bp = float_data(bias, bias_f);
    const int64_t k_tiles = packed.size(1) / 16;
    amx_pairs_of_blocks<c10::BFloat16, true>(a_tiles(x), x.size(0), k_tiles,
                                             reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                                             packed.size(1) * 2 * kBlock, packed.size(0), bp,
                                             out.data_ptr<c10::BFloat16>(), out.stride(0), n);
    return;
  }
#endif
  at::Tensor gate_up = at::empty({x.size(0), n}, x.options());
  packed_linear(gate_up, x, packed, bias, n);
  static const auto silu_and_mul = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("tokenline::silu_and_mul", "")
                                       .typed<void(at::Tensor&, const at::Tensor&)>();
  silu_and_mul.call(out, gate_up);
}

// Rows of x from which packed_linear runs on AMX tiles: `rows` > 0 sets it, 0 turns the tiles off, a negative
// value leaves it; returns the value in effect (0 where the build or the CPU has no AMX).
int64_t linear_amx_min_rows(int64_t rows) {
#ifdef TOKENLINE_HAS_AMX
  if (!amx_permitted()) return 0;
  if (rows >= 0) g_amx_min_rows.store(rows, std::memory_order_relaxed);
  return amx_min_rows();
#else
  (void)rows;
  return 0;
#endif
}

// The same with int8 weights packed alike and one scale per output: out = (x q^T) * scales + bias.
void packed_linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& bias, int64_t n) {
  check_linear_args(out, x, packed, n);
  TORCH_CHECK(packed_linear_int8_supported(), "packed_linear_int8 needs AVX512-BF16 and AVX512-VNNI, or AVX2 and FMA");
  TORCH_CHECK(packed.scalar_type() == at::kChar, "packed_linear_int8 takes int8 weights");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) >= n, "scales must hold one value per output");
  at::Tensor bias_f, scales_f;
  const float* bp = float_data(bias, bias_f);
  const float* sp = float_data(scales, scales_f);
#ifdef TOKENLINE_HAS_BF16_DOT
  if (out.scalar_type() == at::kFloat) packed_linear_int8_impl<float>(x, packed, sp, bp, out, n);
  else packed_linear_int8_impl<c10::BFloat16>(x, packed, sp, bp, out, n);
#elif defined(TOKENLINE_HAS_AVX2_LINEAR)
  if (out.scalar_type() == at::kFloat) packed_linear_int8_avx2<float>(x, packed, sp, bp, out, n);
  else packed_linear_int8_avx2<c10::BFloat16>(x, packed, sp, bp, out, n);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.def("packed_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int n) -> ()");
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
  m.def("packed_linear_int8(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n) -> ()");
  m.impl("packed_linear_int8", c10::DispatchKey::CPU, &packed_linear_int8);
  m.def("packed_linear_silu_mul(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int n) -> ()");
  m.impl("packed_linear_silu_mul", c10::DispatchKey::CPU, &packed_linear_silu_mul);
  m.def("packed_linear_supported() -> bool", &packed_linear_supported);
  m.def("packed_linear_int8_supported() -> bool", &packed_linear_int8_supported);
  m.def("packed_linear_int8_max_rows() -> int", &packed_linear_int8_max_rows);
  m.def("linear_amx_min_rows(int rows=-1) -> int", &linear_amx_min_rows);
}
