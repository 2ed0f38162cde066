// Matrix products straight on GGUF blocks (AVX2 + FMA + F16C): the weights are the file's bytes,
// read from the memory map as they are, so a matrix costs exactly its file size in memory and the
// kernel reads as few bytes per token as the file allows.
//
// Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (super-blocks of 256).
// Each type is a decoder that turns one (super-)block into 32-weight groups: 32 integer codes
// (signed, or unsigned with a float min per group), a float scale per 16 or 32 codes. A group
// decoded once is multiplied against up to 4 rows of activations (32-weight blocks) or a tile of 8
// rows (K-quants, which also run prompt chunks: see krows_of).
//
// Activations: each row of x is quantized to int8 per block of 32 (d = max|x| / 127, as llama.cpp's
// Q8_0), then y[m, n] = sum over groups of d_x * scale_w * int_dot(q_x, q_w) + min_w * sum(x_hat).
//
// With AVX-512 VNNI (built so where the CPU has it, `kernels.py`), the integer products use its
// fused dot-product instructions on 256-bit registers: vpdpbusd for 32-weight blocks (the u8 x s8
// products of 4 weights summed into int32, the offset term as its start value) and vpdpwssd for
// K-quant groups (the group scale times the pair sums, added). They compute exactly the integers of
// the AVX2 sequence (no saturation is reachable in either), so both builds give bit-identical results.
//
// Every output is computed by one thread in a fixed order from its own row of x only, so a row's
// result does not depend on how many rows are in the batch or on the thread count: verification of
// k+1 tokens gives bit-identical logits to k+1 single-token steps.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <sys/mman.h>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>
#include "common.h"

namespace {
using mtpllm::grain_rows;
using mtpllm::hmax;
using mtpllm::hsum;
using mtpllm::quantize_row;

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

// One weight row of a 32-weight block type against R rows of x: out[r * os] = x_r . w. Two
// accumulators per row (even and odd blocks) keep two FMA chains in flight; the order of the sum is
// the same for every R. (K-quants take `ktile` below.)
template <class T, int R>
inline void dot_row(const uint8_t* row, const Act& a, float* out, int64_t os) {
  static_assert(T::QK == 32 && !T::VMIN, "32-weight block types only");
  __m256 acc[2][R];
  float mins[R];
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm256_setzero_ps();
    acc[1][r] = _mm256_setzero_ps();
    mins[r] = 0.0f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nblk = a.K / 32;
  auto block = [&](int64_t i) {  // block i of the row against activation block i
    return [&, i](int, __m256i w, __m256 sw, float mn) {
      __m256* ac = acc[i & 1];
      const __m256i aw = T::SIGNED ? _mm256_sign_epi8(w, w) : w;
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + r * a.K + i * 32));
        const __m256i xs = T::SIGNED ? _mm256_sign_epi8(xv, w) : xv;
        const Off* o = T::OFF == 8 ? a.o4 : T::OFF == 16 ? a.o5 : a.o8;
        const __m256i ov = T::OFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + r * (a.K / OFF_PER) + i * (32 / OFF_PER)))
                                  : _mm256_setzero_si256();
#if MTPLLM_VNNI
        const __m256i p = _mm256_dpbusd_epi32(ov, aw, xs);  // (-OFF * sum(x) +) u . x by 4
        (void)ones;
#else
        // minus OFF * sum(x), by pairs (|u . x| <= 7874, |16 * pair| <= 4064: no overflow)
        __m256i p = _mm256_maddubs_epi16(aw, xs);
        if (T::OFF) p = _mm256_sub_epi16(p, ov);
        p = _mm256_madd_epi16(p, ones);
#endif
        // d_x broadcast from memory (a load, not a shuffle), times the block's d_w
        ac[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sw, _mm256_broadcast_ss(a.d + r * a.nb + i)), ac[r]);
        if (T::MIN) mins[r] += mn * a.s[r * a.nb + i];
      }
    };
  };
  auto none = [](__m256) {};
  int64_t i = 0;
  for (; i + 2 <= nblk; i += 2) {  // two blocks at a time: the two decodes overlap
    const uint8_t* blk = row + i * T::BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(blk + PF), _MM_HINT_T0);
    if (2 * T::BYTES > 64) _mm_prefetch(reinterpret_cast<const char*>(blk + PF + 64), _MM_HINT_T0);
    T::each(blk, block(i), none);
    T::each(blk + T::BYTES, block(i + 1), none);
  }
  if (i < nblk) T::each(row + i * T::BYTES, block(i), none);
  for (int r = 0; r < R; ++r) out[r * os] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + mins[r];
}

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

// One super-block of a weight row, ready for integer products: the codes of group g (32 weights),
// the int16 scale vector multiplying them (per 16 lanes of the maddubs output), the integer start of
// the super-block's sum and its conversion to float.
template <bool FIVE>
struct SbK45 {  // Q4_K or Q5_K
  static constexpr int BYTES = TK45<FIVE>::BYTES;
  const uint8_t* b;
  __m256i s16;  // the 8 group scales as int16, in both 128-bit lanes
  __m256 mins;  // -dmin * the 8 group mins
  float d;
  __attribute__((always_inline)) void load(const uint8_t* p) {
    b = p;
    d = f16(p);
    const __m128i sm = scale_min_bytes_k4(p + 4);
    s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    mins = mins_k4(sm, f16(p + 2));
  }
  __m256i code(int g) const {
    __m256i lo, hi;
    k45_codes<FIVE>(b, g >> 1, lo, hi);
    return (g & 1) ? hi : lo;
  }
  __m256i scale(int g) const {
    return _mm256_shuffle_epi8(s16, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * g)));
  }
  __m256i start(const ActK&, int64_t, int64_t) const { return _mm256_setzero_si256(); }
  void finish(__m256& acc, __m256i sumi, const ActK& a, int64_t r, int64_t i) const {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * a.d[r * (a.K / 256) + i]), acc);
    acc = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a.s + r * (a.K / 32) + i * 8), acc);
  }
};

struct SbQ6 {  // Q6_K: codes used unsigned (0..63), 32 * sum(scale * sum(x)) subtracted at the start
  static constexpr int BYTES = TQ6_K::BYTES;
  const uint8_t* b;
  __m256i sc16;    // the 16 scales as int16
  __m256i lo, hi;  // scales 0-7 / 8-15 in both lanes
  float d;
  __attribute__((always_inline)) void load(const uint8_t* p) {
    b = p;
    d = f16(p + 208);
    sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    lo = _mm256_permute2x128_si256(sc16, sc16, 0x00);
    hi = _mm256_permute2x128_si256(sc16, sc16, 0x11);
  }
  __m256i code(int g) const { return q6_code(b, g); }
  __m256i scale(int g) const {  // scale 2g for the first 16 weights, 2g + 1 for the next 16
    const int i0 = (2 * g) & 7, i1 = (2 * g + 1) & 7;
    const __m256i m = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(0x0100 * (2 * i1 + 1) + 2 * i1)),
                                       _mm_set1_epi16(static_cast<int16_t>(0x0100 * (2 * i0 + 1) + 2 * i0)));
    return _mm256_shuffle_epi8(g < 4 ? lo : hi, m);
  }
  __m256i start(const ActK& a, int64_t r, int64_t i) const {
    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs + r * (a.K / 16) + i * 16));
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
  }
  void finish(__m256& acc, __m256i sumi, const ActK& a, int64_t r, int64_t i) const {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * a.d[r * (a.K / 256) + i]), acc);
  }
};

template <class T> struct SbOf;
template <> struct SbOf<TQ4_K> { using type = SbK45<false>; };
template <> struct SbOf<TQ5_K> { using type = SbK45<true>; };
template <> struct SbOf<TQ6_K> { using type = SbQ6; };

// One weight row against RM activation rows over super-blocks [i0, i1): acc[r] += the float
// partial sums (8 lanes) of row r of x. Each row's sum is the int32 sum of a super-block's groups,
// converted once per super-block, in super-block order: the same operations whatever RM and the
// blocking, so results do not depend on the batch. (One weight row per tile: measured faster on
// AVX2 than 2 x 4, whose accumulators leave no registers for the codes and scales.)
template <class S, int RM>
inline void ktile(const uint8_t* row, const ActK& a, int64_t i0, int64_t i1, __m256* acc_out) {
  __m256 acc[RM];  // in registers for the whole loop: through acc_out (which the compiler cannot prove
                   // unaliased with the loads) it was stored back every super-block
  for (int r = 0; r < RM; ++r) acc[r] = acc_out[r];
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* b = row + i * S::BYTES;
    for (int o = 0; o < S::BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + PF + o), _MM_HINT_T0);
    S sb;
    sb.load(b);
    __m256i sumi[RM];
    for (int r = 0; r < RM; ++r) sumi[r] = sb.start(a, r, i);
    const int8_t* x = a.q + i * 256;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {  // unrolled: the group's code and scale selection fold to constants
      const __m256i w = sb.code(g), sc = sb.scale(g);
      for (int r = 0; r < RM; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * a.K + 32 * g));
        __m256i& s = sumi[r];
#if MTPLLM_VNNI
        s = _mm256_dpwssd_epi32(s, _mm256_maddubs_epi16(w, xv), sc);
#else
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), sc));
#endif
        // keep each sum in its register: otherwise the compiler reassociates the integer sums into
        // a tree and spills every product to the stack
        __asm__("" : "+x"(s));
      }
    }
    for (int r = 0; r < RM; ++r) sb.finish(acc[r], sumi[r], a, r, i);
  }
  for (int r = 0; r < RM; ++r) acc_out[r] = acc[r];
}

// Quantize one row of K floats (K % 256 == 0) per 256: d[K/256], s[K/32] = d * sum of codes per
// 32, bs[K/16] = sums of codes per 16, b32[K/32] = sums of codes per 32
inline void quantize_row_k(const float* x, int64_t K, int8_t* q, float* d, float* s, int16_t* bs, int16_t* b32) {
  for (int64_t i = 0; i < K / 256; ++i) {
    const float* xb = x + i * 256;
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 32; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, _mm256_loadu_ps(xb + 8 * j)));
    const float mx = hmax(amax);
    const float db = mx / 127.0f;
    const __m256 mul = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
    d[i] = db;
    for (int j = 0; j < 16; ++j) {  // 16 codes at a time
      alignas(32) int32_t t[16];
      for (int h = 0; h < 2; ++h)
        _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8 * h),
                           _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * j + 8 * h), mul),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      int32_t sum = 0;
      for (int k = 0; k < 16; ++k) {
        q[i * 256 + 16 * j + k] = static_cast<int8_t>(t[k]);
        sum += t[k];
      }
      bs[i * 16 + j] = static_cast<int16_t>(sum);
    }
    for (int g = 0; g < 8; ++g) {
      b32[i * 8 + g] = static_cast<int16_t>(bs[i * 16 + 2 * g] + bs[i * 16 + 2 * g + 1]);  // |sum| <= 32 * 127
      s[i * 8 + g] = db * static_cast<float>(b32[i * 8 + g]);
    }
  }
}

