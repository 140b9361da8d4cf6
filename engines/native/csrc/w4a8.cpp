// The block-quantized kernels (int4 and int8 weights, either with minimums, int8 in half blocks; int8 activations): a scalar reference
// (any CPU) and x86 kernels picked at run time, each computing exactly the reference's integers and float
// sequence (see w4a8.h).
#include "w4a8.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define SPN_X86 1
#endif

namespace spn {
namespace {

// ── scalar reference ──────────────────────────────────────────────────────────────────────────────
inline int weight_at(const QWeight& w, int t, int b, int col, int k) {  // k: 0..31 within the block
  int g = k / 4, j = k % 4;
  const uint8_t* blk = w.packed + (static_cast<size_t>(t) * w.blocks + b) * tile_bytes(w.format);
  if (is_int8(w.format)) return static_cast<int>(blk[g * 64 + col * 4 + j]) - 128;
  uint8_t byte = blk[(g / 2) * 64 + col * 4 + j];
  return (g % 2) ? (byte >> 4) : (byte & 15);
}

// A block's weight factors besides its codes: ws / wh the scales of inputs 0..15 / 16..31 (wh: kQ8x16 and
// kQ8x16Min), wm the minimum (kQ4Min, kQ8Min; kQ8x16Min: of inputs 0..15), wmh kQ8x16Min's of 16..31.
struct BlockFactors {
  float ws, wh, wm, wmh;
};

// One block's step of the float sequence of format `format` (w4a8.h); the vector kernels run the same steps.
// isum_lo / isum_hi: the integer sums over the block's inputs 0..15 / 16..31; corr, lo, qsum: the
// activations' 8 · sum, sum over inputs 0..15 and scaled sum (QAct).
inline float block_step(int format, int32_t isum_lo, int32_t isum_hi, int32_t corr, int32_t lo, float qsum,
                        const BlockFactors& f, float as, float acc) {
  const int32_t isum = isum_lo + isum_hi;
  switch (format) {
    case kQ4Min:
    case kQ8Min:
      acc = std::fma(static_cast<float>(isum), f.ws * as, acc);
      return std::fma(f.wm, qsum, acc);
    case kQ8:
      return std::fma(static_cast<float>(isum), f.ws * as, acc);
    case kQ8x16:
      acc = std::fma(static_cast<float>(isum_lo), f.ws * as, acc);
      return std::fma(static_cast<float>(isum_hi), f.wh * as, acc);
    case kQ8x16Min:
      acc = std::fma(static_cast<float>(isum_lo), f.ws * as, acc);
      acc = std::fma(static_cast<float>(isum_hi), f.wh * as, acc);
      acc = std::fma(f.wm, as * static_cast<float>(lo), acc);
      return std::fma(f.wmh, as * static_cast<float>(corr / 8 - lo), acc);
    default:
      return std::fma(static_cast<float>(isum - corr), f.ws * as, acc);
  }
}

void gemm_scalar(const QWeight& w, const QAct& a, float* y, int ldy, int t0, int t1) {
  for (int t = t0; t < t1; ++t) {
    for (int r = 0; r < a.M; ++r) {
      const int8_t* qa = a.q + static_cast<size_t>(r) * a.blocks * kBlock;
      for (int col = 0; col < kTileN; ++col) {
        int n = t * kTileN + col;
        if (n >= w.N) break;
        float acc = 0.0f;
        for (int b = 0; b < w.blocks; ++b) {
          int32_t isum[2] = {0, 0};
          for (int k = 0; k < kBlock; ++k) isum[k / 16] += weight_at(w, t, b, col, k) * qa[b * kBlock + k];
          const size_t at = (static_cast<size_t>(t) * w.blocks + b) * kTileN + col, ab = r * a.blocks + b;
          const BlockFactors f{factor_at(w.scales, w.half_scales, at), w.hi_scales ? w.hi_scales[at] : 0.0f,
                               w.mins || w.half_mins ? factor_at(w.mins, w.half_mins, at) : 0.0f,
                               w.hi_mins ? w.hi_mins[at] : 0.0f};
          acc = block_step(w.format, isum[0], isum[1], a.corr[ab], a.lo_sum[ab], a.qsum[ab], f, a.scale[ab], acc);
        }
        y[static_cast<size_t>(r) * ldy + n] = w.bias ? acc + w.bias[n] : acc;
      }
    }
  }
}

#ifdef SPN_X86
// Asks for a line of weights ahead of use: non-temporal where they stream (QWeight::stream), else into every
// cache level.
inline void prefetch_weights(const QWeight& w, const uint8_t* at) {
  if (w.stream)
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_NTA);
  else
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
}

// Stores the 16 columns of a tile, the tail cut to N, the bias added after the block sum (as the reference).
inline void store_tile(const QWeight& w, int t, const float* acc16, float* yrow) {
  int n0 = t * kTileN;
  int n = w.N - n0 < kTileN ? w.N - n0 : kTileN;
  for (int i = 0; i < n; ++i) yrow[n0 + i] = w.bias ? acc16[i] + w.bias[n0 + i] : acc16[i];
}

// One tile's scales or minimums from `off`: floats, or halves (QWeight::half_scales, half_mins). The kernels read
// 8 or 16 of them a block, widened to the same floats either way.
struct Factors {
  const float* f = nullptr;
  const uint16_t* h = nullptr;
};
inline Factors tile_factors(const float* f, const uint16_t* h, size_t off) {
  Factors p;
  if (h) p.h = h + off;
  else if (f) p.f = f + off;
  return p;
}
__attribute__((target("avx2,f16c"))) inline __m256 factors8(const Factors& p, size_t i) {
  return p.h ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.h + i))) : _mm256_loadu_ps(p.f + i);
}
__attribute__((target("avx512f"))) inline __m512 factors16(const Factors& p, size_t i) {
  return p.h ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.h + i))) : _mm512_loadu_ps(p.f + i);
}

