// The decoder's per-row operations as a table, one per instruction set; every table computes the same values
// (ops.inc). The W4A8 products are separate (w4a8.h).
#pragma once
#include "w4a8.h"

namespace spn {

// How a KV cache holds a row of d keys or values: floats, IEEE halves (written rounded to nearest even, read
// exactly), or q8 blocks (d a multiple of 32; each value is its block's scale times its code, one float
// product, so reading is exact and every table reads the same floats).
enum KvFormat : int { kKvF32 = 0, kKvF16 = 1, kKvQ8 = 2, kKvFormatCount = 3 };
struct KvQ8 {
  float scale;  // the block's absmax / 127 (0 for a block of zeros)
  int8_t q[32];
};
// A row's size in its format's units (floats, halves or bytes), and a unit's bytes.
inline int kv_row_units(int format, int d) { return format == kKvQ8 ? d / 32 * static_cast<int>(sizeof(KvQ8)) : d; }
inline int kv_unit_bytes(int format) { return format == kKvF32 ? 4 : format == kKvF16 ? 2 : 1; }

struct Ops {
  void (*rmsnorm_row)(const float* x, int H, const float* w, float eps, float* out);
  void (*quantize_row)(const float* x, int K, QAct& a, int row);
  void (*rope_row)(float* x, int heads, int d, const float* cs, const float* sn);
  // Attention of `nq` queries that share one key/value head (a GQA group's query heads, over every row of a
  // window): query i computes exactly ops.inc's attend(q[i], ..., extra[i], n_extra[i], scores + i * ld_scores,
  // out[i]); a table may read each shared cache row once for all of them. The cache's rows are in KvFormat
  // `format` (each value read as the float it stands for)
  void (*attend_many)(const float* const* q, int nq, const void* kc, const void* vc, int format, int d, int prefix,
                      const int* const* extra, const int* n_extra, float* scores, int ld_scores, float* const* out);
  // out[i] = x[i] rounded to the nearest IEEE half (ties to even; what F16C's vcvtps2ph computes)
  void (*to_half)(const float* x, uint16_t* out, int n);
  // d values (a multiple of 32) as q8 blocks: ops.inc's to_q8
  void (*to_q8)(const float* x, KvQ8* out, int d);
  void (*silu_mul_row)(const float* gu, int I, float* out);
  void (*add_row)(float* x, const float* y, int H);
};

Ops reference_ops();
Ops avx2_ops();    // x86 only; callers check isa_supported(kAvx2) first
Ops avx512_ops();  // x86 only; callers check isa_supported(kAvx512Vnni) first

}  // namespace spn
