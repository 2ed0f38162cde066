// The blocks of the hybrid models (Qwen3.5 / Qwen3.6 / Qwen3-Next: Gated DeltaNet layers and gated
// full-attention layers, dense or mixture-of-experts feed-forward) run whole in C++ for decoding and
// verification blocks (T <= 31 rows per sequence), as DecodeStack (decode.cpp) runs the dense ones:
//
//   HybridStack
//     add_part(lin, weights, types)   a linear map: one or more parts whose outputs are concatenated,
//                                     each GGUF block matrices (gguf_linear's layout and type ids) or,
//                                     type -1, one float32 matrix [N, K]; lin = -1 starts a new one;
//                                     returns its id
//     add_deltanet(...), add_attention(...)   a block's token mixer and its norms
//     set_mlp(gate_up, down), set_moe(...)    the last added block's feed-forward
//     forward_batch(x, ks, vs, convs, states, records, bases, replays, starts, rows, cos, sin)
//                                     all blocks over x [R, D]: rows[s] consecutive rows of sequence s
//                                     at positions [starts[s], +rows[s]) of its caches: KV ks[s], vs[s]
//                                     [attention layers, KV, max_len, hd]; recurrent convs[s]
//                                     [recurrent layers, K - 1 + max_rows, C], states[s] [recurrent
//                                     layers, 2, H, dk, dv] starting from slot bases[s] after replaying
//                                     the first replays[s] rows recorded in records[s] [recurrent
//                                     layers, max_rows, H, dk + dv + 2] (runtime/cache.py
//                                     RecurrentCache). Returns the residual stream.
//   replay_delta_rule(states, records, base, n)   a cache's pending replay: every layer's state in
//                                     slot base with the first n recorded rows applied -> slot 1 - base
//
// The Gated DeltaNet step of one row (transformers' torch_recurrent_gated_delta_rule), per value head h
// with state S [dk, dv]:
//   c = silu(causal depthwise conv1d over the last K inputs)   q, k, v = split(c)
//   q, k L2-normalised, q *= dk^-1/2;  beta = sigmoid(b);  g = A * softplus(a + dt_bias)
//   S = S * exp(g);  S += k (beta (v - S^T k))^T;  o = S^T q;  y = rmsnorm(o) * w * silu(z)
// Lazy replay (RecurrentCache's protocol): a forward writes only its final state, to slot 1 - base,
// and records each row's inputs [k | v | decay | beta] per head; a trim leaves the state of slot base
// plus the kept recorded rows as the committed state, and the next forward replays those rows in the
// same per-head pass that reads the state (compute on column blocks of the head state held in L1,
// delta_rule_head) instead of every verification row writing a whole state (H dk dv floats per
// layer) to memory. The state the replay
// gives is written back to slot base when this forward has rows a trim could keep. The convolution
// inputs are appended to the cache's history. Every row's arithmetic is fixed (the same order of
// operations whatever T, whatever the number of threads, replayed or not), so a row gives the same
// bits decoded alone, verified in a block or replayed: speculative decoding stays greedy-identical.
//
// Matrix products use the same kernels as the per-module path (gguf_linear_rows; float32 parts
// row by row through at::linear, as Linear("f32") computes verification rows), attention the fused
// attend_rows with the output gate applied after it. The elementwise steps (convolution, gates,
// delta rule, norms) are this file's own, so this path and the per-module PyTorch path agree to
// float32 rounding, not bit for bit (tests/test_hybrid_native.py states the tolerance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include "common.h"
#include "stack.h"

namespace {
using mtpllm::dot;
using mtpllm::exp256;

// sigmoid from e = exp(-|x|) (<= 1, no overflow): 1 / (1 + e) for x >= 0, e / (1 + e) below
inline __m256 sigmoid256(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp256(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
  const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
  return _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

inline float sigmoid1(float x) {
  const float e = std::exp(-std::fabs(x));
  const float inv = 1.0f / (1.0f + e);
  return x < 0.0f ? e * inv : inv;
}

// x = x * sigmoid(x), in place
inline void silu_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(v, sigmoid256(v)));
  }
  for (; i < n; ++i) x[i] = x[i] * sigmoid1(x[i]);
}

// y = y * sigmoid(g)
inline void mul_sigmoid(float* y, const float* g, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), sigmoid256(_mm256_loadu_ps(g + i))));
  for (; i < n; ++i) y[i] = y[i] * sigmoid1(g[i]);
}

