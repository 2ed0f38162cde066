// The Gated DeltaNet delta rule over a prompt chunk in chunked (WY / UT) form, per value head on all
// threads: the C++ counterpart of models/deltanet.py `delta_rule_chunked` (transformers'
// torch_chunk_gated_delta_rule), without the per-operator passes, copies and layout changes of the
// PyTorch version.
//
//   deltanet_chunked(q, k, v, g, beta, state) -> (o, final)
//     q, k [T, H, dk] (L2-normalised, q scaled by dk^-1/2), v [T, H, dv], g (log-decay), beta [T, H],
//     state [H, dk, dv] (read only) -> o [T, H, dv], the state after the T rows [H, dk, dv]
//
// Per head and chunk of C = 64 rows (cum = the chunk's cumulative g, gamma(i, j) = exp(cum_i - cum_j)):
//   L = strictly lower (beta_i k_i.k_j gamma(i, j));  (I + L) [U | W] = [beta v | beta exp(cum) k]
//   V' = U - W S;  o = (exp(cum) q) S + (lower incl. diagonal (q_i.k_j gamma(i, j))) V'
//   S = exp(cum_last) S + (exp(cum_last - cum) k)^T V'
// The products per chunk go through PyTorch's matrix product (one thread each inside the per-head
// tasks); the triangular solve is a forward substitution over the 64 rows.
// Decays below e^-40 count as 0 (as in deltanet.py), and the tasks run with subnormals flushed to zero
// (MXCSR FTZ/DAZ, restored after): a fast-forgetting head's products of decays would otherwise
// underflow into subnormal floats, on which the CPU's arithmetic runs several times slower. The
// result agrees with the PyTorch form and the row-by-row recurrence to float32 rounding (the sums
// run in other orders), not bit for bit; prompt chunks are not verified against decoding rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;
constexpr float kDecayFloor = 40.0f;  // deltanet.py DECAY_FLOOR
constexpr float kTiny = 1e-30f;       // deltanet.py TINY

inline float decay(float x) { return x < -kDecayFloor ? 0.0f : std::exp(x); }

// row-major C [m, n] = alpha op(A) op(B) + beta C (beta 0 or 1), with row strides lda, ldb, ldc, through
// PyTorch's matrix product on views of the buffers (one thread inside the per-head tasks)
void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor a = ta ? at::from_blob(const_cast<float*>(A), {k, m}, {lda, 1}, opts).t()
                    : at::from_blob(const_cast<float*>(A), {m, k}, {lda, 1}, opts);
  at::Tensor b = tb ? at::from_blob(const_cast<float*>(B), {n, k}, {ldb, 1}, opts).t()
                    : at::from_blob(const_cast<float*>(B), {k, n}, {ldb, 1}, opts);
  at::Tensor c = at::from_blob(C, {m, n}, {ldc, 1}, opts);
  if (beta == 0.0f) {
    at::mm_out(c, a, b);
    if (alpha != 1.0f) c.mul_(alpha);
  } else {
    c.addmm_(a, b, 1.0f, alpha);
  }
}

