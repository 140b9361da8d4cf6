// The per-row operations for AVX2 + FMA + F16C: ops.inc compiled for AVX2, with attention, SiLU, activation
// quantization and half conversion vectorized by hand.
// Each hand-written loop performs the reference's operations on the same values in the same order (lanes
// are the reference's lane accumulators; 8 scores are reduced at once by a tree of horizontal adds, which is
// hsum8's order), so this table's results equal reference_ops() bitwise.
#include "ops.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace spn {
namespace avx2 {
#include "ops.inc"

#include "x86_attend.inc"

template <int C, typename KV>
static void attend_many_fast(const float* const* q, int nq, const KV* kc, const KV* vc, int prefix,
                             const int* const* extra, const int* n_extra, float* scores, int lds,
                             float* const* out) {
  constexpr int d = 8 * C;
  alignas(32) float buf[kKeyBlock * d];  // a half or q8 cache's block, converted (block_rows)
  alignas(32) float row[d];              // … and one row of the window's own (row_floats)
  for (int j0 = 0; j0 < prefix; j0 += kKeyBlock) {  // scores over the shared rows
    const int j1 = j0 + kKeyBlock < prefix ? j0 + kKeyBlock : prefix;
    const float* kb = block_rows<C>(kc, j0, j1, buf);  // row j at kb + (j - j0) * d
    for (int i = 0; i < nq; ++i) {
      float* s = scores + static_cast<size_t>(i) * lds;
      int j = j0;
      for (; j + 8 <= j1; j += 8) {
        const float* kp[8];
        for (int u = 0; u < 8; ++u) kp[u] = kb + static_cast<size_t>(j + u - j0) * d;
        scores8<C>(q[i], kp, s + j);
      }
      for (; j < j1; ++j) s[j] = dot8<C>(q[i], kb + static_cast<size_t>(j - j0) * d);
    }
  }
  alignas(32) float lanes[8];
  for (int i = 0; i < nq; ++i) {  // each query's own rows, its softmax, then its output zeroed
    float* s = scores + static_cast<size_t>(i) * lds;
    const int n = prefix + n_extra[i];
    for (int e = 0; e < n_extra[i]; ++e) s[prefix + e] = dot8<C>(q[i], row_floats<C>(kv_row(kc, extra[i][e], d), row));
    const float m = max_scores(s, n);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_store_ps(lanes, sum);
    for (; j < n; ++j) {
      s[j] = exp_c(s[j] - m);
      lanes[j % 8] = lanes[j % 8] + s[j];
    }
    s[n] = 1.0f / hsum8(lanes);  // the row's normalizer, kept past its scores (lds leaves room)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[i] + 8 * c, _mm256_setzero_ps());
  }
  for (int j0 = 0; j0 < prefix; j0 += kKeyBlock) {  // the weighted sum over the shared rows
    const int j1 = j0 + kKeyBlock < prefix ? j0 + kKeyBlock : prefix;
    const float* vb = block_rows<C>(vc, j0, j1, buf);
    for (int i = 0; i < nq; ++i) {
      const float* s = scores + static_cast<size_t>(i) * lds;
      __m256 o[C];
      for (int c = 0; c < C; ++c) o[c] = _mm256_loadu_ps(out[i] + 8 * c);
      for (int j = j0; j < j1; ++j) {
        const float* v = vb + static_cast<size_t>(j - j0) * d;
        const __m256 p = _mm256_set1_ps(s[j]);
        for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(p, ld8(v + 8 * c), o[c]);
      }
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[i] + 8 * c, o[c]);
    }
  }
  for (int i = 0; i < nq; ++i) {  // each query's own rows, then the normalizer
    const float* s = scores + static_cast<size_t>(i) * lds;
    __m256 o[C];
    for (int c = 0; c < C; ++c) o[c] = _mm256_loadu_ps(out[i] + 8 * c);
    for (int e = 0; e < n_extra[i]; ++e) {
      const float* v = row_floats<C>(kv_row(vc, extra[i][e], d), row);
      const __m256 p = _mm256_set1_ps(s[prefix + e]);
      for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), o[c]);
    }
    const __m256 inv = _mm256_set1_ps(s[prefix + n_extra[i]]);
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[i] + 8 * c, _mm256_mul_ps(o[c], inv));
  }
}