// ── AVX2: vpmaddubsw (u8 x s8 -> s16 pairs) + vpmaddwd -> s32, on two 8-column halves, rows on the inside ──
// int4: each 64-byte chunk of a block (two input groups of 16 columns) is unpacked once and multiplied into every
// row's two 16-bit sums (columns 0-7, 8-15) while those stay in registers; four rows' sums, the chunk's four
// unpacked groups and two broadcast activations fill the 16 registers. The pairs are summed in s16 over the whole
// block (each pair within ±2·15·127 = ±3810, eight of them within ±30480 < 2^15: no sum saturates), then one
// vpmaddwd widens them. The rows' float sums live in memory (one load and store a row and block), so nothing else
// spills. The integer sums are exact and the float steps are w4a8.h's, in its order: bitwise the reference.
constexpr int kAvx2Rows = 4;  // rows of a tile, int4 and int8
template <int R, int F>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_int4(const QWeight& w, const QAct& a, int r0, int t,
                                                         float* y, int ldy) {
  static_assert(!is_int8(F) && R <= kAvx2Rows, "int4 formats, at most four rows");
  constexpr int TB = tile_bytes(F);
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  alignas(32) float acc[R][kTileN] = {};
  const uint8_t* wp = w.packed + static_cast<size_t>(t) * w.blocks * TB;
  const size_t off = static_cast<size_t>(t) * w.blocks * kTileN;
  const Factors ws = tile_factors(w.scales, w.half_scales, off), wm = tile_factors(w.mins, w.half_mins, off);
  const int8_t* qa[R];
  const float *as[R], *qs[R];
  const int32_t* corr[R];
  for (int r = 0; r < R; ++r) {
    const size_t row = static_cast<size_t>(r0 + r) * a.blocks;
    qa[r] = a.q + row * kBlock, as[r] = a.scale + row, qs[r] = a.qsum + row, corr[r] = a.corr + row;
  }
  for (int b = 0; b < w.blocks; ++b) {
    for (int c = 0; c < TB / 64; ++c)  // 4 KiB ahead, as tile_vnni
      prefetch_weights(w, wp + b * TB + 4096 + c * 64);
    __m256i pl[R], ph[R];
    for (int r = 0; r < R; ++r) pl[r] = ph[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + b * TB + c * 64));
      const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + b * TB + c * 64 + 32));
      const __m256i l0 = _mm256_and_si256(v0, m4), h0 = _mm256_and_si256(v1, m4);  // group 2c
      const __m256i l1 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);            // group 2c + 1
      const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t four0, four1;
        std::memcpy(&four0, qa[r] + b * kBlock + 8 * c, 4);
        std::memcpy(&four1, qa[r] + b * kBlock + 8 * c + 4, 4);
        const __m256i a0 = _mm256_set1_epi32(four0), a1 = _mm256_set1_epi32(four1);
        pl[r] = _mm256_add_epi16(pl[r], _mm256_maddubs_epi16(l0, a0));
        ph[r] = _mm256_add_epi16(ph[r], _mm256_maddubs_epi16(h0, a0));
        pl[r] = _mm256_add_epi16(pl[r], _mm256_maddubs_epi16(l1, a1));
        ph[r] = _mm256_add_epi16(ph[r], _mm256_maddubs_epi16(h1, a1));
        // the sums stay in registers: without this GCC re-associates them into one tree per block and spills
        // every product to the stack
        asm("" : "+x"(pl[r]), "+x"(ph[r]));
      }
    }
    const __m256 wsl = factors8(ws, b * kTileN), wsh = factors8(ws, b * kTileN + 8);
    __m256 wml = _mm256_setzero_ps(), wmh = _mm256_setzero_ps();
    if (F == kQ4Min) wml = factors8(wm, b * kTileN), wmh = factors8(wm, b * kTileN + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256i sl = _mm256_madd_epi16(pl[r], ones), sh = _mm256_madd_epi16(ph[r], ones);
      if (F == kQ4) {
        const __m256i zp = _mm256_set1_epi32(corr[r][b]);
        sl = _mm256_sub_epi32(sl, zp), sh = _mm256_sub_epi32(sh, zp);
      }
      const __m256 scale = _mm256_set1_ps(as[r][b]);
      __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl), _mm256_mul_ps(wsl, scale), _mm256_load_ps(acc[r]));
      __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh), _mm256_mul_ps(wsh, scale), _mm256_load_ps(acc[r] + 8));
      if (F == kQ4Min) {
        const __m256 qsum = _mm256_set1_ps(qs[r][b]);
        lo = _mm256_fmadd_ps(wml, qsum, lo);
        hi = _mm256_fmadd_ps(wmh, qsum, hi);
      }
      _mm256_store_ps(acc[r], lo);
      _mm256_store_ps(acc[r] + 8, hi);
    }
  }
  for (int r = 0; r < R; ++r) store_tile(w, t, acc[r], y + static_cast<size_t>(r0 + r) * ldy);
}

