// specrt's native decoder pass: a Llama-family decoder (RMSNorm, fused q|k|v and gate|up projections, RoPE,
// grouped-query tree attention over an in-place KV cache, SiLU MLP, tied or separate LM head) run over any
// number of rows of any number of sequences in one call, every row computed by the same per-row arithmetic:
// W4A8 products (w4a8.h), per-row element-wise operations and per-row attention (ops.inc). A C API for ctypes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "arena.h"
#include "ops.h"
#include "pool.h"
#include "w4a8.h"

namespace spn {

// Each kernel's table of per-row operations (every table computes the reference's values): the avx512vnni and
// amx kernels need AVX-512 F/VL/BW, so they take its attention.
static Ops ops_for(Isa isa) {
  static Ops (*const tables[kIsaCount])() = {reference_ops, avx2_ops, avx512_ops, avx512_ops};
  return tables[isa]();
}

static thread_local std::string g_error;

std::shared_ptr<Pool> shared_pool(int threads) {
  static std::mutex mu;
  static std::map<int, std::weak_ptr<Pool>> pools;
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<Pool>& slot = pools[threads];
  std::shared_ptr<Pool> pool = slot.lock();
  if (!pool) {
    pool = std::make_shared<Pool>(threads);
    slot = pool;
  }
  return pool;
}
constexpr int kMaxThreads = 1024;  // more is a mistake, not a machine

static void* aligned(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64) != 0) throw std::bad_alloc();
  return p;
}

// A projection's packed weights and factors, in an arena (arena.h): the model's, or one of its own (a product made
// alone, spn_linear_new). Its arrays live as long as that arena.
// Whether a decoder's weights (and a product alone's) are prefetched non-temporal (QWeight::stream), read when
// they are loaded: yes unless SPECRT_NATIVE_STREAM=0 (a benchmark's comparison, the suite's bitwise check). A
// drafter layer's weights never are: they are read again next step.
static bool stream_weights() {
  const char* env = std::getenv("SPECRT_NATIVE_STREAM");
  return !(env && std::strcmp(env, "0") == 0);
}

struct OwnedWeight : QWeight {
  OwnedWeight() = default;
  OwnedWeight(const OwnedWeight&) = delete;
  OwnedWeight& operator=(const OwnedWeight&) = delete;
  Arena* arena = nullptr;  // the model's (spn_set_linear sets it), else own_arena, made on the first take
  std::unique_ptr<Arena> own_arena;

  void* take(size_t bytes) {
    if (!arena) {
      own_arena = std::make_unique<Arena>();
      arena = own_arena.get();
    }
    return arena->take(bytes);
  }
  void release() {
    packed = nullptr, scales = nullptr, mins = nullptr, hi_scales = nullptr, hi_mins = nullptr, bias = nullptr;
    half_scales = nullptr, half_mins = nullptr;
  }
  // Factors worked out in `work` (n floats) into the arena: as halves in `h` when every value is a half exactly
  // (the GGUF blocks' d and m are: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1) and `halves` allows it, else as floats in `f`.
  // SPECRT_NATIVE_HALF_FACTORS=0 keeps floats always.
  void settle(const float* work, size_t n, bool halves, float*& f, uint16_t*& h) {
    if (!work) return;
    const char* env = std::getenv("SPECRT_NATIVE_HALF_FACTORS");
    bool as_halves = halves && !(env && std::strcmp(env, "0") == 0);
    for (size_t i = 0; as_halves && i < n; ++i) as_halves = float_to_half_exact(work[i]) != kNotHalf;
    if (as_halves) {
      h = static_cast<uint16_t*>(take(n * sizeof(uint16_t)));
      for (size_t i = 0; i < n; ++i) h[i] = static_cast<uint16_t>(float_to_half_exact(work[i]));
    } else {
      f = static_cast<float*>(take(n * sizeof(float)));
      std::memcpy(f, work, n * sizeof(float));
    }
  }
  // From the blocks of each column (weight_ok's layout): int4, q [N][blocks][16] (input 2i in the low nibble
  // of byte i); int8, q [N][blocks][32] (two's complement). scales and mins [N][blocks] (kQ8x16: scales
  // [N][blocks][2], the lower and upper half's; kQ8x16Min: scales and mins so). Columns past N pad the last
  // tile with zero scales and minimums.
  void load(int fmt, int k, int n, const uint8_t* q, const float* s, const float* mn, const float* b) {
    release();
    format = fmt, K = k, N = n, blocks = (k + kBlock - 1) / kBlock, tiles = (n + kTileN - 1) / kTileN;
    const int tb = tile_bytes(fmt), src_bytes = is_int8(fmt) ? kBlock : kBlock / 2;
    const size_t nbytes = static_cast<size_t>(tiles) * blocks * tb, nscales = static_cast<size_t>(tiles) * blocks * kTileN;
    packed = static_cast<uint8_t*>(take(nbytes));
    std::memset(packed, is_int8(fmt) ? 0x80 : 0x88, nbytes);
    // the factors, worked out in arrays of their own first (settle() keeps them as halves or floats)
    struct Work {
      float* p = nullptr;
      ~Work() { free(p); }
      void make(bool has, size_t n) {
        if (!has) return;
        p = static_cast<float*>(aligned(n * sizeof(float)));
        std::memset(p, 0, n * sizeof(float));
      }
    } sc, mi, hs, hm;
    sc.make(true, nscales), mi.make(has_mins(fmt), nscales), hs.make(has_halves(fmt), nscales);
    hm.make(fmt == kQ8x16Min, nscales);
    for (int col = 0; col < n; ++col) {
      int t = col / kTileN, c = col % kTileN;
      for (int blk = 0; blk < blocks; ++blk) {
        const uint8_t* src = q + (static_cast<size_t>(col) * blocks + blk) * src_bytes;
        uint8_t* dst = packed + (static_cast<size_t>(t) * blocks + blk) * tb;
        // each destination byte written once (packing ~3x faster than setting nibbles one at a time)
        if (is_int8(fmt)) {
          for (int g = 0; g < kBlock / 4; ++g)
            for (int j = 0; j < 4; ++j) dst[g * 64 + c * 4 + j] = static_cast<uint8_t>(src[4 * g + j] ^ 0x80);  // q + 128
        } else {
          // byte (g2, j) of column c: input 8·g2 + j (group 2·g2) in its low nibble, input 8·g2 + 4 + j (group
          // 2·g2 + 1) in its high one; the source holds input 2i in the low nibble of byte i
          for (int g2 = 0; g2 < kBlock / 8; ++g2)
            for (int j = 0; j < 4; ++j) {
              const int k0 = 8 * g2 + j, k1 = k0 + 4;
              const int lo = (src[k0 / 2] >> (4 * (k0 % 2))) & 15, hi = (src[k1 / 2] >> (4 * (k1 % 2))) & 15;
              dst[g2 * 64 + c * 4 + j] = static_cast<uint8_t>(lo | (hi << 4));
            }
        }
        const size_t from = static_cast<size_t>(col) * blocks + blk, to = (static_cast<size_t>(t) * blocks + blk) * kTileN + c;
        if (has_halves(fmt)) {
          sc.p[to] = s[2 * from], hs.p[to] = s[2 * from + 1];
        } else {
          sc.p[to] = s[from];
        }
        if (hm.p) {
          mi.p[to] = mn[2 * from], hm.p[to] = mn[2 * from + 1];
        } else if (mi.p) {
          mi.p[to] = mn[from];
        }
      }
    }
    settle(sc.p, nscales, !has_halves(fmt), scales, half_scales), settle(mi.p, nscales, !has_halves(fmt), mins, half_mins);
    uint16_t* none = nullptr;  // the half-block formats keep their upper halves' factors as floats
    settle(hs.p, nscales, false, hi_scales, none), settle(hm.p, nscales, false, hi_mins, none);
    if (b) {
      bias = static_cast<float*>(take(n * sizeof(float)));
      std::memcpy(bias, b, n * sizeof(float));
    }
  }
};

