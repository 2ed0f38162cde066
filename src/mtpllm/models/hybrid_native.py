"""The hybrid models' decoding step in C++ (`HybridStack`, runtime/csrc/hybrid.cpp): every block of
a Qwen3.5 / Qwen3-Next trunk (Gated DeltaNet with its recurrent state, gated attention, dense or
mixture-of-experts feed-forward) in one call per step, as `DecodeStack` does for the dense models.

It runs decoding and verification rows (T < GEMM_MIN_ROWS per sequence, within the recurrent cache's
row slots) on the CPU kernels; prompt chunks, autograd and weights in other formats (int8/int4/blocks
Linears) stay on the modules' PyTorch path. A row's result does not depend on the rows beside it,
so speculative verification and plain decoding agree bit for bit on this path as on the other.
"""
from __future__ import annotations

import math

import torch

from ..runtime import kernels
from ..runtime.cache import CacheGroup, RecurrentCache
from ..runtime.kv_cache import KVCache
from ..runtime.linear import GEMM_MIN_ROWS, Linear
from .deltanet import MLP, Concat, GatedAttention, GatedDeltaNet, MoE
from .layers import _fused


def _parts(lin) -> list[tuple[list[torch.Tensor], list[int]]] | None:
    """A Linear (or Concat of Linears) as the stack's parts, or None for a format it does not run."""
    out = []
    for m in (lin.parts if isinstance(lin, Concat) else [lin]):
        if not isinstance(m, Linear) or m.bias is not None:
            return None
        if m.kind == "gguf":
            out.append((list(m._gw), list(m._gt)))
        elif m.kind == "f32" and m.weight.dtype == torch.float32 and m.weight.is_contiguous():
            out.append(([m.weight], [-1]))
        else:
            return None
    return out


class _Builder:
    def __init__(self, stack):
        self.stack = stack

    def lin(self, module) -> int:
        parts = _parts(module)
        if parts is None:
            raise _Unsupported
        lid = -1
        for ws, ts in parts:
            lid = self.stack.add_part(lid, ws, ts)
        return lid

    def ffn(self, ffn) -> None:
        if isinstance(ffn, MLP):
            if ffn.act_name != "silu":
                raise _Unsupported
            self.stack.set_mlp(self.lin(ffn.gate_up), self.lin(ffn.down))
        elif isinstance(ffn, MoE):
            gus, downs = [], []
            for e in ffn.experts:
                if e.act_name != "silu":
                    raise _Unsupported
                gus.append(self.lin(e.gate_up))
                downs.append(self.lin(e.down))
            sh_gu = sh_down = sh_gate = -1
            if ffn.shared is not None:
                sh_gu, sh_down = self.lin(ffn.shared.gate_up), self.lin(ffn.shared.down)
                if ffn.shared_gate is not None:
                    sh_gate = self.lin(ffn.shared_gate)
            self.stack.set_moe(self.lin(ffn.router), gus, downs, ffn.top_k, ffn.norm_topk, sh_gu, sh_down, sh_gate)
        else:
            raise _Unsupported


class _Unsupported(Exception):
    pass


def _attn_key(mixer: GatedAttention) -> tuple:
    qk_eps = mixer.q_norm.eps if mixer.q_norm is not None else 1e-6
    return (mixer.n_heads, mixer.n_kv, mixer.hd, mixer.rotary.rot_dim, mixer.rotary.style == "neox",
            mixer.scale or 1.0 / math.sqrt(mixer.hd), qk_eps)


