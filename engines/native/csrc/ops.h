// The decoder's per-row operations as a table, one per instruction set; every table computes the same values
// (ops.inc). The W4A8 products are separate (w4a8.h).
#pragma once
#include "w4a8.h"

namespace spn {

struct Ops {
  void (*rmsnorm_row)(const float* x, int H, const float* w, float eps, float* out);
  void (*quantize_row)(const float* x, int K, QAct& a, int row);
  void (*rope_row)(float* x, int heads, int d, const float* cs, const float* sn);
  void (*attend)(const float* q, const float* kc, const float* vc, int d, int prefix, const int* extra,
                 int n_extra, float* scores, float* out);
  void (*silu_mul_row)(const float* gu, int I, float* out);
  void (*add_row)(float* x, const float* y, int H);
};

Ops reference_ops();
Ops avx2_ops();  // x86 only; callers check isa_supported(kAvx2) first

}  // namespace spn