// K-quant rows [n0, n1) of W against the M rows of x, in tiles of one weight row x KRM activation
// rows; blocks of KNB weight rows are swept by every tile of x, in chunks of KKC super-blocks so
// that the tile of x (KRM * KKC * 256 bytes) stays in L1 while the block's rows pass over it.
constexpr int KRM = 8, KNB = 16, KKC = 8;

template <class S, int RM = KRM>
inline void ktile_rm(int rm, const uint8_t* row, const ActK& a, int64_t i0, int64_t i1, __m256* acc) {
  if constexpr (RM > 1) {
    if (rm < RM) return ktile_rm<S, RM - 1>(rm, row, a, i0, i1, acc);
  }
  ktile<S, RM>(row, a, i0, i1, acc);
}

template <class T>
void krows_of(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const ActK& xk, int64_t M, float* y,
              int64_t ldy) {
  using S = typename SbOf<T>::type;
  const int64_t K = xk.K, nsb = K / 256;
  for (int64_t nb0 = n0; nb0 < n1; nb0 += KNB) {
    const int64_t nb1 = std::min(nb0 + KNB, n1);
    for (int64_t m = 0; m < M; m += KRM) {
      const int rm = static_cast<int>(std::min<int64_t>(KRM, M - m));
      const ActK a = xk.from(m);
      __m256 acc[KNB * KRM];
      for (int64_t n = 0; n < nb1 - nb0; ++n)  // only the tile's rows (decoding: one per weight row)
        for (int r = 0; r < rm; ++r) acc[n * KRM + r] = _mm256_setzero_ps();
      // one tile of x (decoding, verification): each weight row is streamed whole, as the
      // prefetch ahead of it expects
      const int64_t kc = M <= KRM ? nsb : KKC;
      for (int64_t i0 = 0; i0 < nsb; i0 += kc)
        for (int64_t n = nb0; n < nb1; ++n)
          ktile_rm<S>(rm, w + n * row_bytes, a, i0, std::min(i0 + kc, nsb), acc + (n - nb0) * KRM);
      for (int64_t n = nb0; n < nb1; ++n)
        for (int r = 0; r < rm; ++r) y[(m + r) * ldy + n] = hsum(acc[(n - nb0) * KRM + r]);
    }
  }
}

// Rows [n0, n1) of W (type T) against the M rows of x into y[:, n0:n1] (row stride ldy)
template <class T>
void rows_of(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Act& x, const ActK& xk, int64_t M,
             float* y, int64_t ldy) {
  if constexpr (T::KQ) {
    krows_of<T>(w, row_bytes, n0, n1, xk, M, y, ldy);
  } else {
    const int64_t K = x.K, nb = K / 32;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * row_bytes;
      // rows of x in tiles of up to 4 (a weight group is decoded once per tile); every row's sum is
      // accumulated in the same order whatever its tile, so results do not depend on M
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t t = std::min<int64_t>(4, M - m);
        float* o = y + m * ldy + n;
        const Act a{x.q + m * K, x.d + m * nb, x.s + m * nb, x.o4 ? x.o4 + m * K / OFF_PER : nullptr,
                    x.o5 ? x.o5 + m * K / OFF_PER : nullptr, x.o8 ? x.o8 + m * K / OFF_PER : nullptr, K, nb};
        switch (t) {
          case 4: dot_row<T, 4>(wr, a, o, ldy); break;
          case 3: dot_row<T, 3>(wr, a, o, ldy); break;
          case 2: dot_row<T, 2>(wr, a, o, ldy); break;
          default: dot_row<T, 1>(wr, a, o, ldy); break;
        }
      }
    }
  }
}

// Q4_K repacked by 8 rows ("Q4_Kx8", engine type id Q4_KX8; `gguf_repack` builds it at load). The
// 8 rows' super-blocks i are stored together so that one register holds 8 codes of each of 4 rows
// (256 bits) or 8 rows (512 bits): a broadcast of 8 activations and one vpdpbusd multiply them, the
// sums of each row's two 4-code halves landing in its two 32-bit lanes. The 8 rows' scales, mins, d
// and dmin then come as vectors, and a super-block's scale, min and float work is done once for 8
// rows instead of per row (the one-row kernel spends more on that than on the products). One block of
// 8 rows x 256 weights, X8_BYTES:
//   qs [1024]: group g (32 weights), pair p: 64 bytes at 128 g + 64 p, byte 8 r + k of row r = code
//              8 p + k of the group (low nibble) and code 16 + 8 p + k (high nibble)
//   sc [64]:   byte 8 g + r = the 6-bit scale of row r, group g
//   mn [64]:   byte 16 p + 2 r + h = the 6-bit min of row r, group 2 p + h (int16 pairs once widened)
//   d [8], dmin [8]: float16 per row
// Row r, super-block i: y += d * dx * sum_g sc_g * (q_g . x_g) - dmin * dx * sum_g mn_g * sum(x_g),
// both sums in int32 (exact: the same integers in every build and tile), then two float
// multiply-adds per super-block, in super-block order: each output depends on its own row of x only.
constexpr int64_t Q4_KX8 = 1012, X8_BYTES = 1184, X8_SC = 1024, X8_MN = 1088, X8_D = 1152, X8_DMIN = 1168;

inline int64_t load8(const int8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// bytes 0..7 of v each twice: the byte of row r in 16-bit lane r (a row's scale for both its lanes)
inline __m128i dup_bytes(__m128i v) { return _mm_shuffle_epi8(v, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)); }

// macc[r] lane n = sum over pairs p < P of the int16 pair (w[16 p + 2 n], w[16 p + 2 n + 1]) (bytes,
// widened signed or not) times the pair (xs_r[2 p], xs_r[2 p + 1]), xs_r = xs + r * stride: the 8 rows'
// mins (Q4_Kx8) or scales (Q6_Kx8) against the activations' code sums per 32 or per 16
template <int RM, int P, bool SIGNED>
__attribute__((always_inline)) inline void x8_pair_sums(const uint8_t* w, const int16_t* xs, int64_t stride, __m256i* macc) {
  for (int r = 0; r < RM; ++r) macc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    const __m128i w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * p));
    const __m256i wv = SIGNED ? _mm256_cvtepi8_epi16(w8) : _mm256_cvtepu8_epi16(w8);
    for (int r = 0; r < RM; ++r) {
      int32_t xp;
      std::memcpy(&xp, xs + r * stride + 2 * p, 4);
#if MTPLLM_VNNI
      macc[r] = _mm256_dpwssd_epi32(macc[r], wv, _mm256_set1_epi32(xp));
#else
      macc[r] = _mm256_add_epi32(macc[r], _mm256_madd_epi16(wv, _mm256_set1_epi32(xp)));
#endif
    }
  }
}

// the min sums of super-block i (block b) for RM rows of x: macc[r] lane n = sum_g mn_g(n) * sum(x_g)
template <int RM>
__attribute__((always_inline)) inline void x8_mins(const uint8_t* b, const ActK& a, int64_t i, __m256i* macc) {
  x8_pair_sums<RM, 4, false>(b + X8_MN, a.b32 + i * 8, a.K / 32, macc);
}

// facc[r] += d * dx * sacc[r] - dmin * dx * macc[r] (super-block i, block b)
template <int RM>
__attribute__((always_inline)) inline void x8_finish(const uint8_t* b, const ActK& a, int64_t i, const __m256i* sacc,
                                                     const __m256i* macc, __m256* facc) {
  const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + X8_D)));
  const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + X8_DMIN)));
  for (int r = 0; r < RM; ++r) {
    const __m256 dx = _mm256_set1_ps(a.d[r * (a.K / 256) + i]);
    facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sacc[r]), _mm256_mul_ps(d8, dx), facc[r]);
    facc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(macc[r]), _mm256_mul_ps(m8, dx), facc[r]);
  }
}

#if MTPLLM_VNNI
constexpr int X8_RM = 4;  // rows of x per tile (32 vector registers)
// Above this many super-blocks (default 8: K > 2048; `tune_pair_nsb`, chosen per machine by
// timing) verification tiles take two Q4_Kx8 row groups at once (`x8_tile2`): 4 rows of x over
// K = 8960 (35 KB) are read from L2 once per pair of groups instead of once per group (Zen 5: the
// 1.5B's FFN-down, 4 rows: 4.3-4.5 -> 3.5 ms per step). Below it the tile of x stays in L1 and the
// paired tile, short of registers, is slower (the gate/up products: 10.6 -> 16.6).

// the 8 rows' products over super-blocks [0, nsb) for RM rows of x (ActK a) into facc. 512-bit
// registers: a pair's 64 bytes are 8 codes of all 8 rows, lanes 2 r and 2 r + 1 row r's.
template <int RM>
inline void x8_tile(const uint8_t* blk, int64_t nsb, const ActK& a, __m256* facc_out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m256 facc[RM];
  for (int r = 0; r < RM; ++r) facc[r] = facc_out[r];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * X8_BYTES;
    __m512i sacc[RM];
    for (int r = 0; r < RM; ++r) sacc[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(b + PF + 128 * g), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + PF + 128 * g + 64), _MM_HINT_T0);
      __m512i acc[RM];  // |lane| <= 16 * 15 * 127 < 2^15: its low 16 bits are the value
      for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
        const __m512i raw = _mm512_loadu_si512(b + 128 * g + 64 * p);
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        for (int r = 0; r < RM; ++r) {
          const int8_t* x = a.q + r * a.K + i * 256 + 32 * g + 8 * p;
          acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi64(load8(x)));
          acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi64(load8(x + 16)));
        }
      }
      // the scale of row r in lanes 2 r, 2 r + 1 as int16 pairs (scale, 0): vpdpwssd adds acc * scale
      const __m512i sc = _mm512_cvtepu8_epi32(dup_bytes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + X8_SC + 8 * g))));
      for (int r = 0; r < RM; ++r) sacc[r] = _mm512_dpwssd_epi32(sacc[r], acc[r], sc);
    }
    __m256i s[RM], macc[RM];
    for (int r = 0; r < RM; ++r)  // row r's two lanes summed, in lane r
      s[r] = _mm512_cvtepi64_epi32(_mm512_add_epi32(sacc[r], _mm512_srli_epi64(sacc[r], 32)));
    x8_mins<RM>(b, a, i, macc);
    x8_finish<RM>(b, a, i, s, macc, facc);
  }
  for (int r = 0; r < RM; ++r) facc_out[r] = facc[r];
}