// int8, rows on the inside as tile_avx2_int4: each input group's two 8-column halves are read once (their
// magnitudes and signs) and multiplied into every row's two 32-bit sums, kept in registers. vpmaddubsw takes |w|
// and the activation with w's sign (vpsignb), so a pair is within ±2·128·127 = ±32512; each group widens at once.
// The half-block formats (kQ8x16, kQ8x16Min) run groups 0-3, take the lower half's float step, then groups 4-7
// and the upper half's: w4a8.h's order.
template <int R, int F>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_int8(const QWeight& w, const QAct& a, int r0, int t,
                                                         float* y, int ldy) {
  static_assert(is_int8(F) && R <= kAvx2Rows, "int8 formats, at most four rows");
  constexpr int TB = tile_bytes(F);
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  alignas(32) float acc[R][kTileN] = {};
  const uint8_t* wp = w.packed + static_cast<size_t>(t) * w.blocks * TB;
  const size_t off = static_cast<size_t>(t) * w.blocks * kTileN;
  const Factors ws = tile_factors(w.scales, w.half_scales, off), wm = tile_factors(w.mins, w.half_mins, off);
  const float* whs = has_halves(F) ? w.hi_scales + off : nullptr;  // the upper halves' scales and minimums
  const float* wmh = F == kQ8x16Min ? w.hi_mins + off : nullptr;
  const int8_t* qa[R];
  const float *as[R], *qs[R];
  const int32_t *corr[R], *lo_sum[R];
  for (int r = 0; r < R; ++r) {
    const size_t row = static_cast<size_t>(r0 + r) * a.blocks;
    qa[r] = a.q + row * kBlock, as[r] = a.scale + row, qs[r] = a.qsum + row, corr[r] = a.corr + row;
    lo_sum[r] = a.lo_sum + row;
  }
  for (int b = 0; b < w.blocks; ++b) {
    for (int c = 0; c < TB / 64; ++c)  // 4 KiB ahead, as tile_vnni
      prefetch_weights(w, wp + b * TB + 4096 + c * 64);
    const __m256 wsl = factors8(ws, b * kTileN), wsh = factors8(ws, b * kTileN + 8);
    // the groups of each half block (kQ8x16, kQ8x16Min) or of the whole block: every row's sums over them,
    // then each row's float step with that part's scales
    constexpr int parts = has_halves(F) ? 2 : 1;
    for (int part = 0; part < parts; ++part) {
      const int g0 = part * 8 / parts, g1 = (part + 1) * 8 / parts;
      const __m256 lo_scale = part ? _mm256_loadu_ps(whs + b * kTileN) : wsl;
      const __m256 hi_scale = part ? _mm256_loadu_ps(whs + b * kTileN + 8) : wsh;
      __m256i sl[R], sh[R];
      for (int r = 0; r < R; ++r) sl[r] = sh[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = g0; g < g1; ++g) {
        const __m256i wl =
            _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(wp + b * TB + g * 64)), flip);
        const __m256i wh =
            _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(wp + b * TB + g * 64 + 32)), flip);
        const __m256i ml = _mm256_abs_epi8(wl), mh = _mm256_abs_epi8(wh);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, qa[r] + b * kBlock + 4 * g, 4);
          const __m256i av = _mm256_set1_epi32(four);
          sl[r] = _mm256_add_epi32(sl[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ml, _mm256_sign_epi8(av, wl)), ones));
          sh[r] = _mm256_add_epi32(sh[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mh, _mm256_sign_epi8(av, wh)), ones));
          asm("" : "+x"(sl[r]), "+x"(sh[r]));  // as tile_avx2_int4: the sums stay in registers
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_set1_ps(as[r][b]);
        _mm256_store_ps(acc[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl[r]), _mm256_mul_ps(lo_scale, scale),
                                                _mm256_load_ps(acc[r])));
        _mm256_store_ps(acc[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh[r]), _mm256_mul_ps(hi_scale, scale),
                                                    _mm256_load_ps(acc[r] + 8)));
      }
    }
    if (!has_mins(F)) continue;
    const __m256 wml = factors8(wm, b * kTileN), wmh8 = factors8(wm, b * kTileN + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // the minimums' terms: kQ8Min's one, kQ8x16Min's lower then upper half's
      __m256 lo = _mm256_load_ps(acc[r]), hi = _mm256_load_ps(acc[r] + 8);
      if (F == kQ8Min) {
        const __m256 qsum = _mm256_set1_ps(qs[r][b]);
        lo = _mm256_fmadd_ps(wml, qsum, lo);
        hi = _mm256_fmadd_ps(wmh8, qsum, hi);
      } else {
        const float sc = as[r][b];
        const int32_t low = lo_sum[r][b];
        const __m256 alo = _mm256_set1_ps(sc * static_cast<float>(low));
        const __m256 ahi = _mm256_set1_ps(sc * static_cast<float>(corr[r][b] / 8 - low));
        lo = _mm256_fmadd_ps(wml, alo, lo);
        hi = _mm256_fmadd_ps(wmh8, alo, hi);
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(wmh + b * kTileN), ahi, lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(wmh + b * kTileN + 8), ahi, hi);
      }
      _mm256_store_ps(acc[r], lo);
      _mm256_store_ps(acc[r] + 8, hi);
    }
  }
  for (int r = 0; r < R; ++r) store_tile(w, t, acc[r], y + static_cast<size_t>(r0 + r) * ldy);
}

