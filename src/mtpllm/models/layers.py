"""Building blocks shared by all architectures: norms, rotary embedding, attention, MLP, block.

Modules only: no file access, no sampling, no device policy. Shapes are single-sequence:
activations are [T, D] for T tokens at positions [pos, pos+T).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MtpllmError
from ..runtime import kernels
from ..runtime.kv_cache import BatchKV, KVCache
from ..runtime.linear import GEMM_MIN_ROWS, Linear
from .config import ModelConfig, RopeConfig


def _fused(x: torch.Tensor) -> bool:
    """Use the engine's fused CPU operators (csrc/attention.cpp): float32 on the CPU, no autograd
    (the MTP trainer differentiates through these layers) and the kernels built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled() \
        and kernels.available()


class RMSNorm(nn.Module):
    """x / rms(x) * w. GGUF files store Gemma's (1 + w) already folded into w."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# ---------------------------------------------------------------------------- rotary
def rope_inv_freq(rope: RopeConfig, dim: int, base: float | None = None,
                  scaling: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention factor applied to cos/sin.

    YaRN follows Hugging Face transformers' `_compute_yarn_parameters` (beta_fast=32, beta_slow=1,
    factor = target / original context, mscale = 0.1 ln(factor) + 1).
    """
    base = rope.base if base is None else base
    scaling = rope.scaling if scaling is None else scaling
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv = 1.0 / pos_freqs
    if scaling == "linear":
        return (inv / rope.factor).float(), 1.0
    if scaling == "yarn":
        s = rope.factor
        orig = rope.orig_ctx or 4096

        def corr_dim(n_rot: float) -> float:
            # dimension index whose wavelength completes n_rot rotations over the original context
            return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(32.0)), 0)
        high = min(math.ceil(corr_dim(1.0)), dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrap_weight = 1 - ramp  # 1 for high-frequency dims (kept), 0 for low-frequency (interpolated)
        inv = (inv / s) * (1 - extrap_weight) + inv * extrap_weight
        mscale = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
        return inv.float(), mscale
    return inv.float(), 1.0


class Rotary(nn.Module):
    """cos/sin tables grown on demand; applies rotary embedding to [T, H, D]."""

    def __init__(self, inv_freq: torch.Tensor, attn_factor: float, style: str, rot_dim: int):
        super().__init__()
        self.inv_freq = inv_freq
        self.attn_factor = attn_factor
        self.style = style
        self.rot_dim = rot_dim
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)

    def tables(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos.shape[0] < n or self.cos.device != torch.device(device):
            size = max(n, 2 * self.cos.shape[0], 256)
            t = torch.arange(size, dtype=torch.float64)
            ang = torch.outer(t, self.inv_freq.double())  # [size, rot/2]
            self.cos = (ang.cos() * self.attn_factor).float().to(device)
            self.sin = (ang.sin() * self.attn_factor).float().to(device)
        return self.cos, self.sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos_t, sin_t = self.tables(int(positions[-1]) + 1, x.device)
        cos = cos_t[positions][:, None, :]  # [T, 1, rot/2]
        sin = sin_t[positions][:, None, :]
        r = self.rot_dim
        xr, xp = x[..., :r], x[..., r:]
        if self.style == "neox":
            x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:  # adjacent pairs (2i, 2i+1)
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


# ---------------------------------------------------------------------------- attention / mlp
# A prompt chunk deep in a context: its queries attend to the keys before it without a mask (every
# head's queries of one kv head as one sequence of queries: the keys are read once for all of them)
# and to its own keys causally, the two merged by their log-sum-exps. With one [T, L] mask for the
# whole context instead, PyTorch's CPU kernel ran at 93-124 GFLOP/s, split at 144-159 (Zen 4, 2
# threads, 512-query chunks of the 0.5B's and the 1.5B's shapes at 4,096-32,000 positions: 1.16-1.54x);
# with 512 keys before the chunk the two calls cost more than the mask saves (14.0 against 17.3 ms),
# with 1,024 as much; the threshold is set above that crossing, at 2,048, so that a CPU on which it
# lies higher does not lose. Windowed layers (a ring cache, keys not in position order) keep the mask.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
SPLIT_PREFIX_MIN = 2048


def _attend_prefix_and_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             scale: float | None) -> torch.Tensor:
    """q [1, H, T, D]: the queries of the last T positions of keys/values [KV, L, D] (the chunk's
    own), each attending to every key up to its own -> [1, H, T, D]."""
    _, H, T, D = q.shape
    KV, L = keys.shape[0], keys.shape[1]
    rep = H // KV
    grouped = q[0].reshape(KV, rep * T, D).unsqueeze(0)  # head kv * rep + j's queries at rows j T ..
    oa, la = _FLASH(grouped, keys[:, :L - T].unsqueeze(0), values[:, :L - T].unsqueeze(0), scale=scale)
    kb, vb = keys[:, L - T:], values[:, L - T:]
    if rep > 1:
        kb, vb = kb.repeat_interleave(rep, 0), vb.repeat_interleave(rep, 0)
    ob, lb = _FLASH(q, kb.unsqueeze(0), vb.unsqueeze(0), is_causal=True, scale=scale)
    la = la.reshape(1, H, T, 1).float()
    lb = lb.reshape(1, H, T, 1).float()
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    return ((oa.reshape(1, H, T, D) * wa + ob * wb) / (wa + wb)).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv: nn.Module, out: nn.Module, rotary: Rotary,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, window: int = 0):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv, self.out, self.rotary = qkv, out, rotary
        self.q_norm, self.k_norm = q_norm, k_norm
        self.scale = cfg.attn_scale
        self.window = window  # 0 = full attention

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_pos: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """q [1, H, T, D] over keys/values [KV, L, D] at key positions [L] -> [1, H, T, D]."""
        T = q.shape[2]
        L = keys.shape[1]
        if (T >= GEMM_MIN_ROWS and L - T >= SPLIT_PREFIX_MIN and not self.window and _FLASH is not None
                and q.device.type == "cpu" and int(key_pos[0]) == 0 and int(positions[0]) == L - T
                and int(positions[-1]) == L - 1):
            return _attend_prefix_and_block(q, keys, values, self.scale)
        mask = None
        qpos = positions[:, None]
        if T > 1 or (self.window and int(positions[-1]) - int(key_pos[0]) >= self.window):
            allowed = key_pos[None, :] <= qpos  # [T, L]
            if self.window:
                allowed &= (qpos - key_pos[None, :]) < self.window
            mask = allowed
        return F.scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                              scale=self.scale, enable_gqa=self.n_heads != self.n_kv)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv, layer: int) -> torch.Tensor:
        qkv = self.qkv(x)
        if isinstance(kv, BatchKV):  # one token of each of several sequences, each with its own cache
            o = torch.cat([self._mix(qkv[b:b + 1], positions[b:b + 1], c, layer) for b, c in enumerate(kv.caches)])
        else:
            o = self._mix(qkv, positions, kv, layer)
        return self.out(o)

    def store(self, x: torch.Tensor, positions: torch.Tensor, kv, layer: int) -> None:
        """The cache entries of rows x [T, D] (normed) at `positions`, without their attention: for
        rows whose output nobody reads (an MTP head's catch-up). Only the projections run."""
        self.store_kv(self.qkv(x)[:, self.n_heads * self.hd:], positions, kv, layer)

    def store_kv(self, kv_rows: torch.Tensor, positions: torch.Tensor, kv, layer: int):
        """Key norm, rotary and cache write of the key/value projections kv_rows [T, 2 KV hd]
        -> the cache's keys, values and their positions (`kv.update`)."""
        T, kv_sz = kv_rows.shape[0], self.n_kv * self.hd
        k = kv_rows[:, :kv_sz].view(T, self.n_kv, self.hd)
        v = kv_rows[:, kv_sz:2 * kv_sz].view(T, self.n_kv, self.hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return kv.update(layer, self.rotary(k, positions), v, positions)

    def _mix(self, qkv: torch.Tensor, positions: torch.Tensor, kv, layer: int) -> torch.Tensor:
        """Rotary, cache write and attention for qkv [T, ...] at `positions` -> [T, H * hd]."""
        T = qkv.shape[0]
        if T < GEMM_MIN_ROWS and isinstance(kv, KVCache) and not kv.span(layer) and _fused(qkv):
            # decoding and verification: norm, rotary, cache write and attention in one operator,
            # each query row computed exactly as in one-token decoding (a window on a cache that
            # keeps every position: the kernel reads the window's keys only)
            start = int(positions[0])
            if start + T > kv.max_len:
                raise MtpllmError(f"context overflow: position {start + T} exceeds the context size {kv.max_len}")
            cos, sin = self.rotary.tables(start + T, qkv.device)
            j = kv.slot[layer]
            o = kernels.attend_cached(
                qkv.contiguous(), cos, sin, kv.k[j], kv.v[j], start, self.n_heads, self.n_kv, self.hd,
                self.rotary.rot_dim, self.rotary.style == "neox", self.scale or 1.0 / math.sqrt(self.hd),
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.q_norm.eps if self.q_norm is not None else 1e-6, self.window)
            return o
        q_sz = self.n_heads * self.hd
        q = qkv[:, :q_sz].view(T, self.n_heads, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self.rotary(q, positions)
        # k: the entries an MTP head's catch-up writes alone (`store`), the same operations
        keys, values, key_pos = self.store_kv(qkv[:, q_sz:], positions, kv, layer)  # [KV, L, D], [KV, L, D], [L]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        if 1 < T < GEMM_MIN_ROWS:
            # verification blocks: each query row attends exactly as in one-token decoding (same
            # kernel, same key range, no mask), so speculative and plain greedy decoding agree
            # bit for bit; a batched masked kernel sums in another order
            # (a sliding-window ring cache shows one-token decoding at position p the keys >= p - span)
            L0 = keys.shape[1] - T
            span = kv.span(layer) if hasattr(kv, "span") else 0
            p0, k0 = int(positions[0]), int(key_pos[0])
            lo = [max(0, p0 + t - span) - k0 if span else 0 for t in range(T)]
            o = torch.cat([self._attend(qh[:, :, t:t + 1], keys[:, lo[t]:L0 + t + 1], values[:, lo[t]:L0 + t + 1],
                                        key_pos[lo[t]:L0 + t + 1], positions[t:t + 1]) for t in range(T)], dim=2)
        else:
            o = self._attend(qh, keys, values, key_pos, positions)
        return o[0].transpose(0, 1).reshape(T, self.n_heads * self.hd)


class MLP(nn.Module):
    def __init__(self, gate_up: nn.Module, down: nn.Module, act: str):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.act_name = act
        self.act = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        if self.act_name == "silu" and _fused(gu):
            return self.down(kernels.silu_mul(gu))  # the arithmetic of the C++ blocks (DecodeStack)
        gate, up = gu.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder block; with `post_attn_norm`/`post_ffn_norm` (Gemma) it is a sandwich block."""

    def __init__(self, attn_norm: RMSNorm, attn: Attention, ffn_norm: RMSNorm, mlp: MLP,
                 post_attn_norm: RMSNorm | None = None, post_ffn_norm: RMSNorm | None = None):
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.mlp = attn_norm, attn, ffn_norm, mlp
        self.post_attn_norm, self.post_ffn_norm = post_attn_norm, post_ffn_norm
        self._native = None  # this block alone as a DecodeStack; False where it does not apply

    def store(self, x: torch.Tensor, positions: torch.Tensor, kv, layer: int) -> None:
        """The cache entries `forward` writes for rows x, without computing the block's output."""
        self.attn.store(self.attn_norm(x), positions, kv, layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv, layer: int) -> torch.Tensor:
        if native_rows(x, kv):
            stack = cached_stack(self, "_native", [self])
            if stack is not None:
                return run_stack(stack, self.attn.rotary, x, int(positions[0]), kv, layer, 1)
        h = self.attn(self.attn_norm(x), positions, kv, layer)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


# ---------------------------------------------------------------------------- C++ decode path
def native_rows(x: torch.Tensor, kv) -> bool:
    """Whether blocks over x [T, D] can run as a `DecodeStack`: decoding or verification rows
    (T < GEMM_MIN_ROWS: the one-row kernels and fused attention, as the per-operator path uses
    there), one sequence's cache without sliding-window rings, inference on the CPU kernels."""
    return x.shape[0] < GEMM_MIN_ROWS and type(kv) is KVCache and not any(kv.ring) and _fused(x)


def _stack_args(b: Block) -> tuple | None:
    """`DecodeStack.add_layer`'s weights of a block, or None for a layout it does not cover."""
    a, m = b.attn, b.mlp
    lins = (a.qkv, a.out, m.gate_up, m.down)
    if b.post_attn_norm is not None or b.post_ffn_norm is not None or m.act_name != "silu" \
            or not all(isinstance(lin, Linear) and lin.kind == "gguf" for lin in lins) \
            or any(lin.bias is not None for lin in lins[1:]) or b.attn_norm.eps != b.ffn_norm.eps:
        return None
    return ([a.qkv._gw, a.qkv._gt, a.qkv.bias, a.out._gw, a.out._gt, m.gate_up._gw, m.gate_up._gt, m.down._gw,
             m.down._gt, b.attn_norm.weight.data, b.ffn_norm.weight.data],
            (a.q_norm.weight.data if a.q_norm is not None else None,
             a.k_norm.weight.data if a.k_norm is not None else None))


def _attn_key(b: Block) -> tuple:
    a = b.attn
    qk_eps = a.q_norm.eps if a.q_norm is not None else 1e-6
    return (a.n_heads, a.n_kv, a.hd, a.rotary.rot_dim, a.rotary.style == "neox",
            a.scale or 1.0 / math.sqrt(a.hd), b.attn_norm.eps, qk_eps)


def decode_stack(blocks: list[Block]):
    """The blocks as one C++ `DecodeStack` (csrc/decode.cpp: one call per step instead of ~13
    operators and ~10 module calls per block), or None if one of them is outside what it covers
    or they differ in attention shape or rotary. Weights are shared with the modules."""
    if not blocks or not kernels.available():
        return None
    args = [_stack_args(b) for b in blocks]
    if any(a is None for a in args) or len({_attn_key(b) for b in blocks}) != 1 \
            or len({id(b.attn.rotary) for b in blocks}) != 1 or len({b.attn.window for b in blocks}) != 1:
        return None
    stack = kernels.decode_stack(*_attn_key(blocks[0]))
    for i, (w, (qn, kn)) in enumerate(args):
        stack.add_layer(*w, qn, kn, i)
    stack.set_window(blocks[0].attn.window)  # on caches that keep every position (`native_rows`)
    return stack


def cached_stack(owner: nn.Module, attr: str, blocks: list[Block]):
    """`owner.attr`: the DecodeStack of `blocks`, built on first use; None (remembered as False)
    where they are outside what it covers."""
    stack = getattr(owner, attr)
    if stack is None:
        stack = decode_stack(blocks)
        setattr(owner, attr, False if stack is None else stack)
    return None if stack is None or stack is False else stack


def run_stack(stack, rotary: Rotary, x: torch.Tensor, start: int, kv: KVCache, first: int,
              count: int) -> torch.Tensor:
    """The `count` blocks of `stack` (sharing `rotary`) over x [T, D] at positions [start, start + T),
    on cache layers [first, first + count) -> the residual stream after them."""
    T = x.shape[0]
    if start + T > kv.max_len:
        raise MtpllmError(f"context overflow: position {start + T} exceeds the context size {kv.max_len}")
    cos, sin = rotary.tables(start + T, x.device)
    return stack.forward(x, kv.k[first:first + count], kv.v[first:first + count], cos, sin, start, 0, count)


def batch_rows(tokens: list, caches: list) -> list[int]:
    """`forward_batch`'s argument checks: one token list per cache, each non-empty and fitting its
    cache -> the row count of each sequence."""
    if len(tokens) != len(caches) or not caches:
        raise MtpllmError(f"forward_batch: {len(tokens)} token lists for {len(caches)} caches")
    rows = [int(t.shape[0]) for t in tokens]
    for c, T in zip(caches, rows):
        if T <= 0 or c.length + T > c.max_len:
            raise MtpllmError(f"context overflow: {c.length} + {T} tokens exceed the context size {c.max_len}")
    return rows