struct ActBuffer : QAct {
  size_t cap = 0;
  ~ActBuffer() {
    free(q);
    free(scale);
    free(corr);
    free(lo_sum);
    free(qsum);
  }
  void reserve(int m, int k) {
    M = m, blocks = (k + kBlock - 1) / kBlock;
    size_t need = static_cast<size_t>(m) * blocks;
    if (need <= cap) return;
    free(q), free(scale), free(corr), free(lo_sum), free(qsum);
    q = static_cast<int8_t*>(aligned(need * kBlock));
    scale = static_cast<float*>(aligned(need * sizeof(float)));
    corr = static_cast<int32_t*>(aligned(need * sizeof(int32_t)));
    lo_sum = static_cast<int32_t*>(aligned(need * sizeof(int32_t)));
    qsum = static_cast<float*>(aligned(need * sizeof(float)));
    cap = need;
  }
};

struct Layer {
  std::vector<float> ln1, ln2;
  OwnedWeight qkv, o, gate_up, down;
};

// How a drafter layer (spn_feature_pass) mixes a row's token and feature before its attention:
//   kConcat   EAGLE-3: q|k|v read concat(norm(embed), norm(feature)) (2H wide); the residual is the feature
//   kProject  EAGLE-1/2 and MTP: x = P·concat([norm](embed), [norm](feature)) (+ bias), the residual; q|k|v
//             read [input norm](x). The bracketed norms are optional (EAGLE-1 has none, MTP all three).
enum Mix { kNoMix = 0, kConcat = 1, kProject = 2, kMixCount = 3 };

struct Model {
  std::unique_ptr<Arena> arena;  // its weights' memory (declared first: freed after every weight that points into it)
  int L = 0, H = 0, nh = 0, kvh = 0, d = 0, I = 0, V = 0;
  int mix = kNoMix;      // a decoder (spn_pass), or a drafter layer's Mix
  bool feature = false;  // a drafter layer (mix != kNoMix)
  int kv_format = kKvF32;  // how the KV cache holds its rows (ops.h KvFormat; spn_set_kv_format)
  float eps = 0, embed_scale = 1;
  Isa isa = kScalar;
  int threads = 1;
  std::vector<float> embed, final_norm, cos_tab, sin_tab;
  const float* embed_rows = nullptr;  // `embed`, or a table the caller owns (spn_use_embed)
  // or a table of int8 blocks the caller owns (spn_use_embed_blocks): codes q + 128 [V][H], a scale per
  // `embed_block` inputs [V][H / embed_block]; a row is dequantized when it is looked up
  const uint8_t* embed_codes = nullptr;
  const float* embed_scales = nullptr;
  int embed_block = 0;
  std::vector<float> hidden_norm;  // a feature layer's norm of its feature input (spn_set_norm which 3)
  std::vector<float> embed_norm;   // a kProject layer's norm of its embedding row (spn_set_norm which 4)
  int rope_rows = 0;
  std::vector<Layer> layers;
  OwnedWeight head;
  OwnedWeight fuse;  // a feature layer's fuse fc: the target's tapped rows [n·H] -> its features [H] (optional)
  OwnedWeight mix_proj;  // a kProject layer's P [2H -> H]
  std::vector<int> taps;
  // scratch, grown to the largest pass seen
  std::vector<float> x, h, mixed, fused, qkv, attn, gu, act, rows, scores;
  std::vector<int> extra, extra_n, att_n;
  std::vector<const float*> att_q;
  std::vector<float*> att_out;
  std::vector<const int*> att_extra;
  ActBuffer qa;
  std::shared_ptr<Pool> pool;  // shared_pool(threads): the process's one pool of that size
};

// How many chunks each thread's share of a phase is cut into (Phases::each): a few, so a thread that is late
// leaves most of its share to the others, and few enough that handing them out costs nothing next to them.
constexpr int kRowChunks = 2, kTileChunks = 4;

// Row `id` of the embedding table into out[H]: a float table's row, or a block table's row dequantized.
static void embed_row(const Model& m, int id, float* out) {
  if (m.embed_codes == nullptr) {
    std::memcpy(out, m.embed_rows + static_cast<size_t>(id) * m.H, m.H * sizeof(float));
    return;
  }
  const uint8_t* q = m.embed_codes + static_cast<size_t>(id) * m.H;
  const float* s = m.embed_scales + static_cast<size_t>(id) * (m.H / m.embed_block);
  for (int i = 0; i < m.H; ++i) out[i] = static_cast<float>(static_cast<int>(q[i]) - 128) * s[i / m.embed_block];
}

static void linear(Model& m, const QWeight& w, const float* x, int M, int ldx, float* y, Phases& ph,
                   const Ops& ops) {
  QAct a = m.qa;  // the buffer, viewed as M rows of this product's blocks
  a.M = M;
  a.blocks = w.blocks;
  ph.each(M, kRowChunks, [&](int lo, int hi) {
    for (int r = lo; r < hi; ++r) ops.quantize_row(x + static_cast<size_t>(r) * ldx, w.K, a, r);
  });
  ph.each(w.tiles, kTileChunks, [&](int lo, int hi) { gemm(m.isa, w, a, y, w.N, lo, hi); });
}

// Where each sequence's rows sit in a pass: sequence b's rows are [start[b], start[b+1]) of the M rows
// (T_b = start[b+1] - start[b], 0 for a slot in the range with nothing to run), its logits rows
// [rstart[b], rstart[b+1]) of the Rt, its tree mask T_b x T_b at mask + mstart[b]. A padded pass (spn_pass)
// is the layout where every T_b = T and every sequence asks for R rows.
struct Layout {
  std::vector<int> start, rstart, seq, rseq;
  std::vector<size_t> mstart;
  int M = 0, Rt = 0, maxT = 0;

  // T[b] rows and R[b] logits rows of each of B sequences; false (and g_error) when they do not add up.
  bool set(int B, const int64_t* T, const int64_t* R);
};

struct PassArgs {
  int B, T;
  const int64_t* ids;
  const int64_t* pos;
  const int64_t* past;
  const uint8_t* mask;
  int R;
  const int64_t* logits_index;
  void* const* kv;  // per layer, key then value, rows in the model's kv_format
  int64_t slot_stride;
  int cap;
  float* logits;
  float* hidden;
  float* aux;
  const float* hidden_in;  // a feature layer's feature input [B·T, H] (spn_feature_pass); null for a decoder
  const float* aux_in;     // … or the target's tapped rows [B·T, fuse.K], fused into it first; null otherwise
  const Layout* lay;       // the rows of each sequence (T and R above: the longest window, the most logits rows)
};

