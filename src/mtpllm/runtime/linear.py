"""Weight storage and matmul kernels for GGUF tensors.

`Linear` keeps a weight in one of these formats, picked per tensor by `make_linear`:
  - "f32":  dequantized float32 (the exact reference path, `--dequantize`)
  - "int8": other quantized types (Q8_0, Q5_0, Q6_K, ...) requantized to int8 with one scale per
            output row, run by `aten._weight_int8pack_mm` (bf16 activations). Not bit-exact to the
            file (per-row instead of per-block scales): the row's step max|w|/127 is a fraction
            of the 5-6-bit types' own block steps, and perplexity is checked against the fp32 path.
  - "int4": GGUF Q4_K mapped exactly onto group-32 asymmetric int4 (see `q4k_to_int4`),
            run by `aten._weight_int4pack_mm_for_cpu` on CPU.
  - "gguf":  the GGUF tensors' own bytes, read in place from the file mapping, multiplied by the
            engine's CPU kernel (`kernels.gguf_linear`, AVX2) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/
            Q6_K: no conversion at load and no copy in memory, except Q4_K/Q4_0/Q5_0/Q8_0 matrices,
            repacked at load by 8 rows (`repack`; MTPLLM_REPACK=0 keeps them in place). Activations are quantized to
            int8 per block of 32 (llama.cpp's Q8_0), per 256 against K-quants (Q8_K); each output
            row is computed independently of the other rows in the batch.
  - "blocks": the engine's CPU kernel for the other quantized types (`kernels.q8_linear`, AVX2): the file's own integer codes with
            one float scale (and min) per group of 16/32 weights, so w = scale * q - min exactly as
            in the file (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, Q2_K, Q4_K, Q5_K, Q6_K; Q4_K codes stay
            4-bit, two per byte). Other quantized types are requantized to int8 per group of 32.
            Activations are quantized per block of 32 (int8, like llama.cpp's Q8_0); each output
            row is computed independently of the other rows in the batch.
Several GGUF tensors that share an input (q/k/v, gate/up) can be fused into one `Linear`.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from ..gguf.quants import dequantize
from ..gguf.reader import GGUFFile
from . import kernels

INT4_GROUP = 32  # Q4_K sub-block size: one 6-bit scale and min per 32 weights
# The one row-count threshold of the engine. A forward over fewer rows than this is decoding or
# speculative verification (at most 1 + 16 drafts, speculative.config.MAX_K): every layer gives
# each row exactly what one-token decoding gives it (one-row kernels, attention row by row, the C++
# decoder blocks), so speculative and plain greedy decoding agree bit for bit. From this many rows
# on it is a prompt chunk: Q4_0/Q5_0/Q8_0 matrices take the 8-row integer GEMM
# (`kernels.gguf_linear_chunk`; other 32-weight block types: dequantized, fp32 GEMM), K-quant
# matrices stay on their tile kernel, and attention is one batched masked call.
GEMM_MIN_ROWS = 32


def decode_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (a row-wise product: a Linear, an output matrix) over x [R, ...] in slices of fewer than
    GEMM_MIN_ROWS rows, so that rows from several sequences batched together each get exactly the
    bits one-row decoding gives them (a larger slice may take a prompt-chunk kernel that sums in
    another order)."""
    n = GEMM_MIN_ROWS - 1
    if x.shape[0] <= n:
        return fn(x)
    return torch.cat([fn(x[a:a + n]) for a in range(0, x.shape[0], n)])


# super-block types the kernel sums in int32 per 256 weights (it runs prompt chunks too)
K_QUANTS = (int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K))
# 32-weight block types with an integer prompt-chunk kernel (`kernels.gguf_linear_chunk`)
CHUNK_TYPES = (int(QT.Q4_0), int(QT.Q5_0), int(QT.Q8_0))


def _raw_blocks(raw: np.ndarray, n: int, n_blocks: int, block_bytes: int) -> torch.Tensor:
    """A tensor's raw bytes as [n, n_blocks, block_bytes] uint8 (a read-only file mapping, only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(raw)).reshape(n, n_blocks, block_bytes)


def _q4k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks [n, nb, 144] -> 4-bit codes [n, nb*256] (0..15): per 64-weight chunk of 32
    bytes, the low nibbles are the first 32 weights and the high nibbles the next 32."""
    n, nb = b.shape[:2]
    qs = b[..., 16:].reshape(n, nb, 4, 32)
    return torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, nb * 256)