// Two row groups (blk0, blk1) against the same RM rows of x: x8_tile's operations for each, with
// each broadcast of x serving both. Used for verification over a long K (`kx8_rows`), where the tile
// of x does not stay in L1 while a group's weights stream through it.
template <int RM>
inline void x8_tile2(const uint8_t* blk0, const uint8_t* blk1, int64_t nsb, const ActK& a, __m256* f0_out,
                     __m256* f1_out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m256 f0[RM], f1[RM];
  for (int r = 0; r < RM; ++r) f0[r] = f0_out[r], f1[r] = f1_out[r];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b0 = blk0 + i * X8_BYTES;
    const uint8_t* b1 = blk1 + i * X8_BYTES;
    __m512i s0[RM], s1[RM];
    for (int r = 0; r < RM; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(b0 + PF + 128 * g), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b0 + PF + 128 * g + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + PF + 128 * g), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + PF + 128 * g + 64), _MM_HINT_T0);
      __m512i a0[RM], a1[RM];
      for (int r = 0; r < RM; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
        const __m512i raw0 = _mm512_loadu_si512(b0 + 128 * g + 64 * p);
        const __m512i raw1 = _mm512_loadu_si512(b1 + 128 * g + 64 * p);
        const __m512i lo0 = _mm512_and_si512(raw0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(raw0, 4), m4);
        const __m512i lo1 = _mm512_and_si512(raw1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(raw1, 4), m4);
        for (int r = 0; r < RM; ++r) {
          const int8_t* x = a.q + r * a.K + i * 256 + 32 * g + 8 * p;
          const __m512i xl = _mm512_set1_epi64(load8(x)), xh = _mm512_set1_epi64(load8(x + 16));
          a0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a0[r], lo0, xl), hi0, xh);
          a1[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a1[r], lo1, xl), hi1, xh);
        }
      }
      const __m512i sc0 = _mm512_cvtepu8_epi32(dup_bytes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b0 + X8_SC + 8 * g))));
      const __m512i sc1 = _mm512_cvtepu8_epi32(dup_bytes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b1 + X8_SC + 8 * g))));
      for (int r = 0; r < RM; ++r) {
        s0[r] = _mm512_dpwssd_epi32(s0[r], a0[r], sc0);
        s1[r] = _mm512_dpwssd_epi32(s1[r], a1[r], sc1);
      }
    }
    __m256i s[RM], macc[RM];
    for (int r = 0; r < RM; ++r) s[r] = _mm512_cvtepi64_epi32(_mm512_add_epi32(s0[r], _mm512_srli_epi64(s0[r], 32)));
    x8_mins<RM>(b0, a, i, macc);
    x8_finish<RM>(b0, a, i, s, macc, f0);
    for (int r = 0; r < RM; ++r) s[r] = _mm512_cvtepi64_epi32(_mm512_add_epi32(s1[r], _mm512_srli_epi64(s1[r], 32)));
    x8_mins<RM>(b1, a, i, macc);
    x8_finish<RM>(b1, a, i, s, macc, f1);
  }
  for (int r = 0; r < RM; ++r) f0_out[r] = f0[r], f1_out[r] = f1[r];
}
#else
constexpr int X8_RM = 2;  // 16 registers

// the same on 256-bit registers: half q of a pair's 64 bytes holds 8 codes of rows 4 q .. 4 q + 3
template <int RM>
inline void x8_tile(const uint8_t* blk, int64_t nsb, const ActK& a, __m256* facc_out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 facc[RM];
  for (int r = 0; r < RM; ++r) facc[r] = facc_out[r];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * X8_BYTES;
    __m256i sacc[2][RM];
    for (int r = 0; r < RM; ++r) sacc[0][r] = sacc[1][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(b + PF + 128 * g), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + PF + 128 * g + 64), _MM_HINT_T0);
      __m256i acc[2][RM];  // 16-bit lanes of 4 pairs of u4 x s8 products: at most 4 * 2 * 15 * 127
      for (int r = 0; r < RM; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p)
        for (int q = 0; q < 2; ++q) {
          const __m256i raw = loadu(b + 128 * g + 64 * p + 32 * q);
          const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
          for (int r = 0; r < RM; ++r) {
            const int8_t* x = a.q + r * a.K + i * 256 + 32 * g + 8 * p;
            const __m256i xl = _mm256_set1_epi64x(load8(x)), xh = _mm256_set1_epi64x(load8(x + 16));
            acc[q][r] = _mm256_add_epi16(acc[q][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
          }
        }
      const __m128i sd = dup_bytes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + X8_SC + 8 * g)));
      for (int q = 0; q < 2; ++q) {
        const __m256i sc = _mm256_cvtepu8_epi32(q ? _mm_srli_si128(sd, 8) : sd);
        const __m256i sc16 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));  // int16 pairs (scale, scale)
        for (int r = 0; r < RM; ++r) sacc[q][r] = _mm256_add_epi32(sacc[q][r], _mm256_madd_epi16(acc[q][r], sc16));
      }
    }
    __m256i s[RM], macc[RM];
    for (int r = 0; r < RM; ++r)  // lanes [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order
      s[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sacc[0][r], sacc[1][r]), 0xD8);
    x8_mins<RM>(b, a, i, macc);
    x8_finish<RM>(b, a, i, s, macc, facc);
  }
  for (int r = 0; r < RM; ++r) facc_out[r] = facc[r];
}

// 3-4 rows of x in one pass (verification): x8_tile<2> twice decodes every code twice and reads
// the block twice (from L2 where K is long). Here each super-block is swept once per half q
// (weight rows 4 q .. 4 q + 3): the half's codes of a group are decoded once into 4 registers and
// serve all RM rows of x, whose int32 sums (RM registers) are all that is kept across the groups.
// The same integers as x8_tile (16-bit partial sums in another order: exact, no overflow).
template <int RM>
inline void x8_tile4(const uint8_t* blk, int64_t nsb, const ActK& a, __m256* facc_out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * X8_BYTES;
    __m256i sq[2][RM];
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const int8_t* x0 = a.q + i * 256;
      // the same broadcasts of x in both halves: without this the compiler keeps those of the first
      // half for the second, on the stack (a store and a reload each, slower than broadcasting again)
      __asm__ volatile("" : "+r"(x0));
      __m256i sacc[RM];
      for (int r = 0; r < RM; ++r) sacc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        if (q == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(b + PF + 128 * g), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(b + PF + 128 * g + 64), _MM_HINT_T0);
        }
        const __m256i raw0 = loadu(b + 128 * g + 32 * q), raw1 = loadu(b + 128 * g + 64 + 32 * q);
        const __m256i lo0 = _mm256_and_si256(raw0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), m4);
        const __m256i lo1 = _mm256_and_si256(raw1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), m4);
        // the scale of row 4 q + j as int16 in lanes 4 j .. 4 j + 3 (int32 lanes 2 j, 2 j + 1 hold the
        // pairs (scale, scale)): one shuffle of the group's 8 scale bytes
        const __m256i s8 = _mm256_set1_epi64x(load8(reinterpret_cast<const int8_t*>(b + X8_SC + 8 * g)));
        const __m256i sc16 = _mm256_shuffle_epi8(s8, _mm256_setr_epi8(
            4 * q, -1, 4 * q, -1, 4 * q, -1, 4 * q, -1, 4 * q + 1, -1, 4 * q + 1, -1, 4 * q + 1, -1, 4 * q + 1, -1,
            4 * q + 2, -1, 4 * q + 2, -1, 4 * q + 2, -1, 4 * q + 2, -1, 4 * q + 3, -1, 4 * q + 3, -1, 4 * q + 3, -1,
            4 * q + 3, -1));
        for (int r = 0; r < RM; ++r) {
          const int8_t* x = x0 + r * a.K + 32 * g;
          // 16-bit lanes of 4 pairs of u4 x s8 products: at most 4 * 2 * 15 * 127
          __m256i acc = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_set1_epi64x(load8(x))),
                                         _mm256_maddubs_epi16(hi0, _mm256_set1_epi64x(load8(x + 16))));
          acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(lo1, _mm256_set1_epi64x(load8(x + 8))));
          acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(hi1, _mm256_set1_epi64x(load8(x + 24))));
          sacc[r] = _mm256_add_epi32(sacc[r], _mm256_madd_epi16(acc, sc16));
          __asm__("" : "+x"(sacc[r]));
        }
      }
      for (int r = 0; r < RM; ++r) sq[q][r] = sacc[r];
    }
    __m256i s[RM], macc[RM];
    for (int r = 0; r < RM; ++r)  // lanes [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order
      s[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sq[0][r], sq[1][r]), 0xD8);
    x8_mins<RM>(b, a, i, macc);
    x8_finish<RM>(b, a, i, s, macc, facc_out);
  }
}
#endif

// Q4_K rows [8 g0, 8 g1) of w (uint8 [N, K / 256 * 144]) -> row groups [g0, g1) of the Q4_Kx8 layout
void x8_repack(const uint8_t* w, int64_t row_bytes, int64_t nsb, int64_t g0, int64_t g1, uint8_t* out) {
  for (int64_t grp = g0; grp < g1; ++grp)
    for (int64_t i = 0; i < nsb; ++i) {
      uint8_t* o = out + (grp * nsb + i) * X8_BYTES;
      for (int r = 0; r < 8; ++r) {
        const uint8_t* b = w + (grp * 8 + r) * row_bytes + i * 144;
        const uint8_t* s = b + 4;
        std::memcpy(o + X8_D + 2 * r, b, 2);
        std::memcpy(o + X8_DMIN + 2 * r, b + 2, 2);
        for (int g = 0; g < 8; ++g) {  // ggml's get_scale_min_k4
          const uint8_t sc = g < 4 ? (s[g] & 63) : ((s[g + 4] & 0xF) | ((s[g - 4] >> 6) << 4));
          const uint8_t mn = g < 4 ? (s[g + 4] & 63) : ((s[g + 4] >> 4) | ((s[g] >> 6) << 4));
          o[X8_SC + 8 * g + r] = sc;
          o[X8_MN + 16 * (g / 2) + 2 * r + (g & 1)] = mn;
          // codes of group g: nibble g & 1 of 32 bytes; codes t and 16 + t share byte t of v
          const __m128i m4 = _mm_set1_epi8(0x0F);
          const uint8_t* qs = b + 16 + 32 * (g / 2);
          __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
          __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
          if (g & 1) {
            lo = _mm_srli_epi16(lo, 4);
            hi = _mm_srli_epi16(hi, 4);
          }
          alignas(16) uint8_t v[16];
          _mm_store_si128(reinterpret_cast<__m128i*>(v), _mm_or_si128(_mm_and_si128(lo, m4), _mm_slli_epi16(_mm_and_si128(hi, m4), 4)));
          for (int p = 0; p < 2; ++p) std::memcpy(o + 128 * g + 64 * p + 8 * r, v + 8 * p, 8);
        }
      }
    }
}