inline void scale_inplace(float* x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

// torch.nn.functional.softplus (beta 1, threshold 20)
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

struct Part {
  std::vector<at::Tensor> w;  // GGUF block matrices, or one float32 [N, K]
  std::vector<int64_t> t;     // their type ids; {-1}: float32
};

struct Lin {
  std::vector<Part> parts;
};

struct HLayer {
  bool recurrent = false;
  int64_t slot = 0;  // index in the sequence's recurrent state (DeltaNet) or KV cache (attention)
  at::Tensor attn_norm, ffn_norm;
  // Gated DeltaNet
  int64_t proj = -1, out = -1;  // D -> [qkv | z | b | a] (or [qkv | z | ba grouped per key head]); H dv -> D
  at::Tensor conv_t;            // the convolution kernel transposed, [K, C]
  at::Tensor a, dt_bias, ssm_norm;
  int64_t nk = 0, nv = 0, dk = 0, dv = 0;
  bool tiled = true, ba_grouped = false;
  // gated attention
  int64_t qkv = -1, o = -1;  // D -> [H x (q | gate), k, v]; H hd -> D
  c10::optional<at::Tensor> q_norm, k_norm;
  // feed-forward: dense (gu, down) or routed experts + optional shared expert
  int64_t gu = -1, down = -1;
  int64_t router = -1, sh_gu = -1, sh_down = -1, sh_gate = -1, top_k = 0;
  std::vector<int64_t> ex_gu, ex_down;
  bool norm_topk = true;
};

// One row of the delta rule for one head: state src [dk, dv] -> the new state, written to loc (the
// working copy, may be src) or, kStore (the last row), to dst (the cache's slot) only; kOut: o = S^T q
// (a replayed row has no output: q and o unused). Two sweeps: the first only reads (mem = exp(g) S^T k,
// the decay applied once per column, not per element; v - mem is one fused multiply-add, written out in
// every path so that none depends on the compiler's contraction), the second computes S exp(g) + k delta^T
// with delta = beta (v - mem) and o. The arithmetic per element is fixed (the same for every row count and
// thread, with or without output).
template <bool kOut, bool kStore>
inline void delta_rule_row(const float* src, float* loc, float* dst, const float* q, const float* k, const float* v,
                           float dec, float bt, int64_t dk, int64_t dv, float* mem, float* delta, float* o) {
  const bool vec = dv % 8 == 0;
  const bool stream = kStore && vec && reinterpret_cast<uintptr_t>(dst) % 32 == 0;
  std::fill(mem, mem + dv, 0.0f);
  if (kOut) std::fill(o, o + dv, 0.0f);
  if (vec) {
    const __m256 vd = _mm256_set1_ps(dec);
    for (int64_t i = 0; i < dk; ++i) {
      const float* sr = src + i * dv;
      const __m256 ki = _mm256_set1_ps(k[i]);
      for (int64_t j = 0; j < dv; j += 8)
        _mm256_storeu_ps(mem + j, _mm256_fmadd_ps(_mm256_loadu_ps(sr + j), ki, _mm256_loadu_ps(mem + j)));
    }
    const __m256 vb = _mm256_set1_ps(bt);
    for (int64_t j = 0; j < dv; j += 8)
      _mm256_storeu_ps(delta + j,
                       _mm256_mul_ps(_mm256_fnmadd_ps(_mm256_loadu_ps(mem + j), vd, _mm256_loadu_ps(v + j)), vb));
    for (int64_t i = 0; i < dk; ++i) {
      const float* sr = src + i * dv;
      float* lr = loc + i * dv;
      float* dr = dst + i * dv;
      const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(kOut ? q[i] : 0.0f);
      for (int64_t j = 0; j < dv; j += 8) {
        const __m256 sv = _mm256_fmadd_ps(ki, _mm256_loadu_ps(delta + j), _mm256_mul_ps(_mm256_loadu_ps(sr + j), vd));
        if (!kStore)
          _mm256_storeu_ps(lr + j, sv);
        else if (stream)
          _mm256_stream_ps(dr + j, sv);
        else
          _mm256_storeu_ps(dr + j, sv);
        if (kOut) _mm256_storeu_ps(o + j, _mm256_fmadd_ps(sv, qi, _mm256_loadu_ps(o + j)));
      }
    }
    return;
  }
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) mem[j] = std::fma(src[i * dv + j], k[i], mem[j]);
  for (int64_t j = 0; j < dv; ++j) delta[j] = std::fma(-mem[j], dec, v[j]) * bt;
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) {
      const float sv = std::fma(k[i], delta[j], src[i * dv + j] * dec);
      if (kStore)
        dst[i * dv + j] = sv;
      else
        loc[i * dv + j] = sv;
      if (kOut) o[j] = std::fma(sv, q[i], o[j]);
    }
}

// One row of the delta rule as delta_rule_head takes it: its inputs, and where its output o = S^T q
// goes (o == nullptr: a replayed row, state update only, q unused).
struct DeltaRow {
  const float *q, *k, *v;
  float dec, bt;
  float* o;
};

constexpr int64_t kConvBlock = 256;  // channels per task of the DeltaNet convolution
static_assert(kConvBlock % 8 == 0, "a block boundary must not move an element between vector and scalar code");
constexpr int64_t kCols = 32;  // state columns per block in delta_rule_head: 4 registers of 8

