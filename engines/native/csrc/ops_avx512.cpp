// The per-row operations for AVX-512 (F, VL, BW) CPUs: the AVX2 table with attention on 16 lanes, for the
// avx512vnni and amx kernels. A 16-lane vector holds two keys' 8 lane accumulators side by side (scores), or
// 16 output values of one query (the weighted sum), so every lane runs ops.inc's chain in ops.inc's order and
// this table's results equal reference_ops() bitwise (tests/engines/test_native_pass.py, every kernel).
#include "ops.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx2,fma,f16c")

namespace spn {
namespace avx512 {
#include "ops.inc"

#include "x86_attend.inc"

// Two 8-lane halves as one vector, and back (AVX-512 F only: through the 64-bit lane forms).
static inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m256 lower(__m512 v) { return _mm512_castps512_ps256(v); }
static inline __m256 upper(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
// 8 floats in both halves
static inline __m512 twice(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// exp_c on 16 lanes: exp8's operations.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
  const __m512 round = _mm512_set1_ps(kRound);
  __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), round), round);
  __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                           _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_add_ps(_mm512_set1_ps(0.00833333377f), _mm512_mul_ps(r, _mm512_set1_ps(0.00138888892f)));
  p = _mm512_add_ps(_mm512_set1_ps(0.0416666679f), _mm512_mul_ps(r, p));
  p = _mm512_add_ps(_mm512_set1_ps(0.166666672f), _mm512_mul_ps(r, p));
  p = _mm512_add_ps(_mm512_set1_ps(0.5f), _mm512_mul_ps(r, p));
  p = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(r, p));
  p = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(r, p));
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 half values as floats (exactly), and 8 of row a beside 8 of row b.
static inline __m512 ld16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 pair8(const float* a, const float* b) { return join(_mm256_loadu_ps(a), _mm256_loadu_ps(b)); }
static inline __m512 pair8(const uint16_t* a, const uint16_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

constexpr int kBlockRows = 32;  // shared cache rows per block (even: keys go in pairs)

// Keys [j0, j1) as floats in pairs: pair p's chunk c (16 floats) is key j0+2p's values 8c..8c+7, then key
// j0+2p+1's (zeros past j1), so one vector carries two keys' lane accumulators.
template <int C, typename KV>
static inline void key_pairs(const KV* base, int j0, int j1, float* buf) {
  static const KV zeros[8 * C] = {};
  for (int j = j0; j < j1; j += 2) {
    const KV* a = base + static_cast<size_t>(j) * 8 * C;
    const KV* b = j + 1 < j1 ? a + 8 * C : zeros;
    float* dst = buf + static_cast<size_t>(j - j0) * 8 * C;
    for (int c = 0; c < C; ++c) _mm512_store_ps(dst + 16 * c, pair8(a + 8 * c, b + 8 * c));
  }
}

// 16 codes of a q8 block as floats times their scales: codes 8c..8c+7 of block a beside those of block b.
static inline __m512 q8_pair8(const KvQ8& a, const KvQ8& b, int c) {
  const __m128i q = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.q + 8 * c)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.q + 8 * c)));
  return _mm512_mul_ps(join(_mm256_set1_ps(a.scale), _mm256_set1_ps(b.scale)),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
}

template <int C>
static inline void key_pairs(const KvQ8* base, int j0, int j1, float* buf) {
  static const KvQ8 zeros[C / 4] = {};
  for (int j = j0; j < j1; j += 2) {
    const KvQ8* a = kv_row(base, j, 8 * C);
    const KvQ8* b = j + 1 < j1 ? kv_row(base, j + 1, 8 * C) : zeros;
    float* dst = buf + static_cast<size_t>(j - j0) * 8 * C;
    for (int c = 0; c < C; ++c) _mm512_store_ps(dst + 16 * c, q8_pair8(a[c / 4], b[c / 4], c % 4));
  }
}