// to_half on 8 lanes: vcvtps2ph, rounding to nearest even (float_to_half's rounding).
static void to_half_f16c(const float* x, uint16_t* out, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = float_to_half(x[i]);
}

// quantize32 on 8 lanes: its absmax (a maximum is exact in any order; _mm256_max_ps(f, m) is the
// reference's `f > m ? f : m`, NaN skipped) and, where it is positive, its codes into q (the reference's
// product, rounding and clamps on each value, a NaN giving 0) with their int32 lanes in qi; else zero codes.
static inline float quantize32_avx2(const float* xb, int8_t* q, __m256i* qi) {
  const __m256 sign = _mm256_set1_ps(-0.0f), round = _mm256_set1_ps(kRound);
  const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
  __m256 v[4], mv = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_loadu_ps(xb + 8 * c);
    mv = _mm256_max_ps(_mm256_andnot_ps(sign, v[c]), mv);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float m = _mm_cvtss_f32(m4);
  if (!(m > 0.0f)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
    return m;
  }
  const __m256 inv = _mm256_set1_ps(127.0f / m);
  for (int c = 0; c < 4; ++c) {
    __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[c], inv), round), round);
    r = _mm256_blendv_ps(r, top, _mm256_cmp_ps(r, top, _CMP_GT_OQ));
    r = _mm256_blendv_ps(r, bottom, _mm256_cmp_ps(r, bottom, _CMP_LT_OQ));
    r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));  // a NaN input gives 0
    qi[c] = _mm256_cvttps_epi32(r);
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                                                     _mm256_packs_epi32(qi[2], qi[3])), order));
  return m;
}

// quantize_row on 8 lanes: each whole block by quantize32_avx2, then its integer sums; a block that runs past K's
// end takes the reference's loop.
static void quantize_row_avx2(const float* x, int K, QAct& a, int row) {
  const int full = K / kBlock;
  for (int b = 0; b < full; ++b) {
    int8_t* q = a.q + (static_cast<size_t>(row) * a.blocks + b) * kBlock;
    __m256i qi[4];
    const float m = quantize32_avx2(x + static_cast<size_t>(b) * kBlock, q, qi);
    int32_t sum = 0, lo = 0;
    if (m > 0.0f) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(qi[0], qi[1]));
      for (int l = 0; l < 8; ++l) lo += lanes[l];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(qi[2], qi[3]));
      sum = lo;
      for (int l = 0; l < 8; ++l) sum += lanes[l];
    }
    set_block_sums(a, row, b, m, sum, lo);
  }
  for (int b = full; b < a.blocks; ++b) quantize_block(x, K, a, row, b);
}

// to_q8 on 8 lanes: quantize32_avx2 on each block of 32, its scale beside.
static void to_q8_avx2(const float* x, KvQ8* out, int d) {
  for (int b = 0; b < d / 32; ++b) {
    __m256i qi[4];
    out[b].scale = quantize32_avx2(x + 32 * b, out[b].q, qi) / 127.0f;
  }
}

static void silu_mul_avx2(const float* gu, int I, float* out) {
  int i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= I; i += 8) {
    __m256 g = _mm256_loadu_ps(gu + i);
    __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(gu + I + i)));
  }
  for (; i < I; ++i) {
    float g = gu[i];
    out[i] = (g * (1.0f / (1.0f + exp_c(-g)))) * gu[I + i];
  }
}

}  // namespace avx2

Ops avx2_ops() {
  return Ops{avx2::rmsnorm_row, avx2::quantize_row_avx2, avx2::rope_row, avx2::attend_many_x86,
             avx2::to_half_f16c, avx2::to_q8_avx2, avx2::silu_mul_avx2, avx2::add_row};
}

}  // namespace spn

#pragma GCC pop_options

#else
namespace spn {
Ops avx2_ops() { return reference_ops(); }
}  // namespace spn
#endif
