// The GGUF block kernels' shared parts (gguf_blocks.cpp and the kernels it calls: gguf_rows.cpp,
// gguf_x8.cpp, gguf_c32.cpp): the build's integer dot product (MTPLLM_VNNI), the type ids, the
// block decoders, the quantized activations, and the entry points each file gives the others. Calls
// across files are per row range or per matrix; everything called per block or per row is here
// (inline) or in the file of its caller.
#pragma once
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>
#include "common.h"

namespace mtpllm::gguf {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MTPLLM_VNNI 1
using Off = int32_t;        // -OFF * the sums of 4 codes: the start of vpdpbusd
constexpr int OFF_PER = 4;
#else
#define MTPLLM_VNNI 0
using Off = int16_t;        // OFF * the sums of pairs of codes, subtracted from vpmaddubsw's pairs
constexpr int OFF_PER = 2;
#endif

// GGML type ids
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;
// the 8-row layouts (gguf_repack): Q4_Kx8 and Q6_Kx8 (gguf_x8.cpp), Q4_0x8 / Q5_0x8 / Q8_0x8
// (gguf_c32.cpp), with their bytes per block of 8 rows
constexpr int64_t Q4_KX8 = 1012, X8_BYTES = 1184;
constexpr int64_t Q6_KX8 = 1014, Q6X8_BYTES = 1680;
constexpr int64_t Q4_0X8 = 1002, Q5_0X8 = 1006, Q8_0X8 = 1008;
constexpr int64_t Q4_0X8_BYTES = 144, Q5_0X8_BYTES = 176, Q8_0X8_BYTES = 272;

// bytes per block of 8 rows x 32 weights of an x8 layout (and its scales' offset in it)
inline int64_t c32x8_bytes(int64_t t) { return t == Q4_0X8 ? Q4_0X8_BYTES : t == Q5_0X8 ? Q5_0X8_BYTES : Q8_0X8_BYTES; }
inline int64_t c32x8_d(int64_t t) { return t == Q4_0X8 ? 128 : t == Q5_0X8 ? 160 : 256; }

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i loadu(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes -> 32 codes: the low nibbles (weights 0..15), then the high nibbles (16..31)
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0xFF where the bit is set (bit j -> byte j)
inline __m256i bits32(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

// Q4_K / Q5_K: the 8 groups' 6-bit scales, then their 8 mins, as bytes (ggml's get_scale_min_k4
// for all 8 groups at once)
__attribute__((always_inline)) inline __m128i scale_min_bytes_k4(const uint8_t* s) {
  // in vector registers (ten operations instead of ~25 scalar ones and the inserts; reads 16 bytes:
  // the 12 scale bytes are followed by the codes). Groups j < 4: scale s[j] & 63, min s[j + 4] & 63;
  // j >= 4: scale s[j + 4] & 15 | (s[j - 4] >> 6) << 4, min s[j + 4] >> 4 | (s[j] >> 6) << 4.
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i L = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i H = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i m1 = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
  const __m128i m2 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
  // 16-bit shifts: the bits pulled in from the neighbouring byte are masked off
  const __m128i lo = _mm_or_si128(_mm_and_si128(L, m1), _mm_and_si128(_mm_srli_epi16(L, 4), m2));
  return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(H, 2), _mm_set1_epi8(0x30)));
}

// the 8 mins of scale_min_bytes_k4's bytes times -dmin
__attribute__((always_inline)) inline __m256 mins_k4(__m128i v, float dmin) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), _mm256_set1_ps(-dmin));
}

// the same as floats: scales times d into sc[8], mins times -dmin returned as a vector
inline __m256 scales_mins_k4(const uint8_t* s, float d, float dmin, float* sc) {
  const __m128i v = scale_min_bytes_k4(s);
  _mm256_store_ps(sc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(d)));
  return mins_k4(v, dmin);
}