// The causal depthwise convolution + SiLU of T rows: c[t] = silu(sum_j hist[t + j] * wt[j]) over C
// channels, hist [K - 1 + T, C], wt [K, C] (the kernel transposed), a fixed order of the taps, on all
// threads by blocks of channels (a multiple of 8: each element takes the vector or the scalar path as
// it would in one sweep, so the bits do not depend on the split or on T).
inline void conv_silu_rows(const float* hist, const float* wt, int64_t T, int64_t C, int64_t K, float* c) {
  const int64_t cblocks = (C + kConvBlock - 1) / kConvBlock;
  at::parallel_for(0, cblocks, std::max<int64_t>(1, 64 / std::max<int64_t>(1, T)), [&](int64_t b0, int64_t b1) {
    const int64_t i0 = b0 * kConvBlock, i1 = std::min(C, b1 * kConvBlock);
    for (int64_t t = 0; t < T; ++t) {
      float* ct = c + t * C;
      const float* h0 = hist + t * C;
      for (int64_t i = i0; i < i1; ++i) ct[i] = h0[i] * wt[i];
      for (int64_t j = 1; j < K; ++j) {
        const float* hj = hist + (t + j) * C;
        const float* wj = wt + j * C;
        for (int64_t i = i0; i < i1; ++i) ct[i] = ct[i] + hj[i] * wj[i];
      }
      silu_inplace(ct + i0, i1 - i0);
    }
  });
}

// rows [0, n) of the delta rule over one head's state, read from `from` [dk, dv]; the state after row
// keep - 1 is written back to `from` (keep > 0), the final one to dst. The columns of the state are
// independent (column j needs only mem[j], delta[j], o[j]), so several rows run column block by
// column block: a block [dk, kCols] (16 KB) stays in L1 through all the rows, its accumulators in
// registers, where whole-row sweeps would stream the 64 KB head state from L2 twice per row. A single
// row reads and writes the state once in order (delta_rule_row: memory-bound). Every element gets
// the operations of delta_rule_row in the same order either way: the same bits. work: dk x dv floats.
inline void delta_rule_head(float* from, float* dst, const DeltaRow* rows, int64_t n, int64_t keep, int64_t dk,
                            int64_t dv, float* work, float* mem, float* delta) {
  if (n == 1 || dv % kCols != 0) {
    const float* src = from;
    for (int64_t t = 0; t < n; ++t) {
      const DeltaRow& R = rows[t];
      if (t == n - 1 && R.o)
        delta_rule_row<true, true>(src, work, dst, R.q, R.k, R.v, R.dec, R.bt, dk, dv, mem, delta, R.o);
      else if (t == n - 1)
        delta_rule_row<false, true>(src, work, dst, nullptr, R.k, R.v, R.dec, R.bt, dk, dv, mem, delta, nullptr);
      else if (R.o)
        delta_rule_row<true, false>(src, work, nullptr, R.q, R.k, R.v, R.dec, R.bt, dk, dv, mem, delta, R.o);
      else
        delta_rule_row<false, false>(src, work, nullptr, nullptr, R.k, R.v, R.dec, R.bt, dk, dv, mem, delta, nullptr);
      src = work;
      if (t + 1 == keep) std::memcpy(from, work, dk * dv * sizeof(float));
    }
    return;
  }
  const bool stream = reinterpret_cast<uintptr_t>(dst) % 32 == 0;
  for (int64_t j0 = 0; j0 < dv; j0 += kCols) {
    const float* src = from + j0;
    int64_t ld = dv;  // src's row stride: the state, then the block
    for (int64_t t = 0; t < n; ++t) {
      const DeltaRow& R = rows[t];
      const __m256 vd = _mm256_set1_ps(R.dec), vb = _mm256_set1_ps(R.bt);
      __m256 m[4], d[4], o[4];
      for (int c = 0; c < 4; ++c) m[c] = o[c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < dk; ++i) {
        const __m256 ki = _mm256_set1_ps(R.k[i]);
        const float* sr = src + i * ld;
        for (int c = 0; c < 4; ++c) m[c] = _mm256_fmadd_ps(_mm256_loadu_ps(sr + 8 * c), ki, m[c]);
      }
      for (int c = 0; c < 4; ++c)
        d[c] = _mm256_mul_ps(_mm256_fnmadd_ps(m[c], vd, _mm256_loadu_ps(R.v + j0 + 8 * c)), vb);
      const bool last = t == n - 1;
      for (int64_t i = 0; i < dk; ++i) {
        const __m256 ki = _mm256_set1_ps(R.k[i]), qi = _mm256_set1_ps(R.o ? R.q[i] : 0.0f);
        const float* sr = src + i * ld;
        float* br = work + i * kCols;
        float* dr = dst + i * dv + j0;
        for (int c = 0; c < 4; ++c) {
          const __m256 sv = _mm256_fmadd_ps(ki, d[c], _mm256_mul_ps(_mm256_loadu_ps(sr + 8 * c), vd));
          if (!last) {
            _mm256_storeu_ps(br + 8 * c, sv);
          } else if (stream) {
            _mm256_stream_ps(dr + 8 * c, sv);
          } else {
            _mm256_storeu_ps(dr + 8 * c, sv);
          }
          o[c] = _mm256_fmadd_ps(sv, qi, o[c]);
        }
      }
      if (R.o)
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(R.o + j0 + 8 * c, o[c]);
      src = work;
      ld = kCols;
      if (t + 1 == keep)
        for (int64_t i = 0; i < dk; ++i) std::memcpy(from + i * dv + j0, work + i * kCols, kCols * sizeof(float));
    }
  }
}

// The rows recorded for head h (records [max_rows, H, dk + dv + 2], per head [k | v | decay | beta])
// as replayed rows.
inline void recorded_rows(const float* rec, int64_t n, int64_t h, int64_t H, int64_t dk, int64_t dv,
                          std::vector<DeltaRow>& out) {
  const int64_t W = dk + dv + 2;
  for (int64_t t = 0; t < n; ++t) {
    const float* r = rec + (t * H + h) * W;
    out.push_back(DeltaRow{nullptr, r, r + dk, r[dk + dv], r[dk + dv + 1], nullptr});
  }
}