// ── AVX-512 VNNI: one vpdpbusd multiplies 4 inputs of 16 columns by a broadcast dword of activations ───────
// (unsigned weights: int4 nibbles, or int8 stored as q + 128, whose offset the start value takes back out)
template <int R, int F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) void tile_vnni(const QWeight& w,
                                                                                   const QAct& a, int r0, int t,
                                                                                   float* y, int ldy) {
  constexpr int TB = tile_bytes(F);
  const __m512i m4 = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* wp = w.packed + static_cast<size_t>(t) * w.blocks * TB;
  const size_t off = static_cast<size_t>(t) * w.blocks * kTileN;  // as tile_avx2_int4's factors
  const Factors ws = tile_factors(w.scales, w.half_scales, off);
  const float* whs = has_halves(F) ? w.hi_scales + off : nullptr;
  const Factors wm = tile_factors(w.mins, w.half_mins, off);
  const float* wmh = F == kQ8x16Min ? w.hi_mins + off : nullptr;
  for (int b = 0; b < w.blocks; ++b) {
    // the weights stream once per pass: ask for the lines 4 KiB ahead (past the tile: the next tile's) while
    // this block's rows compute, so the products of several rows overlap the memory traffic
    for (int c = 0; c < TB / 64; ++c)
      prefetch_weights(w, wp + b * TB + 4096 + c * 64);
    __m512i wv[8];
    if (is_int8(F)) {
      for (int g = 0; g < 8; ++g) wv[g] = _mm512_load_si512(wp + b * TB + g * 64);
    } else {
      for (int c = 0; c < 4; ++c) {
        __m512i v = _mm512_load_si512(wp + b * TB + c * 64);
        wv[2 * c] = _mm512_and_si512(v, m4);
        wv[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
    }
    const __m512 wsv = factors16(ws, b * kTileN);
    const __m512 wmv = has_mins(F) ? factors16(wm, b * kTileN) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int row = r0 + r;
      const int32_t* qa = reinterpret_cast<const int32_t*>(a.q + (static_cast<size_t>(row) * a.blocks + b) * kBlock);
      const int32_t corr = a.corr[row * a.blocks + b];
      // the sum starts at minus the weights' offset times sum(q_a) (int4: 8, int8: 128; none for kQ4Min); with
      // one row, two chains (even / odd groups) hide the latency. Integer sums either way: neither choice can
      // change the result.
      __m512 as = _mm512_set1_ps(a.scale[row * a.blocks + b]);
      if (has_halves(F)) {  // two half blocks, each its own sum from minus 128 times its activations' sum
        const int32_t lo_sum = a.lo_sum[row * a.blocks + b];
        __m512i s0 = _mm512_set1_epi32(-128 * lo_sum), s1 = _mm512_set1_epi32(-128 * (corr / 8 - lo_sum));
        for (int g = 0; g < 4; ++g) {
          s0 = _mm512_dpbusd_epi32(s0, wv[g], _mm512_set1_epi32(qa[g]));
          s1 = _mm512_dpbusd_epi32(s1, wv[g + 4], _mm512_set1_epi32(qa[g + 4]));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(wsv, as), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(_mm512_loadu_ps(whs + b * kTileN), as), acc[r]);
        if (F == kQ8x16Min) {  // each half's minimums times its activations' scaled sum
          const float sc = a.scale[row * a.blocks + b];
          acc[r] = _mm512_fmadd_ps(wmv, _mm512_set1_ps(sc * static_cast<float>(lo_sum)), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(wmh + b * kTileN),
                                   _mm512_set1_ps(sc * static_cast<float>(corr / 8 - lo_sum)), acc[r]);
        }
        continue;
      }
      __m512i s = _mm512_set1_epi32(F == kQ4 ? -corr : is_int8(F) ? -16 * corr : 0);
      if (R == 1) {
        __m512i s1 = _mm512_setzero_si512();
        for (int g = 0; g < 8; g += 2) {
          s = _mm512_dpbusd_epi32(s, wv[g], _mm512_set1_epi32(qa[g]));
          s1 = _mm512_dpbusd_epi32(s1, wv[g + 1], _mm512_set1_epi32(qa[g + 1]));
        }
        s = _mm512_add_epi32(s, s1);
      } else {
        // the activation dword broadcast from memory inside the instruction ({1to16}): no separate uop
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(wv[g]), "m"(qa[g]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(wsv, as), acc[r]);
      if (has_mins(F))  // the minimums times the activations' scaled sum: one product per row and block
        acc[r] = _mm512_fmadd_ps(wmv, _mm512_set1_ps(a.qsum[row * a.blocks + b]), acc[r]);
    }
  }
  alignas(64) float out[kTileN];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(out, acc[r]);
    store_tile(w, t, out, y + static_cast<size_t>(r0 + r) * ldy);
  }
}

// ── AMX (Xeon 4th generation and later): one tdpbssd multiplies a whole block (32 inputs) of 16 rows by 16
// columns into a tile of 16 x 16 exact int32 sums. The packed weights are in the B tile's layout already (8
// rows of 4 inputs x 16 columns: vpdpbusd's lane order); each block is rewritten as signed bytes with its
// offset taken out (amx_weights), so the sums are w4a8.h's isum and each row runs tile_vnni's float steps on
// them: the two kernels agree bitwise. The instructions are spelled in asm with memory clobbers: GCC's tile
// intrinsics do not tell the compiler that a tile load reads memory.
#define SPN_TLOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define SPN_TSTORE(t, base) asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(64L) : "memory")
#define SPN_TZERO(t) asm volatile("tilezero %%tmm" #t ::)
#define SPN_TDPBSSD(c, a, b) asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
// one block's product: weights from wbuf into tile B, activations (16 rows of the block's 32 bytes, a row
// every `stride` bytes) into tile A, their sums into tile C, stored to `sums`
#define SPN_TBLOCK(C, A, B, wbuf, act, stride) \
  SPN_TLOAD(B, wbuf, 64);                      \
  SPN_TLOAD(A, act, stride);                   \
  SPN_TZERO(C);                                \
  SPN_TDPBSSD(C, A, B)

constexpr int kAmxRows = 16;  // rows of a tile at most
// The fewest rows a call runs on tiles: 16 unless SPECRT_AMX_MIN_ROWS (2-16) asks for fewer, when a call of
// that many to 15 rows runs tiles of exactly its rows (the integer sums are exact either way, so every row
// stays bitwise tile_vnni's). They were no faster at 2-8 rows on the AMX Xeon measured (docs/performance.md,
// "Tiles of fewer than 16 rows"), hence the default; the variable lets the suite hold those tiles to the
// reference and a benchmark time them on other machines. One row always stays on tile_vnni.
int amx_min_rows() {
  static const int rows = [] {
    const char* s = std::getenv("SPECRT_AMX_MIN_ROWS");
    const int n = s ? std::atoi(s) : kAmxRows;
    return n < 2 ? 2 : n > kAmxRows ? kAmxRows : n;
  }();
  return rows;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the sums of four blocks (rows x 16 int32); 4, 5: activations (rows x 32 bytes); 6, 7: weights
// (8 x 64). `rows`: the rows every call of tile_amx<rows> until the next configure computes.
void amx_configure(int rows) {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.rows[i] = static_cast<uint8_t>(rows), c.colsb[i] = kTileN * 4;
  for (int i = 4; i < 6; ++i) c.rows[i] = static_cast<uint8_t>(rows), c.colsb[i] = kBlock;
  for (int i = 6; i < 8; ++i) c.rows[i] = kBlock / 4, c.colsb[i] = 64;
  asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

void amx_release() { asm volatile("tilerelease" ::: "memory"); }

// Block `blk` of a tile as signed bytes in the B tile's layout (buf): int4 q - 8 (kQ4) or q (kQ4Min, whose
// minimum is a float term), int8 q from its stored q + 128. For int4 one vpermb maps each byte's low six bits
// through a 64-entry table of (j & 15) - offset: the low nibble with no mask, the high one after a 16-bit
// shift by 4 (the neighbour's bits it pulls in land in bits 4-7, which the table ignores).
template <int F>
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline void amx_weights(const uint8_t* blk, uint8_t* buf) {
  if (is_int8(F)) {
    const __m512i flip = _mm512_set1_epi8(-128);
    for (int g = 0; g < 8; ++g)
      _mm512_store_si512(buf + g * 64, _mm512_xor_si512(_mm512_load_si512(blk + g * 64), flip));
    return;
  }
  alignas(64) static constexpr auto table = [] {
    struct {
      int8_t v[64];
    } t{};
    for (int j = 0; j < 64; ++j) t.v[j] = static_cast<int8_t>((j & 15) - (F == kQ4 ? 8 : 0));
    return t;
  }();
  const __m512i lut = _mm512_load_si512(table.v);
  for (int c = 0; c < 4; ++c) {
    __m512i v = _mm512_load_si512(blk + c * 64);
    _mm512_store_si512(buf + 2 * c * 64, _mm512_permutexvar_epi8(v, lut));
    _mm512_store_si512(buf + (2 * c + 1) * 64, _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), lut));
  }
}

// Block b's float steps for the R rows from r0, from its tile of sums s: tile_vnni's.
template <int R, int F>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"), always_inline)) inline void amx_steps(
    __m512* acc, const QAct& a, int r0, int b, const int32_t* s, const Factors& ws, const Factors& wm) {
  const __m512 wsv = factors16(ws, b * kTileN);
  const __m512 wmv = has_mins(F) ? factors16(wm, b * kTileN) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const int row = r0 + r;
    const __m512i v = _mm512_load_si512(s + r * kTileN);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(wsv, _mm512_set1_ps(a.scale[row * a.blocks + b])),
                             acc[r]);
    if (has_mins(F))
      acc[r] = _mm512_fmadd_ps(wmv, _mm512_set1_ps(a.qsum[row * a.blocks + b]), acc[r]);
  }
}