// The row groups of a Q4_Kx8 matrix starting in rows [n0, n1) as float32 rows of y (the matrix's
// first row; row stride K), exactly the values of the Q4_K blocks they were made from
void x8_dequant(const uint8_t* w, int64_t nsb, int64_t n0, int64_t n1, float* y) {
  const int64_t K = nsb * 256;
  for (int64_t grp = (n0 + 7) / 8; grp * 8 < n1; ++grp)
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* b = w + (grp * nsb + i) * X8_BYTES;
      for (int r = 0; r < 8; ++r) {
        float* o = y + (grp * 8 + r) * K + i * 256;
        const float d = f16(b + X8_D + 2 * r), dmin = f16(b + X8_DMIN + 2 * r);
        for (int g = 0; g < 8; ++g) {
          const float sc = d * b[X8_SC + 8 * g + r], mn = dmin * b[X8_MN + 16 * (g / 2) + 2 * r + (g & 1)];
          for (int p = 0; p < 2; ++p)
            for (int k = 0; k < 8; ++k) {
              const uint8_t q = b[128 * g + 64 * p + 8 * r + k];
              o[32 * g + 8 * p + k] = std::fma(static_cast<float>(q & 15), sc, -mn);
              o[32 * g + 16 + 8 * p + k] = std::fma(static_cast<float>(q >> 4), sc, -mn);
            }
        }
      }
    }
}

// Q6_K repacked by 8 rows ("Q6_Kx8", engine type id Q6_KX8): Q4_Kx8's code layout for the low 4 bits
// of the 6-bit codes, their top 2 bits in a second plane, the 16 signed scales per row, the file's
// byte count. One block of 8 rows x 256 weights, Q6X8_BYTES:
//   ql [1024]: group g (32 weights), pair p: 64 bytes at 128 g + 64 p, byte 8 r + k of row r = the low
//              4 bits of code 8 p + k of the group (low nibble) and of code 16 + 8 p + k (high)
//   qh [512]:  group g: 64 bytes at 1024 + 64 g, byte 8 r + k = the top 2 bits of codes k (bits 0-1),
//              16 + k (2-3), 8 + k (4-5), 24 + k (6-7): pair p's in bits 4 p .. 4 p + 3
//   sc [128]:  byte 16 g + 2 r + h = the int8 scale of row r's weights 32 g + 16 h .. + 15
//   d [16]:    float16 per row
// Codes are unsigned (0..63, the weight d * scale * (code - 32)): row r's super-block sum is
// sum_h scale_h * (q_h . x_h) - 32 * sum_h scale_h * sum(x_h) in int32 (exact), then one float
// multiply-add per super-block: like Q4_Kx8, each output depends on its own row of x only, and every
// build and tile gives the same values.
constexpr int64_t Q6_KX8 = 1014, Q6X8_BYTES = 1680, Q6X8_QH = 1024, Q6X8_SC = 1536, Q6X8_D = 1664;

// the offset sums of super-block i for RM rows: macc[r] lane n = sum over 16-weight groups of the
// scale of row n times the sum of x's codes
template <int RM>
__attribute__((always_inline)) inline void q6x8_offsets(const uint8_t* b, const ActK& a, int64_t i, __m256i* macc) {
  x8_pair_sums<RM, 8, true>(b + Q6X8_SC, a.bs + i * 16, a.K / 16, macc);  // pairs (scale 2 g, scale 2 g + 1)
}

// facc[r] += d * dx * (s[r] - 32 * macc[r])
template <int RM>
__attribute__((always_inline)) inline void q6x8_finish(const uint8_t* b, const ActK& a, int64_t i, const __m256i* s,
                                                       const __m256i* macc, __m256* facc) {
  const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Q6X8_D)));
  for (int r = 0; r < RM; ++r) {
    const __m256i sumi = _mm256_sub_epi32(s[r], _mm256_slli_epi32(macc[r], 5));
    facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d8, _mm256_set1_ps(a.d[r * (a.K / 256) + i])), facc[r]);
  }
}

#if MTPLLM_VNNI
template <int RM>
inline void q6x8_tile(const uint8_t* blk, int64_t nsb, const ActK& a, __m256* facc_out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), lo16 = _mm512_set1_epi32(0xFFFF);
  const __m128i dl = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
  const __m128i dh = _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
  __m256 facc[RM];
  for (int r = 0; r < RM; ++r) facc[r] = facc_out[r];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * Q6X8_BYTES;
    for (int o = 0; o < Q6X8_BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + PF + o), _MM_HINT_T0);
    __m512i sl[RM], sh[RM];  // weights 0..15 / 16..31 of each group (their own scales)
    for (int r = 0; r < RM; ++r) sl[r] = sh[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i qh = _mm512_loadu_si512(b + Q6X8_QH + 64 * g);
      const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Q6X8_SC + 16 * g));
      // row r's scale in lanes 2 r, 2 r + 1 as int16 pairs (scale, 0)
      const __m512i scl = _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(s8, dl)), lo16);
      const __m512i sch = _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(s8, dh)), lo16);
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
        const __m512i raw = _mm512_loadu_si512(b + 128 * g + 64 * p);
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(raw, m4),
                                           _mm512_and_si512(p ? qh : _mm512_slli_epi16(qh, 4), m30));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), m4),
                                           _mm512_and_si512(p ? _mm512_srli_epi16(qh, 2) : _mm512_slli_epi16(qh, 2), m30));
        for (int r = 0; r < RM; ++r) {
          const int8_t* x = a.q + r * a.K + i * 256 + 32 * g + 8 * p;
          // |lane| <= 4 * 63 * 127 < 2^15: the low 16 bits are the value
          const __m512i pl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_set1_epi64(load8(x)));
          const __m512i ph = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_set1_epi64(load8(x + 16)));
          sl[r] = _mm512_dpwssd_epi32(sl[r], pl, scl);
          sh[r] = _mm512_dpwssd_epi32(sh[r], ph, sch);
        }
      }
    }
    __m256i s[RM], macc[RM];
    for (int r = 0; r < RM; ++r) {
      const __m512i t = _mm512_add_epi32(sl[r], sh[r]);
      s[r] = _mm512_cvtepi64_epi32(_mm512_add_epi32(t, _mm512_srli_epi64(t, 32)));
    }
    q6x8_offsets<RM>(b, a, i, macc);
    q6x8_finish<RM>(b, a, i, s, macc, facc);
  }
  for (int r = 0; r < RM; ++r) facc_out[r] = facc[r];
}
#else
template <int RM>
inline void q6x8_tile(const uint8_t* blk, int64_t nsb, const ActK& a, __m256* facc_out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 facc[RM];
  for (int r = 0; r < RM; ++r) facc[r] = facc_out[r];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * Q6X8_BYTES;
    for (int o = 0; o < Q6X8_BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + PF + o), _MM_HINT_T0);
    __m256i sacc[2][RM];
    for (int r = 0; r < RM; ++r) sacc[0][r] = sacc[1][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Q6X8_SC + 16 * g));
      for (int q = 0; q < 2; ++q) {  // rows 4 q .. 4 q + 3
        const __m256i qh = loadu(b + Q6X8_QH + 64 * g + 32 * q);
        __m256i al[RM], ah[RM];  // pairs of u6 x s8 products, two per 16-bit lane: at most 4 * 63 * 127
        for (int r = 0; r < RM; ++r) al[r] = ah[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {
          const __m256i raw = loadu(b + 128 * g + 64 * p + 32 * q);
          const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, m4),
                                             _mm256_and_si256(p ? qh : _mm256_slli_epi16(qh, 4), m30));
          const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                                             _mm256_and_si256(p ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 2), m30));
          for (int r = 0; r < RM; ++r) {
            const int8_t* x = a.q + r * a.K + i * 256 + 32 * g + 8 * p;
            al[r] = _mm256_add_epi16(al[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi64x(load8(x))));
            ah[r] = _mm256_add_epi16(ah[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi64x(load8(x + 16))));
          }
        }
        // the scale of row 4 q + j in 16-bit lanes 4 j .. 4 j + 3: bytes 2 (4 q + j) + h, widened
        const __m128i il = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), _mm_set1_epi8(8 * q));
        const __m256i scl = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, il));
        const __m256i sch = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_add_epi8(il, _mm_set1_epi8(1))));
        for (int r = 0; r < RM; ++r)
          sacc[q][r] = _mm256_add_epi32(sacc[q][r], _mm256_add_epi32(_mm256_madd_epi16(al[r], scl), _mm256_madd_epi16(ah[r], sch)));
      }
    }
    __m256i s[RM], macc[RM];
    for (int r = 0; r < RM; ++r) s[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sacc[0][r], sacc[1][r]), 0xD8);
    q6x8_offsets<RM>(b, a, i, macc);
    q6x8_finish<RM>(b, a, i, s, macc, facc);
  }
  for (int r = 0; r < RM; ++r) facc_out[r] = facc[r];
}

