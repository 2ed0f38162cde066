// Decoder blocks run whole in C++ for decoding and verification blocks (T < 32 rows):
//
//   silu_mul(gu)          gu [T, 2F] (gate | up) -> silu(gate) * up [T, F]
//   argmax_rows(x)        x [T, V] float32 -> int64 [T]: each row's first index of its maximum (torch.argmax's
//                         answer, a NaN counting as the maximum), ~7x faster than it on a 152k vocabulary
//   DecodeStack           a list of pre-norm blocks (Qwen2/Qwen3/Llama shape) over the GGUF kernels:
//     add_layer(...)      one block's weights (the tensors the Python modules hold, shared, not copied)
//     forward(x, k, v, cos, sin, start, first, count)
//                         blocks [first, first + count) over x [T, D] at positions [start, start + T);
//                         k, v: the KV cache [layers, KV, max_len, D]; returns the residual stream
//
// One call per token instead of ~13 PyTorch operators and ~10 module calls per block from Python:
// that dispatch cost was 2.8-4 ms of a 19-20 ms step of the 0.5B (`docs/kernels.md`). The arithmetic
// is the Python path's, operator for operator (the same kernels: gguf_linear_rows, rms_norm_rows,
// attend_rows, silu_mul; additions of the bias and residuals are elementwise float adds), so a block
// gives bit-identical results either way: the Python path stays in use for batched decoding, prompt
// chunks, autograd (MTP training) and the layouts this class does not cover (sliding windows,
// sandwich norms, GELU, other weight formats).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include "common.h"
#include "stack.h"

namespace {
using mtpllm::exp256;

// silu(g) * u for one row of F gates and F ups. sigmoid(g) from e = exp(-|g|) (<= 1, no overflow):
// 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline void silu_mul_row(const float* g, const float* u, float* y, int64_t F) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= F; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_or_ps(gv, sign));  // exp(-|g|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
  for (; i < F; ++i) {
    const float e = std::exp(-std::fabs(g[i]));
    const float inv = 1.0f / (1.0f + e);
    y[i] = g[i] * (g[i] < 0.0f ? e * inv : inv) * u[i];
  }
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.size(1) % 2 == 0,
              "silu_mul: float32 [T, 2F] (gate | up)");
  at::Tensor c = gu.contiguous();
  const int64_t T = c.size(0), F = c.size(1) / 2;
  at::Tensor y = at::empty({T, F}, c.options());
  const float* p = c.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) silu_mul_row(p + t * 2 * F, p + t * 2 * F + F, yp + t * F, F);
  return y;
}

struct Layer {
  std::vector<at::Tensor> qkv_w, o_w, gu_w, down_w;  // GGUF block matrices (gguf_linear's layout)
  std::vector<int64_t> qkv_t, o_t, gu_t, down_t;     // their GGML (or engine) type ids
  at::Tensor qkv_b;                                  // [q + k + v] bias, or undefined
  at::Tensor attn_norm, ffn_norm;
  c10::optional<at::Tensor> q_norm, k_norm;          // Qwen3's per-head norms
  int64_t slot;                                      // the layer's index in the KV cache
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t n_heads, n_kv, head_dim, rot_dim;
  bool neox;
  double scale, eps, qk_eps;
  std::vector<Layer> layers;
  // Per-stage wall time of forward (set_timing, stage_times): attention norm + QKV (+ bias), attention,
  // output projection + residual, FFN norm + gate/up, SiLU * up, FFN down + residual.
  mtpllm::StageClock timer{6};
  int64_t window = 0;  // keys each query row of the attention layers sees: the last `window` (0 = all)

  DecodeStack(int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t rot_dim, bool neox, double scale, double eps,
              double qk_eps)
      : n_heads(n_heads), n_kv(n_kv), head_dim(head_dim), rot_dim(rot_dim), neox(neox), scale(scale), eps(eps),
        qk_eps(qk_eps) {}

