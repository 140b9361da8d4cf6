// The per-row operations for AVX2 + FMA: ops.inc compiled for AVX2, with attention and SiLU vectorized by hand.
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
#pragma GCC target("avx2,fma")

namespace spn {
namespace avx2 {
#include "ops.inc"

// exp_c on 8 lanes.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // -87 > x ? -87 : x, as exp_c's clamp
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 round = _mm256_set1_ps(kRound);
  __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), round), round);
  __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                           _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_add_ps(_mm256_set1_ps(0.00833333377f), _mm256_mul_ps(r, _mm256_set1_ps(0.00138888892f)));
  p = _mm256_add_ps(_mm256_set1_ps(0.0416666679f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(0.166666672f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(r, p));
  p = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(r, p));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// hsum8 of 8 vectors at once: lane i of the result is hsum8(v[i]).
static inline __m256 hsum8x8(const __m256* v) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <int C>  // C = d / 8 chunks of the head
static void attend_fast(const float* q, const float* kc, const float* vc, int prefix, const int* extra,
                        int n_extra, float* scores, float* out) {
  constexpr int d = 8 * C;
  const int n = prefix + n_extra;
  auto row = [&](const float* base, int j) { return base + static_cast<size_t>(j < prefix ? j : extra[j - prefix]) * d; };
  int j = 0;
  for (; j + 8 <= n; j += 8) {  // dot_c of 8 keys
    __m256 acc[8];
    const float* kp[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps(), kp[i] = row(kc, j + i);
    for (int c = 0; c < C; ++c) {
      __m256 qc = _mm256_loadu_ps(q + 8 * c);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kp[i] + 8 * c), acc[i]);
    }
    _mm256_storeu_ps(scores + j, hsum8x8(acc));
  }
  for (; j < n; ++j) scores[j] = dot_c(q, row(kc, j), d);
  float m = scores[0];
  for (int i = 1; i < n; ++i) m = scores[i] > m ? scores[i] : m;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
    _mm256_storeu_ps(scores + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  for (; j < n; ++j) {
    scores[j] = exp_c(scores[j] - m);
    lanes[j % 8] = lanes[j % 8] + scores[j];
  }
  __m256 o[C];
  for (int c = 0; c < C; ++c) o[c] = _mm256_setzero_ps();
  for (j = 0; j < n; ++j) {
    const float* v = row(vc, j);
    const __m256 p = _mm256_set1_ps(scores[j]);
    for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), o[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum8(lanes));
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(o[c], inv));
}

static void attend_avx2(const float* q, const float* kc, const float* vc, int d, int prefix, const int* extra,
                        int n_extra, float* scores, float* out) {
  switch (d) {
    case 64:
      return attend_fast<8>(q, kc, vc, prefix, extra, n_extra, scores, out);
    case 128:
      return attend_fast<16>(q, kc, vc, prefix, extra, n_extra, scores, out);
    default:
      return attend(q, kc, vc, d, prefix, extra, n_extra, scores, out);
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
  return Ops{avx2::rmsnorm_row, avx2::quantize_row, avx2::rope_row, avx2::attend_avx2, avx2::silu_mul_avx2,
             avx2::add_row};
}

}  // namespace spn

#pragma GCC pop_options

#else
namespace spn {
Ops avx2_ops() { return reference_ops(); }
}  // namespace spn
#endif