// Values [j0, j1) as floats, row after row: a float cache's own rows in place, a half or q8 cache's converted.
template <int C>
static inline const float* value_rows(const float* base, int j0, int, float*) {
  return base + static_cast<size_t>(j0) * 8 * C;
}
template <int C>
static inline const float* value_rows(const uint16_t* base, int j0, int j1, float* buf) {
  const uint16_t* src = base + static_cast<size_t>(j0) * 8 * C;
  for (int i = 0; i < (j1 - j0) * C / 2; ++i) _mm512_store_ps(buf + 16 * i, ld16(src + 16 * i));
  return buf;
}
template <int C>
static inline const float* value_rows(const KvQ8* base, int j0, int j1, float* buf) {
  const KvQ8* src = kv_row(base, j0, 8 * C);
  for (int i = 0; i < (j1 - j0) * C / 4; ++i) {  // block i: 32 values, two vectors
    const __m512 scale = _mm512_set1_ps(src[i].scale);
    for (int h = 0; h < 2; ++h) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i].q + 16 * h));
      _mm512_store_ps(buf + 32 * i + 16 * h, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
    }
  }
  return buf;
}

// dot_c of q with the keys of `np` pairs (np <= 8) in hsum8's order: 2 * np scores.
template <int C>
static inline void pair_scores(const float* q, const float* pairs, int np, float* s) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  if (np == 8) {
    for (int c = 0; c < C; ++c) {
      const __m512 qc = twice(q + 8 * c);
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_ps(qc, _mm512_load_ps(pairs + (i * C + c) * 16), acc[i]);
    }
    __m256 h[8];
    for (int half = 0; half < 2; ++half) {
      for (int i = 0; i < 4; ++i) h[2 * i] = lower(acc[4 * half + i]), h[2 * i + 1] = upper(acc[4 * half + i]);
      _mm256_storeu_ps(s + 8 * half, hsum8x8(h));
    }
    return;
  }
  for (int c = 0; c < C; ++c) {
    const __m512 qc = twice(q + 8 * c);
    for (int i = 0; i < np; ++i) acc[i] = _mm512_fmadd_ps(qc, _mm512_load_ps(pairs + (i * C + c) * 16), acc[i]);
  }
  alignas(64) float lanes[16];
  for (int i = 0; i < np; ++i) {
    _mm512_store_ps(lanes, acc[i]);
    s[2 * i] = hsum8(lanes), s[2 * i + 1] = hsum8(lanes + 8);
  }
}

// o[c] += p * v over one value row of 16 * D floats: two queries sharing the row's loads, or one.
template <int D>
static inline void weigh2(__m512* o0, __m512* o1, float p0, float p1, const float* v) {
  const __m512 a = _mm512_set1_ps(p0), b = _mm512_set1_ps(p1);
  for (int c = 0; c < D; ++c) {
    const __m512 x = _mm512_loadu_ps(v + 16 * c);
    o0[c] = _mm512_fmadd_ps(a, x, o0[c]);
    o1[c] = _mm512_fmadd_ps(b, x, o1[c]);
  }
}

template <int D>
static inline void weigh1(__m512* o0, float p0, const float* v) {
  const __m512 a = _mm512_set1_ps(p0);
  for (int c = 0; c < D; ++c) o0[c] = _mm512_fmadd_ps(a, _mm512_loadu_ps(v + 16 * c), o0[c]);
}

