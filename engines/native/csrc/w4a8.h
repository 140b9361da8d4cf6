// Block-quantized weights applied to int8 activations (one fp32 scale per 32 inputs of a row). A weight
// block is 32 inputs of one column, in one of six formats (GGUF's blocks carried as they are):
//   kQ4     int4, w = d·(q - 8)      (Q4_0; also specrt's own symmetric int4 and ONNX MatMulNBits)
//   kQ4Min  int4, w = d·q + m        (Q4_1, and Q4_K's sub-blocks: d = d·scale_j, m = -dmin·min_j)
//   kQ8     int8, w = d·q            (Q8_0)
//   kQ8x16  int8, w = d_lo·q on inputs 0..15, d_hi·q on 16..31 (Q6_K's 16-input sub-blocks, q - 32)
//   kQ8Min  int8, w = d·q + m        (Q5_1, and Q5_K's sub-blocks: 5-bit codes, d = d·scale_j, m = -dmin·min_j)
//   kQ8x16Min  int8, w = d_lo·q + m_lo on inputs 0..15, d_hi·q + m_hi on 16..31 (a projection fused from rows of
//           different types, e.g. Q4_K q|k with a Q6_K v: each type's blocks are these blocks exactly)
//
// Batch invariance by construction: every output y[r][n] is, per format,
//   kQ4     acc = fma(float(isum_b - 8 * asum_b), ws * as, acc)
//   kQ4Min  acc = fma(float(isum_b), ws * as, acc);  acc = fma(wm, as * float(asum_b), acc)
//   kQ8     acc = fma(float(isum_b), ws * as, acc)
//   kQ8x16  acc = fma(float(isum_lo_b), ws * as, acc);  acc = fma(float(isum_hi_b), wh * as, acc)
//   kQ8Min  as kQ4Min
//   kQ8x16Min  kQ8x16's two steps, then acc = fma(wm_lo, as * float(asum_lo_b), acc);
//              acc = fma(wm_hi, as * float(asum_b - asum_lo_b), acc)
// over the blocks b in ascending order from acc = 0, where ws / wm / wh are the weights' scale / minimum / upper
// half's scale of column n and block b, as = as[r][b], isum_b = the block's sum of q_w * q_a (exact in int32;
// isum_lo_b / isum_hi_b over its inputs 0..15 / 16..31) and asum_b the block's sum of q_a. Only integers are
// summed inside a block (or half block), so the order any kernel sums them in is
// irrelevant; across blocks every kernel (scalar, AVX2, AVX-512 VNNI) runs that one float sequence. A row's
// result therefore depends on its own activations only, never on how many rows share the call, and it is
// bitwise the same on every kernel branch.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace spn {

constexpr int kBlock = 32;     // inputs per scale
constexpr int kTileN = 16;     // columns per packed tile (one 512-bit register of int32 lanes)
constexpr int kTileBytes = kBlock * kTileN / 2;  // packed bytes of one int4 block of one tile: 256
constexpr int kTileBytes8 = kBlock * kTileN;     // ... of one int8 block: 512

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2, kAmx = 3, kIsaCount = 4 };
enum Format : int { kQ4 = 0, kQ4Min = 1, kQ8 = 2, kQ8x16 = 3, kQ8Min = 4, kQ8x16Min = 5, kFormatCount = 6 };

constexpr bool is_int8(int format) { return format != kQ4 && format != kQ4Min; }
constexpr bool has_halves(int format) { return format == kQ8x16 || format == kQ8x16Min; }  // two scales a block
constexpr bool has_mins(int format) { return format == kQ4Min || format == kQ8Min || format == kQ8x16Min; }
constexpr int tile_bytes(int format) { return is_int8(format) ? kTileBytes8 : kTileBytes; }