struct FlushSubnormals {  // FTZ + DAZ on this thread for the lifetime of the object
  unsigned int saved;
  FlushSubnormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> deltanet_chunked(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g,
                                                    at::Tensor beta, at::Tensor state) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && g.dim() == 2 && g.size(0) == q.size(0) && g.size(1) == q.size(1) &&
                  beta.sizes() == g.sizes() && state.dim() == 3 && state.size(0) == q.size(1) &&
                  state.size(1) == q.size(2) && state.size(2) == v.size(2),
              "deltanet_chunked: q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state [H, dk, dv]");
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "deltanet_chunked: float32 CPU tensors");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  g = g.contiguous();
  beta = beta.contiguous();
  state = state.contiguous();
  const int64_t T = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2), W = dv + dk;
  at::Tensor o = at::empty({T, H, dv}, v.options());
  at::Tensor final_state = at::empty({H, dk, dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *sp = state.data_ptr<float>();
  float *op = o.data_ptr<float>(), *fp = final_state.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    FlushSubnormals ftz;
    const int64_t C = kChunk;
    std::vector<float> S(dk * dv), Q(C * dk), K(C * dk), KD(C * dk), X(C * W), L(C * C), P(C * C), G(C * C),
        O(C * dv), cum(C);
    for (int64_t h = h0; h < h1; ++h) {
      std::copy(sp + h * dk * dv, sp + (h + 1) * dk * dv, S.begin());
      for (int64_t c0 = 0; c0 < T; c0 += C) {
        const int64_t n = std::min(C, T - c0);
        float acc = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = c0 + i;
          const float* qr = qp + (t * H + h) * dk;
          const float* kr = kp + (t * H + h) * dk;
          const float* vr = vp + (t * H + h) * dv;
          acc += gp[t * H + h];
          cum[i] = acc;
          const float b = bp[t * H + h], e = decay(acc);
          float* x = X.data() + i * W;  // right-hand side [beta v | beta exp(cum) k]
          for (int64_t j = 0; j < dv; ++j) x[j] = b * vr[j];
          for (int64_t j = 0; j < dk; ++j) x[dv + j] = b * e * kr[j];
          std::copy(kr, kr + dk, K.data() + i * dk);
          std::copy(qr, qr + dk, Q.data() + i * dk);
        }
        for (int64_t i = 0; i < n; ++i)  // gamma(i, j), j <= i: read by the substitution and by P
          for (int64_t j = 0; j <= i; ++j) G[i * C + j] = decay(cum[i] - cum[j]);
        // Gram matrices: L = K K^T, P = Q K^T (n x n)
        gemm_rm(false, true, n, n, dk, 1.0f, K.data(), dk, K.data(), dk, 0.0f, L.data(), C);
        gemm_rm(false, true, n, n, dk, 1.0f, Q.data(), dk, K.data(), dk, 0.0f, P.data(), C);
        // forward substitution: X_i -= sum_{j<i} beta_i (k_i.k_j) gamma(i, j) X_j
        for (int64_t i = 1; i < n; ++i) {
          const float b = bp[(c0 + i) * H + h];
          float* xi = X.data() + i * W;
          for (int64_t j = 0; j < i; ++j) {
            const float l = b * L[i * C + j] * G[i * C + j];
            if (l == 0.0f) continue;
            const float* xj = X.data() + j * W;
            for (int64_t m = 0; m < W; ++m) xi[m] -= l * xj[m];
          }
        }
        for (int64_t i = 0; i < n; ++i) {  // W's entries are products of decays: none below kTiny
          float* w = X.data() + i * W + dv;
          for (int64_t m = 0; m < dk; ++m)
            if (std::fabs(w[m]) < kTiny) w[m] = 0.0f;
        }
        // V' = U - W S (in place of U, the first dv columns of X)
        gemm_rm(false, false, n, dv, dk, -1.0f, X.data() + dv, W, S.data(), dv, 1.0f, X.data(), W);
        // o = (exp(cum) q) S + (lower incl. diagonal of P gamma) V'
        for (int64_t i = 0; i < n; ++i) {
          const float e = decay(cum[i]);
          for (int64_t j = 0; j < dk; ++j) Q[i * dk + j] *= e;
          for (int64_t j = 0; j < n; ++j) P[i * C + j] = j <= i ? P[i * C + j] * G[i * C + j] : 0.0f;
        }
        gemm_rm(false, false, n, dv, dk, 1.0f, Q.data(), dk, S.data(), dv, 0.0f, O.data(), dv);
        gemm_rm(false, false, n, dv, n, 1.0f, P.data(), C, X.data(), W, 1.0f, O.data(), dv);
        for (int64_t i = 0; i < n; ++i)
          std::copy(O.data() + i * dv, O.data() + (i + 1) * dv, op + ((c0 + i) * H + h) * dv);
        // S = exp(cum_last) S + (exp(cum_last - cum) k)^T V'
        const float last = cum[n - 1], el = decay(last);
        for (int64_t i = 0; i < n; ++i) {
          const float e = decay(last - cum[i]);
          for (int64_t j = 0; j < dk; ++j) KD[i * dk + j] = e * K[i * dk + j];
        }
        for (int64_t m = 0; m < dk * dv; ++m) S[m] *= el;
        gemm_rm(true, false, dk, dv, n, 1.0f, KD.data(), dk, X.data(), W, 1.0f, S.data(), dv);
      }
      std::copy(S.begin(), S.end(), fp + h * dk * dv);
    }
  });
  return {o, final_state};
}

TORCH_LIBRARY_FRAGMENT(mtpllm, m) {
  m.def("deltanet_chunked", &deltanet_chunked);
}
