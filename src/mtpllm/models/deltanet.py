"""Layers of the hybrid Qwen3.5 / Qwen3-Next family: Gated DeltaNet, gated full attention,
mixture-of-experts feed-forward. Modules only; shapes are single-sequence ([T, D] for T tokens).

Weights are in llama.cpp's GGUF layout (a Hugging Face checkpoint is presented in it by
`models/hf.py`): in particular the value heads of a DeltaNet layer are in *tiled* order (value head
j reads key head j mod n_k), where Hugging Face groups them (value head j reads key head j div r).

Gated DeltaNet, per value head h with state S [dk, dv] (transformers' `torch_recurrent_gated_delta_rule`):

    q, k, v  = split(silu(causal_conv1d(x W_qkv)))     depthwise, kernel K, state = last K-1 inputs
    q, k     = l2norm(q), l2norm(k);  q *= dk^-1/2
    beta     = sigmoid(x W_beta);  g = A * softplus(x W_alpha + dt_bias)     A = -exp(A_log) < 0
    S        = S * exp(g);  S += k (beta (v - S^T k))^T;  o = S^T q
    y        = (rmsnorm(o) * w_norm * silu(x W_z)) W_out

Prompt chunks use the equivalent chunked form (transformers' `torch_chunk_gated_delta_rule`,
the WY/UT representation: a triangular solve per chunk of 64 rows instead of 64 sequential steps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MtpllmError
from ..runtime import kernels
from ..runtime.cache import CacheGroup, RecurrentCache, delta_rule_update
from ..runtime.kv_cache import KVCache
from ..runtime.linear import GEMM_MIN_ROWS
from .layers import Attention, MLP, RMSNorm, _fused

CHUNK = 64  # rows per chunk of the chunked delta rule (transformers and the FLA kernels use 64)
L2_EPS = 1e-6  # transformers' l2norm epsilon (FLA's)
# decays below e^-DECAY_FLOOR (4e-18) count as 0 in the chunked form: far below float32's
# resolution beside the terms they join, and a fast-forgetting head (g of -40 per row is common)
# otherwise fills the chunk's decay products with subnormal floats, on which the CPU's matrix
# products run several times slower (a Qwen3.5-0.8B-shaped prompt chunk: 55-65 instead of 19 ms
# per layer)
DECAY_FLOOR = 40.0
TINY = 1e-30  # entries of the solve's products of decays below it count as 0, for the same reason


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_rule_steps(q, k, v, g, beta, state: torch.Tensor):
    """The recurrence row by row. q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H]; state [H, dk, dv]
    (read only). Returns (o [T, H, dv], final state [H, dk, dv]). Every row is computed exactly as a
    one-row call would (`delta_rule_update`, which also replays a trimmed cache's rows)."""
    T = q.shape[0]
    S = state
    decay = g.exp()  # [T, H]
    outs = []
    for t in range(T):
        S = delta_rule_update(S, k[t], v[t], decay[t], beta[t])
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S


def _decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for log-decays x <= 0, with those below -DECAY_FLOOR exactly 0 (no subnormals)."""
    return x.masked_fill(x < -DECAY_FLOOR, float("-inf")).exp()


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK):
    """The same recurrence over a long block in chunked form. Shapes as `delta_rule_steps`;
    returns (o [T, H, dv], final state [H, dk, dv])."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    # [H, T, .] layout, padded to whole chunks (padding rows have k = v = 0, g = 0: no effect)
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    v_beta = (v * beta[..., None]).view(H, n, chunk, dv)
    k_beta = (k * beta[..., None]).view(H, n, chunk, dk)
    q, k = q.view(H, n, chunk, dk), k.view(H, n, chunk, dk)
    cum = g.view(H, n, chunk).cumsum(-1)  # log of the decay from the chunk start to each row
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = _decay((cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")))  # [H, n, C, C]
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    to_row = _decay(cum)[..., None]  # decay from the chunk's start to each row
    k_cum = torch.linalg.solve_triangular(ut, k_beta * to_row, upper=False, unitriangular=True)
    k_cum = k_cum.masked_fill(k_cum.abs() < TINY, 0.0)  # the solve's products of decays: no subnormals
    q = q * to_row
    k = k * _decay(cum[..., -1:] - cum)[..., None]
    chunk_decay = _decay(cum[..., -1])[..., None, None]  # [H, n, 1, 1]
    S = state
    out = torch.empty(H, n, chunk, dv, dtype=v.dtype, device=v.device)
    for i in range(n):
        v_new = new_v[:, i] - k_cum[:, i] @ S
        out[:, i] = q[:, i] @ S + intra[:, i] @ v_new
        S = S * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, dv)[:, :T].transpose(0, 1), S


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each row alone in verification blocks (1 < T < GEMM_MIN_ROWS):
    vectorised exp/sigmoid give other bits than their scalar tail, and where a row falls in the
    flat tensor depends on T; one row at a time it gets the bits of one-token decoding."""
    if 1 < x.shape[0] < GEMM_MIN_ROWS:
        return torch.cat([fn(r) for r in x.split(1)])
    return fn(x)


def _rec(cache) -> RecurrentCache:
    return cache.rec if isinstance(cache, CacheGroup) else cache


def _kv(cache):
    return cache.kv if isinstance(cache, CacheGroup) else cache


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer. proj: one Linear (or `Concat`) D -> [qkv | z | beta | alpha]."""

    def __init__(self, proj: nn.Module, conv_w: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                 norm: RMSNorm, out: nn.Module, n_k: int, n_v: int, dk: int, dv: int, tiled: bool = True,
                 ba_grouped: bool = False):
        super().__init__()
        # tiled: value heads in llama.cpp's qwen35 order (head j reads key head j mod n_k), else
        # grouped as in Hugging Face and llama.cpp's qwen3next (head j reads key head j div r).
        # ba_grouped: beta and alpha come from one projection laid out per key head as
        # [beta x r, alpha x r] (Qwen3-Next's in_proj_ba), else as [beta | alpha]
        self.tiled, self.ba_grouped = tiled, ba_grouped
        self.proj, self.out, self.norm = proj, out, norm
        self.conv_w = nn.Parameter(conv_w.float().contiguous(), requires_grad=False)  # [C, K]
        self.register_buffer("conv_t", self.conv_w.detach().t().contiguous(), persistent=False)  # [K, C]
        self.a = nn.Parameter(a.float().reshape(-1), requires_grad=False)  # [H]: -exp(A_log)
        self.dt_bias = nn.Parameter(dt_bias.float().reshape(-1), requires_grad=False)  # [H]
        self.n_k, self.n_v, self.dk, self.dv = n_k, n_v, dk, dv
        self.conv_dim = 2 * n_k * dk + n_v * dv

    def _inputs(self, p: torch.Tensor, hist: torch.Tensor):
        """Projections p [T, N] and convolution inputs hist [K-1+T, C] -> q, k [T, H, dk] (normed,
        q scaled), v [T, H, dv], g, beta [T, H], z [T, H, dv]."""
        T = p.shape[0]
        C, nk, nv, dk, dv = self.conv_dim, self.n_k, self.n_v, self.dk, self.dv
        _, z, b, a = p.split([C, nv * dv, nv, nv], dim=-1)
        if self.ba_grouped:
            r = nv // nk
            ba = p[:, C + nv * dv:].reshape(T, nk, 2 * r)
            b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
        # causal depthwise convolution: a fixed-order sum over the kernel taps
        if _fused(hist):  # the C++ forward's arithmetic, on all threads
            c = kernels.deltanet_conv_silu(hist, self.conv_t)
        else:
            K = self.conv_w.shape[1]
            c = hist[0:T] * self.conv_w[:, 0]
            for j in range(1, K):
                c = c + hist[j:j + T] * self.conv_w[:, j]
            c = F.silu(c)
        q = l2norm(c[:, :nk * dk].reshape(T, nk, dk))
        k = l2norm(c[:, nk * dk:2 * nk * dk].reshape(T, nk, dk))
        v = c[:, 2 * nk * dk:].reshape(T, nv, dv)
        if nv != nk and self.tiled:
            q, k = q.repeat(1, nv // nk, 1), k.repeat(1, nv // nk, 1)
        elif nv != nk:
            q, k = q.repeat_interleave(nv // nk, dim=1), k.repeat_interleave(nv // nk, dim=1)
        q = q * dk ** -0.5
        beta = torch.sigmoid(b)
        g = self.a * F.softplus(a + self.dt_bias)  # log of the decay (< 0)
        return q, k, v, g, beta, z.reshape(T, nv, dv)

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z [T, H, dv] -> per-head RMSNorm(o) * silu(z), [T, H * dv]."""
        T, H, dv = o.shape
        return (self.norm(o.reshape(T * H, dv)).view(T, H, dv) * F.silu(z)).reshape(T, H * dv)

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        rec = _rec(cache)
        T = x.shape[0]
        K = self.conv_w.shape[1]
        p = self.proj(x)
        qkv = p[:, :self.conv_dim]
        hist = torch.cat([rec.conv_state(layer).to(qkv.dtype), qkv])  # [K-1+T, C]: state, then this block
        rec.push_conv(layer, qkv)
        if T <= rec.max_rows:
            # decoding and verification rows: each row alone, exactly as a one-row forward computes
            # it (elementwise exp/sigmoid are vectorised over the whole tensor, so a row's bits
            # would otherwise depend on T); each row's delta-rule inputs are recorded for a replay
            # after a trim, and only the final state is written
            S = rec.state_of(layer)
            outs = []
            for t in range(T):
                q, k, v, g, beta, z = self._inputs(p[t:t + 1], hist[t:t + K])
                o, S = delta_rule_steps(q, k, v, g, beta, S)
                rec.record_row(layer, t, k[0], v[0], g.exp()[0], beta[0])
                outs.append(self._output(o, z))
            rec.final_state(layer).copy_(S)
            return self.out(torch.cat(outs))
        q, k, v, g, beta, z = self._inputs(p, hist)
        state = rec.state_of(layer)
        if _fused(p) and state.dtype == torch.float32:  # the same chunked form in C++, per head on all threads
            o, final = kernels.deltanet_chunked(q, k, v, g, beta, state)
        else:
            o, final = delta_rule_chunked(q, k, v, g, beta, state)
        rec.final_state(layer).copy_(final)
        return self.out(self._output(o, z))


class GatedAttention(Attention):
    """Full attention whose query projection also emits a per-head output gate (q and gate
    interleaved per head, [H, 2 hd]); the attention output is multiplied by sigmoid(gate). QK norms
    and partial rotary as configured on `Attention`."""

    def store(self, x: torch.Tensor, positions: torch.Tensor, cache, layer: int) -> None:
        self.store_kv(self.qkv(x)[:, 2 * self.n_heads * self.hd:], positions, _kv(cache), layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache, layer: int) -> torch.Tensor:
        T = x.shape[0]
        H, hd, kv_sz = self.n_heads, self.hd, self.n_kv * self.hd
        p = self.qkv(x)
        qg = p[:, :2 * H * hd].view(T, H, 2 * hd)
        gate = rowwise(torch.sigmoid, qg[..., hd:].reshape(T, H * hd))
        qkv = torch.cat([qg[..., :hd].reshape(T, H * hd), p[:, 2 * H * hd:2 * H * hd + 2 * kv_sz]], dim=-1)
        o = self._mix(qkv, positions, _kv(cache), layer)
        return self.out(o * gate)


class MoE(nn.Module):
    """Routed experts + a shared expert: softmax router over E experts, top-k, the k weights
    renormalised to sum to 1 (`norm_topk`), plus sigmoid(x W_gate_shexp) * shared_mlp(x)."""

    def __init__(self, router: nn.Module, experts: list[MLP], top_k: int, shared: MLP | None,
                 shared_gate: nn.Module | None, norm_topk: bool = True):
        super().__init__()
        self.router, self.experts, self.top_k = router, nn.ModuleList(experts), top_k
        self.shared, self.shared_gate, self.norm_topk = shared, shared_gate, norm_topk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        # experts in increasing index order: a row gets its sum in the same order for any T
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            y = self.experts[e](x[rows]) * w[rows, slot, None].to(x.dtype)
            out[rows] += y  # a row picks an expert at most once: no repeated indices
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = rowwise(torch.sigmoid, self.shared_gate(x)) * s
            out = out + s
        return out


class HybridBlock(nn.Module):
    """Pre-norm block: x += mixer(attn_norm(x)); x += ffn(post_attention_norm(x)). The mixer is a
    `GatedDeltaNet` (state in the cache's recurrent part) or a `GatedAttention` (its KV part);
    `layer` is the block's slot in that part."""

    def __init__(self, attn_norm: RMSNorm, mixer: nn.Module, ffn_norm: RMSNorm, ffn: nn.Module):
        super().__init__()
        self.attn_norm, self.mixer, self.ffn_norm, self.ffn = attn_norm, mixer, ffn_norm, ffn
        self.recurrent = isinstance(mixer, GatedDeltaNet)
        self._native = None  # this block alone as a C++ HybridStack (the MTP block); False where not covered

    @property
    def attn(self):  # the attention module of a full-attention block (MTP code reads its rotary)
        return self.mixer

    def store(self, x: torch.Tensor, positions: torch.Tensor, cache, layer: int) -> None:
        """The KV entries of a full-attention block's rows, without its output (see `Block.store`)."""
        if self.recurrent:
            raise MtpllmError("a recurrent block has no key/value entries to store alone")
        self.mixer.store(self.attn_norm(x), positions, cache, layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache, layer: int) -> torch.Tensor:
        if type(cache) is KVCache and not self.recurrent:  # a block with a KV cache of its own (MTP)
            from . import hybrid_native
            if hybrid_native.native_rows(x, [cache], [x.shape[0]]):
                stack = hybrid_native.cached(self, "_native", [self], [layer])
                if stack is not None:
                    start = int(positions[0])
                    if start != cache.length:
                        raise MtpllmError(f"hybrid block: rows at position {start}, cache at {cache.length}")
                    return hybrid_native.run(stack, self.mixer.rotary, x, [cache], [x.shape[0]])
        h = self.attn_norm(x)
        h = self.mixer(h, cache, layer) if self.recurrent else self.mixer(h, positions, cache, layer)
        x = x + h
        return x + self.ffn(self.ffn_norm(x))


class Concat(nn.Module):
    """Several Linears over the same input, outputs concatenated (tensors of different storage
    types that one fused Linear cannot hold)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