// Packed weights of a [K, N] matrix. Tile t (columns 16t..16t+15), block b: 4 chunks of 64 bytes; chunk c
// holds input groups g = 2c (low nibbles) and 2c+1 (high nibbles), byte 4*col + j = input 32b + 4g + j of
// column col. That is the lane order of vpdpbusd (a dword per column, 4 consecutive inputs per dword) and of
// vpmaddubsw + vpmaddwd on two 8-column halves. kQ8, kQ8x16, kQ8Min: 8 chunks of 64 bytes, chunk g holding input group
// g, byte 4*col + j = q + 128 (unsigned) of input 32b + 4g + j of column col (kQ8x16: groups 0..3 are the lower
// half block, 4..7 the upper).
struct QWeight {
  int K = 0, N = 0, blocks = 0, tiles = 0;
  int format = kQ4;
  uint8_t* packed = nullptr;  // tiles * blocks * tile_bytes(format) bytes, 64-byte aligned
  float* scales = nullptr;    // tiles * blocks * 16: scale of column 16t+i, block b at [(t*blocks+b)*16+i]
  float* mins = nullptr;      // kQ4Min, kQ8Min, kQ8x16Min (its inputs 0..15): the minimums, laid out as `scales`
  float* hi_scales = nullptr; // kQ8x16, kQ8x16Min: the scales of the blocks' inputs 16..31, laid out as `scales`
  float* hi_mins = nullptr;   // kQ8x16Min: the minimums of the blocks' inputs 16..31, laid out as `scales`
  float* bias = nullptr;      // N or null
  // The scales / minimums as IEEE halves instead (then `scales` / `mins` are null): where every one of a matrix's
  // is a half exactly, as the GGUF blocks' d and m are, its load keeps them so (OwnedWeight::load). A half
  // widens to the same float, so the products are bitwise the same; a pass streams 2 bytes a factor, not 4.
  uint16_t* half_scales = nullptr;
  uint16_t* half_mins = nullptr;
  // The weights stream from memory once a pass (a decoder's, tens of MB): the kernels prefetch them
  // non-temporal, so they do not evict from the caches what stays there between passes (a drafter layer's
  // weights, read every step; the KV cache). A hint only: no result depends on it.
  bool stream = false;
};

// IEEE binary16 to float, exactly (the scalar kernels' widening; vcvtph2ps gives the same).
inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: man * 2^-24, normalized
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400u));
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A float's bits as an IEEE half when the half holds it exactly (a finite value; -0 kept), else kNotHalf.
constexpr uint32_t kNotHalf = 0x10000u;
inline uint32_t float_to_half_exact(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  const int e = static_cast<int>(ax >> 23) - 127;
  if (ax == 0) return sign;
  if (ax >= 0x7f800000u || e > 15 || e < -24) return kNotHalf;  // infinite, NaN, or out of the halves' range
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;  // 24 significant bits
  const int drop = e >= -14 ? 13 : 13 + (-14 - e);  // a normal half keeps 11 of them, a subnormal fewer
  if (m & ((1u << drop) - 1u)) return kNotHalf;
  return e >= -14 ? sign | (static_cast<uint32_t>(e + 15) << 10) | ((m >> 13) & 0x3ffu) : sign | (m >> drop);
}

// Factor i of a scale or minimum array kept as floats (f) or as halves (h, when not null).
inline float factor_at(const float* f, const uint16_t* h, size_t i) { return h ? half_to_float(h[i]) : f[i]; }

// Activations of M rows quantized per row per block: q in [-127, 127], scale = absmax / 127.
struct QAct {
  int M = 0, blocks = 0;
  int8_t* q = nullptr;        // M * blocks * 32
  float* scale = nullptr;     // M * blocks
  int32_t* corr = nullptr;    // M * blocks: 8 * sum of the block's q (the weights' zero point)
  int32_t* lo_sum = nullptr;  // M * blocks: sum of the block's q over inputs 0..15 (kQ8x16's lower half)
  float* qsum = nullptr;      // M * blocks: scale * float(sum of the block's q) (the minimums' term)
};

// Columns of tiles [t0, t1) of y[M, ldy] = A · W (+ bias), on kernel `isa`.
void gemm(Isa isa, const QWeight& w, const QAct& a, float* y, int ldy, int t0, int t1);
bool isa_supported(Isa isa);

}  // namespace spn
