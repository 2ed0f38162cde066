// Small fused operators for decoding on the CPU (AVX2 + FMA), replacing dozens of tiny PyTorch
// operators per layer whose dispatch cost dominates once the matrix products are fast:
//
//   rms_norm(x, w, eps)                      x / rms(x) * w, row by row
//   attend_cached(qkv, cos, sin, kc, vc, start, ...)
//       for T <= 32 new tokens at positions [start, start + T): optional per-head RMS norm of q and
//       k, rotary embedding (NeoX or adjacent-pair style, partial rotary), write k and v into the
//       layer's cache at those positions, then causal attention of every query row over the keys
//       [0, start + t] (with window W > 0: the last W of them, [start + t + 1 - W, start + t])
//       -> o [T, H * D].
//
// Every query row is computed by one thread from its own inputs in a fixed order, so a row gives
// bit-identical output whether it is decoded alone or verified in a block of drafts.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <vector>
#include "common.h"

namespace {
using mtpllm::dot;
using mtpllm::exp256;
using mtpllm::hsum;

// p[j] = sc * q . K_j for the keys j < L (rows of D floats): 8 keys at a time, one accumulator each,
// so 8 chains of multiply-adds are in flight instead of one per dot product (which left the scores
// bound by the FMA latency: 1.6 ms of a 29 ms step of the 1.5B at 300 positions), and their 8 sums
// reduced together. A key's score depends only on q, the key and L (which keys form the blocks of 8):
// the same whether its row is decoded alone or verified with others.
// Keys j0 .. j1 - 1 only (j0 a multiple of 8; j1 too unless j1 == L): the blocks are those of the
// whole range 0 .. L - 1, so a key's score does not depend on how the range is cut.
inline void scores(const float* q, const float* K, int64_t D, int64_t L, int64_t j0, int64_t j1, float sc, float* p) {
  int64_t j = j0;
  if (D % 8 == 0)
    for (; j + 8 <= L && j + 8 <= j1; j += 8) {
      __m256 a[8];
      for (int k = 0; k < 8; ++k) a[k] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(K + (j + k) * D + d), a[k]);
      }
      // lane k of s0123 / s4567: the sum of key k's (or k + 4's) low (lanes 0-3) or high half
      const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
      _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(sc)));
    }
  for (; j < j1; ++j) p[j] = dot(q, K + j * D, D) * sc;
}

// acc[d] += sum over keys j0 .. j1 - 1 (in order) of p[j] V[j][d]: 64 dims at a time in 8 vector
// accumulators, then 32 in 4, then one by one, each element's multiply-adds in key order whatever
// the chunks of keys, so chunked calls give the sums of one call over all keys bit for bit.
inline void weighted_values(const float* p, const float* V, int64_t D, int64_t j0, int64_t j1, float* acc) {
  int64_t d = 0;
#ifdef __AVX512F__
  // 128 dims at a time on 512-bit registers (the VNNI build): each element's multiply-adds are the
  // same, in the same key order, so the sums are the 256-bit loops' bit for bit, with half the
  // instructions
  for (; d + 128 <= D; d += 128) {
    __m512 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm512_loadu_ps(acc + d + 16 * c);
    for (int64_t jj = j0; jj < j1; ++jj) {
      const __m512 w = _mm512_set1_ps(p[jj]);
      const float* vr = V + jj * D + d;
      for (int c = 0; c < 8; ++c) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm512_storeu_ps(acc + d + 16 * c, a[c]);
  }
#endif
  for (; d + 64 <= D; d += 64) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + d + 8 * c);
    for (int64_t jj = j0; jj < j1; ++jj) {
      const __m256 w = _mm256_set1_ps(p[jj]);
      const float* vr = V + jj * D + d;
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d + 8 * c, a[c]);
  }
  for (; d + 32 <= D; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8), a2 = _mm256_loadu_ps(acc + d + 16),
           a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t jj = j0; jj < j1; ++jj) {
      const __m256 w = _mm256_set1_ps(p[jj]);
      const float* vr = V + jj * D + d;
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d < D; ++d) {
    float a = acc[d];
    for (int64_t jj = j0; jj < j1; ++jj) a += p[jj] * V[jj * D + d];
    acc[d] = a;
  }
}