// Scratch for a pass of these arguments, grown to the largest pass seen.
static void reserve(Model& m, const PassArgs& p, int max_k) {
  const Layout& lay = *p.lay;
  const int M = lay.M, H = m.H, nq = m.nh * m.d, nqkv = (m.nh + 2 * m.kvh) * m.d;
  m.x.resize(static_cast<size_t>(M) * H);
  m.h.resize(static_cast<size_t>(M) * H);
  m.qkv.resize(static_cast<size_t>(M) * nqkv);
  m.attn.resize(static_cast<size_t>(M) * nq);
  m.gu.resize(static_cast<size_t>(M) * 2 * m.I);
  m.act.resize(static_cast<size_t>(M) * m.I);
  m.rows.resize(static_cast<size_t>(lay.Rt) * H);
  int max_past = 0;
  for (int b = 0; b < p.B; ++b) max_past = p.past[b] > max_past ? static_cast<int>(p.past[b]) : max_past;
  // attention scratch per thread: a part of a group holds at most T * (nh / kvh) queries
  const size_t q_slots = static_cast<size_t>(m.threads) * p.T * (m.nh / m.kvh);
  m.scores.resize(q_slots * (max_past + p.T + 1));
  m.att_q.resize(q_slots);
  m.att_out.resize(q_slots);
  m.att_extra.resize(q_slots);
  m.att_n.resize(q_slots);
  m.extra.resize(static_cast<size_t>(m.threads) * p.T * p.T);
  m.extra_n.resize(static_cast<size_t>(m.threads) * p.T);
  m.qa.reserve(M > lay.Rt ? M : lay.Rt, max_k);
}

// Layer l after its input norm: q|k|v from `in` (M rows, K = the projection's, `ldin` apart), rotary, the new
// keys and values into the cache, tree attention, the output projection added to the residual m.x, then the
// post-attention norm, the MLP and its residual. Called by every thread of the pool, through the same phases.
static void attention_mlp(Model& m, int l, const PassArgs& p, const float* in, int ldin, Phases& ph, const Ops& ops) {
  const int tid = ph.tid(), nt = ph.threads();
  const Layout& lay = *p.lay;
  const int M = lay.M, H = m.H, d = m.d, nq = m.nh * d, nqkv = (m.nh + 2 * m.kvh) * d;
  const int groups = m.nh / m.kvh;
  int max_past = 0;
  for (int b = 0; b < p.B; ++b) max_past = p.past[b] > max_past ? static_cast<int>(p.past[b]) : max_past;
  Layer& layer = m.layers[l];
  linear(m, layer.qkv, in, M, ldin, m.qkv.data(), ph, ops);
  // the cache of layer l: rows of `units` in m.kv_format (floats, halves or bytes); offsets count units
  char* const kc = static_cast<char*>(p.kv[2 * l]);
  char* const vc = static_cast<char*>(p.kv[2 * l + 1]);
  const size_t vsize = kv_unit_bytes(m.kv_format), units = kv_row_units(m.kv_format, d);
  ph.each(M, kRowChunks, [&](int lo, int hi) {
    for (int r = lo; r < hi; ++r) {  // rotary on q and k, then k and v into the cache
      const int b = lay.seq[r], t = r - lay.start[b];
      float* row = m.qkv.data() + static_cast<size_t>(r) * nqkv;
      const int64_t at = p.pos[r];
      ops.rope_row(row, m.nh + m.kvh, d, m.cos_tab.data() + at * (d / 2), m.sin_tab.data() + at * (d / 2));
      const int64_t dst = p.past[b] + t;
      for (int kh = 0; kh < m.kvh; ++kh) {
        const size_t off =
            (static_cast<size_t>(b) * p.slot_stride + (static_cast<size_t>(kh) * p.cap + dst) * units) * vsize;
        const float *k = row + nq + kh * d, *v = row + nq + (m.kvh + kh) * d;
        switch (m.kv_format) {
          case kKvF16:
            ops.to_half(k, reinterpret_cast<uint16_t*>(kc + off), d);
            ops.to_half(v, reinterpret_cast<uint16_t*>(vc + off), d);
            break;
          case kKvQ8:
            ops.to_q8(k, reinterpret_cast<KvQ8*>(kc + off), d);
            ops.to_q8(v, reinterpret_cast<KvQ8*>(vc + off), d);
            break;
          default:
            std::memcpy(kc + off, k, d * sizeof(float));
            std::memcpy(vc + off, v, d * sizeof(float));
        }
      }
    }
  });
  {  // attention: each sequence's key/value heads, the queries sharing one (its group's heads over every row of
     // the window) read its cache rows together; a group is split in parts where there are fewer groups than
     // twice the threads, so one-row passes still keep every thread busy. A query computes the same values
     // whichever part it is in (Ops::attend_many).
    const int max_group = p.T * groups, n_groups = p.B * m.kvh;
    const int parts = n_groups >= 2 * nt ? 1 : (2 * nt + n_groups - 1) / n_groups;
    const int lds = max_past + p.T + 1;
    const size_t base = static_cast<size_t>(tid) * max_group;
    float* scores = m.scores.data() + base * lds;
    const float** qs = m.att_q.data() + base;
    float** outs = m.att_out.data() + base;
    const int** extras = m.att_extra.data() + base;
    int* n_extra = m.att_n.data() + base;
    int* rows_extra = m.extra.data() + static_cast<size_t>(tid) * p.T * p.T;  // row t's window rows: t * T..
    int* rows_n = m.extra_n.data() + static_cast<size_t>(tid) * p.T;
    int last_b = -1;  // the sequence whose rows rows_extra holds
    ph.each(n_groups * parts, kTileChunks, [&](int ulo, int uhi) {
      for (int unit = ulo; unit < uhi; ++unit) {
        const int g = unit / parts, part = unit % parts, b = g / m.kvh, kh = g % m.kvh;
        const int Tb = lay.start[b + 1] - lay.start[b], per_group = Tb * groups;
        if (Tb == 0) continue;  // a slot in the range with no rows this pass
        const int prefix = static_cast<int>(p.past[b]);
        if (b != last_b) {  // each row's visible window rows (a tree row's ancestors), ascending
          for (int t = 0; t < Tb; ++t) {
            const uint8_t* mrow = p.mask + lay.mstart[b] + static_cast<size_t>(t) * Tb;
            int n = 0;
            for (int u = 0; u < Tb; ++u)
              if (mrow[u]) rows_extra[t * p.T + n++] = prefix + u;
            rows_n[t] = n;
          }
          last_b = b;
        }
        const int qlo = static_cast<int>(static_cast<long long>(per_group) * part / parts);
        const int qhi = static_cast<int>(static_cast<long long>(per_group) * (part + 1) / parts);
        for (int i = qlo; i < qhi; ++i) {
          const int t = i / groups, qh = kh * groups + i % groups, r = lay.start[b] + t;
          qs[i - qlo] = m.qkv.data() + static_cast<size_t>(r) * nqkv + qh * d;
          outs[i - qlo] = m.attn.data() + static_cast<size_t>(r) * nq + qh * d;
          extras[i - qlo] = rows_extra + t * p.T;
          n_extra[i - qlo] = rows_n[t];
        }
        const size_t off =
            (static_cast<size_t>(b) * p.slot_stride + static_cast<size_t>(kh) * p.cap * units) * vsize;
        ops.attend_many(qs, qhi - qlo, kc + off, vc + off, m.kv_format, d, prefix, extras, n_extra, scores, lds, outs);
      }
    });
  }
  linear(m, layer.o, m.attn.data(), M, nq, m.h.data(), ph, ops);
  ph.each(M, kRowChunks, [&](int lo, int hi) {
    for (int r = lo; r < hi; ++r) {
      float* xr = m.x.data() + static_cast<size_t>(r) * H;
      ops.add_row(xr, m.h.data() + static_cast<size_t>(r) * H, H);
      ops.rmsnorm_row(xr, H, layer.ln2.data(), m.eps, m.h.data() + static_cast<size_t>(r) * H);
    }
  });
  linear(m, layer.gate_up, m.h.data(), M, H, m.gu.data(), ph, ops);
  ph.each(M, kRowChunks, [&](int lo, int hi) {
    for (int r = lo; r < hi; ++r)
      ops.silu_mul_row(m.gu.data() + static_cast<size_t>(r) * 2 * m.I, m.I,
                       m.act.data() + static_cast<size_t>(r) * m.I);
  });
  linear(m, layer.down, m.act.data(), M, m.I, m.h.data(), ph, ops);
  ph.each(M, kRowChunks, [&](int lo, int hi) {
    for (int r = lo; r < hi; ++r)
      ops.add_row(m.x.data() + static_cast<size_t>(r) * H, m.h.data() + static_cast<size_t>(r) * H, H);
  });
}