template <int C, typename KV>
static void attend_many_fast(const float* const* q, int nq, const KV* kc, const KV* vc, int prefix,
                             const int* const* extra, const int* n_extra, float* scores, int lds,
                             float* const* out) {
  constexpr int d = 8 * C, D = C / 2;
  alignas(64) float buf[kBlockRows * d];  // a block of keys in pairs, or of values (converted where not floats)
  alignas(64) float row[d];             // one row of the window's own (row_floats)
  for (int j0 = 0; j0 < prefix; j0 += kBlockRows) {  // scores over the shared rows, keys in pairs
    const int j1 = j0 + kBlockRows < prefix ? j0 + kBlockRows : prefix;
    key_pairs<C>(kc, j0, j1, buf);
    const int pairs = (j1 - j0 + 1) / 2;
    for (int i = 0; i < nq; ++i) {
      float* s = scores + static_cast<size_t>(i) * lds + j0;
      int p = 0;
      for (; p + 8 <= pairs; p += 8) pair_scores<C>(q[i], buf + static_cast<size_t>(p) * 16 * C, 8, s + 2 * p);
      if (p < pairs) {
        alignas(64) float tail[16];  // the last pair's second score may lie past j1
        pair_scores<C>(q[i], buf + static_cast<size_t>(p) * 16 * C, pairs - p, tail);
        for (int j = 2 * p; j < j1 - j0; ++j) s[j] = tail[j - 2 * p];
      }
    }
  }
  alignas(32) float lanes[8];
  for (int i = 0; i < nq; ++i) {  // each query's own rows, its softmax, then its output zeroed
    float* s = scores + static_cast<size_t>(i) * lds;
    const int n = prefix + n_extra[i];
    for (int e = 0; e < n_extra[i]; ++e) s[prefix + e] = dot8<C>(q[i], row_floats<C>(kv_row(kc, extra[i][e], d), row));
    const float m = max_scores(s, n);
    const __m512 mv = _mm512_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
      _mm512_storeu_ps(s + j, e);
      sum = _mm256_add_ps(_mm256_add_ps(sum, lower(e)), upper(e));  // lanes l, then 8 + l: key order
    }
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), lower(mv)));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_store_ps(lanes, sum);
    for (; j < n; ++j) {
      s[j] = exp_c(s[j] - m);
      lanes[j % 8] = lanes[j % 8] + s[j];
    }
    s[n] = 1.0f / hsum8(lanes);  // the row's normalizer, kept past its scores (lds leaves room)
    for (int c = 0; c < D; ++c) _mm512_storeu_ps(out[i] + 16 * c, _mm512_setzero_ps());
  }
  for (int j0 = 0; j0 < prefix; j0 += kBlockRows) {  // the weighted sum over the shared rows, two queries at once
    const int j1 = j0 + kBlockRows < prefix ? j0 + kBlockRows : prefix;
    const float* vb = value_rows<C>(vc, j0, j1, buf);
    int i = 0;
    for (; i + 2 <= nq; i += 2) {
      const float* s0 = scores + static_cast<size_t>(i) * lds;
      const float* s1 = s0 + lds;
      __m512 o0[D], o1[D];
      for (int c = 0; c < D; ++c) o0[c] = _mm512_loadu_ps(out[i] + 16 * c), o1[c] = _mm512_loadu_ps(out[i + 1] + 16 * c);
      for (int j = j0; j < j1; ++j) weigh2<D>(o0, o1, s0[j], s1[j], vb + static_cast<size_t>(j - j0) * d);
      for (int c = 0; c < D; ++c) _mm512_storeu_ps(out[i] + 16 * c, o0[c]), _mm512_storeu_ps(out[i + 1] + 16 * c, o1[c]);
    }
    if (i < nq) {  // an odd last query
      const float* s0 = scores + static_cast<size_t>(i) * lds;
      __m512 o0[D];
      for (int c = 0; c < D; ++c) o0[c] = _mm512_loadu_ps(out[i] + 16 * c);
      for (int j = j0; j < j1; ++j) weigh1<D>(o0, s0[j], vb + static_cast<size_t>(j - j0) * d);
      for (int c = 0; c < D; ++c) _mm512_storeu_ps(out[i] + 16 * c, o0[c]);
    }
  }
  for (int i = 0; i < nq; ++i) {  // each query's own rows, then the normalizer
    const float* s = scores + static_cast<size_t>(i) * lds;
    __m512 o[D];
    for (int c = 0; c < D; ++c) o[c] = _mm512_loadu_ps(out[i] + 16 * c);
    for (int e = 0; e < n_extra[i]; ++e) {
      const float* v = row_floats<C>(kv_row(vc, extra[i][e], d), row);
      const __m512 p = _mm512_set1_ps(s[prefix + e]);
      for (int c = 0; c < D; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), o[c]);
    }
    const __m512 inv = _mm512_set1_ps(s[prefix + n_extra[i]]);
    for (int c = 0; c < D; ++c) _mm512_storeu_ps(out[i] + 16 * c, _mm512_mul_ps(o[c], inv));
  }
}

}  // namespace avx512

Ops avx512_ops() {
  Ops ops = avx2_ops();
  ops.attend_many = avx512::attend_many_x86;
  return ops;
}

}  // namespace spn

#pragma GCC pop_options

#else
namespace spn {
Ops avx512_ops() { return reference_ops(); }
}  // namespace spn
#endif