inline void rms_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float ss = dot(x, x, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 vr = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vr), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = x[i] * r * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous(), "float32 inputs");
  const int64_t n = w.numel();
  TORCH_CHECK(x.size(-1) == n, "x's last dimension must match the weight");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = xc.numel() / n;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rms_row(xp + r * n, wp, yp + r * n, n, static_cast<float>(eps));
  return y;
}

// rotate one head vector in place: NeoX pairs (i, i + rot/2) or adjacent pairs (2i, 2i + 1)
inline void rope(float* v, const float* c, const float* s, int64_t rot, bool neox) {
  const int64_t h = rot / 2;
  if (neox) {
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
      const __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + h + i);
      const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
      _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
      _mm256_storeu_ps(v + h + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
    }
    for (; i < h; ++i) {
      const float x1 = v[i], x2 = v[h + i];
      v[i] = x1 * c[i] - x2 * s[i];
      v[h + i] = x2 * c[i] + x1 * s[i];
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      const float x1 = v[2 * i], x2 = v[2 * i + 1];
      v[2 * i] = x1 * c[i] - x2 * s[i];
      v[2 * i + 1] = x2 * c[i] + x1 * s[i];
    }
  }
}

at::Tensor attend_cached(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kc,
                         const at::Tensor& vc, int64_t start, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                         int64_t rot_dim, bool neox, double scale, const c10::optional<at::Tensor>& q_norm,
                         const c10::optional<at::Tensor>& k_norm, double eps, int64_t window) {
  const int64_t T = qkv.size(0), D = head_dim, H = n_heads, KV = n_kv;
  TORCH_CHECK(window >= 0, "attention window must be >= 0");
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() &&
              qkv.size(1) == (H + 2 * KV) * D, "qkv: contiguous float32 [T, (H + 2 KV) * D]");
  TORCH_CHECK(H % KV == 0 && rot_dim % 2 == 0 && rot_dim <= D, "bad head configuration");
  TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() &&
              vc.is_contiguous() && kc.dim() == 3 && kc.size(0) == KV && kc.size(2) == D &&
              vc.sizes() == kc.sizes(), "caches: contiguous float32 [KV, max_len, D]");
  const int64_t max_len = kc.size(1);
  TORCH_CHECK(start >= 0 && start + T <= max_len, "positions beyond the cache");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) >= start + T && cos.size(1) == rot_dim / 2 &&
              sin.sizes() == cos.sizes(), "rotary tables too short");
  const bool has_qn = q_norm.has_value() && q_norm->defined();
  const bool has_kn = k_norm.has_value() && k_norm->defined();
  at::Tensor work = qkv.clone();  // q and k are normed/rotated in place
  float* wp = work.data_ptr<float>();
  const int64_t row = (H + 2 * KV) * D;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  const float* qn = has_qn ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = has_kn ? k_norm->data_ptr<float>() : nullptr;
  // 1. norm + rotary on q and k heads, then k and v into the cache
  for (int64_t t = 0; t < T; ++t) {
    float* r = wp + t * row;
    const float* c = cp + (start + t) * (rot_dim / 2);
    const float* s = sp + (start + t) * (rot_dim / 2);
    for (int64_t h = 0; h < H + KV; ++h) {
      float* v = r + h * D;
      const float* nw = h < H ? qn : kn;
      if (nw != nullptr) rms_row(v, nw, v, D, static_cast<float>(eps));
      rope(v, c, s, rot_dim, neox);
    }
    for (int64_t g = 0; g < KV; ++g) {
      std::memcpy(kp + (g * max_len + start + t) * D, r + (H + g) * D, D * sizeof(float));
      std::memcpy(vp + (g * max_len + start + t) * D, r + (H + KV + g) * D, D * sizeof(float));
    }
  }
  // 2. attention. The query vectors (row, head) that share a kv head are taken QCH at a time by one
  // task, which sweeps the keys and values in chunks of CH positions: a chunk is read from L2 once
  // and serves all of the task's queries from L1 (per query vector and per (row, head), the keys and
  // values were streamed from L2 anew, 2 x 150 KB per head at 300 positions for the 1.5B, and that
  // stream bounded the kernel). Each query's arithmetic is unchanged (the same blocks of 8 keys, the
  // same order of multiply-adds per output element, its accumulators kept in memory between chunks),
  // so a row's output is the same bit for bit whether it is decoded alone or verified with others.
  // With a window each query sees its last `window` keys only: its key range starts at lo (its own
  // position's), and its blocks of 8 and chunks count from there, so a row's output still depends on
  // its position alone.
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t group = H / KV;
  const float sc = static_cast<float>(scale);
  constexpr int64_t QCH = 8, CH = 32;  // CH: a multiple of 8, so chunks split no block of 8 keys
  const int64_t nq = T * group, per = (nq + QCH - 1) / QCH;
  // tasks of at least ~64K multiply-adds each: short contexts run on the calling thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, std::min(nq, QCH) * (start + 1) * D));
  const int64_t P = start + T;  // the longest row's key count
  at::parallel_for(0, KV * per, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> pbuf(QCH * P), acc(QCH * D);
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t g = task / per, q0 = (task % per) * QCH, n = std::min(QCH, nq - q0);
      const float* K = kp + g * max_len * D;
      const float* V = vp + g * max_len * D;
      const float* qv[QCH];
      const float* Kv[QCH];  // the query's first key and value
      const float* Vv[QCH];
      float* pv[QCH];
      float* ov[QCH];
      int64_t Lv[QCH], Lmax = 0;
      float inv[QCH];
      for (int64_t i = 0; i < n; ++i) {  // query q0 + i: row t, head h of this kv head's group
        const int64_t t = (q0 + i) / group, h = g * group + (q0 + i) % group;
        const int64_t end = start + t + 1, lo = window > 0 ? std::max<int64_t>(0, end - window) : 0;
        qv[i] = wp + t * row + h * D;
        Kv[i] = K + lo * D;
        Vv[i] = V + lo * D;
        pv[i] = pbuf.data() + i * P;
        ov[i] = op + t * H * D + h * D;
        Lv[i] = end - lo;
        Lmax = std::max(Lmax, Lv[i]);
      }
      for (int64_t j0 = 0; j0 < Lmax; j0 += CH)
        for (int64_t i = 0; i < n; ++i)
          if (j0 < Lv[i]) scores(qv[i], Kv[i], D, Lv[i], j0, std::min(j0 + CH, Lv[i]), sc, pv[i]);
      for (int64_t i = 0; i < n; ++i) {
        float* p = pv[i];
        const int64_t L = Lv[i];
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; ++j) mx = std::max(mx, p[j]);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= L; j += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + j), vmx));
          _mm256_storeu_ps(p + j, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum(vsum);
        for (; j < L; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        inv[i] = 1.0f / sum;
        std::memset(acc.data() + i * D, 0, D * sizeof(float));
      }
      for (int64_t j0 = 0; j0 < Lmax; j0 += CH)
        for (int64_t i = 0; i < n; ++i)
          if (j0 < Lv[i]) weighted_values(pv[i], Vv[i], D, j0, std::min(j0 + CH, Lv[i]), acc.data() + i * D);
      for (int64_t i = 0; i < n; ++i) {
        const float* a = acc.data() + i * D;
        float* o = ov[i];
        const __m256 vi = _mm256_set1_ps(inv[i]);
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), vi));
        for (; d < D; ++d) o[d] = a[d] * inv[i];
      }
    }
  });
  return out;
}

}  // namespace

namespace mtpllm {
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm(x, w, eps); }
at::Tensor attend_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kc,
                       const at::Tensor& vc, int64_t start, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                       int64_t rot_dim, bool neox, double scale, const c10::optional<at::Tensor>& q_norm,
                       const c10::optional<at::Tensor>& k_norm, double eps, int64_t window) {
  return attend_cached(qkv, cos, sin, kc, vc, start, n_heads, n_kv, head_dim, rot_dim, neox, scale, q_norm, k_norm,
                       eps, window);
}
}  // namespace mtpllm

TORCH_LIBRARY_FRAGMENT(mtpllm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("attend_cached(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, int start, int n_heads, "
        "int n_kv, int head_dim, int rot_dim, bool neox, float scale, Tensor? q_norm, Tensor? k_norm, float eps, "
        "int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("attend_cached", &attend_cached);
}
