// The GGUF block types one weight row at a time (gguf_blocks.cpp's `gguf_linear` for the file's own
// blocks, and `gguf_dequantize`): the 32-weight block types row by row against tiles of up to 4 rows of
// x (dot_row), the K-quants in tiles of one weight row x up to 8 rows of x over their super-blocks in
// int32 (ktile, krows_of; prompt chunks too).
#include <c10/util/Exception.h>
#include "gguf_blocks.h"

namespace mtpllm::gguf {
namespace {
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
}  // namespace

void rows_of_type(int64_t t, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Act& x,
                  const ActK& xk, int64_t M, float* y, int64_t ldy) {
  dispatch<RowsOf>(t, w, row_bytes, n0, n1, x, xk, M, y, ldy);
}

void dequant_rows_of_type(int64_t t, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, float* y) {
  dispatch<DequantRows>(t, w, row_bytes, n0, n1, K, y);
}
}  // namespace mtpllm::gguf
