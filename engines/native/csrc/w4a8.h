// W4A8 matrix product: int4 weights (symmetric, zero point 8, one fp32 scale per 32 inputs of a column)
// applied to int8 activations (one fp32 scale per 32 inputs of a row).
//
// Batch invariance by construction: every output y[r][n] is
//     acc = 0;  for b in blocks (ascending):  acc = fma(float(isum_b - 8 * asum_b), ws[n][b] * as[r][b], acc)
// where isum_b = sum over the block of q_w * q_a (unsigned nibble times signed byte, exact in int32) and asum_b
// the block's sum of q_a. Only integers are summed inside a block, so the order any kernel sums them in is
// irrelevant; across blocks every kernel (scalar, AVX2, AVX-512 VNNI) runs that one float sequence. A row's
// result therefore depends on its own activations only, never on how many rows share the call, and it is
// bitwise the same on every kernel branch.
#pragma once
#include <cstddef>
#include <cstdint>

namespace spn {

constexpr int kBlock = 32;     // inputs per scale
constexpr int kTileN = 16;     // columns per packed tile (one 512-bit register of int32 lanes)
constexpr int kTileBytes = kBlock * kTileN / 2;  // packed bytes of one block of one tile: 256
constexpr int kRowTile = 8;    // rows that share one unpacked weight block

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2, kIsaCount = 3 };

// Packed weights of a [K, N] matrix. Tile t (columns 16t..16t+15), block b: 4 chunks of 64 bytes; chunk c
// holds input groups g = 2c (low nibbles) and 2c+1 (high nibbles), byte 4*col + j = input 32b + 4g + j of
// column col. That is the lane order of vpdpbusd (a dword per column, 4 consecutive inputs per dword) and of
// vpmaddubsw + vpmaddwd on two 8-column halves.
struct QWeight {
  int K = 0, N = 0, blocks = 0, tiles = 0;
  uint8_t* packed = nullptr;  // tiles * blocks * 256 bytes, 64-byte aligned
  float* scales = nullptr;    // tiles * blocks * 16: scale of column 16t+i, block b at [(t*blocks+b)*16+i]
  float* bias = nullptr;      // N or null
};

// Activations of M rows quantized per row per block: q in [-127, 127], scale = absmax / 127.
struct QAct {
  int M = 0, blocks = 0;
  int8_t* q = nullptr;        // M * blocks * 32
  float* scale = nullptr;     // M * blocks
  int32_t* corr = nullptr;    // M * blocks: 8 * sum of the block's q (the weights' zero point)
};

// Columns of tiles [t0, t1) of y[M, ldy] = A · W (+ bias), on kernel `isa`.
void gemm(Isa isa, const QWeight& w, const QAct& a, float* y, int ldy, int t0, int t1);
bool isa_supported(Isa isa);

}  // namespace spn
