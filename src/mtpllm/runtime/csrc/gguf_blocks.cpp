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
//
// This file: the operators (activation quantization, checks, dispatch to the kernels by type and
// row range, registration). The kernels: gguf_blocks.h (decoders, activations, shared helpers),
// gguf_rows.cpp (one weight row at a time: every file type), gguf_x8.cpp (Q4_Kx8, Q6_Kx8),
// gguf_c32.cpp (Q4_0 / Q5_0 / Q8_0 by 8 rows: prompt chunks and the Q4_0x8 / Q5_0x8 / Q8_0x8 layouts).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <sys/mman.h>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>
#include "gguf_blocks.h"

namespace {
using namespace mtpllm::gguf;
using mtpllm::grain_rows;
using mtpllm::hmax;
using mtpllm::hsum;
using mtpllm::quantize_row;

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
      const uint8_t* wp = ws[i].data_ptr<uint8_t>();
      if (types[i] == Q4_KX8 || types[i] == Q6_KX8)
        kx8_rows_of_type(types[i], wp, ws[i].stride(0), lo - off[i], hi - off[i], ak, M, yp + off[i], N);
      else if (c32x8_type(types[i]))  // every M: the same products as c32_rows on the file's blocks
        c32x8_rows_of_type(types[i], wp, ws[i].stride(0), lo - off[i], hi - off[i], a, bsum.data(), M, yp + off[i], N);
      else if (chunk && c32_type(types[i]))
        c32_rows_of_type(types[i], wp, ws[i].stride(0), lo - off[i], hi - off[i], a, bsum.data(), M, yp + off[i], N);
      else
        rows_of_type(types[i], wp, ws[i].stride(0), lo - off[i], hi - off[i], a, ak, M, yp + off[i], N);
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
      dequant_rows_of_type(types[i], ws[i].data_ptr<uint8_t>(), ws[i].stride(0), a - off[i], b - off[i], K,
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
  if (name == "tile_rows") v = &mtpllm::tune_tile_rows();
  if (name == "prefetch") v = &mtpllm::tune_prefetch();
  if (name == "q6_prefetch") v = &mtpllm::tune_q6_prefetch();
  if (name == "attn_prefetch") v = &mtpllm::tune_attn_prefetch();
  TORCH_CHECK(v != nullptr, "tuning: unknown choice '", std::string(name.data(), name.size()),
              "' (grain_macs, pair_nsb, tile_rows, prefetch, q6_prefetch, attn_prefetch)");
  const int64_t old = *v;
  if (value >= 0) {
    TORCH_CHECK(name != "grain_macs" || value >= 1, "tuning: grain_macs must be at least 1");
    TORCH_CHECK(name != "tile_rows" || value == 4 || value == 8, "tuning: tile_rows must be 4 or 8");
    TORCH_CHECK((name != "prefetch" && name != "q6_prefetch") || value <= (1 << 16) + 1,
                "tuning: a prefetch distance must be at most 65536 bytes");
    TORCH_CHECK(name != "prefetch" || value % 2 == 0, "tuning: prefetch must be even (into L1)");
    TORCH_CHECK(name != "attn_prefetch" || value <= 1, "tuning: attn_prefetch must be 0 or 1");
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
  m.def("x8_tile4(int value) -> int", &mtpllm::gguf::x8_tile4_choice);
}

TORCH_LIBRARY_IMPL(mtpllm, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_repack", &gguf_repack);
  m.impl("gguf_linear_chunk", &gguf_linear_chunk);
}