// 3-4 rows of x in one pass, as x8_tile4: each half q of a super-block (weight rows 4 q .. 4 q + 3)
// is decoded once per group and serves all RM rows; the same integers as q6x8_tile
template <int RM>
inline void q6x8_tile4(const uint8_t* blk, int64_t nsb, const ActK& a, __m256* facc_out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * Q6X8_BYTES;
    for (int o = 0; o < Q6X8_BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + PF + o), _MM_HINT_T0);
    __m256i sq[2][RM];
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const int8_t* x0 = a.q + i * 256;
      // the same broadcasts of x in both halves: without this the compiler keeps those of the first
      // half for the second, on the stack (a store and a reload each, slower than broadcasting again)
      __asm__ volatile("" : "+r"(x0));
      __m256i sacc[RM];
      for (int r = 0; r < RM; ++r) sacc[r] = _mm256_setzero_si256();
      const __m128i il = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), _mm_set1_epi8(8 * q));
      const __m128i ih = _mm_add_epi8(il, _mm_set1_epi8(1));
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m256i qh = loadu(b + Q6X8_QH + 64 * g + 32 * q);
        const __m256i raw0 = loadu(b + 128 * g + 32 * q), raw1 = loadu(b + 128 * g + 64 + 32 * q);
        const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(raw0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        const __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), m4),
                                            _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(raw1, m4), _mm256_and_si256(qh, m30));
        const __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        // the scale of row 4 q + j in 16-bit lanes 4 j .. 4 j + 3: bytes 2 (4 q + j) + h, widened
        const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Q6X8_SC + 16 * g));
        const __m256i scl = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, il));
        const __m256i sch = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, ih));
        for (int r = 0; r < RM; ++r) {
          const int8_t* x = x0 + r * a.K + 32 * g;
          // pairs of u6 x s8 products, two per 16-bit lane: at most 4 * 63 * 127
          const __m256i al = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_set1_epi64x(load8(x))),
                                              _mm256_maddubs_epi16(lo1, _mm256_set1_epi64x(load8(x + 8))));
          const __m256i ah = _mm256_add_epi16(_mm256_maddubs_epi16(hi0, _mm256_set1_epi64x(load8(x + 16))),
                                              _mm256_maddubs_epi16(hi1, _mm256_set1_epi64x(load8(x + 24))));
          sacc[r] = _mm256_add_epi32(sacc[r], _mm256_add_epi32(_mm256_madd_epi16(al, scl), _mm256_madd_epi16(ah, sch)));
          __asm__("" : "+x"(sacc[r]));
        }
      }
      for (int r = 0; r < RM; ++r) sq[q][r] = sacc[r];
    }
    __m256i s[RM], macc[RM];
    for (int r = 0; r < RM; ++r) s[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sq[0][r], sq[1][r]), 0xD8);
    q6x8_offsets<RM>(b, a, i, macc);
    q6x8_finish<RM>(b, a, i, s, macc, facc_out);
  }
}
#endif

// Output rows [n0, n1) of a Q4_Kx8 or Q6_Kx8 matrix (row groups of 8 starting in that range) against
// the M rows of x into y (row stride ldy), in tiles of X8_RM rows of x
struct Q4Kx8Tile {
  template <int RM> static void run(const uint8_t* b, int64_t nsb, const ActK& a, __m256* f) { x8_tile<RM>(b, nsb, a, f); }
};
struct Q6Kx8Tile {
  template <int RM> static void run(const uint8_t* b, int64_t nsb, const ActK& a, __m256* f) { q6x8_tile<RM>(b, nsb, a, f); }
};

#if !MTPLLM_VNNI
// AVX2 build: which 8-row K-quant layouts run 3-4 rows of x in one pass (x8_tile4 / q6x8_tile4)
// instead of tiles of 2: bit 0 Q4_Kx8, bit 1 Q6_Kx8 (`x8_tile4` op). Both give the same bits.
int64_t& x8_tile4_mask() {
  static int64_t v = 3;
  return v;
}
template <class Tile> bool x8_tile4_on() { return x8_tile4_mask() & (std::is_same_v<Tile, Q4Kx8Tile> ? 1 : 2); }
template <class Tile, int RM> void run_tile4(const uint8_t* b, int64_t nsb, const ActK& a, __m256* f) {
  if constexpr (std::is_same_v<Tile, Q4Kx8Tile>) x8_tile4<RM>(b, nsb, a, f);
  else q6x8_tile4<RM>(b, nsb, a, f);
}
#endif

template <class Tile, int RM = X8_RM>
inline void kx8_tile_rm(int rm, const uint8_t* blk, int64_t nsb, const ActK& a, __m256* facc) {
  if constexpr (RM > 1) {
    if (rm < RM) return kx8_tile_rm<Tile, RM - 1>(rm, blk, nsb, a, facc);
  }
  Tile::template run<RM>(blk, nsb, a, facc);
}

template <class Tile>
void kx8_rows(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1, const ActK& xk, int64_t M, float* y,
              int64_t ldy) {
  const int64_t nsb = xk.K / 256;
  int64_t grp = (n0 + 7) / 8;
#if MTPLLM_VNNI
  if (std::is_same_v<Tile, Q4Kx8Tile> && M > 1 && M <= X8_RM && nsb > mtpllm::tune_pair_nsb()) {
    const int rm = static_cast<int>(M);
    for (; (grp + 1) * 8 < n1; grp += 2) {
      __m256 f[2][X8_RM];
      for (int r = 0; r < X8_RM; ++r) f[0][r] = f[1][r] = _mm256_setzero_ps();
      const uint8_t* blk = w + grp * group_bytes;
      switch (rm) {
        case 4: x8_tile2<4>(blk, blk + group_bytes, nsb, xk, f[0], f[1]); break;
        case 3: x8_tile2<3>(blk, blk + group_bytes, nsb, xk, f[0], f[1]); break;
        default: x8_tile2<2>(blk, blk + group_bytes, nsb, xk, f[0], f[1]); break;
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < rm; ++r) _mm256_storeu_ps(y + r * ldy + (grp + h) * 8, f[h][r]);
    }
  }
#endif
#if !MTPLLM_VNNI
  if (M > 2 && x8_tile4_on<Tile>()) {
    for (; grp * 8 < n1; ++grp) {
      const uint8_t* blk = w + grp * group_bytes;
      for (int64_t m = 0; m < M; m += 4) {
        const int rm = static_cast<int>(std::min<int64_t>(4, M - m));
        __m256 facc[4];
        for (int r = 0; r < 4; ++r) facc[r] = _mm256_setzero_ps();
        switch (rm) {
          case 4: run_tile4<Tile, 4>(blk, nsb, xk.from(m), facc); break;
          case 3: run_tile4<Tile, 3>(blk, nsb, xk.from(m), facc); break;
          default: kx8_tile_rm<Tile>(rm, blk, nsb, xk.from(m), facc); break;
        }
        for (int r = 0; r < rm; ++r) _mm256_storeu_ps(y + (m + r) * ldy + grp * 8, facc[r]);
      }
    }
    return;
  }
#endif
  for (; grp * 8 < n1; ++grp) {
    const uint8_t* blk = w + grp * group_bytes;
    for (int64_t m = 0; m < M; m += X8_RM) {
      const int rm = static_cast<int>(std::min<int64_t>(X8_RM, M - m));
      __m256 facc[X8_RM];
      for (int r = 0; r < X8_RM; ++r) facc[r] = _mm256_setzero_ps();
      kx8_tile_rm<Tile>(rm, blk, nsb, xk.from(m), facc);
      for (int r = 0; r < rm; ++r) _mm256_storeu_ps(y + (m + r) * ldy + grp * 8, facc[r]);
    }
  }
}

// the 256 unsigned codes (0..63) of one Q6_K super-block, in weight order (ggml's dequantize_row_q6_K)
inline void q6_unpack(const uint8_t* b, uint8_t* code) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    uint8_t* c = code + 128 * h;
    for (int l = 0; l < 32; ++l) {
      c[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
      c[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
      c[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      c[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
  }
}

// Q6_K rows [8 g0, 8 g1) of w (uint8 [N, K / 256 * 210]) -> row groups [g0, g1) of the Q6_Kx8 layout
void q6x8_repack(const uint8_t* w, int64_t row_bytes, int64_t nsb, int64_t g0, int64_t g1, uint8_t* out) {
  for (int64_t grp = g0; grp < g1; ++grp)
    for (int64_t i = 0; i < nsb; ++i) {
      uint8_t* o = out + (grp * nsb + i) * Q6X8_BYTES;
      for (int r = 0; r < 8; ++r) {
        const uint8_t* b = w + (grp * 8 + r) * row_bytes + i * 210;
        uint8_t c[256];
        q6_unpack(b, c);
        std::memcpy(o + Q6X8_D + 2 * r, b + 208, 2);
        for (int g = 0; g < 8; ++g) {
          const uint8_t* cg = c + 32 * g;
          for (int h = 0; h < 2; ++h) o[Q6X8_SC + 16 * g + 2 * r + h] = b[192 + 2 * g + h];
          for (int k = 0; k < 8; ++k) {
            for (int p = 0; p < 2; ++p) o[128 * g + 64 * p + 8 * r + k] = (cg[8 * p + k] & 15) | ((cg[16 + 8 * p + k] & 15) << 4);
            o[Q6X8_QH + 64 * g + 8 * r + k] = (cg[k] >> 4) | ((cg[16 + k] >> 4) << 2) | ((cg[8 + k] >> 4) << 4) | ((cg[24 + k] >> 4) << 6);
          }
        }
      }
    }
}

// the row groups of a Q6_Kx8 matrix starting in rows [n0, n1) as float32 rows of y (row stride K):
// exactly the Q6_K blocks' values
void q6x8_dequant(const uint8_t* w, int64_t nsb, int64_t n0, int64_t n1, float* y) {
  const int64_t K = nsb * 256;
  for (int64_t grp = (n0 + 7) / 8; grp * 8 < n1; ++grp)
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* b = w + (grp * nsb + i) * Q6X8_BYTES;
      for (int r = 0; r < 8; ++r) {
        float* o = y + (grp * 8 + r) * K + i * 256;
        const float d = f16(b + Q6X8_D + 2 * r);
        for (int g = 0; g < 8; ++g)
          for (int p = 0; p < 2; ++p)
            for (int k = 0; k < 8; ++k) {
              const uint8_t q = b[128 * g + 64 * p + 8 * r + k], qh = b[Q6X8_QH + 64 * g + 8 * r + k] >> (4 * p);
              const int lo = (q & 15) | ((qh & 3) << 4), hi = (q >> 4) | (((qh >> 2) & 3) << 4);
              const auto sc = [&](int h) { return d * static_cast<float>(static_cast<int8_t>(b[Q6X8_SC + 16 * g + 2 * r + h])); };
              o[32 * g + 8 * p + k] = sc(0) * static_cast<float>(lo - 32);
              o[32 * g + 16 + 8 * p + k] = sc(1) * static_cast<float>(hi - 32);
            }
      }
    }
}

// Prompt chunks of the 32-weight block types (Q4_0, Q5_0, Q8_0): 8 weight rows at a time are decoded
// once into a small buffer, each block's codes interleaved by 4 (one 256-bit register holds codes
// 4c..4c+3 of the 8 rows: an 8 x 8 transpose of 32-bit words), and every row of x is multiplied
// against them: vpdpbusd multiplies 4 weights of 8 rows by 4 broadcast activations, summing into
// int32 per row (the offset term, -OFF * sum(x), as its start value), then one float multiply-add
// per block for the 8 rows. The decode is paid once per 8 weight rows and all rows of x, not per
// row pair. Each output is the sum over blocks, in block order, of d_w * d_x * (integer block sum):
// from its own row of x only, so any split of a prompt into chunks gives the same values (not the
// same rounding as the one-row kernel, whose float sums run in two chains; decoding never comes here).
inline void transpose8x32(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]);
    t[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);
  }
  for (int h = 0; h < 8; h += 4) {
    u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
    v[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
  }
}

