"""Weight storage and matmul kernels for GGUF tensors.

`Linear` keeps a weight in one of these formats, picked per tensor by `make_linear`:
  - "f32":  dequantized float32 (the exact reference path, `--dequantize`)
  - "int8": other quantized types (Q8_0, Q5_0, Q6_K, ...) requantized to int8 with one scale per
            output row, run by `aten._weight_int8pack_mm` (bf16 activations). Not bit-exact to the
            file (per-row instead of per-block scales): the row's step max|w|/127 is a fraction
            of the 5-6-bit types' own block steps, and perplexity is checked against the fp32 path.
  - "int4": GGUF Q4_K mapped exactly onto group-32 asymmetric int4 (see `q4k_to_int4`),
            run by `aten._weight_int4pack_mm_for_cpu` on CPU.
Several GGUF tensors that share an input (q/k/v, gate/up) can be fused into one `Linear`.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from ..gguf.reader import GGUFFile

INT4_GROUP = 32  # Q4_K sub-block size: one 6-bit scale and min per 32 weights
# From this many rows on (prompt chunks), int8 weights are dequantized and multiplied by an fp32
# GEMM (measured: int8 kernel 11.6 ms for 64 rows of a 4864x896 matrix, ~linear in rows). Kept
# above the largest verification block (1 + 16 drafts) so decoding and verification always use
# the same row-independent kernel.
GEMM_MIN_ROWS = 32


def q4k_to_int4(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K blocks [n, k/256*144 bytes] -> (q int32 [n, k] in 0..15, scales_and_zeros bf16 [k/32, n, 2]).

    Q4_K stores w = d*sc*q - dmin*m per group of 32. The int4 kernel computes
    w = (q - 8)*scale + zero, so scale = d*sc and zero = 8*d*sc - dmin*m: no requantization.
    """
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).reshape(n, k // 256, 144)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    s = blocks[..., 4:16].to(torch.int32)  # 12 bytes of packed 6-bit scales/mins
    # unpack as in ggml get_scale_min_k4: j<4: sc=s[j]&63, m=s[j+4]&63;
    # j>=4: sc=(s[j+4]&15)|((s[j-4]>>6)<<4), m=(s[j+4]>>4)|((s[j]>>6)<<4)
    sc_lo = s[..., 0:4] & 63
    m_lo = s[..., 4:8] & 63
    sc_hi = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    m_hi = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = torch.cat([sc_lo, sc_hi], dim=-1).float()  # [n, nb, 8]
    m = torch.cat([m_lo, m_hi], dim=-1).float()
    qs = blocks[..., 16:].to(torch.int32).reshape(n, k // 256, 4, 32)  # 4 chunks of 32 bytes = 64 weights
    lo = qs & 15  # first 32 weights of the chunk
    hi = qs >> 4  # next 32 weights
    q = torch.stack([lo, hi], dim=3).reshape(n, k)  # [n, nb, 4, 2, 32] -> [n, k]
    scale = (d * sc).reshape(n, k // INT4_GROUP)
    zero = (8 * d * sc - dmin * m).reshape(n, k // INT4_GROUP)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [k/32, n, 2]
    return q, sz


class Linear(torch.nn.Module):
    """y = x @ W^T (+ b) with W stored as f32, int8 or packed int4. x: [T, K] float32 -> [T, N] float32."""

    def __init__(self, kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scales_zeros: torch.Tensor | None = None, out_features: int = 0, in_features: int = 0):
        super().__init__()
        self.kind = kind
        self.weight = weight
        self.bias = bias
        self.scales_zeros = scales_zeros
        self.out_features = out_features or weight.shape[0]
        self.in_features = in_features or weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "f32":
            if 1 < x.shape[0] < GEMM_MIN_ROWS:
                # verification blocks: the BLAS GEMM sums in another order than the one-row GEMV of
                # decoding; row by row keeps speculative output bit-identical on the exact path
                return torch.cat([F.linear(r, self.weight, self.bias) for r in x.split(1)])
            return F.linear(x, self.weight, self.bias)
        if self.kind == "int8":
            if x.shape[0] >= GEMM_MIN_ROWS:  # prefill: the int8 kernel's cost is linear in rows; fp32 GEMM blocks
                return F.linear(x, self.weight.float() * self.scales_zeros.float()[:, None], self.bias)
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales_zeros).float()
        else:  # int4
            if x.device.type == "cpu":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.to(torch.bfloat16), self.weight, INT4_GROUP, self.scales_zeros).float()
            else:
                y = torch.ops.aten._weight_int4pack_mm(
                    x.to(torch.bfloat16), self.weight, INT4_GROUP, self.scales_zeros).float()
        return y + self.bias if self.bias is not None else y

    def rows(self, ids: torch.Tensor) -> "Linear":
        """A Linear computing only output rows `ids` (same storage format where it can be sliced)."""
        bias = self.bias[ids] if self.bias is not None else None
        if self.kind == "f32":
            return Linear("f32", self.weight[ids].contiguous(), bias)
        if self.kind == "int8":
            return Linear("int8", self.weight[ids].contiguous(), bias, self.scales_zeros[ids].contiguous())
        return int8_linear(self.dequantized()[ids], bias)  # packed int4 rows cannot be sliced

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [N, K] (for the MTP trainer and tests)."""
        if self.kind == "f32":
            return self.weight
        if self.kind == "int8":
            return self.weight.float() * self.scales_zeros.float()[:, None]
        eye = torch.eye(self.in_features, dtype=torch.float32)
        saved = self.bias
        self.bias = None
        try:
            return self.forward(eye).t().contiguous()
        finally:
            self.bias = saved

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, kind={self.kind}"


def int8_linear(w: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """float32 [N, K] -> int8 with one bf16 scale per output row (symmetric, round to nearest)."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Linear("int8", q, bias, scale)


def make_linear(g: GGUFFile, names: list[str], bias_names: list[str] | None = None,
                mode: str = "fast") -> Linear:
    """Build one Linear from one or more GGUF weight tensors (fused along the output dim).

    mode "f32": everything dequantized to float32; "fast": Q4_K -> int4, other quantized types -> int8
    per output row, float types -> f32.
    """
    infos = [g.info(n) for n in names]
    k = infos[0].shape[1]
    bias = None
    if bias_names:
        bias = torch.cat([g.load(b).reshape(-1) for b in bias_names])
    if mode == "fast" and all(i.qtype == QT.Q4_K for i in infos) and k % 256 == 0:
        qs, szs = zip(*(q4k_to_int4(g.raw(i.name), i.shape[0], k) for i in infos))
        q = torch.cat(qs, dim=0)
        sz = torch.cat(szs, dim=1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        return Linear("int4", packed, bias, sz, out_features=q.shape[0], in_features=k)
    w = torch.cat([g.load(n) for n in names], dim=0)
    if mode == "fast" and any(i.qtype not in (QT.F32, QT.F16) for i in infos):
        return int8_linear(w, bias)
    return Linear("f32", w, bias)
