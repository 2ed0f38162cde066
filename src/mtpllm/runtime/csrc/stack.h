// What the two decoding stacks share (DecodeStack, decode.cpp; HybridStack, hybrid.cpp): the
// kernels they call, the checks of a batch's arguments, stage timing, attention over a batch of
// sequences, and the constructor and methods both register.
#pragma once
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <chrono>
#include <vector>

namespace mtpllm {
at::Tensor gguf_linear_rows(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types);
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor attend_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kc,
                       const at::Tensor& vc, int64_t start, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                       int64_t rot_dim, bool neox, double scale, const c10::optional<at::Tensor>& q_norm,
                       const c10::optional<at::Tensor>& k_norm, double eps, int64_t window);
at::Tensor silu_mul_rows(const at::Tensor& gu);

// Per-stage wall time of a stack's forward passes (DecodeStack, HybridStack), summed over layers and
// calls while timing is on (off by default: docs/kernels.md): lap(-1) starts the clock, lap(i) adds
// the time since the last lap to stage i. Off, a lap reads no clock.
class StageClock {
 public:
  explicit StageClock(int stages) : ms_(stages, 0.0) {}
  // on or off; the sums start again from zero either way
  void set(bool on) {
    on_ = on;
    std::fill(ms_.begin(), ms_.end(), 0.0);
  }
  std::vector<double> times() const { return ms_; }
  void lap(int stage) {
    if (!on_) return;
    const clock::time_point t1 = clock::now();
    if (stage >= 0) ms_[stage] += std::chrono::duration<double, std::milli>(t1 - t0_).count();
    t0_ = t1;
  }

 private:
  using clock = std::chrono::steady_clock;
  bool on_ = false;
  std::vector<double> ms_;
  clock::time_point t0_;
};

// The arguments of a stack's forward_batch over S = rows.size() sequences: x float32 [R, D] holds
// rows[s] > 0 consecutive rows of sequence s, at positions [starts[s], starts[s] + rows[s]); with
// `kv`, those positions lie in the sequence's KV cache ks[s], vs[s] ([layers, KV, max_len, hd]) and
// in the rotary tables (cos). `who` names the stack in the messages.
inline void check_batch(const char* who, const at::Tensor& x, const std::vector<at::Tensor>& ks,
                        const std::vector<at::Tensor>& vs, const std::vector<int64_t>& starts,
                        const std::vector<int64_t>& rows, const at::Tensor& cos, bool kv) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, who, ": x float32 [R, D]");
  const size_t S = rows.size();
  TORCH_CHECK(S > 0 && starts.size() == S, who, ": one start and row count per sequence");
  TORCH_CHECK(!kv || (ks.size() == S && vs.size() == S), who, ": one KV cache per sequence");
  int64_t total = 0;
  for (size_t s = 0; s < S; ++s) {
    TORCH_CHECK(rows[s] > 0 && starts[s] >= 0, who, ": bad rows");
    if (kv) {
      TORCH_CHECK(ks[s].dim() == 4 && vs[s].sizes() == ks[s].sizes() && starts[s] + rows[s] <= ks[s].size(2) &&
                      starts[s] + rows[s] <= cos.size(0),
                  who, ": sequence rows out of its cache or rotary range");
    }
    total += rows[s];
  }
  TORCH_CHECK(total == x.size(0), who, ": row counts do not add up to x's rows");
}

// Attention of one layer (`slot` of the caches) for every sequence of a batch: qkv [R, (H + 2 KV) hd]
// holds rows[s] rows of sequence s (checked by check_batch) -> o [R, H hd], each sequence's rows
// attending in its own cache (attend_rows)
inline at::Tensor attend_batch(const char* who, const at::Tensor& qkv, const std::vector<at::Tensor>& ks,
                               const std::vector<at::Tensor>& vs, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& rows, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t slot, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t rot_dim,
                               bool neox, double scale, const c10::optional<at::Tensor>& q_norm,
                               const c10::optional<at::Tensor>& k_norm, double eps, int64_t window) {
  const size_t S = rows.size();
  std::vector<at::Tensor> parts(S);
  int64_t off = 0;
  for (size_t s = 0; s < S; ++s) {
    TORCH_CHECK(slot < ks[s].size(0), who, ": cache has no slot ", slot);
    parts[s] = attend_rows(S == 1 ? qkv : qkv.narrow(0, off, rows[s]), cos, sin, ks[s].select(0, slot),
                           vs[s].select(0, slot), starts[s], n_heads, n_kv, head_dim, rot_dim, neox, scale, q_norm,
                           k_norm, eps, window);
    off += rows[s];
  }
  return S == 1 ? parts[0] : at::cat(parts, 0);
}

// Registers a stack class C with what both have: the constructor (n_heads, n_kv, head_dim, rot_dim,
// neox, scale, eps, qk_eps), size, forward_batch, set_timing, stage_times and set_window (the keys
// each query row of its attention layers sees: the last `window`, 0 = all)
template <class C>
torch::class_<C> stack_class(torch::Library& m, const char* name) {
  return m.class_<C>(name)
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, bool, double, double, double>())
      .def("size", &C::size)
      .def("forward_batch", &C::forward_batch)
      .def("set_timing", &C::set_timing)
      .def("stage_times", &C::stage_times)
      .def("set_window", &C::set_window);
}

}  // namespace mtpllm
