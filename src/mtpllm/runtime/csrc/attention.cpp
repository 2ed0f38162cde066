// Small fused operators for decoding on the CPU (AVX2 + FMA), replacing dozens of tiny PyTorch
// operators per layer whose dispatch cost dominates once the matrix products are fast:
//
//   rms_norm(x, w, eps)                      x / rms(x) * w, row by row
//   attend_cached(qkv, cos, sin, kc, vc, start, ...)
//       for T < 32 new tokens (linear.py's GEMM_MIN_ROWS) at positions [start, start + T): optional
//       per-head RMS norm of q and k, rotary embedding (NeoX or adjacent-pair style, partial
//       rotary), write k and v into the layer's cache at those positions, then causal attention of every query row over the keys
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

// Lanes of query vectors for the query-parallel attention below: 8 on 256-bit registers, 16 on
// 512-bit ones (the VNNI build, for tasks of more than 8 queries: one decoded row of the 0.5B has 7
// per kv head, which would leave 9 of 16 lanes idle). Every operation is lane-wise and the same on
// both widths (the same multiply-adds, exp256's arithmetic lane by lane), so a query's results do
// not depend on the register width, the lane it occupies or the other queries beside it.
struct V256 {
  static constexpr int64_t W = 8;
  typedef __m256 v;
  static v zero() { return _mm256_setzero_ps(); }
  static v load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, v x) { _mm256_storeu_ps(p, x); }
  static v set1(float x) { return _mm256_set1_ps(x); }
  static v fma(v a, v b, v c) { return _mm256_fmadd_ps(a, b, c); }
  static v max(v a, v b) { return _mm256_max_ps(a, b); }
  static v add(v a, v b) { return _mm256_add_ps(a, b); }
  static v mul(v a, v b) { return _mm256_mul_ps(a, b); }
  // exp(p - mx), and 0 where p is -inf (a key outside the query's range)
  static v exp_masked(v p, v mx) {
    const __m256 keep = _mm256_cmp_ps(p, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm256_and_ps(keep, exp256(_mm256_sub_ps(p, mx)));
  }
};
#ifdef __AVX512F__
struct V512 {
  static constexpr int64_t W = 16;
  typedef __m512 v;
  static v zero() { return _mm512_setzero_ps(); }
  static v load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, v x) { _mm512_storeu_ps(p, x); }
  static v set1(float x) { return _mm512_set1_ps(x); }
  static v fma(v a, v b, v c) { return _mm512_fmadd_ps(a, b, c); }
  static v max(v a, v b) { return _mm512_max_ps(a, b); }
  static v add(v a, v b) { return _mm512_add_ps(a, b); }
  static v mul(v a, v b) { return _mm512_mul_ps(a, b); }
  static v exp_masked(v p, v mx) {  // exp256 on each half: the same arithmetic lane by lane
    const __mmask16 keep = _mm512_cmp_ps_mask(p, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512d x = _mm512_castps_pd(_mm512_sub_ps(p, mx));
    const __m256d lo = _mm256_castps_pd(exp256(_mm256_castpd_ps(_mm512_castpd512_pd256(x))));
    const __m256d hi = _mm256_castps_pd(exp256(_mm256_castpd_ps(_mm512_extractf64x4_pd(x, 1))));
    return _mm512_maskz_mov_ps(keep, _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1)));
  }
};
#endif

// P.V for NQ queries (their weights at w, QW per key) over L keys and 4 QW output elements (vals:
// the first key's, D floats per key): each sum in key order, one multiply-add per key, as in the
// general loop below (register-resident accumulators where it keeps them in memory)
template <class VT, int NQ>
inline void pv_tile(typename VT::v (&s)[4][4], const float* vals, const float* w, int64_t L, int64_t D) {
  constexpr int64_t QW = VT::W;
  typedef typename VT::v vq;
  for (int64_t r = 0; r < L; ++r) {
    const float* vr = vals + r * D;
    const vq v0 = VT::load(vr), v1 = VT::load(vr + QW), v2 = VT::load(vr + 2 * QW), v3 = VT::load(vr + 3 * QW);
    const float* wr = w + r * QW;
    for (int i = 0; i < NQ; ++i) {
      const vq wi = VT::set1(wr[i]);
      s[i][0] = VT::fma(wi, v0, s[i][0]);
      s[i][1] = VT::fma(wi, v1, s[i][1]);
      s[i][2] = VT::fma(wi, v2, s[i][2]);
      s[i][3] = VT::fma(wi, v3, s[i][3]);
    }
  }
}