// The LM head over the window rows `logits_index` of `normed` ([B·T, H]).
static void head_rows(Model& m, const PassArgs& p, const float* normed, Phases& ph, const Ops& ops) {
  const int H = m.H;
  const Layout& lay = *p.lay;
  ph.each(lay.Rt, kRowChunks, [&](int lo, int hi) {
    for (int i = lo; i < hi; ++i) {
      const int b = lay.rseq[i];
      std::memcpy(m.rows.data() + static_cast<size_t>(i) * H,
                  normed + (static_cast<size_t>(lay.start[b]) + p.logits_index[i]) * H, H * sizeof(float));
    }
  });
  linear(m, m.head, m.rows.data(), lay.Rt, H, p.logits, ph, ops);
}

static void run_pass(Model& m, const PassArgs& p) {
  const int M = p.lay->M, H = m.H, nq = m.nh * m.d;
  const int ntaps = static_cast<int>(m.taps.size());
  const Ops ops = ops_for(m.isa);
  int max_k = H > m.I ? H : m.I;
  reserve(m, p, max_k > nq ? max_k : nq);
  m.pool->run([&](int tid, int) {
    Phases ph(*m.pool, tid);
    ph.each(M, kRowChunks, [&](int lo, int hi) {
      for (int r = lo; r < hi; ++r) {
        float* xr = m.x.data() + static_cast<size_t>(r) * H;
        embed_row(m, p.ids[r], xr);
        if (m.embed_scale != 1.0f)
          for (int i = 0; i < H; ++i) xr[i] *= m.embed_scale;
      }
    });
    for (int l = 0; l < m.L; ++l) {
      ph.each(M, kRowChunks, [&](int lo, int hi) {
        for (int t = 0; t < ntaps; ++t) {
          if (m.taps[t] != l) continue;
          for (int r = lo; r < hi; ++r)
            std::memcpy(p.aux + (static_cast<size_t>(r) * ntaps + t) * H, m.x.data() + static_cast<size_t>(r) * H,
                        H * sizeof(float));
        }
        for (int r = lo; r < hi; ++r)
          ops.rmsnorm_row(m.x.data() + static_cast<size_t>(r) * H, H, m.layers[l].ln1.data(), m.eps,
                          m.h.data() + static_cast<size_t>(r) * H);
      });
      attention_mlp(m, l, p, m.h.data(), H, ph, ops);
    }
    ph.each(M, kRowChunks, [&](int lo, int hi) {
      for (int r = lo; r < hi; ++r)
        ops.rmsnorm_row(m.x.data() + static_cast<size_t>(r) * H, H, m.final_norm.data(), m.eps,
                        p.hidden + static_cast<size_t>(r) * H);
    });
    head_rows(m, p, p.hidden, ph, ops);
  });
}

// `n` floats of `x` normed by `w` into `out`, or copied where the norm is absent (an empty `w`).
static void norm_or_copy(const Ops& ops, const float* x, int n, const std::vector<float>& w, float eps, float* out) {
  if (w.empty())
    std::memcpy(out, x, n * sizeof(float));
  else
    ops.rmsnorm_row(x, n, w.data(), eps, out);
}

// A drafter layer (export/drafters/eagle3.py, eagle.py, mtp.py): the rows' token and feature mixed (Mix), one
// decoder layer; `hidden` gets the layer output, the head reads its norm (the final norm; none where unset).
// Its arithmetic decides only what is proposed: the target's verify decides every token.
static void run_feature_pass(Model& m, const PassArgs& p) {
  const int M = p.lay->M, H = m.H, nq = m.nh * m.d;
  const Ops ops = ops_for(m.isa);
  int max_k = 2 * H > m.I ? 2 * H : m.I;
  max_k = max_k > nq ? max_k : nq;
  const bool fuse = p.aux_in != nullptr;  // the features are fuse(aux): one call for the fuse and the layer
  reserve(m, p, fuse && m.fuse.K > max_k ? m.fuse.K : max_k);
  m.mixed.resize(static_cast<size_t>(M) * 2 * H);
  if (fuse) m.fused.resize(static_cast<size_t>(M) * H);
  const float* features = fuse ? m.fused.data() : p.hidden_in;
  const bool concat = m.mix == kConcat;
  m.pool->run([&](int tid, int) {
    Phases ph(*m.pool, tid);
    if (fuse) linear(m, m.fuse, p.aux_in, M, m.fuse.K, m.fused.data(), ph, ops);
    ph.each(M, kRowChunks, [&](int lo, int hi) {
      for (int r = lo; r < hi; ++r) {
        const float* f = features + static_cast<size_t>(r) * H;
        float* mr = m.mixed.data() + static_cast<size_t>(r) * 2 * H;
        float* xr = m.x.data() + static_cast<size_t>(r) * H;
        embed_row(m, p.ids[r], xr);
        if (concat) {  // the row's x is the feature, once the embedding row is normed
          ops.rmsnorm_row(xr, H, m.layers[0].ln1.data(), m.eps, mr);
          ops.rmsnorm_row(f, H, m.hidden_norm.data(), m.eps, mr + H);
          std::memcpy(xr, f, H * sizeof(float));
        } else {
          norm_or_copy(ops, xr, H, m.embed_norm, m.eps, mr);
          norm_or_copy(ops, f, H, m.hidden_norm, m.eps, mr + H);
        }
      }
    });
    if (!concat) {  // x = P·mixed, then the layer's input norm
      linear(m, m.mix_proj, m.mixed.data(), M, 2 * H, m.x.data(), ph, ops);
      ph.each(M, kRowChunks, [&](int lo, int hi) {
        for (int r = lo; r < hi; ++r)
          norm_or_copy(ops, m.x.data() + static_cast<size_t>(r) * H, H, m.layers[0].ln1, m.eps,
                       m.h.data() + static_cast<size_t>(r) * H);
      });
    }
    attention_mlp(m, 0, p, concat ? m.mixed.data() : m.h.data(), concat ? 2 * H : H, ph, ops);
    ph.each(M, kRowChunks, [&](int lo, int hi) {
      for (int r = lo; r < hi; ++r) {
        std::memcpy(p.hidden + static_cast<size_t>(r) * H, m.x.data() + static_cast<size_t>(r) * H, H * sizeof(float));
        norm_or_copy(ops, m.x.data() + static_cast<size_t>(r) * H, H, m.final_norm, m.eps,
                     m.h.data() + static_cast<size_t>(r) * H);
      }
    });
    head_rows(m, p, m.h.data(), ph, ops);
  });
}

