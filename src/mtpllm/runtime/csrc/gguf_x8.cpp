// Q4_K and Q6_K repacked by 8 rows (Q4_Kx8, Q6_Kx8): the layouts, their tiles against 2-4 rows of x
// (x8_tile, x8_tile2, x8_tile4, q6x8_tile, q6x8_tile4), the products of a row range (kx8_rows), and the
// repacking and decoding that gguf_blocks.cpp's `gguf_repack` and `gguf_dequantize` call.
#include <c10/util/Exception.h>
#include "gguf_blocks.h"

namespace mtpllm::gguf {
namespace {
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
constexpr int64_t X8_SC = 1024, X8_MN = 1088, X8_D = 1152, X8_DMIN = 1168;

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
constexpr int X8_RM = 4;       // rows of x per paired tile (x8_tile2), and the default tile
constexpr int X8_RM_MAX = 8;   // the widest tile (32 vector registers: 8 rows' accumulators fit)
// Tiles of 8 rows of x (`tune_tile_rows`, chosen per machine by timing) decode each group's codes
// once for 8 rows instead of twice for two tiles of 4: more multiply-adds per decoded byte where
// the products are compute-bound (several sequences' verification rows in one step), at the cost of
// a tile of x that may not stay in L1 over a long K.
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
constexpr int X8_RM_MAX = 2;

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

}  // namespace

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

namespace {
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
constexpr int64_t Q6X8_QH = 1024, Q6X8_SC = 1536, Q6X8_D = 1664;

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
  const int64_t pf6 = mtpllm::tune_q6_prefetch();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), lo16 = _mm512_set1_epi32(0xFFFF);
  const __m128i dl = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
  const __m128i dh = _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
  __m256 facc[RM];
  for (int r = 0; r < RM; ++r) facc[r] = facc_out[r];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * Q6X8_BYTES;
    for (int o = 0; o < Q6X8_BYTES; o += 64) prefetch_weights(b, o, pf6);
    __m512i sl[RM], sh[RM];  // weights 0..15 / 16..31 of each group (their own scales)
    for (int r = 0; r < RM; ++r) sl[r] = sh[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i qh = _mm512_loadu_si512(b + Q6X8_QH + 64 * g);
      const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Q6X8_SC + 16 * g));
      // row r's scale in lanes 2 r, 2 r + 1 as int16 pairs (scale, 0)
      const __m512i scl = _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(s8, dl)), lo16);
      const __m512i sch = _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(s8, dh)), lo16);
      __m512i lo[2], hi[2];  // the group's 6-bit codes, pair p: codes 8 p + k (lo) and 16 + 8 p + k (hi)
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
        const __m512i raw = _mm512_loadu_si512(b + 128 * g + 64 * p);
        lo[p] = _mm512_or_si512(_mm512_and_si512(raw, m4), _mm512_and_si512(p ? qh : _mm512_slli_epi16(qh, 4), m30));
        hi[p] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), m4),
                                _mm512_and_si512(p ? _mm512_srli_epi16(qh, 2) : _mm512_slli_epi16(qh, 2), m30));
      }
      if constexpr (RM >= 3) {
        // 3+ rows of x (verification, batches, prompt chunks): the products of both pairs go to
        // 16-bit lanes (vpmaddubsw: two u6 x s8 products each, their sum over the pairs four, at
        // most 4 * 63 * 127 < 2^15) and one vpdpwssd by (scale, scale) per half instead of two by
        // (scale, 0): the same integers as below with a quarter fewer multiplies (Zen 4, the
        // 1.5B's FFN-down from L3: 4 rows 0.354 -> 0.327 ms, 8 rows 0.647 -> 0.563)
        const __m512i scl2 = _mm512_or_si512(scl, _mm512_slli_epi32(scl, 16));
        const __m512i sch2 = _mm512_or_si512(sch, _mm512_slli_epi32(sch, 16));
        for (int r = 0; r < RM; ++r) {
          const int8_t* x = a.q + r * a.K + i * 256 + 32 * g;
          const __m512i pl = _mm512_add_epi16(_mm512_maddubs_epi16(lo[0], _mm512_set1_epi64(load8(x))),
                                              _mm512_maddubs_epi16(lo[1], _mm512_set1_epi64(load8(x + 8))));
          const __m512i ph = _mm512_add_epi16(_mm512_maddubs_epi16(hi[0], _mm512_set1_epi64(load8(x + 16))),
                                              _mm512_maddubs_epi16(hi[1], _mm512_set1_epi64(load8(x + 24))));
          sl[r] = _mm512_dpwssd_epi32(sl[r], pl, scl2);
          sh[r] = _mm512_dpwssd_epi32(sh[r], ph, sch2);
        }
      } else {
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p)
          for (int r = 0; r < RM; ++r) {
            const int8_t* x = a.q + r * a.K + i * 256 + 32 * g + 8 * p;
            // |lane| <= 4 * 63 * 127 < 2^15: the low 16 bits are the value
            const __m512i pl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[p], _mm512_set1_epi64(load8(x)));
            const __m512i ph = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[p], _mm512_set1_epi64(load8(x + 16)));
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
  const int64_t pf6 = mtpllm::tune_q6_prefetch();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 facc[RM];
  for (int r = 0; r < RM; ++r) facc[r] = facc_out[r];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * Q6X8_BYTES;
    for (int o = 0; o < Q6X8_BYTES; o += 64) prefetch_weights(b, o, pf6);
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
  const int64_t pf6 = mtpllm::tune_q6_prefetch();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = blk + i * Q6X8_BYTES;
    for (int o = 0; o < Q6X8_BYTES; o += 64) prefetch_weights(b, o, pf6);
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
// the M rows of x into y (row stride ldy), in tiles of X8_RM (or tune_tile_rows) rows of x
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

template <class Tile, int RM = X8_RM_MAX>
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
#if MTPLLM_VNNI
  const int64_t step = mtpllm::tune_tile_rows() >= X8_RM_MAX ? X8_RM_MAX : X8_RM;
#else
  const int64_t step = X8_RM;
#endif
  for (; grp * 8 < n1; ++grp) {
    const uint8_t* blk = w + grp * group_bytes;
    for (int64_t m = 0; m < M; m += step) {
      const int rm = static_cast<int>(std::min<int64_t>(step, M - m));
      __m256 facc[X8_RM_MAX];
      for (int r = 0; r < X8_RM_MAX; ++r) facc[r] = _mm256_setzero_ps();
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

}  // namespace

void kx8_rows_of_type(int64_t t, const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1, const ActK& xk,
                      int64_t M, float* y, int64_t ldy) {
  if (t == Q4_KX8)
    kx8_rows<Q4Kx8Tile>(w, group_bytes, n0, n1, xk, M, y, ldy);
  else
    kx8_rows<Q6Kx8Tile>(w, group_bytes, n0, n1, xk, M, y, ldy);
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

}  // namespace mtpllm::gguf
