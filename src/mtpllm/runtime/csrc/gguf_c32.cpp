// The 32-weight block types Q4_0 / Q5_0 / Q8_0 8 weight rows at a time (c32): prompt chunks of the
// file's blocks and every product of the Q4_0x8 / Q5_0x8 / Q8_0x8 layouts, with their repacking and
// decoding (gguf_blocks.cpp's `gguf_linear_chunk`, `gguf_linear`, `gguf_repack`, `gguf_dequantize`).
#include "gguf_blocks.h"

namespace mtpllm::gguf {
namespace {
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
// Decoded, they are exactly c32_unpack's codes and scales: both give the same products. (Their type
// ids and sizes: gguf_blocks.h.)

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

}  // namespace

void c32_rows_of_type(int64_t t, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Act& x,
                      const int32_t* xs, int64_t M, float* y, int64_t ldy) {
  switch (t) {
    case Q4_0: c32_rows<TQ4_0>(w, row_bytes, n0, n1, x, xs, M, y, ldy); break;
    case Q5_0: c32_rows<TQ5_0>(w, row_bytes, n0, n1, x, xs, M, y, ldy); break;
    default: c32_rows<TQ8_0>(w, row_bytes, n0, n1, x, xs, M, y, ldy); break;
  }
}

void c32x8_rows_of_type(int64_t t, const uint8_t* w, int64_t group_bytes, int64_t n0, int64_t n1, const Act& x,
                        const int32_t* xs, int64_t M, float* y, int64_t ldy) {
  if (t == Q4_0X8)
    c32x8_rows<TQ4_0, C32Q4x8>(w, group_bytes, n0, n1, x, xs, M, y, ldy);
  else if (t == Q5_0X8)
    c32x8_rows<TQ5_0, C32Q5x8>(w, group_bytes, n0, n1, x, xs, M, y, ldy);
  else
    c32x8_rows<TQ8_0, C32Q8x8>(w, group_bytes, n0, n1, x, xs, M, y, ldy);
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
}  // namespace mtpllm::gguf