def q4k_to_int4(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K blocks [n, k/256*144 bytes] -> (q int32 [n, k] in 0..15, scales_and_zeros bf16 [k/32, n, 2]).

    Q4_K stores w = d*sc*q - dmin*m per group of 32. The int4 kernel computes
    w = (q - 8)*scale + zero, so scale = d*sc and zero = 8*d*sc - dmin*m: no requantization.
    """
    blocks = _raw_blocks(raw, n, k // 256, 144)
    sc, mn = _k_scales_mins(blocks)  # d*sc and dmin*m per 32 weights
    q = _q4k_codes(blocks).to(torch.int32)
    scale = sc.reshape(n, k // INT4_GROUP)
    zero = (8 * sc - mn).reshape(n, k // INT4_GROUP)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [k/32, n, 2]
    return q, sz


class BlockWeight:
    """One weight matrix in the CPU kernel's format: integer codes, per-group scales (and mins).

    codes: int8 [N, K] (signed or unsigned values) or uint8 [N, K/2] (4-bit codes, per 32-block
    16 bytes: code j in the low nibble, code j + 16 in the high one); scales, mins: float32
    [N, K/group]; w[n, k] = scales[n, k // group] * code[n, k] - mins[n, k // group].
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int):
        self.codes, self.scales, self.mins, self.group = codes, scales, mins, group

    @property
    def nibbles(self) -> bool:
        return self.codes.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return n, k * 2 if self.nibbles else k

    def fmt(self) -> tuple:
        return self.codes.dtype, self.group, self.mins is not None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.q8_linear(x, self.codes, self.scales, self.mins, self.group)

    def int_codes(self) -> torch.Tensor:
        if not self.nibbles:
            return self.codes
        n, k = self.shape
        c = self.codes.reshape(n, k // 32, 16)
        return torch.stack([c & 15, c >> 4], dim=2).reshape(n, k).to(torch.int8)

    def dequantized(self) -> torch.Tensor:
        n, k = self.shape
        w = self.int_codes().float().reshape(n, k // self.group, self.group) * self.scales[..., None]
        if self.mins is not None:
            w -= self.mins[..., None]
        return w.reshape(n, k)

    def rows(self, ids: torch.Tensor) -> "BlockWeight":
        return BlockWeight(self.codes[ids].contiguous(), self.scales[ids].contiguous(),
                           self.mins[ids].contiguous() if self.mins is not None else None, self.group)

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        if len(parts) == 1:
            return parts[0]
        mins = [p.mins for p in parts]
        return BlockWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat(mins) if mins[0] is not None else None, parts[0].group)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    return b[..., off:off + 2].contiguous().view(torch.float16).float()[..., 0]


def _k_scales_mins(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-blocks [.., 144|176 bytes] -> (d*sc, dmin*m) per 32 weights, as ggml get_scale_min_k4."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[..., 4:16].to(torch.int32)
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1).float()
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1).float()
    return d[..., None] * sc, dmin[..., None] * m


def _group_params(qtype, b: torch.Tensor):
    """(group, scales, mins) of a GGUF type from its raw blocks b [N, n_blocks, block_bytes], or None."""
    if qtype in (QT.Q8_0, QT.Q5_0, QT.Q4_0):
        return 32, _f16(b, 0), None
    if qtype in (QT.Q4_1, QT.Q5_1):  # w = d * q + m
        return 32, _f16(b, 0), -_f16(b, 2)
    if qtype in (QT.Q4_K, QT.Q5_K):
        sc, mn = _k_scales_mins(b)
        return 32, sc, mn
    if qtype == QT.Q6_K:  # w = d * sc * (q - 32) per 16
        return 16, _f16(b, 208)[..., None] * b[..., 192:208].contiguous().view(torch.int8).float(), None
    if qtype == QT.Q2_K:  # w = d * (sc & 15) * q - dmin * (sc >> 4) per 16
        sc = b[..., 0:16].to(torch.int32)
        return 16, _f16(b, 80)[..., None] * (sc & 15).float(), _f16(b, 82)[..., None] * (sc >> 4).float()
    return None


def block_weight(g: GGUFFile, name: str) -> BlockWeight:
    info = g.info(name)
    return block_weight_from_raw(g.raw(name), info.qtype, info.shape[0], info.shape[1], name)


CONVERT_ROWS = 4096  # rows converted at a time: bounds the float32 temporaries of loading


def block_weight_from_raw(raw: np.ndarray, qtype, n: int, k: int, name: str = "?") -> BlockWeight:
    """A quantized GGUF tensor in the kernel's format: the file's codes where the type maps exactly
    (the codes are recovered from the dequantized weights and the block scales, and checked),
    otherwise int8 requantized per group of 32 (symmetric, round to nearest)."""
    if n > CONVERT_ROWS and np.ndim(raw) == 2:
        parts = [_block_weight(raw[r:r + CONVERT_ROWS], qtype, min(CONVERT_ROWS, n - r), k, name)
                 for r in range(0, n, CONVERT_ROWS)]
        if len({p.fmt() for p in parts}) > 1:  # a chunk missed the exact mapping: all requantized
            parts = [_block_weight(raw[r:r + CONVERT_ROWS], qtype, min(CONVERT_ROWS, n - r), k, name, exact=False)
                     for r in range(0, n, CONVERT_ROWS)]
        return BlockWeight.cat(parts)
    return _block_weight(raw, qtype, n, k, name)


def _block_weight(raw: np.ndarray, qtype, n: int, k: int, name: str, exact: bool = True) -> BlockWeight:
    from gguf import GGML_QUANT_SIZES
    bsz, tsz = GGML_QUANT_SIZES[qtype]
    if exact and qtype == QT.Q4_K and k % 256 == 0:  # codes straight from the bits (fast, exact)
        b = _raw_blocks(raw, n, k // 256, 144)
        sc, mn = _k_scales_mins(b)
        c = _q4k_codes(b).reshape(n, k // 32, 2, 16)  # the kernel's nibble layout: j | (j + 16) << 4
        return BlockWeight((c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous(),
                           sc.reshape(n, k // 32).contiguous(), mn.reshape(n, k // 32).contiguous(), 32)
    w = dequantize(raw, qtype, (n, k), name)
    params = _group_params(qtype, _raw_blocks(raw, n, k // bsz, tsz)) if exact and k % bsz == 0 else None
    if params is not None:
        group, scales, mins = params
        scales = scales.reshape(n, k // group).contiguous()
        mins = mins.reshape(n, k // group).contiguous() if mins is not None else None
        wg = w.reshape(n, k // group, group)
        num = wg + mins[..., None] if mins is not None else wg
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.round(num / safe[..., None])
        err = (q * scales[..., None] - num).abs()
        if q.abs().max() <= 127 and bool((err <= 1e-3 * scales.abs()[..., None] + 1e-30).all()):
            return BlockWeight(q.reshape(n, k).to(torch.int8), scales, mins, group)
    wg = w.reshape(n, k // 32, 32)
    scales = (wg.abs().amax(-1) / 127.0)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(wg / safe[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return BlockWeight(codes, scales.contiguous(), None, 32)


# GGUF types the CPU kernel multiplies in place (GGML type ids)
NATIVE_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def raw_tensor(raw: np.ndarray) -> torch.Tensor:
    """A GGUF tensor's bytes [rows, row bytes] as a uint8 tensor sharing the (read-only) file mapping;
    the engine only ever reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


class Linear(torch.nn.Module):
    """y = x @ W^T (+ b), W in one of the formats above. x: [T, K] float32 -> [T, N] float32."""

    def __init__(self, kind: str, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 scales_zeros: torch.Tensor | None = None, out_features: int = 0, in_features: int = 0,
                 blocks: list[BlockWeight] | None = None,
                 ggufs: list[tuple[torch.Tensor, int]] | None = None,
                 packed: list[tuple[torch.Tensor, int]] | None = None):
        super().__init__()
        self.kind = kind
        self.weight = weight
        self.bias = bias
        self.scales_zeros = scales_zeros
        self.blocks = blocks or []
        self.ggufs = ggufs or []  # (uint8 [N_i, row bytes], GGML type id) per fused tensor
        # what the kernel multiplies: the file's blocks, or the 8-row layout (Q4_K, Q6_K, Q4_0, Q5_0, Q8_0) (`repack`)
        self._gw = [w for w, _ in packed or self.ggufs]
        self._gt = [t for _, t in packed or self.ggufs]
        self._kquant = bool(self._gt) and all(t in K_QUANTS or t in kernels.KX8_TYPES for t in self._gt)
        # every part has an integer prompt-chunk kernel (K-quants, Q4_0/Q5_0/Q8_0's 8-row GEMM)
        self._chunked = bool(self._gt) and all(t in K_QUANTS or t in CHUNK_TYPES or t in kernels.X8_TYPES
                                               for t in self._gt)
        if kind == "blocks":
            out_features = sum(b.shape[0] for b in self.blocks)
            in_features = self.blocks[0].shape[1]
        if kind == "gguf":
            # (a part in an 8-row layout has one row of bytes per 8 weight rows)
            out_features = sum(w.shape[0] * (8 if t in kernels.X8_TYPES else 1) for w, t in self.ggufs)
        self.out_features = out_features or weight.shape[0]
        self.in_features = in_features or weight.shape[1]

    def _apply(self, fn, recurse=True):
        # the weights are plain attributes (uint8 blocks, packed ints): move them with the module
        device = fn(torch.zeros(1)).device
        if self.kind in ("gguf", "blocks") and device.type != "cpu":
            raise RuntimeError(f"{self.kind} weights run on the CPU kernels only; load with mode 'f32' "
                               f"for {device.type}")
        for name in ("weight", "bias", "scales_zeros"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t) if t.is_floating_point() or name == "bias" else t.to(device))
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= GEMM_MIN_ROWS and self.kind == "gguf" and self._chunked:
            # prompt chunks: K-quants on their tile kernel, Q4_0/Q5_0/Q8_0 on the 8-row integer GEMM
            # (~2.3x the fp32 GEMM on dequantized weights, which also needed a float32 copy per call)
            y = kernels.gguf_linear_chunk(x.contiguous(), self._gw, self._gt)
            return y + self.bias if self.bias is not None else y
        if x.shape[0] >= GEMM_MIN_ROWS and (self.kind == "blocks" or (self.kind == "gguf" and not self._kquant)):
            # prompt chunks of the other block types (Q4_1, Q5_1, ...): the fp32 GEMM on the file's
            # exact weights beats the one-row integer kernel
            return F.linear(x, self.dequantized(), self.bias)
        if self.kind == "gguf":
            y = kernels.gguf_linear(x.contiguous(), self._gw, self._gt)
            return y + self.bias if self.bias is not None else y
        if self.kind == "blocks":
            x = x.contiguous()
            ys = [b.matmul(x) for b in self.blocks]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
            return y + self.bias if self.bias is not None else y
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
        if self.kind == "gguf":
            if len(self.ggufs) == 1 and self.ggufs[0][1] not in kernels.X8_TYPES:
                w, t = self.ggufs[0]
                w = w[ids].contiguous()
                # only the kernel's copy is kept (a repacked result is itself the weights: no file-layout
                # copy of the rows beside it, 20 MB for the 1.5B's 16,384-row draft vocabulary)
                return Linear("gguf", None, bias, in_features=self.in_features,
                              ggufs=[repacked(w, t, self.in_features)])
            return Linear("f32", self.dequantized()[ids].contiguous(), bias)
        if self.kind == "blocks":
            if len(self.blocks) == 1:
                return Linear("blocks", None, bias, blocks=[self.blocks[0].rows(ids)])
            return Linear("f32", self.dequantized()[ids].contiguous(), bias)
        if self.kind == "f32":
            return Linear("f32", self.weight[ids].contiguous(), bias)
        if self.kind == "int8":
            return Linear("int8", self.weight[ids].contiguous(), bias, self.scales_zeros[ids].contiguous())
        return int8_linear(self.dequantized()[ids], bias)  # packed int4 rows cannot be sliced

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [N, K] (for the MTP trainer and tests)."""
        if self.kind == "f32":
            return self.weight
        if self.kind == "gguf":
            return kernels.gguf_dequantize(self._gw, self._gt, self.in_features)
        if self.kind == "blocks":
            return torch.cat([b.dequantized() for b in self.blocks]) if len(self.blocks) > 1 \
                else self.blocks[0].dequantized()
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


def repack_enabled() -> bool:
    """Q4_K / Q6_K / Q4_0 / Q5_0 / Q8_0 matrices are repacked by 8 rows at load (`kernels.gguf_repack`)
    unless MTPLLM_REPACK=0."""
    return os.environ.get("MTPLLM_REPACK", "1") != "0"


def repack(g: GGUFFile, name: str, w: torch.Tensor, qtype: int, k: int) -> tuple[torch.Tensor, int]:
    """The kernel's copy of one file tensor: Q4_K, Q6_K, Q4_0, Q5_0 and Q8_0 with a row count divisible
    by 8 repacked by 8 rows (one vector instruction then multiplies 4 weights of 8 rows, and the per-block
    scale and float work is shared by the 8: Q4_K one-row products ~2x faster from cache, Q5_0's at
    the memory bandwidth instead of ~2/3 of it, verification rows 1.3-2x faster). Q4_0/Q5_0/Q8_0 rows then
    take the same products for every batch size, the prompt chunks' (`gguf_linear_chunk`). The copy
    replaces the file's pages in memory (released from the mapping; they are read again only by
    `rows`/`dequantized`). Other tensors stay the file's blocks, read in place."""
    packed = repacked(w, qtype, k)
    if packed[1] != qtype:
        g.release(name)
    return packed


def repacked(w: torch.Tensor, qtype: int, k: int) -> tuple[torch.Tensor, int]:
    """(weights, type) the kernel multiplies for GGUF blocks w of type qtype: the 8-row layout where
    there is one (and the row count allows it, and MTPLLM_REPACK is not 0), else w itself."""
    if qtype not in kernels.X8_OF or w.shape[0] % 8 or not repack_enabled():
        return w, qtype
    return kernels.gguf_repack(w, qtype, k), kernels.X8_OF[qtype]


def int8_linear(w: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """float32 [N, K] -> int8 with one bf16 scale per output row (symmetric, round to nearest)."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Linear("int8", q, bias, scale)


def make_linear(g: GGUFFile, names: list[str], bias_names: list[str] | None = None,
                mode: str = "fast") -> Linear:
    """Build one Linear from one or more GGUF weight tensors (fused along the output dim).

    mode "f32": everything dequantized to float32; "fast": quantized types -> the engine's CPU kernel
    when it is available (NATIVE_TYPES: the file's blocks in place; others: file codes kept or int8
    per 32), else Q4_K -> int4 and other quantized types -> int8 per output row; float types -> f32.
    """
    infos = [g.info(n) for n in names]
    k = infos[0].shape[1]
    bias = None
    if bias_names:
        bias = torch.cat([g.load(b).reshape(-1) for b in bias_names])
    if mode == "fast" and all(i.qtype in NATIVE_TYPES for i in infos) and kernels.available():
        ggufs = [(raw_tensor(g.raw(i.name)), int(i.qtype)) for i in infos]
        packed = [repack(g, i.name, w, t, k) for i, (w, t) in zip(infos, ggufs)] if repack_enabled() else None
        return Linear("gguf", None, bias, in_features=k, ggufs=ggufs, packed=packed)
    if mode == "fast" and k % 32 == 0 and all(i.qtype not in (QT.F32, QT.F16, QT.BF16) for i in infos) \
            and kernels.available():
        segments: list[BlockWeight] = []
        for n in names:  # adjacent tensors of the same format are fused into one kernel call
            bw = block_weight(g, n)
            if segments and segments[-1][-1].fmt() == bw.fmt():
                segments[-1].append(bw)
            else:
                segments.append([bw])
        return Linear("blocks", None, bias, blocks=[BlockWeight.cat(p) for p in segments])
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