// weight rows [n, n + rows) (rows <= 8; missing rows decode as zeros with d = 0) -> codes
// [nb][8 chunks][32 bytes], d [nb][8]
template <class T>
inline void c32_unpack(const uint8_t* w, int64_t row_bytes, int64_t n, int rows, int64_t nb, uint8_t* codes,
                       float* d) {
  auto none = [](__m256) {};
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) {
      v[j] = _mm256_setzero_si256();
      d[b * 8 + j] = 0.0f;
      if (j < rows)
        T::each(w + (n + j) * row_bytes + b * T::BYTES, [&](int, __m256i c, __m256 s, float) {
          v[j] = c;
          d[b * 8 + j] = _mm256_cvtss_f32(s);
        }, none);
    }
    transpose8x32(v);
    for (int c = 0; c < 8; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * 256 + 32 * c), v[c]);
  }
}

// The 8 weight rows' codes of block b, interleaved by 4 (cv[c] byte 4 r + j = code 4 c + j of row
// r, as the type's decoder gives them: see T::SIGNED, T::OFF) and their 8 scales d8: from the
// buffer c32_unpack fills (prompt chunks of the file's blocks) ...
struct C32Unpacked {
  const uint8_t* codes;
  const float* dw;
  __attribute__((always_inline)) void block(int64_t b, __m256i cv[8], __m256& d8) const {
    for (int c = 0; c < 8; ++c) cv[c] = loadu(codes + b * 256 + 32 * c);
    d8 = _mm256_loadu_ps(dw + b * 8);
  }
};

// ... or from the Q4_0x8 / Q5_0x8 / Q8_0x8 layouts, the file's blocks of 8 rows repacked at load
// (`gguf_repack`), in as many bytes as the file's blocks. One block of 8 rows x 32 weights:
//   Q4_0x8 (144 bytes): nib [128] as Q5_0x8's; d [8] float16 at 128
//   Q8_0x8 (272 bytes): codes [256]: chunk c at 32 c, byte 4 r + j = code 4 c + j of row r (int8,
//                       the file's); d [8] float16 at 256
//   Q5_0x8 (176 bytes): nib [128]: 32 bytes at 32 c (c < 4), byte 4 r + j = the file's qs byte 4 c + j
//                       of row r (low nibble: code 4 c + j; high nibble: code 16 + 4 c + j, 4 low bits);
//                       hb [32] at 128: bit c of byte 4 r + j = the 5th bit of code 4 c + j of row r
//                       (a 16-bit shift and a mask bring chunk c's bits to 0x10); d [8] float16 at 160
// Decoded, they are exactly c32_unpack's codes and scales: both give the same products.
constexpr int64_t Q4_0X8 = 1002, Q5_0X8 = 1006, Q8_0X8 = 1008;
constexpr int64_t Q4_0X8_BYTES = 144, Q5_0X8_BYTES = 176, Q8_0X8_BYTES = 272;

// bytes per block of 8 rows x 32 weights of an x8 layout (and its scales' offset in it)
inline int64_t c32x8_bytes(int64_t t) { return t == Q4_0X8 ? Q4_0X8_BYTES : t == Q5_0X8 ? Q5_0X8_BYTES : Q8_0X8_BYTES; }
inline int64_t c32x8_d(int64_t t) { return t == Q4_0X8 ? 128 : t == Q5_0X8 ? 160 : 256; }

// software prefetch of the cache lines of the block PF bytes ahead of p (a block of `bytes`)
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PF + o), _MM_HINT_T0);
}

struct C32Q4x8 {
  const uint8_t* w;
  __attribute__((always_inline)) void block(int64_t b, __m256i cv[8], __m256& d8) const {
    const uint8_t* p = w + b * Q4_0X8_BYTES;
    prefetch_ahead(p, Q4_0X8_BYTES);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = loadu(p + 32 * c);
      cv[c] = _mm256_and_si256(raw, m4);
      cv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    }
    d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 128)));
  }
};

struct C32Q5x8 {
  const uint8_t* w;
  __attribute__((always_inline)) void block(int64_t b, __m256i cv[8], __m256& d8) const {
    const uint8_t* p = w + b * Q5_0X8_BYTES;
    prefetch_ahead(p, Q5_0X8_BYTES);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m5 = _mm256_set1_epi8(0x10);
    const __m256i hb = loadu(p + 128);
    cv[0] = _mm256_slli_epi16(hb, 4);  // bit c of each byte -> bit 4 (no bit crosses into bit 4 of
    cv[1] = _mm256_slli_epi16(hb, 3);  // the other byte of a 16-bit lane: see the layout)
    cv[2] = _mm256_slli_epi16(hb, 2);
    cv[3] = _mm256_slli_epi16(hb, 1);
    cv[4] = hb;
    cv[5] = _mm256_srli_epi16(hb, 1);
    cv[6] = _mm256_srli_epi16(hb, 2);
    cv[7] = _mm256_srli_epi16(hb, 3);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = loadu(p + 32 * c);
      cv[c] = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(cv[c], m5));
      cv[c + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), _mm256_and_si256(cv[c + 4], m5));
    }
    d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 160)));
  }
};

struct C32Q8x8 {
  const uint8_t* w;
  __attribute__((always_inline)) void block(int64_t b, __m256i cv[8], __m256& d8) const {
    const uint8_t* p = w + b * Q8_0X8_BYTES;
    prefetch_ahead(p, Q8_0X8_BYTES);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#if MTPLLM_VNNI  // used unsigned, as TQ8_0 gives them in this build
      cv[c] = _mm256_xor_si256(loadu(p + 32 * c), _mm256_set1_epi8(static_cast<char>(0x80)));
#else
      cv[c] = loadu(p + 32 * c);
#endif
    }
    d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 256)));
  }
};

// RM rows of x (int8 codes xq [RM, K], block scales xd [RM, nb], block code sums xs [RM, nb])
// against 8 weight rows (codes from src): facc[r] lane j = row j's output for x row r
template <class T, int RM, class Src>
inline void c32_tile(const Src& src, int64_t nb, const int8_t* xq, const float* xd, const int32_t* xs, int64_t K,
                     __m256* facc_out) {
  __m256 facc[RM];
  for (int r = 0; r < RM; ++r) facc[r] = facc_out[r];
#if !MTPLLM_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    __m256i cv[8];
    __m256 d8;
    src.block(b, cv, d8);
    for (int r = 0; r < RM; ++r) {
      const int8_t* x = xq + r * K + 32 * b;
      __m256i acc = T::OFF ? _mm256_set1_epi32(-T::OFF * xs[r * nb + b]) : _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        int32_t x4;
        std::memcpy(&x4, x + 4 * c, 4);
        const __m256i xb = _mm256_set1_epi32(x4);
#if MTPLLM_VNNI
        acc = _mm256_dpbusd_epi32(acc, cv[c], xb);
#else  // signed codes (Q8_0): |w| times x with w's sign, as the one-row kernel (pairs <= 2 * 128 * 127)
        const __m256i p = T::SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(cv[c], cv[c]), _mm256_sign_epi8(xb, cv[c]))
                                    : _mm256_maddubs_epi16(cv[c], xb);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
#endif
      }
      facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(d8, _mm256_set1_ps(xd[r * nb + b])), facc[r]);
    }
  }
  for (int r = 0; r < RM; ++r) facc_out[r] = facc[r];
}

#if MTPLLM_VNNI
constexpr int C32_RM = 4;
#else
constexpr int C32_RM = 2;
#endif

template <class T, class Src, int RM = C32_RM>
inline void c32_tile_rm(int rm, const Src& src, int64_t nb, const int8_t* xq, const float* xd, const int32_t* xs,
                        int64_t K, __m256* facc) {
  if constexpr (RM > 1) {
    if (rm < RM) return c32_tile_rm<T, Src, RM - 1>(rm, src, nb, xq, xd, xs, K, facc);
  }
  c32_tile<T, RM>(src, nb, xq, xd, xs, K, facc);
}

// The 8 output rows of one weight group (codes from src) against the M rows of x into y[:, n..n+rows)
template <class T, class Src>
inline void c32_group(const Src& src, int rows, int64_t n, const Act& x, const int32_t* xs, int64_t M, float* y,
                      int64_t ldy) {
  const int64_t K = x.K, nb = K / 32;
  for (int64_t m = 0; m < M; m += C32_RM) {
    const int rm = static_cast<int>(std::min<int64_t>(C32_RM, M - m));
    __m256 facc[C32_RM];
    for (int r = 0; r < C32_RM; ++r) facc[r] = _mm256_setzero_ps();
    c32_tile_rm<T>(rm, src, nb, x.q + m * K, x.d + m * nb, xs + m * nb, K, facc);
    for (int r = 0; r < rm; ++r) {
      if (rows == 8) {
        _mm256_storeu_ps(y + (m + r) * ldy + n, facc[r]);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, facc[r]);
        for (int j = 0; j < rows; ++j) y[(m + r) * ldy + n + j] = t[j];
      }
    }
  }
}

// Rows [n0, n1) of W (a 32-weight block type) against the M rows of x (quantized per 32: x.q, x.d;
// block code sums xs) into y[:, n0:n1]
template <class T>
void c32_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Act& x, const int32_t* xs, int64_t M,
              float* y, int64_t ldy) {
  const int64_t K = x.K, nb = K / 32;
  std::vector<uint8_t> codes(nb * 256);
  std::vector<float> dw(nb * 8);
  for (int64_t n = n0; n < n1; n += 8) {
    const int rows = static_cast<int>(std::min<int64_t>(8, n1 - n));
    c32_unpack<T>(w, row_bytes, n, rows, nb, codes.data(), dw.data());
    c32_group<T>(C32Unpacked{codes.data(), dw.data()}, rows, n, x, xs, M, y, ldy);
  }
}

