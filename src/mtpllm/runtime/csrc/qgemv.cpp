// Block-quantized matrix-vector products for CPU decoding (AVX2 + FMA + F16C).
//
// Weights: int8 codes W[N, K] with one float scale per group of G (16 or 32) weights and, for
// asymmetric types (Q4_K, Q5_K, ...), one float min per group: w = scale * q - min. Every GGUF
// type the engine maps here is stored this way without requantization (the file's integers).
// Activations: each row of x is quantized to int8 per block of 32 with its own scale
// (d = max|x| / 127, as llama.cpp's Q8_0), then y[m, n] = sum over blocks of
// d_x * scale_w * int_dot(q_x, q_w) - sum over groups of min_w * sum(x_hat).
//
// Every output is computed by one thread in a fixed order from its own row of x only, so a row's
// result does not depend on how many rows are in the batch or on the thread count: verification
// of k+1 tokens gives bit-identical logits to k+1 single-token steps.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <vector>
#include "common.h"

namespace {
using mtpllm::hsum;
using mtpllm::quantize_row;

// R rows of x against one weight row: the weight block is loaded once for all R rows.
template <int G, bool MINS, bool NIB, int R>
inline void dot_rows(const uint8_t* w, const float* ws, const float* wm, const int8_t* xq, const float* xd,
                     const float* xs, int64_t K, float* out, int64_t out_stride) {
  const int64_t nb = K / 32, ng = K / G;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv, aw;
    if (NIB) {  // 16 bytes: codes j (low nibble) and j + 16 (high nibble), unsigned 0..15
      _mm_prefetch(reinterpret_cast<const char*>(w + b * 16 + PF), _MM_HINT_T0);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      const __m128i m4 = _mm_set1_epi8(0x0F);
      aw = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
      wv = aw;
    } else {  // 32 signed int8 codes: |w| as the unsigned operand, the sign moved onto x
      _mm_prefetch(reinterpret_cast<const char*>(w + b * 32 + PF), _MM_HINT_T0);
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
      aw = _mm256_sign_epi8(wv, wv);
    }
    __m256 sw;
    if (G == 32) {
      sw = _mm256_set1_ps(ws[b]);
    } else {
      sw = _mm256_set_m128(_mm_set1_ps(ws[2 * b + 1]), _mm_set1_ps(ws[2 * b]));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * 32));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, NIB ? xv : _mm256_sign_epi8(xv, wv)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sw, _mm256_set1_ps(xd[r * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float v = hsum(acc[r]);
    if (MINS) {
      const float* xsr = xs + r * ng;
      __m256 macc = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= ng; g += 8) macc = _mm256_fmadd_ps(_mm256_loadu_ps(wm + g), _mm256_loadu_ps(xsr + g), macc);
      float mn = hsum(macc);
      for (; g < ng; ++g) mn += wm[g] * xsr[g];
      v -= mn;
    }
    out[r * out_stride] = v;
  }
}

template <int G, bool MINS, bool NIB>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* ws, const float* wm,
         int64_t N, float* y) {
  const int64_t nb = K / 32, ng = K / G;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(MINS ? M * ng : 1);
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x + m * K, K, xq.data() + m * K, xd.data() + m * nb, MINS ? xs.data() + m * ng : nullptr, G);
  }
  at::parallel_for(0, N, mtpllm::grain_rows(K, M), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * (NIB ? K / 2 : K);
      const float* wsr = ws + n * ng;
      const float* wmr = MINS ? wm + n * ng : nullptr;
      int64_t m = 0;
      // rows in tiles of up to 4 (the weight block is decoded once per tile); every row's sum is
      // accumulated in the same order whatever its tile, so results do not depend on M
      for (; m + 4 <= M; m += 4)
        dot_rows<G, MINS, NIB, 4>(wr, wsr, wmr, xq.data() + m * K, xd.data() + m * nb, xs.data() + (MINS ? m * ng : 0), K, y + m * N + n, N);
      const int64_t rest = M - m;
      if (rest == 3)
        dot_rows<G, MINS, NIB, 3>(wr, wsr, wmr, xq.data() + m * K, xd.data() + m * nb, xs.data() + (MINS ? m * ng : 0), K, y + m * N + n, N);
      else if (rest == 2)
        dot_rows<G, MINS, NIB, 2>(wr, wsr, wmr, xq.data() + m * K, xd.data() + m * nb, xs.data() + (MINS ? m * ng : 0), K, y + m * N + n, N);
      else if (rest == 1)
        dot_rows<G, MINS, NIB, 1>(wr, wsr, wmr, xq.data() + m * K, xd.data() + m * nb, xs.data() + (MINS ? m * ng : 0), K, y + m * N + n, N);
    }
  });
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kChar || w.scalar_type() == at::kByte),
              "w: contiguous int8 codes [N, K] or uint8 nibble pairs [N, K/2]");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  const bool nib = w.scalar_type() == at::kByte;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == (nib ? K / 2 : K), "shape mismatch or K not a multiple of 32");
  TORCH_CHECK(!nib || group == 32, "nibble codes need group 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / group),
              "scales: float32 [N, K/group]");
  const bool has_min = mins.has_value() && mins->defined();
  if (has_min) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->numel() == N * (K / group),
                "mins: float32 [N, K/group]");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* wm = has_min ? mins->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (nib) {
    has_min ? run<32, true, true>(xp, M, K, wp, sp, wm, N, yp) : run<32, false, true>(xp, M, K, wp, sp, wm, N, yp);
  } else if (group == 32) {
    has_min ? run<32, true, false>(xp, M, K, wp, sp, wm, N, yp) : run<32, false, false>(xp, M, K, wp, sp, wm, N, yp);
  } else {
    has_min ? run<16, true, false>(xp, M, K, wp, sp, wm, N, yp) : run<16, false, false>(xp, M, K, wp, sp, wm, N, yp);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(mtpllm, m) {
  m.def("q8_linear(Tensor x, Tensor w, Tensor scales, Tensor? mins, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpllm, CPU, m) {
  m.impl("q8_linear", &q8_linear);
}
