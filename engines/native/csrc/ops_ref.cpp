// The per-row operations for any CPU: the reference every other table equals bitwise.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace spn {
namespace ref {
#include "ops.inc"
}  // namespace ref

Ops reference_ops() {
  return Ops{ref::rmsnorm_row, ref::quantize_row, ref::rope_row, ref::attend_many, ref::to_half, ref::to_q8,
             ref::silu_mul_row, ref::add_row};
}

}  // namespace spn