// Output rows [n0, n1) of a Q5_0x8 / Q8_0x8 matrix (the row groups of 8 starting in that range)
// against the M rows of x, for every M: decoding, verification and prompt chunks share these
// products, which are exactly c32_rows' on the file's blocks
template <class T, class Src>
void c32x8_rows(const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1, const Act& x, const int32_t* xs,
                int64_t M, float* y, int64_t ldy) {
  for (int64_t grp = (n0 + 7) / 8; grp * 8 < n1; ++grp)
    c32_group<T>(Src{w + grp * group_bytes}, 8, grp * 8, x, xs, M, y, ldy);
}

// Q4_0 / Q5_0 / Q8_0 rows [8 g0, 8 g1) of w (the file's blocks, type t) -> row groups [g0, g1) of
// the x8 layout (type t8)
void c32x8_repack(int64_t t, int64_t t8, const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t g0, int64_t g1,
                  uint8_t* out) {
  const int64_t bytes = c32x8_bytes(t8), dof = c32x8_d(t8);
  const int64_t in = t == Q4_0 ? TQ4_0::BYTES : t == Q5_0 ? TQ5_0::BYTES : TQ8_0::BYTES;
  for (int64_t grp = g0; grp < g1; ++grp)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* o = out + (grp * nb + b) * bytes;
      if (t == Q5_0) std::memset(o + 128, 0, 32);
      for (int r = 0; r < 8; ++r) {
        const uint8_t* blk = w + (grp * 8 + r) * row_bytes + b * in;
        std::memcpy(o + dof + 2 * r, blk, 2);
        if (t == Q8_0) {
          for (int c = 0; c < 8; ++c) std::memcpy(o + 32 * c + 4 * r, blk + 2 + 4 * c, 4);
          continue;
        }
        const uint8_t* qs = blk + (t == Q5_0 ? 6 : 2);
        for (int c = 0; c < 4; ++c) std::memcpy(o + 32 * c + 4 * r, qs + 4 * c, 4);
        if (t == Q5_0) {
          uint32_t qh;
          std::memcpy(&qh, blk + 2, 4);
          for (int c = 0; c < 8; ++c)
            for (int j = 0; j < 4; ++j) o[128 + 4 * r + j] |= static_cast<uint8_t>(((qh >> (4 * c + j)) & 1) << c);
        }
      }
    }
}

// The row groups of a Q5_0x8 / Q8_0x8 matrix starting in rows [n0, n1) as float32 rows of y (the
// matrix's first row; row stride K): exactly the values of the blocks they were made from
void c32x8_dequant(int64_t t, const uint8_t* w, int64_t nb, int64_t n0, int64_t n1, float* y) {
  const int64_t bytes = c32x8_bytes(t), K = nb * 32;
  for (int64_t grp = (n0 + 7) / 8; grp * 8 < n1; ++grp)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w + (grp * nb + b) * bytes;
      for (int r = 0; r < 8; ++r) {
        const float d = f16(p + c32x8_d(t) + 2 * r);
        float* o = y + (grp * 8 + r) * K + b * 32;
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j) {
            int code;
            if (t == Q8_0X8) {
              code = static_cast<int8_t>(p[32 * c + 4 * r + j]);
            } else {
              const uint8_t nib = p[32 * (c & 3) + 4 * r + j];
              code = c < 4 ? nib & 15 : nib >> 4;
              code = t == Q5_0X8 ? (code | (((p[128 + 4 * r + j] >> c) & 1) << 4)) - 16 : code - 8;
            }
            o[4 * c + j] = static_cast<float>(code) * d;
          }
      }
    }
}

// Dequantize rows [n0, n1) of one matrix into y (float32, row stride K)
template <class T>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* yr = y + (n - n0) * K;
    for (int64_t i = 0; i < K / T::QK; ++i) {
      alignas(32) float m8[8];
      T::each(wr + i * T::BYTES, [&](int g, __m256i q, __m256 sw, float mn) {
        float* o = yr + i * T::QK + g * 32;
        const __m256 vm = _mm256_set1_ps(T::VMIN ? m8[g] : mn);
        const __m256 s_lo = _mm256_permute2f128_ps(sw, sw, 0x00), s_hi = _mm256_permute2f128_ps(sw, sw, 0x11);
        for (int j = 0; j < 4; ++j) {
          const __m128i b8 = j < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
          const __m128i part = (j & 1) ? _mm_srli_si128(b8, 8) : b8;
          const __m256i i32 = T::SIGNED ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
          _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), j < 2 ? s_lo : s_hi, vm));
        }
      }, [&](__m256 v) { _mm256_store_ps(m8, v); });
    }
  }
}

struct TypeInfo {
  int64_t qk, bytes;
};

TypeInfo type_info(int64_t t) {
  switch (t) {
    case Q4_0: return {TQ4_0::QK, TQ4_0::BYTES};
    case Q4_1: return {TQ4_1::QK, TQ4_1::BYTES};
    case Q5_0: return {TQ5_0::QK, TQ5_0::BYTES};
    case Q5_1: return {TQ5_1::QK, TQ5_1::BYTES};
    case Q8_0: return {TQ8_0::QK, TQ8_0::BYTES};
    case Q4_K: return {TQ4_K::QK, TQ4_K::BYTES};
    case Q5_K: return {TQ5_K::QK, TQ5_K::BYTES};
    case Q6_K: return {TQ6_K::QK, TQ6_K::BYTES};
    default: TORCH_CHECK(false, "GGML type ", t, " has no block kernel");
  }
}

template <template <class> class Fn, class... A>
void dispatch(int64_t t, A&&... args) {
  switch (t) {
    case Q4_0: Fn<TQ4_0>::run(args...); break;
    case Q4_1: Fn<TQ4_1>::run(args...); break;
    case Q5_0: Fn<TQ5_0>::run(args...); break;
    case Q5_1: Fn<TQ5_1>::run(args...); break;
    case Q8_0: Fn<TQ8_0>::run(args...); break;
    case Q4_K: Fn<TQ4_K>::run(args...); break;
    case Q5_K: Fn<TQ5_K>::run(args...); break;
    case Q6_K: Fn<TQ6_K>::run(args...); break;
    default: TORCH_CHECK(false, "GGML type ", t, " has no block kernel");
  }
}
template <class T> struct RowsOf {
  template <class... A> static void run(A... a) { rows_of<T>(a...); }
};
template <class T> struct DequantRows {
  template <class... A> static void run(A... a) { dequant_rows<T>(a...); }
};

// output rows of one weight tensor (Q4_Kx8: 8 per row group)
bool x8_type(int64_t t) { return t == Q4_KX8 || t == Q6_KX8 || t == Q4_0X8 || t == Q5_0X8 || t == Q8_0X8; }
int64_t weight_rows(const at::Tensor& w, int64_t t) { return x8_type(t) ? 8 * w.size(0) : w.size(0); }

void check_weight(const at::Tensor& w, int64_t t, int64_t K) {
  if (t == Q4_KX8) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && K % 256 == 0 &&
                    w.size(1) == K / 256 * X8_BYTES,
                "Q4_Kx8 weights: uint8 [N / 8, K / 256 * ", X8_BYTES, "] (gguf_repack) for K = ", K);
    return;
  }
  if (t == Q6_KX8) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && K % 256 == 0 &&
                    w.size(1) == K / 256 * Q6X8_BYTES,
                "Q6_Kx8 weights: uint8 [N / 8, K / 256 * ", Q6X8_BYTES, "] (gguf_repack) for K = ", K);
    return;
  }
  if (t == Q4_0X8 || t == Q5_0X8 || t == Q8_0X8) {
    const int64_t bytes = c32x8_bytes(t);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && K % 32 == 0 &&
                    w.size(1) == K / 32 * bytes,
                "Q4_0x8/Q5_0x8/Q8_0x8 weights: uint8 [N / 8, K / 32 * ", bytes, "] (gguf_repack) for K = ", K);
    return;
  }
  const TypeInfo ti = type_info(t);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1,
              "weights: uint8 [N, row bytes] with contiguous rows");
  TORCH_CHECK(K % ti.qk == 0 && w.size(1) == K / ti.qk * ti.bytes, "weight row bytes do not match K = ", K,
              " for GGML type ", t);
}

bool c32_type(int64_t t) { return t == Q4_0 || t == Q5_0 || t == Q8_0; }
bool c32x8_type(int64_t t) { return t == Q4_0X8 || t == Q5_0X8 || t == Q8_0X8; }

// y = x @ W^T for W = the row-wise concatenation of ws (GGUF blocks of types `types`); `chunk`:
// a prompt chunk, whose Q4_0/Q5_0/Q8_0 matrices take the 8-row GEMM (c32_rows)
at::Tensor gguf_linear_impl(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, bool chunk) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(ws.size() == types.size() && !ws.empty(), "one GGML type per weight");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  std::vector<int64_t> off(ws.size() + 1, 0);
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight(ws[i], types[i], K);
    off[i + 1] = off[i] + weight_rows(ws[i], types[i]);
  }
  const int64_t N = off.back();
  at::Tensor y = at::empty({M, N}, x.options());
  bool any_k = false, any_32 = false, any_q4 = false, any_q5 = false, any_q8 = false;
  for (size_t i = 0; i < ws.size(); ++i) {
    const bool k = types[i] == Q4_K || types[i] == Q5_K || types[i] == Q6_K || types[i] == Q4_KX8 ||
                   types[i] == Q6_KX8;
    any_k |= k;
    any_32 |= !k;
    any_q4 |= types[i] == Q4_0;
    any_q5 |= types[i] == Q5_0;
    any_q8 |= TQ8_0::OFF && types[i] == Q8_0;
  }
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> xq(any_32 ? M * K : 0), kq(any_k ? M * K : 0);
  std::vector<float> xd(any_32 ? M * nb : 0), xs(any_32 ? M * nb : 0), kd(any_k ? M * K / 256 : 0),
      ks(any_k ? M * nb : 0);
  std::vector<int16_t> kb(any_k ? M * K / 16 : 0), kb32(any_k ? M * nb : 0);
  std::vector<Off> o4(any_q4 ? M * K / OFF_PER : 0), o5(any_q5 ? M * K / OFF_PER : 0), o8(any_q8 ? M * K / OFF_PER : 0);
  bool any_c32 = false;
  for (size_t i = 0; i < ws.size(); ++i) any_c32 |= (chunk && c32_type(types[i])) || c32x8_type(types[i]);
  std::vector<int32_t> bsum(any_c32 ? M * nb : 0);  // sums of x's codes per block (c32_rows' offset terms)
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (any_32) quantize_row(xp + m * K, K, xq.data() + m * K, xd.data() + m * nb, xs.data() + m * nb, 32);
      if (any_c32)
        for (int64_t j = 0; j < nb; ++j) {
          int32_t sum = 0;
          for (int k = 0; k < 32; ++k) sum += xq[m * K + 32 * j + k];
          bsum[m * nb + j] = sum;
        }
      if (any_q4 || any_q5 || any_q8) {  // the offset terms (see Off): 8, 16, 128 times sums of codes
        const __m256i one = _mm256_set1_epi8(1);
        for (int64_t j = 0; j < nb; ++j) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.data() + m * K + 32 * j));