// Attention of n (<= 64) query vectors that share one kv head, QW queries per vector lane-wise,
// in one sweep over the keys and values in chunks of CH positions aligned to multiples of CH (each
// chunk read from memory once for all n queries: deep in a context the cache is streamed once per
// kv head whatever the number of verification rows, where a query at a time streamed it once per
// query, and the scores never leave L1). Per chunk: the scores of 8 keys at a time (each score one
// chain of multiply-adds over the head dimension, in order), then the softmax online: the running
// max m, the weights exp(s - m), and the sum and the weighted values rescaled by exp(m_old - m)
// when m grows (exactly 1 when it does not). A query sees keys [lo[i], end[i]); keys of a chunk
// outside its range get score -inf and weight exactly 0, and a chunk with none of its keys leaves
// its state unchanged, so its output is bit for bit the same whatever queries share its task: a
// row decoded alone and the same row verified with drafts agree.
// scratch: nsb * QW * (2 D + ACH) floats, nsb = ceil(n / QW).
constexpr int64_t ACH = 64, PF_CHUNKS = 2, PF_SPREAD = 128;
// prefetch `bytes` of keys and of values from position j on (rows of D floats), into L1 or L2
template <bool L1>
__attribute__((always_inline)) inline void prefetch_kv(const float* K, const float* V, int64_t j, int64_t bytes,
                                                       int64_t D) {
  const char* kb = reinterpret_cast<const char*>(K + j * D);
  const char* vb = reinterpret_cast<const char*>(V + j * D);
  for (int64_t o = 0; o < bytes; o += 64) {
    if constexpr (L1) {
      _mm_prefetch(kb + o, _MM_HINT_T0);
      _mm_prefetch(vb + o, _MM_HINT_T0);
    } else {
      _mm_prefetch(kb + o, _MM_HINT_T1);
      _mm_prefetch(vb + o, _MM_HINT_T1);
    }
  }
}
template <class VT>
void attend_queries_t(int64_t n, const float* const* qv, float* const* ov, const int64_t* lo, const int64_t* end,
                    const float* K, const float* V, int64_t D, float sc, float* scratch) {
  constexpr int64_t QW = VT::W;
  typedef typename VT::v vq;
  const int64_t nsb = (n + QW - 1) / QW;
  float* qT = scratch;                   // [nsb][D][QW] queries, transposed
  float* acc = qT + nsb * D * QW;        // [nsb][QW][D] weighted sums of values
  float* sb = acc + nsb * QW * D;        // [ACH][QW] one chunk's scores, then weights
  int64_t lmin[8], lmax[8];              // per sub-block (n <= 8 QW)
  vq mrun[8], lrun[8];                   // running max and sum per lane
  for (int64_t b = 0; b < nsb; ++b) {
    const int64_t m = std::min(QW, n - b * QW);
    lmin[b] = INT64_MAX;
    lmax[b] = 0;
    float* t = qT + b * D * QW;
    for (int64_t i = 0; i < QW; ++i) {
      const float* q = i < m ? qv[b * QW + i] : nullptr;
      for (int64_t d = 0; d < D; ++d) t[d * QW + i] = q ? q[d] : 0.0f;
      if (q) lmin[b] = std::min(lmin[b], lo[b * QW + i]), lmax[b] = std::max(lmax[b], end[b * QW + i]);
    }
    mrun[b] = VT::set1(-INFINITY);
    lrun[b] = VT::zero();
  }
  std::memset(acc, 0, nsb * QW * D * sizeof(float));
  int64_t Lmin = INT64_MAX, Lmax = 0;
  for (int64_t b = 0; b < nsb; ++b) Lmin = std::min(Lmin, lmin[b]), Lmax = std::max(Lmax, lmax[b]);
  const vq vsc = VT::set1(sc);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  const bool spread = ::mtpllm::tune_attn_prefetch() == 1;
  for (int64_t c = (Lmin / ACH) * ACH; c < Lmax; c += ACH) {
    // the keys and values ahead, on their way from memory while this chunk is computed (two streams
    // that alternate chunk by chunk defeat the hardware prefetcher: one decoded row at 32K positions
    // took 26% longer without this). `attn_prefetch` (common.h): 0, the chunk after next into L1 at
    // the start of each chunk; 1, below: the keys PF_SPREAD positions ahead of each block of 8, into L2
    const int64_t pa = c + PF_CHUNKS * ACH, pz = std::min(pa + ACH, Lmax);
    if (!spread && pa < pz) prefetch_kv<true>(K, V, pa, (pz - pa) * row_bytes, D);
    for (int64_t b = 0; b < nsb; ++b) {
      const int64_t a = std::max(c, lmin[b]), z = std::min(c + ACH, lmax[b]);
      if (a >= z) continue;
      const int64_t m = std::min(QW, n - b * QW);
      const float* t = qT + b * D * QW;
      // scores of keys a .. z - 1 at rows j - a of sb
      int64_t j = a;
      for (; j + 8 <= z; j += 8) {
        vq s8[8];
        for (int k = 0; k < 8; ++k) s8[k] = VT::zero();
        const float* kr = K + j * D;
        if (spread && b == 0 && j + PF_SPREAD + 8 <= Lmax)
          prefetch_kv<false>(K, V, j + PF_SPREAD, 8 * row_bytes, D);
        for (int64_t d = 0; d < D; ++d) {
          const vq qd = VT::load(t + d * QW);
          for (int k = 0; k < 8; ++k) s8[k] = VT::fma(VT::set1(kr[k * D + d]), qd, s8[k]);
        }
        for (int k = 0; k < 8; ++k) VT::store(sb + (j + k - a) * QW, VT::mul(s8[k], vsc));
      }
      for (; j < z; ++j) {
        vq s0 = VT::zero();
        const float* kr = K + j * D;
        for (int64_t d = 0; d < D; ++d) s0 = VT::fma(VT::set1(kr[d]), VT::load(t + d * QW), s0);
        VT::store(sb + (j - a) * QW, VT::mul(s0, vsc));
      }
      for (int64_t i = 0; i < m; ++i) {  // keys outside query i's own range
        const int64_t qlo = lo[b * QW + i], qend = end[b * QW + i];
        for (int64_t jj = a; jj < std::min(z, qlo); ++jj) sb[(jj - a) * QW + i] = -INFINITY;
        for (int64_t jj = std::max(a, qend); jj < z; ++jj) sb[(jj - a) * QW + i] = -INFINITY;
      }
      const int64_t L = z - a;
      vq cm = VT::set1(-INFINITY);
      for (int64_t r = 0; r < L; ++r) cm = VT::max(cm, VT::load(sb + r * QW));
      const vq mnew = VT::max(mrun[b], cm);
      const vq scale = VT::exp_masked(mrun[b], mnew);  // exp(m_old - m); 0 where nothing was seen yet
      mrun[b] = mnew;
      vq l = VT::mul(lrun[b], scale);
      for (int64_t r = 0; r < L; ++r) {
        const vq e = VT::exp_masked(VT::load(sb + r * QW), mnew);
        VT::store(sb + r * QW, e);
        l = VT::add(l, e);
      }
      lrun[b] = l;
      float scl[QW];
      VT::store(scl, scale);
      // weighted values: each query's sums rescaled, then its multiply-adds in key order
      for (int64_t d0 = 0; d0 < D; d0 += 4 * QW) {
        const int64_t nv = std::min<int64_t>(4, (D - d0) / QW);
        for (int64_t i0 = 0; i0 < m; i0 += 4) {
          const int64_t nq = std::min<int64_t>(4, m - i0);
          vq s[4][4];
          for (int64_t i = 0; i < nq; ++i) {
            const vq si = VT::set1(scl[i0 + i]);
            for (int64_t v = 0; v < nv; ++v) s[i][v] = VT::mul(VT::load(acc + (b * QW + i0 + i) * D + d0 + v * QW), si);
          }
          // a group of 4 queries and its remainder (one decoded row of the 1.5B: 6 queries per kv head)
          if (nv == 4 && nq == 4) {
            pv_tile<VT, 4>(s, V + a * D + d0, sb + i0, L, D);
          } else if (nv == 4 && nq == 3) {
            pv_tile<VT, 3>(s, V + a * D + d0, sb + i0, L, D);
          } else if (nv == 4 && nq == 2) {
            pv_tile<VT, 2>(s, V + a * D + d0, sb + i0, L, D);
          } else if (nv == 4 && nq == 1) {
            pv_tile<VT, 1>(s, V + a * D + d0, sb + i0, L, D);
          } else {
            for (int64_t r = 0; r < L; ++r) {
              const float* vr = V + (a + r) * D + d0;
              const float* wr = sb + r * QW + i0;
              for (int64_t i = 0; i < nq; ++i) {
                const vq wi = VT::set1(wr[i]);
                for (int64_t v = 0; v < nv; ++v) s[i][v] = VT::fma(wi, VT::load(vr + v * QW), s[i][v]);
              }
            }
          }
          for (int64_t i = 0; i < nq; ++i)
            for (int64_t v = 0; v < nv; ++v) VT::store(acc + (b * QW + i0 + i) * D + d0 + v * QW, s[i][v]);
        }
      }
    }
  }
  for (int64_t b = 0; b < nsb; ++b) {
    float sums[QW];
    VT::store(sums, lrun[b]);
    for (int64_t i = 0; i < std::min(QW, n - b * QW); ++i) {
      const float* ai = acc + (b * QW + i) * D;
      float* o = ov[b * QW + i];
      const vq vi = VT::set1(1.0f / sums[i]);
      for (int64_t d = 0; d < D; d += QW) VT::store(o + d, VT::mul(VT::load(ai + d), vi));
    }
  }
}