// The R rows from r0 of tile t (the tiles configured for R rows); every format but the half-block ones. A
// pipeline over groups of four blocks: group g's four products are issued into four sum tiles (a tile is not renamed: a product into it waits for its last
// reader), group g + 2's weights are unpacked (a tile load reads stores only once they have left the core),
// and group g - 1's float steps run from the sums it stored one group earlier.
template <int R, int F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,fma"))) void tile_amx(const QWeight& w, const QAct& a,
                                                                                 int r0, int t, float* y, int ldy) {
  constexpr int TB = tile_bytes(F);
  alignas(64) uint8_t wbuf[3][4][kBlock * kTileN];   // [group % 3][block of the group]
  alignas(64) int32_t sums[2][4][R * kTileN];  // [group % 2][block of the group]
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* wp = w.packed + static_cast<size_t>(t) * w.blocks * TB;
  const Factors ws = tile_factors(w.scales, w.half_scales, static_cast<size_t>(t) * w.blocks * kTileN);
  const Factors wm = tile_factors(w.mins, w.half_mins, static_cast<size_t>(t) * w.blocks * kTileN);
  const int8_t* qa = a.q + static_cast<size_t>(r0) * a.blocks * kBlock;
  const long stride = static_cast<long>(a.blocks) * kBlock;
  const int groups = (w.blocks + 3) / 4;
  for (int i = 0; i < 8 && i < w.blocks; ++i) amx_weights<F>(wp + i * TB, wbuf[i / 4][i % 4]);
  for (int g = 0; g < groups; ++g) {
    const int b = 4 * g, n = w.blocks - b < 4 ? w.blocks - b : 4;
    int32_t(*s)[R * kTileN] = sums[g & 1];
    for (int c = 0; c < 4 * TB / 64; ++c)  // the weights 4 KiB ahead, as tile_vnni
      prefetch_weights(w, wp + b * TB + 4096 + c * 64);
    SPN_TBLOCK(0, 4, 6, wbuf[g % 3][0], qa + b * kBlock, stride);
    if (n > 1) SPN_TBLOCK(1, 5, 7, wbuf[g % 3][1], qa + (b + 1) * kBlock, stride);
    if (n > 2) SPN_TBLOCK(2, 4, 6, wbuf[g % 3][2], qa + (b + 2) * kBlock, stride);
    if (n > 3) SPN_TBLOCK(3, 5, 7, wbuf[g % 3][3], qa + (b + 3) * kBlock, stride);
    SPN_TSTORE(0, s[0]);
    if (n > 1) SPN_TSTORE(1, s[1]);
    if (n > 2) SPN_TSTORE(2, s[2]);
    if (n > 3) SPN_TSTORE(3, s[3]);
    for (int i = 0; i < 4 && b + 8 + i < w.blocks; ++i) amx_weights<F>(wp + (b + 8 + i) * TB, wbuf[(g + 2) % 3][i]);
    if (g > 0)
      for (int i = 0; i < 4; ++i) amx_steps<R, F>(acc, a, r0, b - 4 + i, sums[(g - 1) & 1][i], ws, wm);
  }
  const int last = 4 * (groups - 1);
  for (int i = 0; last + i < w.blocks; ++i) amx_steps<R, F>(acc, a, r0, last + i, sums[(groups - 1) & 1][i], ws, wm);
  alignas(64) float out[kTileN];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(out, acc[r]);
    store_tile(w, t, out, y + static_cast<size_t>(r0 + r) * ldy);
  }
}
#undef SPN_TBLOCK
#undef SPN_TLOAD
#undef SPN_TSTORE
#undef SPN_TZERO
#undef SPN_TDPBSSD