static bool check(bool ok, const std::string& what) {
  if (!ok) g_error = what;
  return ok;
}

// Every entry point checks what it is given against the model's shapes before it reads a byte: the caller
// passes each buffer's element count, and a mismatch is an error (spn_last_error), never a read past an end.
static bool positive(long long v) { return v > 0; }

static std::string dims(const char* what, long long a, long long b) {
  return std::string(what) + " " + std::to_string(a) + " x " + std::to_string(b);
}

// The [K, N] a projection slot must have: which 0 q|k|v, 1 o, 2 gate|up, 3 down; layer -1 which 0 the LM head,
// which 2 a kProject layer's P (2H -> H). A kConcat layer's q|k|v reads 2H (its mix), and a feature layer's head
// has a draft vocabulary of its own: K given, N any (0).
static void expected_shape(const Model& m, int layer, int which, long long& K, long long& N) {
  const long long H = m.H, nq = static_cast<long long>(m.nh) * m.d, nqkv = static_cast<long long>(m.nh + 2 * m.kvh) * m.d;
  if (layer < 0) {
    if (which == 2)
      K = 2 * H, N = H;
    else
      K = H, N = m.feature ? 0 : m.V;
    return;
  }
  switch (which) {
    case 0: K = m.mix == kConcat ? 2 * H : H, N = nqkv; return;
    case 1: K = nq, N = H; return;
    case 2: K = H, N = 2LL * m.I; return;
    default: K = m.I, N = H; return;
  }
}

static const OwnedWeight* slot(const Model& m, int layer, int which) {
  if (layer < 0) return which == 1 ? &m.fuse : which == 2 ? &m.mix_proj : &m.head;
  const Layer& l = m.layers[layer];
  return which == 0 ? &l.qkv : which == 1 ? &l.o : which == 2 ? &l.gate_up : &l.down;
}

// Every weight a pass reads is set, with the shapes the model's dimensions give. A kProject layer's norms but the
// post-attention one are optional (export/drafters: EAGLE-1 has no input norm and its head reads the layer output).
static bool complete(const Model& m) {
  const bool project = m.mix == kProject;
  if (!check(m.embed_rows != nullptr || m.embed_codes != nullptr, "no embedding table set") ||
      !check(project || static_cast<int>(m.final_norm.size()) == m.H, "no final norm set") ||
      !check(m.rope_rows > 0, "no rotary table set") ||
      !check(m.mix != kConcat || static_cast<int>(m.hidden_norm.size()) == m.H, "no feature norm set") ||
      !check(!project || m.mix_proj.packed != nullptr, "no mix projection set"))
    return false;
  for (int l = 0; l < m.L; ++l) {
    if (!check((project || static_cast<int>(m.layers[l].ln1.size()) == m.H) &&
                   static_cast<int>(m.layers[l].ln2.size()) == m.H,
               "layer " + std::to_string(l) + ": norms not set"))
      return false;
    for (int which = 0; which < 4; ++which)
      if (!check(slot(m, l, which)->packed != nullptr,
                 "layer " + std::to_string(l) + ": projection " + std::to_string(which) + " not set"))
        return false;
  }
  return check(m.head.packed != nullptr, "no LM head set");
}

}  // namespace spn

using namespace spn;