// Decoders. `each(blk, f, fm)` calls f(g, codes, scale, min) for the 32-weight groups g of one
// (super-)block in order: w = scale * code + min, with `scale` an __m256 whose lanes 0-3 scale codes
// 0..15 and lanes 4-7 codes 16..31 (one value for both halves except Q6_K). Types with VMIN give
// the mins of all 8 groups of a super-block at once, fm(__m256), before the groups (min = 0 in f).
#if MTPLLM_VNNI
// With vpdpbusd (no 16-bit saturation) Q8_0 codes are used unsigned too, w + 128 (a flip of the
// top bit), with 128 * sum(x) taken off through the start value like Q4_0/Q5_0: no sign shuffles
struct TQ8_0 {
  static constexpr int QK = 32, BYTES = 34, OFF = 128;
  static constexpr bool SIGNED = false, MIN = false, VMIN = false, KQ = false;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&&) {
    const float d = f16(b);
    f(0, _mm256_xor_si256(loadu(b + 2), _mm256_set1_epi8(static_cast<char>(0x80))), _mm256_set1_ps(d), -OFF * d);
  }
};
#else
struct TQ8_0 {
  static constexpr int QK = 32, BYTES = 34, OFF = 0;
  static constexpr bool SIGNED = true, MIN = false, VMIN = false, KQ = false;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&&) {
    f(0, loadu(b + 2), _mm256_set1_ps(f16(b)), 0.0f);
  }
};
#endif
// Q4_0 and Q5_0 codes are used unsigned (0..15, 0..31) with the offset (8, 16) taken off in the
// integer sum: w = d * (u - 8), and u . x - 8 * sum(x) is maddubs(u, x) minus 8 times x's pair sums
// (precomputed per row, `Act::o4`/`o5`): one subtraction per row instead of a sign shuffle or a
// float min term.
struct TQ4_0 {
  static constexpr int QK = 32, BYTES = 18, OFF = 8;
  static constexpr bool SIGNED = false, MIN = false, VMIN = false, KQ = false;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&&) {
    const float d = f16(b);
    f(0, nibbles32(b + 2), _mm256_set1_ps(d), -OFF * d);  // the min for dequantization
  }
};
struct TQ5_0 {
  static constexpr int QK = 32, BYTES = 22, OFF = 16;
  static constexpr bool SIGNED = false, MIN = false, VMIN = false, KQ = false;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&&) {
    const float d = f16(b);
    const __m256i hi = _mm256_and_si256(bits32(b + 2), _mm256_set1_epi8(0x10));
    f(0, _mm256_or_si256(nibbles32(b + 6), hi), _mm256_set1_ps(d), -OFF * d);
  }
};
struct TQ4_1 {
  static constexpr int QK = 32, BYTES = 20, OFF = 0;
  static constexpr bool SIGNED = false, MIN = true, VMIN = false, KQ = false;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&&) {
    f(0, nibbles32(b + 4), _mm256_set1_ps(f16(b)), f16(b + 2));
  }
};
struct TQ5_1 {
  static constexpr int QK = 32, BYTES = 24, OFF = 0;
  static constexpr bool SIGNED = false, MIN = true, VMIN = false, KQ = false;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&&) {
    const __m256i hi = _mm256_and_si256(bits32(b + 4), _mm256_set1_epi8(0x10));
    f(0, _mm256_or_si256(nibbles32(b + 8), hi), _mm256_set1_ps(f16(b)), f16(b + 2));
  }
};
// Q4_K / Q5_K: the unsigned codes of groups 2j (lo) and 2j + 1 (hi) of a super-block: per 64
// weights 32 bytes, low nibbles then high nibbles; Q5_K adds a fifth bit, bit 2j (2j + 1) of qh[l]
template <bool FIVE>
__attribute__((always_inline)) inline void k45_codes(const uint8_t* b, int j, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i q = loadu(b + (FIVE ? 48 : 16) + 32 * j);
  lo = _mm256_and_si256(q, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
  if (FIVE) {
    const __m256i qh = loadu(b + 16), b4 = _mm256_set1_epi8(0x10);
    const __m256i ml = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
    const __m256i mh = _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1)));
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, ml), ml), b4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mh), mh), b4));
  }
}

// Q6_K: the unsigned codes (0..63) of 32-weight group g (0..7) of a super-block: half h = g / 4
// (128 weights: ql[64h..), qh[32h..)), k = g % 4 picks the nibbles and the 2-bit field of qh; the
// weight is d * scale * (code - 32). Always inlined: with g a constant it folds to 4-5 operations
// (a call per group made one-row decoding 3x slower).
__attribute__((always_inline)) inline __m256i q6_code(const uint8_t* b, int g) {
  const int h = g >> 2, k = g & 3;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lq = loadu(b + 64 * h + (k & 1) * 32), qh = loadu(b + 128 + 32 * h);
  const __m256i lo = (k & 2) ? _mm256_and_si256(_mm256_srli_epi16(lq, 4), m4) : _mm256_and_si256(lq, m4);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(0x03));
  return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

// the four groups of half h
__attribute__((always_inline)) inline void q6_codes(const uint8_t* b, int h, __m256i q[4]) {
  for (int k = 0; k < 4; ++k) q[k] = q6_code(b, 4 * h + k);
}