// A prompt chunk's convolution + SiLU (models/deltanet.py): hist [K - 1 + T, C], conv_t [K, C] -> [T, C],
// the arithmetic of the decoding rows above.
at::Tensor deltanet_conv_silu(at::Tensor hist, at::Tensor conv_t) {
  TORCH_CHECK(hist.dim() == 2 && conv_t.dim() == 2 && hist.scalar_type() == at::kFloat &&
                  conv_t.scalar_type() == at::kFloat && hist.device().is_cpu() && conv_t.device().is_cpu() &&
                  hist.size(1) == conv_t.size(1) && conv_t.size(0) >= 1 && hist.size(0) >= conv_t.size(0),
              "deltanet_conv_silu: float32 CPU hist [K - 1 + T, C] and kernel [K, C]");
  hist = hist.contiguous();
  conv_t = conv_t.contiguous();
  const int64_t K = conv_t.size(0), C = conv_t.size(1), T = hist.size(0) - K + 1;
  at::Tensor c = at::empty({T, C}, hist.options());
  conv_silu_rows(hist.data_ptr<float>(), conv_t.data_ptr<float>(), T, C, K, c.data_ptr<float>());
  return c;
}

// A cache's pending replay (RecurrentCache.materialize): states [L, 2, H, dk, dv], records [L, max_rows,
// H, dk + dv + 2]; slot 1 - base of every layer gets slot base with the first n recorded rows applied.
void replay_delta_rule(at::Tensor states, at::Tensor records, int64_t base, int64_t n) {
  TORCH_CHECK(states.dim() == 5 && states.size(1) == 2 && records.dim() == 4 && states.scalar_type() == at::kFloat &&
                  records.scalar_type() == at::kFloat && states.is_contiguous() && records.is_contiguous(),
              "replay_delta_rule: states float32 [L, 2, H, dk, dv], records float32 [L, rows, H, dk + dv + 2]");
  const int64_t L = states.size(0), H = states.size(2), dk = states.size(3), dv = states.size(4);
  TORCH_CHECK(records.size(0) == L && records.size(2) == H && records.size(3) == dk + dv + 2 && n >= 0 &&
                  n <= records.size(1) && (base == 0 || base == 1),
              "replay_delta_rule: records do not match the states");
  const int64_t HS = dk * dv, MR = records.size(1);
  float* sp = states.data_ptr<float>();
  const float* rp = records.data_ptr<float>();
  if (n == 0) return;
  at::parallel_for(0, L * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> mem(dv), delta(dv), work(HS);
    std::vector<DeltaRow> rows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t l = i / H, h = i % H;
      float* st = sp + l * 2 * H * HS;
      rows.clear();
      recorded_rows(rp + l * MR * H * (dk + dv + 2), n, h, H, dk, dv, rows);
      delta_rule_head(st + (base * H + h) * HS, st + ((1 - base) * H + h) * HS, rows.data(), n, 0, dk, dv,
                      work.data(), mem.data(), delta.data());
    }
    _mm_sfence();
  });
}

struct HybridStack : torch::CustomClassHolder {
  int64_t n_heads, n_kv, head_dim, rot_dim;
  bool neox;
  double scale, eps, qk_eps;
  std::vector<Lin> lins;
  std::vector<HLayer> layers;
  // Per-stage wall time of forward_batch (set_timing, stage_times): DeltaNet norm + projections,
  // DeltaNet convolution + delta rule + gated norm, DeltaNet output projection, attention norm +
  // projections, attention, attention output projection, FFN (norm, products, routing).
  mtpllm::StageClock timer{7};
  int64_t window = 0;  // keys each query row of the attention layers sees: the last `window` (0 = all)

  void set_timing(bool on) { timer.set(on); }
  void set_window(int64_t w) {
    TORCH_CHECK(w >= 0, "HybridStack: window must be >= 0");
    window = w;
  }
  std::vector<double> stage_times() const { return timer.times(); }

  HybridStack(int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t rot_dim, bool neox, double scale, double eps,
              double qk_eps)
      : n_heads(n_heads), n_kv(n_kv), head_dim(head_dim), rot_dim(rot_dim), neox(neox), scale(scale), eps(eps),
        qk_eps(qk_eps) {}

