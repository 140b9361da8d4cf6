// specrt's native decoder pass: a Llama-family decoder (RMSNorm, fused q|k|v and gate|up projections, RoPE,
// grouped-query tree attention over an in-place KV cache, SiLU MLP, tied or separate LM head) run over any
// number of rows of any number of sequences in one call, every row computed by the same per-row arithmetic:
// W4A8 products (w4a8.h), per-row element-wise operations and per-row attention (ops.inc). A C API for ctypes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "w4a8.h"

namespace spn {

static Ops ops_for(Isa isa) { return isa == kScalar ? reference_ops() : avx2_ops(); }

static thread_local std::string g_error;

static void* aligned(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64) != 0) throw std::bad_alloc();
  return p;
}

struct OwnedWeight : QWeight {
  OwnedWeight() = default;
  OwnedWeight(const OwnedWeight&) = delete;
  OwnedWeight& operator=(const OwnedWeight&) = delete;
  ~OwnedWeight() {
    free(packed);
    free(scales);
    free(bias);
  }
  // From ONNX Runtime's MatMulNBits layout: q [N][blocks][16] (input 2i in the low nibble of byte i), scales
  // [N][blocks]; symmetric (zero point 8). Columns past N pad the last tile with zero scales.
  void load(int k, int n, const uint8_t* q, const float* s, const float* b) {
    K = k, N = n, blocks = (k + kBlock - 1) / kBlock, tiles = (n + kTileN - 1) / kTileN;
    size_t nbytes = static_cast<size_t>(tiles) * blocks * kTileBytes;
    packed = static_cast<uint8_t*>(aligned(nbytes));
    scales = static_cast<float*>(aligned(static_cast<size_t>(tiles) * blocks * kTileN * sizeof(float)));
    std::memset(packed, 0x88, nbytes);
    std::memset(scales, 0, static_cast<size_t>(tiles) * blocks * kTileN * sizeof(float));
    for (int col = 0; col < n; ++col) {
      int t = col / kTileN, c = col % kTileN;
      for (int blk = 0; blk < blocks; ++blk) {
        const uint8_t* src = q + (static_cast<size_t>(col) * blocks + blk) * (kBlock / 2);
        uint8_t* dst = packed + (static_cast<size_t>(t) * blocks + blk) * kTileBytes;
        for (int kk = 0; kk < kBlock; ++kk) {
          int v = (src[kk / 2] >> (4 * (kk % 2))) & 15;
          int g = kk / 4, j = kk % 4;
          uint8_t& byte = dst[(g / 2) * 64 + c * 4 + j];
          byte = (g % 2) ? static_cast<uint8_t>((byte & 0x0F) | (v << 4)) : static_cast<uint8_t>((byte & 0xF0) | v);
        }
        scales[(static_cast<size_t>(t) * blocks + blk) * kTileN + c] = s[static_cast<size_t>(col) * blocks + blk];
      }
    }
    if (b) {
      bias = static_cast<float*>(aligned(n * sizeof(float)));
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
  }
  void reserve(int m, int k) {
    M = m, blocks = (k + kBlock - 1) / kBlock;
    size_t need = static_cast<size_t>(m) * blocks;
    if (need <= cap) return;
    free(q), free(scale), free(corr);
    q = static_cast<int8_t*>(aligned(need * kBlock));
    scale = static_cast<float*>(aligned(need * sizeof(float)));
    corr = static_cast<int32_t*>(aligned(need * sizeof(int32_t)));
    cap = need;
  }
};

struct Layer {
  std::vector<float> ln1, ln2;
  OwnedWeight qkv, o, gate_up, down;
};

struct Model {
  int L = 0, H = 0, nh = 0, kvh = 0, d = 0, I = 0, V = 0;
  float eps = 0, embed_scale = 1;
  Isa isa = kScalar;
  int threads = 1;
  std::vector<float> embed, final_norm, cos_tab, sin_tab;
  int rope_rows = 0;
  std::vector<Layer> layers;
  OwnedWeight head;
  std::vector<int> taps;
  // scratch, grown to the largest pass seen
  std::vector<float> x, h, qkv, attn, gu, act, rows, scores;
  std::vector<int> extra;
  ActBuffer qa;
  std::unique_ptr<Pool> pool;
};

// Rows [lo, hi) of n for thread `tid` of `nt`: static and contiguous.
static inline void share(int n, int tid, int nt, int& lo, int& hi) {
  lo = static_cast<int>(static_cast<long long>(n) * tid / nt);
  hi = static_cast<int>(static_cast<long long>(n) * (tid + 1) / nt);
}

static void linear(Model& m, const QWeight& w, const float* x, int M, int ldx, float* y, int tid, int nt,
                   const Ops& ops) {
  Pool& pool = *m.pool;
  QAct a = m.qa;  // the buffer, viewed as M rows of this product's blocks
  a.M = M;
  a.blocks = w.blocks;
  int lo, hi;
  share(M, tid, nt, lo, hi);
  for (int r = lo; r < hi; ++r) ops.quantize_row(x + static_cast<size_t>(r) * ldx, w.K, a, r);
pool.barrier();
  share(w.tiles, tid, nt, lo, hi);
  gemm(m.isa, w, a, y, w.N, lo, hi);
pool.barrier();
}

struct PassArgs {
  int B, T;
  const int64_t* ids;
  const int64_t* pos;
  const int64_t* past;
  const uint8_t* mask;
  int R;
  const int64_t* logits_index;
  float* const* kv;
  int64_t slot_stride;
  int cap;
  float* logits;
  float* hidden;
  float* aux;
};

static void run_pass(Model& m, const PassArgs& p) {
  const int M = p.B * p.T, H = m.H, d = m.d, nq = m.nh * d, nqkv = (m.nh + 2 * m.kvh) * d;
  const int groups = m.nh / m.kvh, ntaps = static_cast<int>(m.taps.size());
  const Ops ops = ops_for(m.isa);
  int max_k = H > m.I ? H : m.I;
  max_k = max_k > nq ? max_k : nq;
  m.x.resize(static_cast<size_t>(M) * H);
  m.h.resize(static_cast<size_t>(M) * H);
  m.qkv.resize(static_cast<size_t>(M) * nqkv);
  m.attn.resize(static_cast<size_t>(M) * nq);
  m.gu.resize(static_cast<size_t>(M) * 2 * m.I);
  m.act.resize(static_cast<size_t>(M) * m.I);
  m.rows.resize(static_cast<size_t>(p.B) * p.R * H);
  int max_past = 0;
  for (int b = 0; b < p.B; ++b) max_past = p.past[b] > max_past ? static_cast<int>(p.past[b]) : max_past;
  const int nt = m.threads;
  m.scores.resize(static_cast<size_t>(nt) * (max_past + p.T));
  m.extra.resize(static_cast<size_t>(nt) * p.T);
  m.qa.reserve(M > p.B * p.R ? M : p.B * p.R, max_k);

  Pool& pool = *m.pool;
  pool.run([&](int tid, int) {
    int lo, hi;
    share(M, tid, nt, lo, hi);
    for (int r = lo; r < hi; ++r) {
      const float* e = m.embed.data() + static_cast<size_t>(p.ids[r]) * H;
      float* xr = m.x.data() + static_cast<size_t>(r) * H;
      for (int i = 0; i < H; ++i) xr[i] = m.embed_scale == 1.0f ? e[i] : e[i] * m.embed_scale;
    }
pool.barrier();
    for (int l = 0; l < m.L; ++l) {
      Layer& layer = m.layers[l];
      for (int t = 0; t < ntaps; ++t) {
        if (m.taps[t] != l) continue;
        for (int r = lo; r < hi; ++r)
          std::memcpy(p.aux + (static_cast<size_t>(r) * ntaps + t) * H, m.x.data() + static_cast<size_t>(r) * H,
                      H * sizeof(float));
      }
      for (int r = lo; r < hi; ++r)
        ops.rmsnorm_row(m.x.data() + static_cast<size_t>(r) * H, H, layer.ln1.data(), m.eps,
                        m.h.data() + static_cast<size_t>(r) * H);
pool.barrier();
      linear(m, layer.qkv, m.h.data(), M, H, m.qkv.data(), tid, nt, ops);
      float* kc = p.kv[2 * l];
      float* vc = p.kv[2 * l + 1];
      for (int r = lo; r < hi; ++r) {  // rotary on q and k, then k and v into the cache
        int b = r / p.T, t = r % p.T;
        float* row = m.qkv.data() + static_cast<size_t>(r) * nqkv;
        const int64_t at = p.pos[r];
        ops.rope_row(row, m.nh + m.kvh, d, m.cos_tab.data() + at * (d / 2), m.sin_tab.data() + at * (d / 2));
        const int64_t dst = p.past[b] + t;
        for (int kh = 0; kh < m.kvh; ++kh) {
          size_t off = static_cast<size_t>(b) * p.slot_stride + (static_cast<size_t>(kh) * p.cap + dst) * d;
          std::memcpy(kc + off, row + nq + kh * d, d * sizeof(float));
          std::memcpy(vc + off, row + nq + (m.kvh + kh) * d, d * sizeof(float));
        }
      }
pool.barrier();
      {  // attention: (row, query head) items split over threads
        int alo, ahi;
        share(M * m.nh, tid, nt, alo, ahi);
        float* scores = m.scores.data() + static_cast<size_t>(tid) * (max_past + p.T);
        int* extra = m.extra.data() + static_cast<size_t>(tid) * p.T;
        int last_row = -1, n_extra = 0;
        for (int item = alo; item < ahi; ++item) {
          int r = item / m.nh, qh = item % m.nh, b = r / p.T, t = r % p.T, kh = qh / groups;
          const int prefix = static_cast<int>(p.past[b]);
          if (r != last_row) {
            n_extra = 0;
            const uint8_t* mrow = p.mask + (static_cast<size_t>(b) * p.T + t) * p.T;
            for (int u = 0; u < p.T; ++u)
              if (mrow[u]) extra[n_extra++] = prefix + u;
            last_row = r;
          }
          size_t off = static_cast<size_t>(b) * p.slot_stride + static_cast<size_t>(kh) * p.cap * d;
          ops.attend(m.qkv.data() + static_cast<size_t>(r) * nqkv + qh * d, kc + off, vc + off, d, prefix, extra,
                     n_extra, scores, m.attn.data() + static_cast<size_t>(r) * nq + qh * d);
        }
      }
pool.barrier();
      linear(m, layer.o, m.attn.data(), M, nq, m.h.data(), tid, nt, ops);
      for (int r = lo; r < hi; ++r) {
        float* xr = m.x.data() + static_cast<size_t>(r) * H;
        ops.add_row(xr, m.h.data() + static_cast<size_t>(r) * H, H);
        ops.rmsnorm_row(xr, H, layer.ln2.data(), m.eps, m.h.data() + static_cast<size_t>(r) * H);
      }
pool.barrier();
      linear(m, layer.gate_up, m.h.data(), M, H, m.gu.data(), tid, nt, ops);
      for (int r = lo; r < hi; ++r)
        ops.silu_mul_row(m.gu.data() + static_cast<size_t>(r) * 2 * m.I, m.I, m.act.data() + static_cast<size_t>(r) * m.I);
pool.barrier();
      linear(m, layer.down, m.act.data(), M, m.I, m.h.data(), tid, nt, ops);
      for (int r = lo; r < hi; ++r)
        ops.add_row(m.x.data() + static_cast<size_t>(r) * H, m.h.data() + static_cast<size_t>(r) * H, H);
pool.barrier();
    }
    for (int r = lo; r < hi; ++r)
      ops.rmsnorm_row(m.x.data() + static_cast<size_t>(r) * H, H, m.final_norm.data(), m.eps,
                      p.hidden + static_cast<size_t>(r) * H);
pool.barrier();
    int glo, ghi;
    share(p.B * p.R, tid, nt, glo, ghi);
    for (int i = glo; i < ghi; ++i) {
      int b = i / p.R;
      std::memcpy(m.rows.data() + static_cast<size_t>(i) * H,
                  p.hidden + (static_cast<size_t>(b) * p.T + p.logits_index[i]) * H, H * sizeof(float));
    }
pool.barrier();
    linear(m, m.head, m.rows.data(), p.B * p.R, H, p.logits, tid, nt, ops);
  });
}

static bool check(bool ok, const std::string& what) {
  if (!ok) g_error = what;
  return ok;
}

}  // namespace spn