#if MTPLLM_VNNI
          const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), one, xv));
          auto put = [&](Off* o, int sh) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + m * K / OFF_PER + 8 * j), _mm256_slli_epi32(c, sh));
          };
#else
          const __m256i c = _mm256_maddubs_epi16(one, xv);
          auto put = [&](Off* o, int sh) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + m * K / OFF_PER + 16 * j), _mm256_slli_epi16(c, sh));
          };
#endif
          if (any_q4) put(o4.data(), 3);
          if (any_q5) put(o5.data(), 4);
          if (any_q8) put(o8.data(), 7);
        }
      }
      if (any_k) quantize_row_k(xp + m * K, K, kq.data() + m * K, kd.data() + m * K / 256, ks.data() + m * nb,
                                kb.data() + m * K / 16, kb32.data() + m * nb);
    }
  });
  const Act a{xq.data(), xd.data(), xs.data(), any_q4 ? o4.data() : nullptr, any_q5 ? o5.data() : nullptr,
              any_q8 ? o8.data() : nullptr, K, nb};
  const ActK ak{kq.data(), kd.data(), ks.data(), kb.data(), kb32.data(), K};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain_rows(K, M), [&](int64_t n0, int64_t n1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t lo = std::max(n0, off[i]), hi = std::min(n1, off[i + 1]);
      if (lo >= hi) continue;
      if (types[i] == Q4_KX8) {
        kx8_rows<Q4Kx8Tile>(ws[i].data_ptr<uint8_t>(), ws[i].stride(0), lo - off[i], hi - off[i], ak, M, yp + off[i], N);
        continue;
      }
      if (types[i] == Q6_KX8) {
        kx8_rows<Q6Kx8Tile>(ws[i].data_ptr<uint8_t>(), ws[i].stride(0), lo - off[i], hi - off[i], ak, M, yp + off[i], N);
        continue;
      }
      if (c32x8_type(types[i])) {  // every M: the same products as c32_rows on the file's blocks
        const uint8_t* wp = ws[i].data_ptr<uint8_t>();
        if (types[i] == Q4_0X8)
          c32x8_rows<TQ4_0, C32Q4x8>(wp, ws[i].stride(0), lo - off[i], hi - off[i], a, bsum.data(), M, yp + off[i], N);
        else if (types[i] == Q5_0X8)
          c32x8_rows<TQ5_0, C32Q5x8>(wp, ws[i].stride(0), lo - off[i], hi - off[i], a, bsum.data(), M, yp + off[i], N);
        else
          c32x8_rows<TQ8_0, C32Q8x8>(wp, ws[i].stride(0), lo - off[i], hi - off[i], a, bsum.data(), M, yp + off[i], N);
        continue;
      }
      if (chunk && c32_type(types[i])) {
        const uint8_t* wp = ws[i].data_ptr<uint8_t>();
        const int64_t rb = ws[i].stride(0);
        float* yo = yp + off[i];
        switch (types[i]) {
          case Q4_0: c32_rows<TQ4_0>(wp, rb, lo - off[i], hi - off[i], a, bsum.data(), M, yo, N); break;
          case Q5_0: c32_rows<TQ5_0>(wp, rb, lo - off[i], hi - off[i], a, bsum.data(), M, yo, N); break;
          default: c32_rows<TQ8_0>(wp, rb, lo - off[i], hi - off[i], a, bsum.data(), M, yo, N); break;
        }
        continue;
      }
      dispatch<RowsOf>(types[i], ws[i].data_ptr<uint8_t>(), ws[i].stride(0), lo - off[i], hi - off[i], a, ak, M,
                       yp + off[i], N);
    }
  });
  return y;
}

at::Tensor gguf_linear(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types) {
  return gguf_linear_impl(x, ws, types, false);
}

at::Tensor gguf_linear_chunk(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types) {
  return gguf_linear_impl(x, ws, types, true);
}

// The float32 weights [sum N_i, K] of the row-wise concatenation of GGUF block matrices ws
at::Tensor gguf_dequantize(at::TensorList ws, at::IntArrayRef types, int64_t K) {
  TORCH_CHECK(ws.size() == types.size() && !ws.empty(), "one GGML type per weight");
  std::vector<int64_t> off(ws.size() + 1, 0);
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight(ws[i], types[i], K);
    off[i + 1] = off[i] + weight_rows(ws[i], types[i]);
  }
  at::Tensor y = at::empty({off.back(), K}, at::TensorOptions().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, off.back(), grain_rows(K, 1), [&](int64_t n0, int64_t n1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t a = std::max(n0, off[i]), b = std::min(n1, off[i + 1]);
      if (a >= b) continue;
      if (types[i] == Q4_KX8) {
        x8_dequant(ws[i].data_ptr<uint8_t>(), K / 256, a - off[i], b - off[i], yp + off[i] * K);
        continue;
      }
      if (types[i] == Q6_KX8) {
        q6x8_dequant(ws[i].data_ptr<uint8_t>(), K / 256, a - off[i], b - off[i], yp + off[i] * K);
        continue;
      }
      if (c32x8_type(types[i])) {
        c32x8_dequant(types[i], ws[i].data_ptr<uint8_t>(), K / 32, a - off[i], b - off[i], yp + off[i] * K);
        continue;
      }
      dispatch<DequantRows>(types[i], ws[i].data_ptr<uint8_t>(), ws[i].stride(0), a - off[i], b - off[i], K,
                            yp + a * K);
    }
  });
  return y;
}

// Ask for transparent huge pages over the 2 MiB-aligned interior of a fresh allocation (before it is
// written): the kernels stream every weight once per token, and with 4 KiB pages that is a TLB miss
// every 4 KiB. Only advice: where THP is off or unavailable nothing changes.
inline void advise_huge_pages(void* p, int64_t n) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t H = 2u << 20;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + H - 1) & ~(H - 1), e = (reinterpret_cast<uintptr_t>(p) + n) & ~(H - 1);
  if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
#endif
}

// Q4_K / Q4_0 / Q5_0 / Q8_0 weights (the file's blocks, N % 8 == 0) in the layout of 8 rows: Q4_Kx8
// uint8 [N / 8, K / 256 * X8_BYTES], Q4_0x8 / Q5_0x8 / Q8_0x8 uint8 [N / 8, K / 32 * (144 | 176 | 272)]
at::Tensor gguf_repack(const at::Tensor& w, int64_t t, int64_t K) {
  TORCH_CHECK(t == Q4_K || t == Q6_K || t == Q4_0 || t == Q5_0 || t == Q8_0,
              "gguf_repack: Q4_K, Q6_K, Q4_0, Q5_0 and Q8_0 (types 12, 14, 2, 6, 8) are repacked, got type ", t);
  check_weight(w, t, K);
  const int64_t N = w.size(0);
  TORCH_CHECK(N % 8 == 0, "gguf_repack: the row count (", N, ") must be a multiple of 8");
  const int64_t t8 = t == Q4_0 ? Q4_0X8 : t == Q5_0 ? Q5_0X8 : Q8_0X8;
  const int64_t group_bytes = t == Q4_K ? K / 256 * X8_BYTES : t == Q6_K ? K / 256 * Q6X8_BYTES : K / 32 * c32x8_bytes(t8);
  at::Tensor out = at::empty({N / 8, group_bytes}, w.options().dtype(at::kByte));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  advise_huge_pages(op, out.numel());
  at::parallel_for(0, N / 8, 16, [&](int64_t g0, int64_t g1) {
    if (t == Q4_K)
      x8_repack(wp, w.stride(0), K / 256, g0, g1, op);
    else if (t == Q6_K)
      q6x8_repack(wp, w.stride(0), K / 256, g0, g1, op);
    else
      c32x8_repack(t, t8, wp, w.stride(0), K / 32, g0, g1, op);
  });
  return out;
}

}  // namespace

namespace mtpllm {
at::Tensor gguf_linear_rows(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types) {
  return gguf_linear_impl(x, ws, types, false);
}
}  // namespace mtpllm

namespace {
// Read (value < 0) or set one of the choices of common.h; returns the value before
int64_t tuning(c10::string_view name, int64_t value) {
  int64_t* v = nullptr;
  if (name == "grain_macs") v = &mtpllm::tune_grain_macs();
  if (name == "pair_nsb") v = &mtpllm::tune_pair_nsb();
  TORCH_CHECK(v != nullptr, "tuning: unknown choice '", std::string(name.data(), name.size()), "' (grain_macs, pair_nsb)");
  const int64_t old = *v;
  if (value >= 0) {
    TORCH_CHECK(name != "grain_macs" || value >= 1, "tuning: grain_macs must be at least 1");
    *v = value;
  }
  return old;
}

int64_t paired_tiles() {
#if MTPLLM_VNNI
  return 1;
#else
  return 0;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(mtpllm, m) {
  m.def("gguf_linear(Tensor x, Tensor[] ws, int[] types) -> Tensor");
  m.def("gguf_dequantize(Tensor[] ws, int[] types, int K) -> Tensor");
  m.def("gguf_repack(Tensor w, int type, int K) -> Tensor");
  m.def("gguf_linear_chunk(Tensor x, Tensor[] ws, int[] types) -> Tensor");
  m.def("tuning(str name, int value) -> int", &tuning);
  m.def("paired_tiles() -> int", &paired_tiles);
}

TORCH_LIBRARY_IMPL(mtpllm, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_repack", &gguf_repack);
  m.impl("gguf_linear_chunk", &gguf_linear_chunk);
}

namespace {
// The AVX2 build's choice of verification tiles (x8_tile4_mask): set when value >= 0; returns the
// value before (-1 in the AVX-512 VNNI build, whose tiles take 4 rows anyway)
int64_t x8_tile4_choice(int64_t value) {
#if MTPLLM_VNNI
  (void)value;
  return -1;
#else
  TORCH_CHECK(value <= 3, "x8_tile4: a mask of bits 0 (Q4_Kx8) and 1 (Q6_Kx8), got ", value);
  const int64_t old = x8_tile4_mask();
  if (value >= 0) x8_tile4_mask() = value;
  return old;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(mtpllm, m) { m.def("x8_tile4(int value) -> int", &x8_tile4_choice); }