  static void check_f32(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous(), "HybridStack: ", what,
                " must be contiguous float32");
  }

  int64_t add_part(int64_t lin, std::vector<at::Tensor> ws, std::vector<int64_t> types) {
    TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "HybridStack: one type per weight");
    const bool dense = types[0] == -1;
    if (dense) {
      TORCH_CHECK(ws.size() == 1 && ws[0].dim() == 2, "HybridStack: a float32 part is one [N, K] matrix");
      check_f32(ws[0], "a float32 weight");
    } else {
      for (int64_t t : types) TORCH_CHECK(t >= 0, "HybridStack: float32 parts stand alone");
    }
    if (lin < 0) {
      lins.emplace_back();
      lin = static_cast<int64_t>(lins.size()) - 1;
    }
    TORCH_CHECK(lin < static_cast<int64_t>(lins.size()), "HybridStack: no linear ", lin);
    lins[lin].parts.push_back(Part{std::move(ws), std::move(types)});
    return lin;
  }

  void check_lin(int64_t id) const {
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(lins.size()), "HybridStack: no linear ", id);
  }

  // A new block at `slot` of the caches with its two norms and its token mixer's input and output
  // linears (checked), for add_deltanet / add_attention to complete and add
  HLayer new_layer(int64_t slot, const at::Tensor& attn_norm, const at::Tensor& ffn_norm, int64_t in,
                   int64_t out) const {
    check_lin(in);
    check_lin(out);
    check_f32(attn_norm, "norm weights");
    check_f32(ffn_norm, "norm weights");
    HLayer L;
    L.slot = slot;
    L.attn_norm = attn_norm;
    L.ffn_norm = ffn_norm;
    return L;
  }

  void add_deltanet(int64_t slot, at::Tensor attn_norm, int64_t proj, at::Tensor conv_w, at::Tensor a,
                    at::Tensor dt_bias, at::Tensor ssm_norm, int64_t out, int64_t nk, int64_t nv, int64_t dk,
                    int64_t dv, bool tiled, bool ba_grouped, at::Tensor ffn_norm) {
    HLayer L = new_layer(slot, attn_norm, ffn_norm, proj, out);
    check_f32(a, "A");
    check_f32(dt_bias, "dt_bias");
    check_f32(ssm_norm, "the output norm");
    TORCH_CHECK(nk > 0 && nv > 0 && dk > 0 && dv > 0 && nv % nk == 0, "HybridStack: bad DeltaNet heads");
    const int64_t C = 2 * nk * dk + nv * dv;
    TORCH_CHECK(conv_w.dim() == 2 && conv_w.size(0) == C && conv_w.size(1) >= 1 && conv_w.scalar_type() == at::kFloat,
                "HybridStack: convolution kernel float32 [C, K]");
    TORCH_CHECK(a.numel() == nv && dt_bias.numel() == nv && ssm_norm.numel() == dv,
                "HybridStack: DeltaNet per-head tensors do not match the heads");
    L.recurrent = true;
    L.proj = proj;
    L.out = out;
    L.conv_t = conv_w.t().contiguous();
    L.a = a;
    L.dt_bias = dt_bias;
    L.ssm_norm = ssm_norm;
    L.nk = nk;
    L.nv = nv;
    L.dk = dk;
    L.dv = dv;
    L.tiled = tiled;
    L.ba_grouped = ba_grouped;
    layers.push_back(std::move(L));
  }

  void add_attention(int64_t slot, at::Tensor attn_norm, int64_t qkv, int64_t o, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, at::Tensor ffn_norm) {
    HLayer L = new_layer(slot, attn_norm, ffn_norm, qkv, o);
    L.qkv = qkv;
    L.o = o;
    L.q_norm = q_norm;
    L.k_norm = k_norm;
    layers.push_back(std::move(L));
  }

  void set_mlp(int64_t gu, int64_t down) {
    TORCH_CHECK(!layers.empty(), "HybridStack: no layer");
    check_lin(gu);
    check_lin(down);
    layers.back().gu = gu;
    layers.back().down = down;
  }

  void set_moe(int64_t router, std::vector<int64_t> ex_gu, std::vector<int64_t> ex_down, int64_t top_k,
               bool norm_topk, int64_t sh_gu, int64_t sh_down, int64_t sh_gate) {
    TORCH_CHECK(!layers.empty(), "HybridStack: no layer");
    check_lin(router);
    TORCH_CHECK(!ex_gu.empty() && ex_gu.size() == ex_down.size() && top_k > 0 &&
                    top_k <= static_cast<int64_t>(ex_gu.size()),
                "HybridStack: experts and top-k");
    for (size_t e = 0; e < ex_gu.size(); ++e) {
      check_lin(ex_gu[e]);
      check_lin(ex_down[e]);
    }
    if (sh_gu >= 0 || sh_down >= 0) {
      check_lin(sh_gu);
      check_lin(sh_down);
    }
    if (sh_gate >= 0) check_lin(sh_gate);
    HLayer& L = layers.back();
    L.router = router;
    L.ex_gu = std::move(ex_gu);
    L.ex_down = std::move(ex_down);
    L.top_k = top_k;
    L.norm_topk = norm_topk;
    L.sh_gu = sh_gu;
    L.sh_down = sh_down;
    L.sh_gate = sh_gate;
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // x [R, K] (contiguous) through linear `id` -> [R, N]
  at::Tensor run(int64_t id, const at::Tensor& x) const {
    const Lin& L = lins[id];
    std::vector<at::Tensor> ys;
    ys.reserve(L.parts.size());
    for (const Part& p : L.parts) {
      if (p.t[0] == -1) {
        // row by row: the one-row product of decoding for every row (Linear("f32") does the same)
        if (x.size(0) == 1) {
          ys.push_back(at::linear(x, p.w[0]));
        } else {
          std::vector<at::Tensor> r;
          r.reserve(x.size(0));
          for (int64_t t = 0; t < x.size(0); ++t) r.push_back(at::linear(x.narrow(0, t, 1), p.w[0]));
          ys.push_back(at::cat(r, 0));
        }
      } else {
        ys.push_back(mtpllm::gguf_linear_rows(x, p.w, p.t));
      }
    }
    return ys.size() == 1 ? ys[0] : at::cat(ys, 1);
  }

  at::Tensor mlp(int64_t gu, int64_t down, const at::Tensor& h) const {
    return run(down, mtpllm::silu_mul_rows(run(gu, h)));
  }

  // One sequence's T rows through DeltaNet layer L: p [T, N] its projections, conv [K - 1 + max_rows, C],
  // state [2, H, dk, dv] and rec [max_rows, H, dk + dv + 2] the layer's part of the sequence's recurrent
  // cache, starting from slot base after replaying the first `replay` recorded rows -> y [T, H dv]
  // (before the output projection).
  void deltanet_rows(const HLayer& L, const float* p, int64_t T, int64_t N, at::Tensor& conv, at::Tensor& state,
                     at::Tensor& record, int64_t base, int64_t replay, float* y) const {
    const int64_t nk = L.nk, nv = L.nv, dk = L.dk, dv = L.dv, C = 2 * nk * dk + nv * dv;
    const int64_t K = L.conv_t.size(0), CL = K - 1;
    const int64_t nbuf = conv.size(0), MR = record.size(0), W = dk + dv + 2;
    TORCH_CHECK(N == C + nv * dv + 2 * nv, "HybridStack: DeltaNet projections have ", N, " outputs, expected ",
                C + nv * dv + 2 * nv);
    TORCH_CHECK(conv.size(1) == C && nbuf == CL + MR && state.size(0) == 2 && state.size(1) == nv &&
                    state.size(2) == dk && state.size(3) == dv && record.size(1) == nv && record.size(2) == W,
                "HybridStack: recurrent cache does not match the layer");
    TORCH_CHECK(T <= MR && replay >= 0 && replay <= MR && (base == 0 || base == 1), "HybridStack: ", T,
                " rows exceed the recurrent cache's ", MR, " row slots");
    float* cb = conv.data_ptr<float>();
    float* sp = state.data_ptr<float>();
    float* rp = record.data_ptr<float>();
    // the convolution's inputs: the CL committed ones, then this block's
    std::vector<float> hist((CL + T) * C);
    std::memcpy(hist.data(), cb + (nbuf - CL) * C, CL * C * sizeof(float));
    for (int64_t t = 0; t < T; ++t) std::memcpy(hist.data() + (CL + t) * C, p + t * N, C * sizeof(float));
    // the cache keeps the last nbuf inputs (RecurrentCache.push_conv)
    if (T >= nbuf) {
      std::memcpy(cb, hist.data() + (CL + T - nbuf) * C, nbuf * C * sizeof(float));
    } else {
      std::memmove(cb, cb + T * C, (nbuf - T) * C * sizeof(float));
      std::memcpy(cb + (nbuf - T) * C, hist.data() + CL * C, T * C * sizeof(float));
    }
    // per row: convolution + SiLU, L2 norms of q and k, the gates
    std::vector<float> c(T * C), beta(T * nv), decay(T * nv);
    const float* wt = L.conv_t.data_ptr<float>();
    const float* A = L.a.data_ptr<float>();
    const float* dtb = L.dt_bias.data_ptr<float>();
    const float qs = 1.0f / std::sqrt(static_cast<float>(dk));
    const int64_t r = nv / nk;
    conv_silu_rows(hist.data(), wt, T, C, K, c.data());
    for (int64_t t = 0; t < T; ++t) {
      float* ct = c.data() + t * C;
      for (int64_t g = 0; g < 2 * nk; ++g) {  // q heads, then k heads
        float* v = ct + g * dk;
        const float inv = 1.0f / std::sqrt(dot(v, v, dk) + 1e-6f);
        scale_inplace(v, g < nk ? inv * qs : inv, dk);
      }
      const float* pb = p + t * N + C + nv * dv;
      for (int64_t h = 0; h < nv; ++h) {
        float b, al;
        if (L.ba_grouped) {  // per key head: [b x r, a x r]
          const int64_t kh = h / r, i = h % r;
          b = pb[kh * 2 * r + i];
          al = pb[kh * 2 * r + r + i];
        } else {
          b = pb[h];
          al = pb[nv + h];
        }
        beta[t * nv + h] = sigmoid1(b);
        decay[t * nv + h] = std::exp(A[h] * softplus(al + dtb[h]));
      }
    }
    // the delta rule, per value head (independent: one head per task, the same arithmetic on any thread)
    const float* nw = L.ssm_norm.data_ptr<float>();
    const float ne = static_cast<float>(eps);
    const int64_t HS = dk * dv;
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, HS * (T + replay)));
    at::parallel_for(0, nv, grain, [&](int64_t h0, int64_t h1) {
      // per head: the rows a trim kept of the last forward (state updates only), then this forward's;
      // slot base is read once (and, when this forward has rows a trim could keep, gets the state the
      // replay gives: the committed state it starts from), the final state streamed to the other slot
      std::vector<float> mem(dv), delta(dv), work(HS), o(T * dv);
      std::vector<DeltaRow> rows;
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t kh = L.tiled ? h % nk : h / r;
        rows.clear();
        recorded_rows(rp, replay, h, nv, dk, dv, rows);
        for (int64_t t = 0; t < T; ++t) {
          const float* ct = c.data() + t * C;
          rows.push_back(DeltaRow{ct + kh * dk, ct + nk * dk + kh * dk, ct + 2 * nk * dk + h * dv, decay[t * nv + h],
                                  beta[t * nv + h], o.data() + t * dv});
        }
        delta_rule_head(sp + (base * nv + h) * HS, sp + ((1 - base) * nv + h) * HS, rows.data(), replay + T,
                        T > 1 ? replay : 0, dk, dv, work.data(), mem.data(), delta.data());
        for (int64_t t = 0; t < T; ++t) {
          // the row's inputs, for a replay after a trim (the replay above has read the old ones)
          const DeltaRow& R = rows[replay + t];
          float* rt = rp + (t * nv + h) * W;
          std::memcpy(rt, R.k, dk * sizeof(float));
          std::memcpy(rt + dk, R.v, dv * sizeof(float));
          rt[dk + dv] = R.dec;
          rt[dk + dv + 1] = R.bt;
          // per-head RMSNorm (plain weight) times silu(z)
          const float* ot = o.data() + t * dv;
          const float* z = p + t * N + C + h * dv;
          float* yo = y + t * nv * dv + h * dv;
          const float inv = 1.0f / std::sqrt(dot(ot, ot, dv) / static_cast<float>(dv) + ne);
          for (int64_t j = 0; j < dv; ++j) yo[j] = z[j];
          silu_inplace(yo, dv);
          for (int64_t j = 0; j < dv; ++j) yo[j] = ot[j] * inv * nw[j] * yo[j];
        }
      }
      _mm_sfence();  // the streamed stores are visible before the states are read again
    });
  }

  at::Tensor moe(const HLayer& L, const at::Tensor& h) const {
    const int64_t R = h.size(0), E = static_cast<int64_t>(L.ex_gu.size()), k = L.top_k;
    at::Tensor logits = run(L.router, h).contiguous();
    TORCH_CHECK(logits.size(1) == E, "HybridStack: router gives ", logits.size(1), " scores for ", E, " experts");
    const float* lp = logits.data_ptr<float>();
    // per row: softmax, top k (ties to the lower index), weights renormalised to sum 1
    std::vector<std::vector<std::pair<int64_t, float>>> picks(E);  // expert -> (row, weight)
    std::vector<float> pr(E);
    std::vector<int64_t> idx(E);
    for (int64_t t = 0; t < R; ++t) {
      const float* l = lp + t * E;
      float mx = -INFINITY;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        pr[e] = std::exp(l[e] - mx);
        sum += pr[e];
      }
      for (int64_t e = 0; e < E; ++e) pr[e] /= sum;
      for (int64_t e = 0; e < E; ++e) idx[e] = e;
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                        [&](int64_t a, int64_t b) { return pr[a] > pr[b] || (pr[a] == pr[b] && a < b); });
      float ws = 0.0f;
      for (int64_t j = 0; j < k; ++j) ws += pr[idx[j]];
      for (int64_t j = 0; j < k; ++j) picks[idx[j]].emplace_back(t, L.norm_topk ? pr[idx[j]] / ws : pr[idx[j]]);
    }
    at::Tensor out = at::zeros_like(h);
    float* op = out.data_ptr<float>();
    const int64_t D = h.size(1);
    // experts in increasing index order: a row gets its sum in the same order for any R
    for (int64_t e = 0; e < E; ++e) {
      const auto& pk = picks[e];
      if (pk.empty()) continue;
      at::Tensor xs;
      if (R == 1) {
        xs = h;
      } else {
        std::vector<int64_t> rows;
        rows.reserve(pk.size());
        for (const auto& rw : pk) rows.push_back(rw.first);
        xs = h.index_select(0, at::tensor(rows, at::kLong)).contiguous();
      }
      at::Tensor ye = mlp(L.ex_gu[e], L.ex_down[e], xs).contiguous();
      const float* yp = ye.data_ptr<float>();
      for (size_t i = 0; i < pk.size(); ++i) {
        float* dst = op + pk[i].first * D;
        const float w = pk[i].second;
        for (int64_t d = 0; d < D; ++d) dst[d] += yp[i * D + d] * w;
      }
    }
    if (L.sh_gu >= 0) {
      at::Tensor s = mlp(L.sh_gu, L.sh_down, h).contiguous();
      if (L.sh_gate >= 0) {
        at::Tensor g = run(L.sh_gate, h).contiguous();  // [R, 1]
        float* sp = s.data_ptr<float>();
        const float* gp = g.data_ptr<float>();
        for (int64_t t = 0; t < R; ++t) {
          const float gv = sigmoid1(gp[t * g.size(1)]);
          for (int64_t d = 0; d < D; ++d) sp[t * D + d] = gv * sp[t * D + d];
        }
      }
      out.add_(s);
    }
    return out;
  }

  at::Tensor forward_batch(at::Tensor x, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs,
                           std::vector<at::Tensor> convs, std::vector<at::Tensor> states,
                           std::vector<at::Tensor> records, std::vector<int64_t> bases, std::vector<int64_t> replays,
                           std::vector<int64_t> starts, std::vector<int64_t> rows, at::Tensor cos, at::Tensor sin) {
    bool has_rec = false, has_att = false;
    for (const HLayer& L : layers) (L.recurrent ? has_rec : has_att) = true;
    mtpllm::check_batch("HybridStack", x, ks, vs, starts, rows, cos, has_att);
    const size_t S = rows.size();
    TORCH_CHECK(!has_rec || (convs.size() == S && states.size() == S && records.size() == S && bases.size() == S &&
                             replays.size() == S),
                "HybridStack: one recurrent cache per sequence");
    for (size_t s = 0; has_rec && s < S; ++s) {
      TORCH_CHECK(convs[s].dim() == 3 && states[s].dim() == 5 && records[s].dim() == 4 &&
                      convs[s].scalar_type() == at::kFloat && states[s].scalar_type() == at::kFloat &&
                      records[s].scalar_type() == at::kFloat && convs[s].is_contiguous() &&
                      states[s].is_contiguous() && records[s].is_contiguous(),
                  "HybridStack: recurrent caches float32 [layers, rows, C], [layers, 2, H, dk, dv] and "
                  "[layers, rows, H, dk + dv + 2]");
    }
    x = x.contiguous();
    const int64_t H = n_heads, KV = n_kv, hd = head_dim;
    timer.lap(-1);
    for (const HLayer& L : layers) {
      TORCH_CHECK(L.gu >= 0 || L.router >= 0, "HybridStack: a block without its feed-forward");
      at::Tensor h = mtpllm::rms_norm_rows(x, L.attn_norm, eps);
      if (L.recurrent) {
        at::Tensor p = run(L.proj, h).contiguous();
        timer.lap(0);
        const int64_t N = p.size(1);
        at::Tensor y = at::empty({x.size(0), L.nv * L.dv}, x.options());
        int64_t off = 0;
        for (size_t s = 0; s < S; ++s) {
          TORCH_CHECK(L.slot < convs[s].size(0) && L.slot < states[s].size(0) && L.slot < records[s].size(0),
                      "HybridStack: cache has no slot ", L.slot);
          at::Tensor conv = convs[s].select(0, L.slot), state = states[s].select(0, L.slot);
          at::Tensor record = records[s].select(0, L.slot);
          deltanet_rows(L, p.data_ptr<float>() + off * N, rows[s], N, conv, state, record, bases[s], replays[s],
                        y.data_ptr<float>() + off * L.nv * L.dv);
          off += rows[s];
        }
        timer.lap(1);
        x = x + run(L.out, y);
        timer.lap(2);
      } else {
        at::Tensor p = run(L.qkv, h).contiguous();
        timer.lap(3);
        const int64_t R = p.size(0), W = p.size(1);
        TORCH_CHECK(W == 2 * H * hd + 2 * KV * hd, "HybridStack: attention projections have ", W, " outputs");
        // query heads come with their gates: [H x (q | gate)], then keys, values
        at::Tensor qkv = at::empty({R, (H + 2 * KV) * hd}, x.options());
        at::Tensor gate = at::empty({R, H * hd}, x.options());
        const float* pp = p.data_ptr<float>();
        float* qp = qkv.data_ptr<float>();
        float* gp = gate.data_ptr<float>();
        for (int64_t t = 0; t < R; ++t) {
          const float* pr = pp + t * W;
          for (int64_t i = 0; i < H; ++i) {
            std::memcpy(qp + t * (H + 2 * KV) * hd + i * hd, pr + i * 2 * hd, hd * sizeof(float));
            std::memcpy(gp + t * H * hd + i * hd, pr + i * 2 * hd + hd, hd * sizeof(float));
          }
          std::memcpy(qp + t * (H + 2 * KV) * hd + H * hd, pr + 2 * H * hd, 2 * KV * hd * sizeof(float));
        }
        at::Tensor o = mtpllm::attend_batch("HybridStack", qkv, ks, vs, starts, rows, cos, sin, L.slot, H, KV, hd,
                                            rot_dim, neox, scale, L.q_norm, L.k_norm, qk_eps, window)
                           .contiguous();
        float* op = o.data_ptr<float>();
        for (int64_t t = 0; t < R; ++t) mul_sigmoid(op + t * H * hd, gp + t * H * hd, H * hd);
        timer.lap(4);
        x = x + run(L.o, o);
        timer.lap(5);
      }
      at::Tensor h2 = mtpllm::rms_norm_rows(x, L.ffn_norm, eps);
      if (L.router >= 0) {
        x.add_(moe(L, h2));
      } else {
        x.add_(mlp(L.gu, L.down, h2));
      }
      timer.lap(6);
    }
    return x;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtpllm, m) {
  mtpllm::stack_class<HybridStack>(m, "HybridStack")
      .def("add_part", &HybridStack::add_part)
      .def("add_deltanet", &HybridStack::add_deltanet)
      .def("add_attention", &HybridStack::add_attention)
      .def("set_mlp", &HybridStack::set_mlp)
      .def("set_moe", &HybridStack::set_moe);
  m.def("replay_delta_rule", &replay_delta_rule);
  m.def("deltanet_conv_silu", &deltanet_conv_silu);
}