  void add_layer(std::vector<at::Tensor> qkv_w, std::vector<int64_t> qkv_t, c10::optional<at::Tensor> qkv_b,
                 std::vector<at::Tensor> o_w, std::vector<int64_t> o_t, std::vector<at::Tensor> gu_w,
                 std::vector<int64_t> gu_t, std::vector<at::Tensor> down_w, std::vector<int64_t> down_t,
                 at::Tensor attn_norm, at::Tensor ffn_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, int64_t slot) {
    auto same = [](const std::vector<at::Tensor>& w, const std::vector<int64_t>& t) {
      TORCH_CHECK(!w.empty() && w.size() == t.size(), "DecodeStack: one type per weight");
    };
    same(qkv_w, qkv_t);
    same(o_w, o_t);
    same(gu_w, gu_t);
    same(down_w, down_t);
    TORCH_CHECK(attn_norm.scalar_type() == at::kFloat && attn_norm.is_contiguous() &&
                    ffn_norm.scalar_type() == at::kFloat && ffn_norm.is_contiguous(),
                "DecodeStack: contiguous float32 norm weights");
    Layer L{std::move(qkv_w), std::move(o_w), std::move(gu_w), std::move(down_w), std::move(qkv_t), std::move(o_t),
            std::move(gu_t), std::move(down_t), qkv_b.has_value() ? *qkv_b : at::Tensor(), attn_norm, ffn_norm,
            q_norm, k_norm, slot};
    layers.push_back(std::move(L));
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  void set_timing(bool on) { timer.set(on); }
  void set_window(int64_t w) {
    TORCH_CHECK(w >= 0, "DecodeStack: window must be >= 0");
    window = w;
  }
  std::vector<double> stage_times() const { return timer.times(); }

  at::Tensor forward(at::Tensor x, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin, int64_t start,
                     int64_t first, int64_t count) {
    return forward_batch(x, {k}, {v}, {start}, {x.size(0)}, cos, sin, first, count);
  }

  // Several sequences' rows in one pass: x [R, D] holds rows[s] consecutive rows of sequence s, at
  // positions [starts[s], starts[s] + rows[s]) of its own cache ks[s], vs[s] ([layers, KV, max_len, D]).
  // The matrix products run over all R rows at once (each row's result is what it gets alone: the
  // row kernels compute every output from its own input row), attention per sequence in its cache.
  at::Tensor forward_batch(at::Tensor x, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs,
                           std::vector<int64_t> starts, std::vector<int64_t> rows, at::Tensor cos, at::Tensor sin,
                           int64_t first, int64_t count) {
    TORCH_CHECK(first >= 0 && count >= 0 && first + count <= size(), "DecodeStack: layers out of range");
    mtpllm::check_batch("DecodeStack", x, ks, vs, starts, rows, cos, true);
    const size_t S = rows.size();
    x = x.contiguous();
    timer.lap(-1);
    for (int64_t i = first; i < first + count; ++i) {
      const Layer& L = layers[i];
      at::Tensor qkv = mtpllm::gguf_linear_rows(mtpllm::rms_norm_rows(x, L.attn_norm, eps), L.qkv_w, L.qkv_t);
      if (L.qkv_b.defined()) qkv.add_(L.qkv_b);
      timer.lap(0);
      at::Tensor o = mtpllm::attend_batch("DecodeStack", qkv, ks, vs, starts, rows, cos, sin, L.slot, n_heads, n_kv,
                                          head_dim, rot_dim, neox, scale, L.q_norm, L.k_norm, qk_eps, window);
      timer.lap(1);
      x = x + mtpllm::gguf_linear_rows(o, L.o_w, L.o_t);
      timer.lap(2);
      at::Tensor gu = mtpllm::gguf_linear_rows(mtpllm::rms_norm_rows(x, L.ffn_norm, eps), L.gu_w, L.gu_t);
      timer.lap(3);
      at::Tensor a = silu_mul(gu);
      timer.lap(4);
      x.add_(mtpllm::gguf_linear_rows(a, L.down_w, L.down_t));
      timer.lap(5);
    }
    return x;
  }
};

// the first index of the maximum of x[0..n) (of the first NaN if there is one, as torch.argmax)
int64_t argmax_row(const float* x, int64_t n) {
  __m256 m[4];
  __m256 nan = _mm256_setzero_ps();
  for (auto& v : m) v = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
      m[j] = _mm256_max_ps(m[j], v);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  float best = -INFINITY;
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  alignas(32) float lanes[8];
  for (const auto& v : m) {
    _mm256_store_ps(lanes, v);
    for (float f : lanes) best = std::max(best, f);
  }
  for (; i < n; ++i) {
    any_nan |= std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 b = _mm256_set1_ps(best);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return 0;  // n == 0 never reaches here (checked by the caller)
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: x must be [T, V > 0] float32");
  x = x.contiguous();
  const int64_t T = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({T}, at::kLong);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) op[t] = argmax_row(xp + t * V, V);
  });
  return out;
}

}  // namespace

namespace mtpllm {
at::Tensor silu_mul_rows(const at::Tensor& gu) { return silu_mul(gu); }
}  // namespace mtpllm

TORCH_LIBRARY_FRAGMENT(mtpllm, m) {
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  mtpllm::stack_class<DecodeStack>(m, "DecodeStack")
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
}

TORCH_LIBRARY_IMPL(mtpllm, CPU, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
}