template <bool FIVE>
struct TK45 {  // Q4_K (FIVE = false) and Q5_K
  static constexpr int QK = 256, BYTES = FIVE ? 176 : 144;
  static constexpr bool SIGNED = false, MIN = false, VMIN = true, KQ = true;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&& fm) {
    alignas(32) float sc[8];
    fm(scales_mins_k4(b + 4, f16(b), f16(b + 2), sc));
    for (int j = 0; j < 4; ++j) {
      __m256i lo, hi;
      k45_codes<FIVE>(b, j, lo, hi);
      f(2 * j, lo, _mm256_broadcast_ss(sc + 2 * j), 0.0f);
      f(2 * j + 1, hi, _mm256_broadcast_ss(sc + 2 * j + 1), 0.0f);
    }
  }
};
using TQ4_K = TK45<false>;
using TQ5_K = TK45<true>;
struct TQ6_K {
  static constexpr int QK = 256, BYTES = 210;
  static constexpr bool SIGNED = true, MIN = false, VMIN = false, KQ = true;
  template <class F, class FM> static inline void each(const uint8_t* b, F&& f, FM&&) {
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    alignas(32) float sc[16];  // d * the 16 int8 scales
    const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    _mm256_store_ps(sc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s16)), d));
    _mm256_store_ps(sc + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8))), d));
    for (int h = 0; h < 2; ++h) {
      __m256i q[4];
      q6_codes(b, h, q);
      const float* s = sc + 8 * h;
      for (int i = 0; i < 4; ++i)
        f(4 * h + i, _mm256_sub_epi8(q[i], _mm256_set1_epi8(32)),
          _mm256_set_m128(_mm_broadcast_ss(s + 2 * i + 1), _mm_broadcast_ss(s + 2 * i)), 0.0f);
    }
  }
};

struct Act {  // R consecutive quantized rows of x
  const int8_t* q;   // [R, K]
  const float* d;    // [R, K/32]
  const float* s;    // [R, K/32]: d * sum of codes per block
  const Off* o4;     // [R, K/OFF_PER]: the offset terms for Q4_0 (OFF = 8), or null (see Off)
  const Off* o5;     // [R, K/OFF_PER]: the same for Q5_0 (OFF = 16)
  const Off* o8;     // [R, K/OFF_PER]: the same for Q8_0 (OFF = 128, VNNI builds only)
  int64_t K, nb;
};

// K-quant weights against activations quantized per 256 (llama.cpp's Q8_K): the 6-bit (Q4_K,
// Q5_K) or 8-bit (Q6_K) group scales are integers, so a super-block's 8 groups are summed in int32
// (maddubs, then madd by the group scale) and converted to float once per super-block.
struct ActK {  // R consecutive rows of x quantized per 256
  const int8_t* q;    // [R, K]
  const float* d;     // [R, K/256]
  const float* s;     // [R, K/32]: d * sum of codes per group of 32
  const int16_t* bs;  // [R, K/16]: sums of codes per 16
  const int16_t* b32; // [R, K/32]: sums of codes per 32
  int64_t K;
  // the same view from row m on
  ActK from(int64_t m) const { return {q + m * K, d + m * (K / 256), s + m * (K / 32), bs + m * (K / 16), b32 + m * (K / 32), K}; }
};

// Entry points, each for rows [n0, n1) of one matrix of type t (the row groups of 8 starting in
// that range for the 8-row layouts) against the M rows of x into y (row stride ldy):
// the file's blocks one weight row at a time, every type (gguf_rows.cpp)
void rows_of_type(int64_t t, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Act& x,
                  const ActK& xk, int64_t M, float* y, int64_t ldy);
// dequantized into y (float32, row stride K) (gguf_rows.cpp)
void dequant_rows_of_type(int64_t t, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, float* y);
// Q4_Kx8 / Q6_Kx8 (gguf_x8.cpp)
void kx8_rows_of_type(int64_t t, const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1, const ActK& xk,
                      int64_t M, float* y, int64_t ldy);
void x8_repack(const uint8_t* w, int64_t row_bytes, int64_t nsb, int64_t g0, int64_t g1, uint8_t* out);
void x8_dequant(const uint8_t* w, int64_t nsb, int64_t n0, int64_t n1, float* y);
void q6x8_repack(const uint8_t* w, int64_t row_bytes, int64_t nsb, int64_t g0, int64_t g1, uint8_t* out);
void q6x8_dequant(const uint8_t* w, int64_t nsb, int64_t n0, int64_t n1, float* y);
// the AVX2 build's choice of verification tiles (the `x8_tile4` op): set when value >= 0; returns the
// value before (-1 in the AVX-512 VNNI build)
int64_t x8_tile4_choice(int64_t value);
// prompt chunks of Q4_0 / Q5_0 / Q8_0 (the file's blocks) and the Q4_0x8 / Q5_0x8 / Q8_0x8 layouts
// (gguf_c32.cpp); xs: x's code sums per block
void c32_rows_of_type(int64_t t, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Act& x,
                      const int32_t* xs, int64_t M, float* y, int64_t ldy);
void c32x8_rows_of_type(int64_t t, const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1, const Act& x,
                        const int32_t* xs, int64_t M, float* y, int64_t ldy);
void c32x8_repack(int64_t t, int64_t t8, const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t g0, int64_t g1,
                  uint8_t* out);
void c32x8_dequant(int64_t t, const uint8_t* w, int64_t nb, int64_t n0, int64_t n1, float* y);
}  // namespace mtpllm::gguf