using TileFn = void (*)(const QWeight&, const QAct&, int, int, float*, int);

#define SPN_TILES4(fn, F) {nullptr, fn<1, F>, fn<2, F>, fn<3, F>, fn<4, F>}
#define SPN_TILES16(fn, F)                                                                                          \
  {nullptr,    fn<1, F>,  fn<2, F>,  fn<3, F>,  fn<4, F>,  fn<5, F>,  fn<6, F>,  fn<7, F>, fn<8, F>,                \
   fn<9, F>,   fn<10, F>, fn<11, F>, fn<12, F>, fn<13, F>, fn<14, F>, fn<15, F>, fn<16, F>}
// AVX2 has 16 vector registers: four rows' two sums, with what they multiply (above); AVX-512 has 32, room for 16
// rows' one accumulator
constexpr int kVnniRows = 16;
const TileFn kAvx2Tiles[kFormatCount][kAvx2Rows + 1] = {
    SPN_TILES4(tile_avx2_int4, kQ4),    SPN_TILES4(tile_avx2_int4, kQ4Min), SPN_TILES4(tile_avx2_int8, kQ8),
    SPN_TILES4(tile_avx2_int8, kQ8x16), SPN_TILES4(tile_avx2_int8, kQ8Min), SPN_TILES4(tile_avx2_int8, kQ8x16Min)};