def build_stack(blocks, slots: list[int]):
    """`blocks` (HybridBlocks; `slots[i]` block i's index in its part of the cache) as one
    `HybridStack` sharing the modules' weights, or None where a block is outside what it covers
    (another weight format, attention blocks of different shapes or rotaries, mixed norm epsilons)."""
    if not blocks or not kernels.available():
        return None
    atts = [b.mixer for b in blocks if not b.recurrent]
    if atts and (len({_attn_key(a) for a in atts}) != 1 or len({id(a.rotary) for a in atts}) != 1
                 or len({a.window for a in atts}) != 1):
        return None
    norms = [n for b in blocks for n in (b.attn_norm, b.ffn_norm)]
    norms += [b.mixer.norm for b in blocks if b.recurrent]
    if len({n.eps for n in norms}) != 1:
        return None
    H, KV, hd, rot, neox, scale, qk_eps = _attn_key(atts[0]) if atts else (1, 1, 1, 0, True, 1.0, 1e-6)
    stack = kernels.hybrid_stack(H, KV, hd, rot, neox, scale, norms[0].eps, qk_eps)
    if atts:
        stack.set_window(atts[0].window)  # on caches that keep every position (`native_rows`)
    b_ = _Builder(stack)
    try:
        for blk, slot in zip(blocks, slots):
            m = blk.mixer
            if blk.recurrent:
                assert isinstance(m, GatedDeltaNet)
                stack.add_deltanet(slot, blk.attn_norm.weight.data, b_.lin(m.proj), m.conv_w.data, m.a.data,
                                   m.dt_bias.data, m.norm.weight.data, b_.lin(m.out), m.n_k, m.n_v, m.dk, m.dv,
                                   m.tiled, m.ba_grouped, blk.ffn_norm.weight.data)
            else:
                stack.add_attention(slot, blk.attn_norm.weight.data, b_.lin(m.qkv), b_.lin(m.out),
                                    m.q_norm.weight.data if m.q_norm is not None else None,
                                    m.k_norm.weight.data if m.k_norm is not None else None, blk.ffn_norm.weight.data)
            b_.ffn(blk.ffn)
    except _Unsupported:
        return None
    return stack


def cached(owner, attr: str, blocks, slots):
    """owner.attr: the stack of `blocks`, built on first use; None (remembered as False) where
    they are outside what it covers."""
    stack = getattr(owner, attr)
    if stack is None:
        stack = build_stack(blocks, slots)
        setattr(owner, attr, False if stack is None else stack)
    return None if stack is False else stack


def _parts_of(cache) -> tuple[KVCache | None, RecurrentCache | None]:
    if isinstance(cache, CacheGroup):
        return getattr(cache, "kv", None), getattr(cache, "rec", None)
    if type(cache) is KVCache:
        return cache, None
    return None, None


def native_rows(x: torch.Tensor, caches: list, rows: list[int]) -> bool:
    """Whether rows[s] rows of each sequence (x: all of them) can run on a HybridStack: decoding or
    verification rows within the recurrent cache's row slots, plain (non-ring) float32 KV caches,
    inference on the CPU kernels."""
    if max(rows) >= GEMM_MIN_ROWS or not _fused(x):
        return False
    for c, T in zip(caches, rows):
        kv, rec = _parts_of(c)
        if kv is None or type(kv) is not KVCache or any(kv.ring) or kv.k.dtype != torch.float32:
            return False
        if isinstance(c, CacheGroup) and (rec is None or rec.state.dtype != torch.float32 or T > rec.max_rows
                                          or set(c.parts) != {"kv", "rec"}):
            return False
    return True


def run(stack, rotary, x: torch.Tensor, caches: list, rows: list[int]) -> torch.Tensor:
    """x [sum rows, D] (rows[s] rows of sequence s at positions [caches[s].length, +rows[s])) through
    the stack -> the residual stream after its blocks. The caches' entries are written; committing
    them (`advance`) is the caller's."""
    kvs, recs = zip(*(_parts_of(c) for c in caches))
    starts = [c.length for c in caches]
    if rotary is not None:
        cos, sin = rotary.tables(max(s + T for s, T in zip(starts, rows)), x.device)
    else:
        cos = sin = torch.empty(0, 0)
    has_rec = all(r is not None for r in recs)
    bases = replays = []
    if has_rec:
        for r in recs:
            if not r.native:  # rows recorded by the PyTorch path: replayed with its arithmetic
                r.materialize()
        bases, replays = (list(v) for v in zip(*(r.replay() for r in recs)))
    out = stack.forward_batch(x, [kv.k for kv in kvs], [kv.v for kv in kvs],
                              [r.conv for r in recs] if has_rec else [], [r.state for r in recs] if has_rec else [],
                              [r.rows for r in recs] if has_rec else [], bases, replays, starts, rows, cos, sin)
    if has_rec:
        for r in recs:
            r.native = True  # the stack replayed the pending rows and recorded its own
    return out
