// Helpers shared by the CPU kernels (AVX2 + FMA + F16C).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace mtpllm {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// a . b over n floats: 8 lanes of multiply-adds, their sum, then the tail one by one
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline float hmax(__m256 v) {
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// exp(x) for x <= 0 (softmax after max subtraction): Cephes-style range reduction + polynomial,
// relative error ~1e-7.
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // x - fx * ln2 in two steps for precision
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Choices between code paths that compute the same bits, made per machine by timing them
// (runtime/tuning.py sets them through the `tuning` op; these are the defaults):
//   grain_macs  multiply-adds per parallel task of a matrix product (how the rows are split
//               between threads; small matrices run on the calling thread)
//   pair_nsb    verification tiles of 2-4 rows take two Q4_Kx8 row groups at once (`x8_tile2`,
//               AVX-512 VNNI build) above this many super-blocks of K
//   tile_rows   rows of x per tile of the 8-row K-quant layouts beyond the paired range: 4, or 8
//               (AVX-512 VNNI build; each group's codes decoded once for 8 rows)
inline int64_t& tune_grain_macs() {
  static int64_t v = 262144;
  return v;
}
inline int64_t& tune_pair_nsb() {
  static int64_t v = 8;
  return v;
}
inline int64_t& tune_tile_rows() {
  static int64_t v = 4;
  return v;
}
//   prefetch    how far ahead of the weight stream the kernels prefetch, in bytes (0: only the lines
//               being read, leaving the stream to the hardware prefetchers). A Zen 4 VM read the
//               1.5B's weights at 27 GB/s with 2048 and 31 with 0 (the Q6_K products 20 -> 32)
inline int64_t& tune_prefetch() {
  static int64_t v = 2048;
  return v;
}
#define PF (::mtpllm::tune_prefetch())
//   q6_prefetch the same for the Q6_Kx8 tiles, whose weight stream a far prefetch into L2 (an odd
//               value: value - 1 bytes ahead, to L2) can serve better than one into L1: on a Zen 4
//               VM the 1.5B's 4-row FFN-down over Q6_K 9.0 -> 5.4 ms with 8192 bytes ahead to L2,
//               while the Q4_K products lost with it
inline int64_t& tune_q6_prefetch() {
  static int64_t v = 2048;
  return v;
}
//   attn_prefetch how decode attention prefetches the keys and values ahead of its sweep: 0, the
//               chunk after next (2 x 64 positions) into L1 at the start of each chunk; 1, spread over
//               the blocks of 8 keys, 128 positions ahead, into L2 (2-8% less on a Zen 4 VM at
//               8K-32K positions, 1 to 4 rows, alternating in one process)
inline int64_t& tune_attn_prefetch() {
  static int64_t v = 0;
  return v;
}
// prefetch the weights at p + off, `choice` bytes ahead (odd: choice - 1 bytes ahead, into L2)
__attribute__((always_inline)) inline void prefetch_weights(const uint8_t* p, int64_t off, int64_t choice) {
  const char* q = reinterpret_cast<const char*>(p) + (choice & ~int64_t{1}) + off;
  if (choice & 1)
    _mm_prefetch(q, _MM_HINT_T1);
  else
    _mm_prefetch(q, _MM_HINT_T0);
}

// Output rows per parallel task for a matrix product of M rows of length K: at least grain_macs
// (~256K) multiply-adds, so small matrices (tiny models) run on the calling thread instead of paying
// for a parallel region (costly when cores are shared)
inline int64_t grain_rows(int64_t K, int64_t M) {
  return std::max<int64_t>(16, tune_grain_macs() / std::max<int64_t>(1, K * M));
}

// Quantize one row of K floats (K % 32 == 0) to int8 per 32-block (d = max|x| / 127, as llama.cpp's
// Q8_0); d[K/32] scales; s[K/G] sums of the dequantized values per group of G = 16 or 32 (only if
// s != nullptr).
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int64_t G) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[j]));
    }
    const float mx = hmax(amax);
    const float db = mx / 127.0f;
    const float id = mx > 0.0f ? 127.0f / mx : 0.0f;
    d[b] = db;
    const __m256 mul = _mm256_set1_ps(id);
    int32_t sum[2] = {0, 0};
    for (int j = 0; j < 4; ++j) {
      __m256i iv = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], mul),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      alignas(32) int32_t tmp[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), iv);
      for (int t = 0; t < 8; ++t) {
        q[b * 32 + 8 * j + t] = static_cast<int8_t>(tmp[t]);
        sum[j / 2] += tmp[t];
      }
    }
    if (s != nullptr) {
      if (G == 32) {
        s[b] = db * static_cast<float>(sum[0] + sum[1]);
      } else {
        s[2 * b] = db * static_cast<float>(sum[0]);
        s[2 * b + 1] = db * static_cast<float>(sum[1]);
      }
    }
  }
}

}  // namespace mtpllm