const TileFn kVnniTiles[kFormatCount][kVnniRows + 1] = {
    SPN_TILES16(tile_vnni, kQ4), SPN_TILES16(tile_vnni, kQ4Min), SPN_TILES16(tile_vnni, kQ8),
    SPN_TILES16(tile_vnni, kQ8x16), SPN_TILES16(tile_vnni, kQ8Min), SPN_TILES16(tile_vnni, kQ8x16Min)};
// the half-block formats need two sums a block: they stay on tile_vnni
#define SPN_AMX(F)                                                                                                \
  {nullptr,          nullptr,          tile_amx<2, F>,  tile_amx<3, F>,  tile_amx<4, F>,  tile_amx<5, F>,          \
   tile_amx<6, F>,   tile_amx<7, F>,   tile_amx<8, F>,  tile_amx<9, F>,  tile_amx<10, F>, tile_amx<11, F>,         \
   tile_amx<12, F>,  tile_amx<13, F>,  tile_amx<14, F>, tile_amx<15, F>, tile_amx<16, F>}
const TileFn kAmxTiles[kFormatCount][kAmxRows + 1] = {SPN_AMX(kQ4),    SPN_AMX(kQ4Min), SPN_AMX(kQ8),
                                                      {},              SPN_AMX(kQ8Min), {}};