// the register width by the number of queries (see V256 / V512): the same bits either way
void attend_queries(int64_t n, const float* const* qv, float* const* ov, const int64_t* lo, const int64_t* end,
                    const float* K, const float* V, int64_t D, float sc, float* scratch) {
#ifdef __AVX512F__
  if (n > 8 && D % 16 == 0) return attend_queries_t<V512>(n, qv, ov, lo, end, K, V, D, sc, scratch);
#endif
  attend_queries_t<V256>(n, qv, ov, lo, end, K, V, D, sc, scratch);
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
  // task, which sweeps the keys and values in chunks of CH positions: a chunk is read from memory
  // once and serves all of the task's queries from L1 (per query vector and per (row, head), the
  // keys and values were streamed anew, 2 x 150 KB per head at 300 positions for the 1.5B, and that
  // stream bounded the kernel). QCH covers every query of a kv head's group where the threads do not
  // need more tasks than kv heads: deep in a long context the keys and values (16 MB per kv head
  // and layer at 32K positions for the 0.5B) come from DRAM, and a verification block of k + 1 rows
  // then reads them once, as one decoded row does, instead of once per 8 query vectors (at 32K, 2
  // rows of the 0.5B cost ~1.7 one-row steps). Each query's arithmetic is unchanged (the same blocks
  // of 8 keys, the same order of multiply-adds per output element, its accumulators kept in memory
  // between chunks), so a row's output is the same bit for bit whether it is decoded alone or
  // verified with others, whatever the grouping.
  // With a window each query sees its last `window` keys only: its key range starts at lo (its own
  // position's), and its blocks of 8 and chunks count from there, so a row's output still depends on
  // its position alone.
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t group = H / KV;
  const float sc = static_cast<float>(scale);
  constexpr int64_t QMIN = 8, QMAX = 64, CH = 32;  // CH: a multiple of 8, so chunks split no block of 8 keys
  const int64_t nq = T * group;
  // tasks per kv head: enough for every thread, each of at least QMIN and at most QMAX queries
  const int64_t want = (at::get_num_threads() + KV - 1) / KV;
  const int64_t QCH = std::min(QMAX, std::max(QMIN, (nq + want - 1) / want));
  const int64_t per = (nq + QCH - 1) / QCH;
  // tasks of at least ~64K multiply-adds each: short contexts run on the calling thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, std::min(nq, QCH) * (start + 1) * D));
  const int64_t P = start + T;  // the longest row's key count
  if (D % 8 == 0) {  // the query-parallel kernel (attend_queries)
    at::parallel_for(0, KV * per, grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> scratch(((QCH + 15) / 16) * 16 * (2 * D + ACH));  // nsb * QW at either width
      const float* qv[QMAX];
      float* ov[QMAX];
      int64_t lo[QMAX], end[QMAX];
      for (int64_t task = i0; task < i1; ++task) {
        const int64_t g = task / per, q0 = (task % per) * QCH, n = std::min(QCH, nq - q0);
        for (int64_t i = 0; i < n; ++i) {  // query q0 + i: row t, head h of this kv head's group
          const int64_t t = (q0 + i) / group, h = g * group + (q0 + i) % group;
          end[i] = start + t + 1;
          lo[i] = window > 0 ? std::max<int64_t>(0, end[i] - window) : 0;
          qv[i] = wp + t * row + h * D;
          ov[i] = op + t * H * D + h * D;
        }
        attend_queries(n, qv, ov, lo, end, kp + g * max_len * D, vp + g * max_len * D, D, sc, scratch.data());
      }
    });
    return out;
  }
  at::parallel_for(0, KV * per, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> pbuf(QCH * P), acc(QCH * D);
    const float* qv[QMAX];
    const float* Kv[QMAX];  // the query's first key and value
    const float* Vv[QMAX];
    float* pv[QMAX];
    float* ov[QMAX];
    int64_t Lv[QMAX];
    float inv[QMAX];
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t g = task / per, q0 = (task % per) * QCH, n = std::min(QCH, nq - q0);
      const float* K = kp + g * max_len * D;
      const float* V = vp + g * max_len * D;
      int64_t Lmax = 0;
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