extern "C" {

const char* spn_last_error() { return g_error.c_str(); }

int spn_isa_supported(int isa) { return isa >= 0 && isa < kIsaCount && isa_supported(static_cast<Isa>(isa)); }

// feature: 0 for a decoder (spn_pass), else a drafter layer's Mix (spn_feature_pass): 1 EAGLE-3's concat, 2 a
// projected mix (EAGLE-1/2, MTP).
void* spn_model_new(int L, int H, int nh, int kvh, int d, int I, int V, float eps, float embed_scale, int isa,
                    int threads, int feature) {
  if (!check(isa >= 0 && isa < kIsaCount && isa_supported(static_cast<Isa>(isa)), "kernel not supported here") ||
      !check(positive(L) && positive(H) && positive(nh) && positive(kvh) && positive(d) && positive(I) && positive(V),
             "every dimension must be positive") ||
      !check(nh % kvh == 0, "query heads (" + std::to_string(nh) + ") not a multiple of KV heads (" +
                                std::to_string(kvh) + ")") ||
      !check(d % 2 == 0, "head_dim " + std::to_string(d) + " is odd") ||
      !check(threads >= 1 && threads <= kMaxThreads, "threads " + std::to_string(threads) + " outside 1.." +
                                                         std::to_string(kMaxThreads)) ||
      !check(feature >= 0 && feature < kMixCount, "drafter mix " + std::to_string(feature) + " is not 0, 1 or 2") ||
      !check(!feature || L == 1, "a feature layer is one layer"))
    return nullptr;
  std::unique_ptr<Model> m;
  try {
    m = std::make_unique<Model>();
    m->L = L, m->H = H, m->nh = nh, m->kvh = kvh, m->d = d, m->I = I, m->V = V, m->mix = feature, m->feature = feature != 0;
    m->eps = eps, m->embed_scale = embed_scale, m->isa = static_cast<Isa>(isa), m->threads = threads;
    m->arena = std::make_unique<Arena>();
    m->layers = std::vector<Layer>(L);
    m->pool = shared_pool(threads);
  } catch (const std::system_error& e) {  // a thread the system would not start
    g_error = "could not start " + std::to_string(threads) + " threads (" + e.what() + ")";
    return nullptr;
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return nullptr;
  }
  return m.release();
}

void spn_model_free(void* h) { delete static_cast<Model*>(h); }

// Where a model's weights live: out[0] the bytes its arena has handed out, out[1] 1 when the system took the
// advice to back them with huge pages (arena.h; 0: SPECRT_NATIVE_HUGE_PAGES=0, or a system without them).
int spn_model_pages(void* h, int64_t* out) {
  const Model* m = static_cast<const Model*>(h);
  out[0] = static_cast<int64_t>(m->arena->taken());
  out[1] = m->arena->advised() ? 1 : 0;
  return 0;
}

static bool embed_ok(const Model& m, const float* e, int64_t rows, int64_t cols) {
  return check(e != nullptr, "embedding table missing") &&
         check(rows == m.V && cols == m.H, dims("embedding table", rows, cols) + " for a model of " +
                                               dims("vocabulary x hidden", m.V, m.H));
}

int spn_set_embed(void* h, const float* e, int64_t rows, int64_t cols) {
  Model* m = static_cast<Model*>(h);
  if (!embed_ok(*m, e, rows, cols)) return 1;
  try {
    m->embed.assign(e, e + static_cast<size_t>(m->V) * m->H);
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  m->embed_rows = m->embed.data();
  return 0;
}

// The embedding table at `e` ([V, H], owned by the caller, alive while the model is): no copy.
int spn_use_embed(void* h, const float* e, int64_t rows, int64_t cols) {
  Model* m = static_cast<Model*>(h);
  if (!embed_ok(*m, e, rows, cols)) return 1;
  m->embed.clear();
  m->embed_rows = e, m->embed_codes = nullptr, m->embed_scales = nullptr;
  return 0;
}

// The embedding table as int8 blocks owned by the caller (alive while the model is), no copy: codes q + 128
// [rows][cols] (n_codes bytes), a float scale per `block` inputs [rows][cols / block] (n_scales). Row i, input
// j is (codes - 128) * scale, exactly the value a float table of the blocks holds.
int spn_use_embed_blocks(void* h, const uint8_t* codes, int64_t n_codes, const float* scales, int64_t n_scales,
                         int64_t rows, int64_t cols, int block) {
  Model* m = static_cast<Model*>(h);
  if (!check(codes != nullptr && scales != nullptr, "embedding blocks missing") ||
      !check(rows == m->V && cols == m->H, dims("embedding table", rows, cols) + " for a model of " +
                                               dims("vocabulary x hidden", m->V, m->H)) ||
      !check((block == 16 || block == 32) && cols % block == 0,
             "embedding blocks of " + std::to_string(block) + " inputs for rows of " + std::to_string(cols) +
                 " (blocks of 16 or 32 that divide the row)") ||
      !check(n_codes == rows * cols && n_scales == rows * (cols / block),
             std::to_string(n_codes) + " codes and " + std::to_string(n_scales) + " scales for " +
                 dims("an embedding table", rows, cols) + " in blocks of " + std::to_string(block)))
    return 1;
  m->embed.clear();
  m->embed_rows = nullptr, m->embed_codes = codes, m->embed_scales = scales, m->embed_block = block;
  return 0;
}

// which: 0 input norm, 1 post-attention norm of layer `layer`; 2 the final norm; 3 a feature layer's norm of
// its feature input; 4 a kProject layer's norm of its embedding row. n: the weights' length (hidden_size).
int spn_set_norm(void* h, int layer, int which, const float* w, int64_t n) {
  Model* m = static_cast<Model*>(h);
  if (!check(which >= 0 && which <= 4, "norm kind out of range") ||
      !check(which >= 2 || (layer >= 0 && layer < m->L), "layer out of range") ||
      !check(which < 3 || m->feature, "only a drafter layer has a feature norm") ||
      !check(which != 4 || m->mix == kProject, "only a projected mix has an embedding norm") ||
      !check(w != nullptr && n == m->H, "norm of " + std::to_string(n) + " weights for hidden size " +
                                            std::to_string(m->H)))
    return 1;
  std::vector<float>& dst = which == 4   ? m->embed_norm
                            : which == 3 ? m->hidden_norm
                            : which == 2 ? m->final_norm
                            : which == 0 ? m->layers[layer].ln1
                                         : m->layers[layer].ln2;
  dst.assign(w, w + m->H);
  return 0;
}

// A [K, N] projection of format `format` (w4a8.h Format): q_bytes = N * blocks * 16 (int4: MatMulNBits' layout)
// or N * blocks * 32 (int8), n_scales = N * blocks (kQ8x16, kQ8x16Min: 2 * N * blocks), n_mins = N * blocks for
// kQ4Min and kQ8Min (kQ8x16Min: 2 * N * blocks), 0 otherwise, n_bias N or 0; checked against the shapes the
// model's dimensions give before it is read.
static bool weight_ok(int format, int K, int N, const uint8_t* q, int64_t q_bytes, const float* scales,
                      int64_t n_scales, const float* mins, int64_t n_mins, const float* bias, int64_t n_bias) {
  if (!check(format >= 0 && format < kFormatCount, "weight format " + std::to_string(format) + " is not one of 0 (int4), "
                                                   "1 (int4 with minimums), 2 (int8), 3 (int8 in half blocks), 4 (int8 "
                                                   "with minimums), 5 (int8 in half blocks with minimums)"))
    return false;
  const int64_t blocks = (static_cast<int64_t>(K) + kBlock - 1) / kBlock;
  const int64_t per_block = is_int8(format) ? kBlock : kBlock / 2;
  const int64_t scales_per_block = has_halves(format) ? 2 : 1;
  const int64_t want_mins = has_mins(format) ? static_cast<int64_t>(N) * blocks * scales_per_block : 0;
  return check(positive(K) && positive(N), dims("projection", K, N) + " is empty") &&
         check(q != nullptr && q_bytes == static_cast<int64_t>(N) * blocks * per_block,
               "packed weights of " + std::to_string(q_bytes) + " bytes for " + dims("a projection", K, N)) &&
         check(scales != nullptr && n_scales == static_cast<int64_t>(N) * blocks * scales_per_block,
               std::to_string(n_scales) + " scales for " + dims("a projection", K, N)) &&
         check(n_mins == want_mins && (want_mins == 0 || mins != nullptr),
               std::to_string(n_mins) + " minimums for " + dims("a projection", K, N) + " of format " +
                   std::to_string(format) + " (which takes " + std::to_string(want_mins) + ")") &&
         check(bias == nullptr ? n_bias == 0 : n_bias == N, std::to_string(n_bias) + " biases for " +
                                                               std::to_string(N) + " outputs");
}

// which: 0 q|k|v, 1 o, 2 gate|up, 3 down of layer `layer`; layer -1: which 0 the LM head, which 1 a feature
// layer's fuse fc (K a multiple of H: the tapped layers' rows side by side; N = H), which 2 a kProject layer's P
int spn_set_linear(void* h, int layer, int which, int format, int K, int N, const uint8_t* q, int64_t q_bytes,
                   const float* scales, int64_t n_scales, const float* mins, int64_t n_mins, const float* bias,
                   int64_t n_bias) {
  Model* m = static_cast<Model*>(h);
  if (!check(layer == -1 || (layer >= 0 && layer < m->L), "layer out of range") ||
      !check(which >= 0 && which <= (layer < 0 ? 2 : 3), "projection kind out of range") ||
      !check(layer >= 0 || which != 1 || m->feature, "only a feature layer has a fuse projection") ||
      !check(layer >= 0 || which != 2 || m->mix == kProject, "only a projected mix has a mix projection"))
    return 1;
  long long wantK, wantN;
  expected_shape(*m, layer, which, wantK, wantN);
  if (layer < 0 && which == 1)  // the fuse: any number of tapped layers
    wantK = K > 0 && K % m->H == 0 ? K : m->H, wantN = m->H;
  if (!check(K == wantK && (wantN == 0 || N == wantN),
             (layer < 0 ? std::string(which == 1 ? "fuse" : which == 2 ? "mix projection" : "LM head")
                        : "layer " + std::to_string(layer) + " projection " +
                                                       std::to_string(which)) +
                 ": " + dims("weights", K, N) + " where the model's dimensions give " + std::to_string(wantK) +
                 " x " + (wantN ? std::to_string(wantN) : std::string("any"))) ||
      !weight_ok(format, K, N, q, q_bytes, scales, n_scales, mins, n_mins, bias, n_bias))
    return 1;
  OwnedWeight* w = const_cast<OwnedWeight*>(slot(*m, layer, which));
  w->arena = m->arena.get();
  try {
    w->load(format, K, N, q, scales, mins, bias);
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  w->stream = !m->feature && stream_weights();
  return 0;
}

// cos, sin: [rows, half] each, half = head_dim / 2.
int spn_set_rope(void* h, int rows, int half, const float* cs, const float* sn) {
  Model* m = static_cast<Model*>(h);
  if (!check(rows > 0 && cs != nullptr && sn != nullptr, "rotary table missing") ||
      !check(half * 2 == m->d, "rotary table of " + std::to_string(half) + " frequencies for head_dim " +
                                   std::to_string(m->d)))
    return 1;
  m->rope_rows = rows;
  m->cos_tab.assign(cs, cs + static_cast<size_t>(rows) * half);
  m->sin_tab.assign(sn, sn + static_cast<size_t>(rows) * half);
  return 0;
}

// How the KV buffers a pass is given hold their rows: KvFormat `format` (ops.h); q8 needs head sizes of whole
// blocks of 32.
int spn_set_kv_format(void* h, int format) {
  Model* m = static_cast<Model*>(h);
  if (!check(format >= 0 && format < kKvFormatCount, "KV format " + std::to_string(format) + " unknown") ||
      !check(format != kKvQ8 || m->d % 32 == 0, "an int8 KV cache needs a head size that is a multiple of 32, not " +
                                                    std::to_string(m->d) + ": use --kv-dtype fp16"))
    return 1;
  m->kv_format = format;
  return 0;
}

int spn_set_taps(void* h, int n, const int* layers) {
  Model* m = static_cast<Model*>(h);
  if (!check(n >= 0 && (n == 0 || layers != nullptr), "taps missing")) return 1;
  for (int i = 0; i < n; ++i)
    if (!check(layers[i] >= 0 && layers[i] <= m->L, "tap layer " + std::to_string(layers[i]) + " out of 0.." +
                                                         std::to_string(m->L)))
      return 1;
  m->taps.assign(layers, layers + n);
  return 0;
}

static bool check_args(const Model& m, const PassArgs& p) {
  if (!complete(m) ||
      !check(p.B >= 1 && p.lay->M >= 1 && p.lay->Rt >= 1 && p.cap >= 1,
             "a pass needs at least one sequence, row and output") ||
      !check(p.ids && p.pos && p.past && p.mask && p.logits_index && p.kv && p.logits && p.hidden,
             "a pass buffer is missing") ||
      !check(p.B == 1 || p.slot_stride >= static_cast<int64_t>(m.kvh) * p.cap * kv_row_units(m.kv_format, m.d),
             "KV slot stride smaller than a slot"))
    return false;
  for (int i = 0; i < 2 * m.L; ++i)
    if (!check(p.kv[i] != nullptr, "KV buffer of layer " + std::to_string(i / 2) + " missing")) return false;
  const Layout& lay = *p.lay;
  for (int r = 0; r < lay.M; ++r) {
    if (!check(p.ids[r] >= 0 && p.ids[r] < m.V, "input_ids out of the vocabulary") ||
        !check(p.pos[r] >= 0 && p.pos[r] < m.rope_rows, "position_ids past the rotary table"))
      return false;
  }
  for (int b = 0; b < p.B; ++b)
    if (!check(p.past[b] >= 0 && p.past[b] + (lay.start[b + 1] - lay.start[b]) <= p.cap, "KV capacity exceeded"))
      return false;
  for (int i = 0; i < lay.Rt; ++i) {
    const int b = lay.rseq[i];
    if (!check(p.logits_index[i] >= 0 && p.logits_index[i] < lay.start[b + 1] - lay.start[b],
               "logits_index outside the window"))
      return false;
  }
  return true;
}

bool Layout::set(int B, const int64_t* T, const int64_t* R) {
  if (!check(B >= 1 && T != nullptr && R != nullptr, "a pass needs at least one sequence")) return false;
  start.assign(B + 1, 0), rstart.assign(B + 1, 0), mstart.assign(B, 0);
  int64_t rows = 0, outs = 0, masks = 0, longest = 0;
  for (int b = 0; b < B; ++b) {
    if (!check(T[b] >= 0 && R[b] >= 0 && (R[b] == 0 || T[b] > 0), "sequence " + std::to_string(b) + " has " +
               std::to_string(T[b]) + " rows and " + std::to_string(R[b]) + " logits rows"))
      return false;
    mstart[b] = static_cast<size_t>(masks);
    rows += T[b], outs += R[b], masks += T[b] * T[b];
    longest = T[b] > longest ? T[b] : longest;
    if (!check(rows <= (1 << 24) && outs <= (1 << 24), "a pass of more than 2^24 rows")) return false;
    start[b + 1] = static_cast<int>(rows), rstart[b + 1] = static_cast<int>(outs);
  }
  M = static_cast<int>(rows), Rt = static_cast<int>(outs), maxT = static_cast<int>(longest);
  seq.resize(M), rseq.resize(Rt);
  for (int b = 0; b < B; ++b) {
    for (int r = start[b]; r < start[b + 1]; ++r) seq[r] = b;
    for (int i = rstart[b]; i < rstart[b + 1]; ++i) rseq[i] = b;
  }
  return true;
}

static int guarded(void (*fn)(Model&, const PassArgs&), Model& m, const PassArgs& p) {
  if (!check_args(m, p)) return 1;
  try {
    fn(m, p);
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  return 0;
}

int spn_pass(void* h, int B, int T, const int64_t* ids, const int64_t* pos, const int64_t* past, const uint8_t* mask,
             int R, const int64_t* logits_index, void* const* kv, int64_t slot_stride, int cap, float* logits,
             float* hidden, float* aux) {
  Model* m = static_cast<Model*>(h);
  if (!check(!m->feature, "a feature layer runs spn_feature_pass") ||
      !check(m->taps.empty() || aux != nullptr, "aux_hidden_states buffer missing"))
    return 1;
  if (!check(B >= 1 && T >= 1 && R >= 1, "a pass needs at least one sequence, row and output")) return 1;
  Layout lay;
  try {
    const std::vector<int64_t> Ts(B, T), Rs(B, R);
    if (!lay.set(B, Ts.data(), Rs.data())) return 1;
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  return guarded(run_pass, *m,
                 PassArgs{B, T, ids, pos, past, mask, R, logits_index, kv, slot_stride, cap, logits, hidden, aux,
                          nullptr, nullptr, &lay});
}

// A ragged pass over B consecutive KV slots: sequence b runs rows[b] rows (0: nothing this pass) and asks for
// nlogits[b] logits rows. ids, pos: the rows of every sequence, one after the other; mask: each sequence's
// rows[b] x rows[b] tree mask, one after the other; logits_index: each sequence's rows (within its own
// window), one after the other. logits [Σ nlogits, V], hidden [Σ rows, H], aux [Σ rows, taps·H]. Each row
// is computed as in a padded pass or alone (the same per-row arithmetic), without the padding rows.
int spn_pass_ragged(void* h, int B, const int64_t* rows, const int64_t* nlogits, const int64_t* ids, const int64_t* pos,
                    const int64_t* past, const uint8_t* mask, const int64_t* logits_index, void* const* kv,
                    int64_t slot_stride, int cap, float* logits, float* hidden, float* aux) {
  Model* m = static_cast<Model*>(h);
  if (!check(!m->feature, "a feature layer runs spn_feature_pass") ||
      !check(m->taps.empty() || aux != nullptr, "aux_hidden_states buffer missing"))
    return 1;
  Layout lay;
  try {
    if (!lay.set(B, rows, nlogits)) return 1;
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  return guarded(run_pass, *m,
                 PassArgs{B, lay.maxT, ids, pos, past, mask, 0, logits_index, kv, slot_stride, cap, logits, hidden,
                          aux, nullptr, nullptr, &lay});
}

// One pass of a drafter layer (a model of one layer made with a Mix, its weights set) over one sequence's
// T rows: token ids and their features, given (`hidden_in` [T, H]) or fused first from the target's tapped
// rows (`aux_in` [T, fuse K], aux_len floats; the fuse set as layer -1 which 1): exactly one of the two.
// `hidden` gets the layer outputs [T, H].
int spn_feature_pass(void* h, int T, const int64_t* ids, const float* hidden_in, const float* aux_in,
                     int64_t aux_len, const int64_t* pos, const int64_t* past, const uint8_t* mask, int R,
                     const int64_t* logits_index, void* const* kv, int cap, float* logits, float* hidden) {
  Model* m = static_cast<Model*>(h);
  if (!check(m->feature, "not a feature layer (spn_model_new feature 0)") ||
      !check((hidden_in != nullptr) != (aux_in != nullptr), "give the features or the rows to fuse, one of them") ||
      !check(aux_in == nullptr || m->fuse.K > 0, "no fuse projection set") ||
      !check(aux_in == nullptr || aux_len == static_cast<int64_t>(T) * m->fuse.K,
             std::to_string(aux_len) + " tapped values for " + std::to_string(T) + " rows of " +
                 std::to_string(m->fuse.K)))
    return 1;
  if (!check(T >= 1 && R >= 1, "a pass needs at least one row and output")) return 1;
  Layout lay;
  try {
    const int64_t Ts[1] = {T}, Rs[1] = {R};
    if (!lay.set(1, Ts, Rs)) return 1;
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  return guarded(run_feature_pass, *m,
                 PassArgs{1, T, ids, pos, past, mask, R, logits_index, kv, 0, cap, logits, hidden, nullptr,
                          hidden_in, aux_in, &lay});
}

// x[n] rounded to IEEE halves by kernel `isa`'s conversion (tests: every kernel against numpy's float16).
int spn_to_half(int isa, const float* x, int64_t n, uint16_t* out) {
  if (!check(isa >= 0 && isa < kIsaCount && isa_supported(static_cast<Isa>(isa)), "kernel not supported here") ||
      !check(n >= 0 && n <= (1 << 30) && (n == 0 || (x && out)), "bad buffers"))
    return 1;
  ops_for(static_cast<Isa>(isa)).to_half(x, out, static_cast<int>(n));
  return 0;
}

// One block-quantized product alone (tests and the kernel benchmark): y[M, N] = x[M, K] · W. Sizes as spn_set_linear.
void* spn_linear_new(int format, int K, int N, const uint8_t* q, int64_t q_bytes, const float* scales,
                     int64_t n_scales, const float* mins, int64_t n_mins, const float* bias, int64_t n_bias) {
  if (!weight_ok(format, K, N, q, q_bytes, scales, n_scales, mins, n_mins, bias, n_bias)) return nullptr;
  try {
    std::unique_ptr<OwnedWeight> w = std::make_unique<OwnedWeight>();
    w->load(format, K, N, q, scales, mins, bias);
    w->stream = stream_weights();
    return w.release();
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return nullptr;
  }
}

void spn_linear_free(void* h) { delete static_cast<OwnedWeight*>(h); }

// How a product keeps its factors: bit 0 set when its scales are halves, bit 1 when its minimums are; bit 2 when
// its weights stream (QWeight::stream).
int spn_linear_factors(void* h) {
  const OwnedWeight* w = static_cast<OwnedWeight*>(h);
  return (w->half_scales ? 1 : 0) | (w->half_mins ? 2 : 0) | (w->stream ? 4 : 0);
}

// x: M * K floats (x_len), y: M * N floats (y_len).
int spn_linear_run(void* h, int isa, int threads, int M, const float* x, int64_t x_len, float* y, int64_t y_len) {
  OwnedWeight* w = static_cast<OwnedWeight*>(h);
  if (!check(isa >= 0 && isa < kIsaCount && isa_supported(static_cast<Isa>(isa)), "kernel not supported here") ||
      !check(threads >= 1 && threads <= kMaxThreads, "threads " + std::to_string(threads) + " outside 1.." +
                                                         std::to_string(kMaxThreads)) ||
      !check(M >= 1 && x && y, "a product needs rows and buffers") ||
      !check(x_len == static_cast<int64_t>(M) * w->K && y_len == static_cast<int64_t>(M) * w->N,
             "buffers of " + std::to_string(x_len) + " and " + std::to_string(y_len) + " floats for " +
                 std::to_string(M) + " rows of " + dims("a projection", w->K, w->N)))
    return 1;
  static thread_local ActBuffer qa;
  // held by this calling thread, so a product run alone (no model alive) does not start and join its pool
  // on every call
  static thread_local std::shared_ptr<Pool> pool;
  try {
    qa.reserve(M, w->K);
    if (!pool || pool->size() != threads) pool = shared_pool(threads);
  } catch (const std::system_error& e) {
    g_error = "could not start " + std::to_string(threads) + " threads (" + e.what() + ")";
    return 1;
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  const Ops ops = ops_for(static_cast<Isa>(isa));
  for (int r = 0; r < M; ++r) ops.quantize_row(x + static_cast<size_t>(r) * w->K, w->K, qa, r);
  const QAct* a = &qa;  // this thread's buffer: the pool's threads have thread_locals of their own
  Pool& workers = *pool;  // `pool` is this thread's: a worker's own thread_local is empty
  workers.run([&](int tid, int) {
    Phases ph(workers, tid);
    ph.each(w->tiles, kTileChunks, [&](int lo, int hi) { gemm(static_cast<Isa>(isa), *w, *a, y, w->N, lo, hi); });
  });
  return 0;
}

}  // extern "C"