#undef SPN_AMX
#undef SPN_TILES4
#undef SPN_TILES16

// Each tile's rows in groups of up to `per` (the table's largest), one unpacked weight block shared by a group.
void gemm_tiles(const TileFn* fns, int per, const QWeight& w, const QAct& a, float* y, int ldy, int t0, int t1) {
  for (int t = t0; t < t1; ++t) {
    for (int r0 = 0; r0 < a.M; r0 += per) {
      int rows = a.M - r0 < per ? a.M - r0 : per;
      fns[rows](w, a, r0, t, y, ldy);
    }
  }
}

// AMX: the tiles are configured once for the call, for 16 rows, or for all of a call's rows below 16 (from
// amx_min_rows()); the rows past the last whole 16 run tile_vnni in the same sweep over the weights, and so does
// a call of fewer rows (measured in docs/performance.md, "AMX").
void gemm_amx(const QWeight& w, const QAct& a, float* y, int ldy, int t0, int t1) {
  if (has_halves(w.format) || a.M < amx_min_rows()) return gemm_tiles(kVnniTiles[w.format], kVnniRows, w, a, y, ldy, t0, t1);
  const int per = a.M < kAmxRows ? a.M : kAmxRows;
  const int full = a.M / per * per;
  amx_configure(per);
  for (int t = t0; t < t1; ++t) {
    for (int r0 = 0; r0 < full; r0 += per) kAmxTiles[w.format][per](w, a, r0, t, y, ldy);
    if (full < a.M) kVnniTiles[w.format][a.M - full](w, a, full, t, y, ldy);
  }
  amx_release();
}

// AMX needs the CPU's tile and int8 units, the OS's tile state (XCR0 bits 17, 18) and, on Linux, the process's
// permission to use it (asked once).
bool amx_usable() {
  static const bool usable = [] {
    unsigned eax, ebx, ecx, edx;
    // leaf 7: AMX-TILE (edx 24), AMX-INT8 (edx 25), AVX512-VBMI (ecx 1: the int4 unpack's vpermb)
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25)) ||
        !(ecx & (1u << 1)))
      return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
    unsigned lo, hi;
    asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
#ifdef __linux__
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) != 0) return false;
#endif
    return true;
  }();
  return usable;
}
#endif  // SPN_X86

}  // namespace

bool isa_supported(Isa isa) {
  switch (isa) {
    case kScalar:
      return true;
#ifdef SPN_X86
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAmx:
      return isa_supported(kAvx512Vnni) && amx_usable();
#endif
    default:
      return false;
  }
}

void gemm(Isa isa, const QWeight& w, const QAct& a, float* y, int ldy, int t0, int t1) {
  switch (isa) {
#ifdef SPN_X86
    case kAvx2:
      gemm_tiles(kAvx2Tiles[w.format], kAvx2Rows, w, a, y, ldy, t0, t1);
      return;
    case kAvx512Vnni:
      gemm_tiles(kVnniTiles[w.format], kVnniRows, w, a, y, ldy, t0, t1);
      return;
    case kAmx:
      gemm_amx(w, a, y, ldy, t0, t1);
      return;
#endif
    default:
      gemm_scalar(w, a, y, ldy, t0, t1);
  }
}

}  // namespace spn