using namespace spn;

extern "C" {

const char* spn_last_error() { return g_error.c_str(); }

int spn_isa_supported(int isa) { return isa >= 0 && isa < kIsaCount && isa_supported(static_cast<Isa>(isa)); }

void* spn_model_new(int L, int H, int nh, int kvh, int d, int I, int V, float eps, float embed_scale, int isa,
                    int threads) {
  if (!check(isa >= 0 && isa < kIsaCount && isa_supported(static_cast<Isa>(isa)), "kernel not supported here") ||
      !check(nh % kvh == 0 && d % 2 == 0 && threads >= 1, "bad shape"))
    return nullptr;
  Model* m = new Model();
  m->L = L, m->H = H, m->nh = nh, m->kvh = kvh, m->d = d, m->I = I, m->V = V;
  m->eps = eps, m->embed_scale = embed_scale, m->isa = static_cast<Isa>(isa), m->threads = threads;
  m->layers = std::vector<Layer>(L);
  m->pool = std::make_unique<Pool>(threads);
  return m;
}

void spn_model_free(void* h) { delete static_cast<Model*>(h); }

int spn_set_embed(void* h, const float* e) {
  Model* m = static_cast<Model*>(h);
  m->embed.assign(e, e + static_cast<size_t>(m->V) * m->H);
  return 0;
}

// which: 0 input norm, 1 post-attention norm of layer `layer`; 2 the final norm
int spn_set_norm(void* h, int layer, int which, const float* w) {
  Model* m = static_cast<Model*>(h);
  if (!check(which == 2 || (layer >= 0 && layer < m->L), "layer out of range")) return 1;
  std::vector<float>& dst = which == 2 ? m->final_norm : which == 0 ? m->layers[layer].ln1 : m->layers[layer].ln2;
  dst.assign(w, w + m->H);
  return 0;
}

// which: 0 q|k|v, 1 o, 2 gate|up, 3 down of layer `layer`; layer -1: the LM head
int spn_set_linear(void* h, int layer, int which, int K, int N, const uint8_t* q, const float* scales,
                   const float* bias) {
  Model* m = static_cast<Model*>(h);
  if (!check(layer == -1 || (layer >= 0 && layer < m->L), "layer out of range")) return 1;
  OwnedWeight* w = layer < 0 ? &m->head
                   : which == 0 ? &m->layers[layer].qkv
                   : which == 1 ? &m->layers[layer].o
                   : which == 2 ? &m->layers[layer].gate_up
                                : &m->layers[layer].down;
  try {
    w->load(K, N, q, scales, bias);
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  return 0;
}

int spn_set_rope(void* h, int rows, const float* cs, const float* sn) {
  Model* m = static_cast<Model*>(h);
  m->rope_rows = rows;
  m->cos_tab.assign(cs, cs + static_cast<size_t>(rows) * (m->d / 2));
  m->sin_tab.assign(sn, sn + static_cast<size_t>(rows) * (m->d / 2));
  return 0;
}

int spn_set_taps(void* h, int n, const int* layers) {
  Model* m = static_cast<Model*>(h);
  m->taps.assign(layers, layers + n);
  return 0;
}

int spn_pass(void* h, int B, int T, const int64_t* ids, const int64_t* pos, const int64_t* past, const uint8_t* mask,
             int R, const int64_t* logits_index, float* const* kv, int64_t slot_stride, int cap, float* logits,
             float* hidden, float* aux) {
  Model* m = static_cast<Model*>(h);
  for (int r = 0; r < B * T; ++r) {
    if (!check(ids[r] >= 0 && ids[r] < m->V, "input_ids out of the vocabulary") ||
        !check(pos[r] >= 0 && pos[r] < m->rope_rows, "position_ids past the rotary table"))
      return 1;
  }
  for (int b = 0; b < B; ++b)
    if (!check(past[b] >= 0 && past[b] + T <= cap, "KV capacity exceeded")) return 1;
  for (int i = 0; i < B * R; ++i)
    if (!check(logits_index[i] >= 0 && logits_index[i] < T, "logits_index outside the window")) return 1;
  if (!check(m->taps.empty() || aux != nullptr, "aux_hidden_states buffer missing")) return 1;
  try {
    run_pass(*m, PassArgs{B, T, ids, pos, past, mask, R, logits_index, kv, slot_stride, cap, logits, hidden, aux});
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return 1;
  }
  return 0;
}

// One W4A8 product alone (tests and the kernel benchmark): y[M, N] = x[M, K] · W.
void* spn_linear_new(int K, int N, const uint8_t* q, const float* scales, const float* bias) {
  OwnedWeight* w = new OwnedWeight();
  w->load(K, N, q, scales, bias);
  return w;
}

void spn_linear_free(void* h) { delete static_cast<OwnedWeight*>(h); }

int spn_linear_run(void* h, int isa, int threads, int M, const float* x, float* y) {
  OwnedWeight* w = static_cast<OwnedWeight*>(h);
  if (!check(isa >= 0 && isa < kIsaCount && isa_supported(static_cast<Isa>(isa)), "kernel not supported here")) return 1;
  static thread_local ActBuffer qa;
  qa.reserve(M, w->K);
  const Ops ops = ops_for(static_cast<Isa>(isa));
  for (int r = 0; r < M; ++r) ops.quantize_row(x + static_cast<size_t>(r) * w->K, w->K, qa, r);
  static thread_local std::unique_ptr<Pool> pool;
  if (!pool || pool->size() != threads) pool = std::make_unique<Pool>(threads);
  const QAct* a = &qa;  // this thread's buffer: the pool's threads have thread_locals of their own
  pool->run([&](int tid, int nt) {
    int lo, hi;
    share(w->tiles, tid, nt, lo, hi);
    gemm(static_cast<Isa>(isa), *w, *a, y, w->N, lo, hi);
  });
  return 0;
}

}  // extern "C"
