"""Qwen3.5 / Qwen3.6 dense (`qwen35`): a hybrid of Gated DeltaNet layers and gated full-attention
layers (three linear layers then one full layer in the released models), zero-centred RMSNorms
(GGUF and `models/hf.py` store them with the 1 added), partial rotary (a quarter of the head),
interleaved MRoPE sections (for text all sections carry the same position, so the rotary is the
plain NEOX one over `rope.dimension_count` dims), and an optional MTP block after the trunk.

The architecture's contract (shared by `qwen35moe.py` and `qwen3next.py`, which reuse this file):
  CONFIG       the config dataclass, filled by `adjust_config` from GGUF metadata
  HF_MAP       Hugging Face tensor names -> GGUF names (`models/hf.py` reads checkpoints through it)
  load_model   GGUF-named tensors -> `HybridModel` (its `make_cache` makes the KV + recurrent cache)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from ..errors import MtpllmError
from ..gguf.quants import dequantize
from ..gguf.reader import TensorInfo
from ..runtime.cache import CacheGroup, RecurrentCache
from ..runtime.kv_cache import KVCache, kv_cache_bytes
from ..runtime.linear import make_linear
from .config import ModelConfig
from . import hybrid_native
from .deltanet import MLP, Concat, GatedAttention, GatedDeltaNet, HybridBlock, MoE, RMSNorm
from .layers import Rotary, batch_rows, rope_inv_freq

MAX_VERIFY_ROWS = 32  # rows a forward records for a rollback (RecurrentCache.max_rows): the longest verification block


@dataclass
class HybridConfig(ModelConfig):
    recurrent: tuple[bool, ...] = ()  # per trunk layer: True = Gated DeltaNet, False = full attention
    conv_kernel: int = 4
    ssm_k_heads: int = 0  # DeltaNet key heads (GGUF ssm.group_count)
    ssm_v_heads: int = 0  # DeltaNet value heads (ssm.time_step_rank)
    ssm_k_dim: int = 0  # key head dim (ssm.state_size)
    ssm_v_dim: int = 0  # value head dim (ssm.inner_size / value heads)
    n_experts: int = 0  # 0: dense feed-forward
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    norm_topk: bool = True
    rope_sections: tuple[int, ...] = ()
    tiled_v_heads: bool = True  # qwen35: llama.cpp's converter reorders value heads (see deltanet.py)

    def __post_init__(self):
        super().__post_init__()
        if len(self.recurrent) != self.n_layers:
            raise MtpllmError(f"model config: {len(self.recurrent)} layer kinds for {self.n_layers} layers")
        for name in ("conv_kernel", "ssm_k_heads", "ssm_v_heads", "ssm_k_dim", "ssm_v_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise MtpllmError(f"model config: {name} must be a positive integer, got {v!r}")
        if self.ssm_v_heads % self.ssm_k_heads:
            raise MtpllmError(f"model config: {self.ssm_v_heads} DeltaNet value heads not a multiple of "
                              f"{self.ssm_k_heads} key heads")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise MtpllmError(f"model config: {self.n_experts_used} experts used of {self.n_experts}")

    @property
    def n_attn(self) -> int:
        return sum(1 for r in self.recurrent if not r)

    @property
    def n_recurrent(self) -> int:
        return sum(self.recurrent)

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_k_heads * self.ssm_k_dim + self.ssm_v_heads * self.ssm_v_dim

    def layer_pattern(self) -> str:
        """One letter per trunk layer: L = linear attention (Gated DeltaNet), A = full attention."""
        return "".join("L" if r else "A" for r in self.recurrent)

    def recurrent_bytes(self, max_rows: int = MAX_VERIFY_ROWS) -> int:
        """Bytes of one sequence's recurrent state (independent of the context length): the
        convolution history, two delta-rule states (committed, before the last forward) and the
        recorded rows of the last forward (runtime/cache.py RecurrentCache)."""
        conv = (self.conv_kernel - 1 + max_rows) * self.conv_dim
        state = 2 * self.ssm_v_heads * self.ssm_k_dim * self.ssm_v_dim
        rows = max_rows * self.ssm_v_heads * (self.ssm_k_dim + self.ssm_v_dim + 2)
        return 4 * self.n_recurrent * (conv + state + rows)

    def cache_bytes(self, n_ctx: int) -> int:
        """KV cache of the attention layers (and MTP layers) + recurrent state, float32."""
        return kv_cache_bytes(self.n_attn + self.n_nextn, self.n_kv_heads, self.head_dim, n_ctx) \
            + self.recurrent_bytes()


CONFIG = HybridConfig


def adjust_config(g, cfg: dict) -> None:
    a = cfg["arch"] + "."
    n = cfg["n_layers"]
    rec = g.get(a + "attention.recurrent_layers")
    if rec is not None:
        if len(rec) < n:
            raise MtpllmError(f"{g.path}: {a}attention.recurrent_layers has {len(rec)} entries for {n} layers")
        cfg["recurrent"] = tuple(bool(x) for x in rec[:n])
    else:
        every = int(g.get(a + "full_attention_interval", 4))
        if every <= 0:
            raise MtpllmError(f"{g.path}: {a}full_attention_interval must be positive, got {every}")
        cfg["recurrent"] = tuple((i + 1) % every != 0 for i in range(n))
    cfg["qk_norm"] = True
    cfg["conv_kernel"] = int(g.require(a + "ssm.conv_kernel"))
    cfg["ssm_k_dim"] = int(g.require(a + "ssm.state_size"))
    cfg["ssm_k_heads"] = int(g.require(a + "ssm.group_count"))
    nv = int(g.require(a + "ssm.time_step_rank"))
    cfg["ssm_v_heads"] = nv
    inner = int(g.require(a + "ssm.inner_size"))
    if nv <= 0 or inner % nv:
        raise MtpllmError(f"{g.path}: {a}ssm.inner_size {inner} is not a multiple of {nv} value heads")
    cfg["ssm_v_dim"] = inner // nv
    cfg["rope_sections"] = tuple(int(x) for x in g.get(a + "rope.dimension_sections", ()) or ())
    if g.get(a + "expert_count"):
        cfg["n_experts"] = int(g.require(a + "expert_count"))
        cfg["n_experts_used"] = int(g.require(a + "expert_used_count"))
        cfg["expert_ffn"] = int(g.require(a + "expert_feed_forward_length"))
        cfg["shared_ffn"] = int(g.get(a + "expert_shared_feed_forward_length", 0))
    cfg["tiled_v_heads"] = cfg["arch"] != "qwen3next"


# Hugging Face name (after the `model.` / `model.language_model.` prefix) -> GGUF name, per layer `{i}`.
# Tensor transforms that go with the names (norm + 1, A = -exp(A_log), value-head order, the
# conv kernel's shape) are in `models/hf.py`, as llama.cpp's converter does them.
HF_MAP = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "layers.{i}.linear_attn.in_proj_qkv.weight": "blk.{i}.attn_qkv.weight",
    "layers.{i}.linear_attn.in_proj_z.weight": "blk.{i}.attn_gate.weight",
    "layers.{i}.linear_attn.in_proj_b.weight": "blk.{i}.ssm_beta.weight",
    "layers.{i}.linear_attn.in_proj_a.weight": "blk.{i}.ssm_alpha.weight",
    "layers.{i}.linear_attn.in_proj_ba.weight": "blk.{i}.ssm_ba.weight",
    "layers.{i}.linear_attn.conv1d.weight": "blk.{i}.ssm_conv1d.weight",
    "layers.{i}.linear_attn.A_log": "blk.{i}.ssm_a",
    "layers.{i}.linear_attn.dt_bias": "blk.{i}.ssm_dt.bias",
    "layers.{i}.linear_attn.norm.weight": "blk.{i}.ssm_norm.weight",
    "layers.{i}.linear_attn.out_proj.weight": "blk.{i}.ssm_out.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",
    "layers.{i}.mlp.shared_expert_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
    "layers.{i}.mlp.shared_expert.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
    "layers.{i}.mlp.shared_expert.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
    "layers.{i}.mlp.shared_expert.down_proj.weight": "blk.{i}.ffn_down_shexp.weight",
    # routed experts: stacked [E, ...] (per-expert `mlp.experts.{e}.*` files are stacked on reading)
    "layers.{i}.mlp.experts.gate_proj": "blk.{i}.ffn_gate_exps.weight",
    "layers.{i}.mlp.experts.up_proj": "blk.{i}.ffn_up_exps.weight",
    "layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
}
# the MTP layer (`mtp.*`), stored as block n_layers: its own tensors, then a decoder layer
HF_MTP_MAP = {
    "mtp.fc.weight": "blk.{L}.nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "blk.{L}.nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "blk.{L}.nextn.hnorm.weight",
    "mtp.norm.weight": "blk.{L}.nextn.shared_head_norm.weight",
}


# ---------------------------------------------------------------------------- building
class _Experts:
    """Expert e of a stacked [E, N, K] GGUF tensor seen as a 2-D tensor `name@e` (what
    `make_linear` reads), without copying the file's bytes."""

    def __init__(self, g):
        self.g = g
        self.path = g.path

    def _split(self, name: str) -> tuple[str, int]:
        base, _, e = name.rpartition("@")
        return base, int(e)

    def info(self, name: str) -> TensorInfo:
        base, e = self._split(name)
        i = self.g.info(base)
        if len(i.shape) != 3 or not 0 <= e < i.shape[0]:
            raise MtpllmError(f"{self.path}: tensor '{base}' is not a stack of experts (shape {i.shape})")
        return TensorInfo(name, i.qtype, tuple(i.shape[1:]), i.n_bytes // i.shape[0], i.offset)

    def raw(self, name: str) -> np.ndarray:
        base, e = self._split(name)
        i = self.g.info(base)
        r = self.g.raw(base)
        return r[e] if r.ndim == 3 else r.reshape(i.shape[0], i.shape[1], -1)[e]

    def load(self, name: str) -> torch.Tensor:
        i = self.info(name)
        return dequantize(self.raw(name), i.qtype, i.shape, name)

    def release(self, name: str) -> None:
        pass


def _norm(g, name: str, eps: float) -> RMSNorm:
    return RMSNorm(g.load(name).reshape(-1), eps)


def _linear(g, names: list[str], mode: str) -> nn.Module:
    """One Linear over tensors that share an input; tensors of different storage types (e.g. float
    beta/alpha beside quantized projections) are kept in separate Linears, so none is requantized."""
    groups: list[list[str]] = []
    for n in names:
        t = g.info(n).qtype
        if groups and g.info(groups[-1][0]).qtype == t:
            groups[-1].append(n)
        else:
            groups.append([n])
    parts = [make_linear(g, grp, mode=mode) for grp in groups]
    return parts[0] if len(parts) == 1 else Concat(parts)


def build_deltanet(g, cfg: HybridConfig, i: int, mode: str) -> GatedDeltaNet:
    p = f"blk.{i}."
    ba = p + "ssm_ba.weight" in g
    names = [p + "attn_qkv.weight", p + "attn_gate.weight"]
    names += [p + "ssm_ba.weight"] if ba else [p + "ssm_beta.weight", p + "ssm_alpha.weight"]
    proj = _linear(g, names, mode)
    C = cfg.conv_dim
    nv, dv = cfg.ssm_v_heads, cfg.ssm_v_dim
    if proj.out_features != C + nv * dv + 2 * nv:
        raise MtpllmError(f"{g.path}: layer {i}: DeltaNet projections give {proj.out_features} outputs, expected "
                          f"{C + nv * dv + 2 * nv} from the ssm.* metadata")
    conv = g.load(p + "ssm_conv1d.weight").reshape(C, -1)
    if conv.shape[1] != cfg.conv_kernel:
        raise MtpllmError(f"{g.path}: layer {i}: conv kernel has {conv.shape[1]} taps, metadata says {cfg.conv_kernel}")
    return GatedDeltaNet(proj, conv, g.load(p + "ssm_a"), g.load(p + "ssm_dt.bias"),
                         _norm(g, p + "ssm_norm.weight", cfg.norm_eps), make_linear(g, [p + "ssm_out.weight"], mode=mode),
                         cfg.ssm_k_heads, nv, cfg.ssm_k_dim, dv, tiled=cfg.tiled_v_heads, ba_grouped=ba)


def build_attention(g, cfg: HybridConfig, i: int, rotary: Rotary, mode: str) -> GatedAttention:
    p = f"blk.{i}."
    qkv = make_linear(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], mode=mode)
    want = 2 * cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim
    if qkv.out_features != want:
        raise MtpllmError(f"{g.path}: layer {i}: attention projections give {qkv.out_features} outputs, expected "
                          f"{want} (query + gate per head, keys, values)")
    return GatedAttention(cfg, qkv, make_linear(g, [p + "attn_output.weight"], mode=mode), rotary,
                          _norm(g, p + "attn_q_norm.weight", cfg.norm_eps), _norm(g, p + "attn_k_norm.weight", cfg.norm_eps))


def build_ffn(g, cfg: HybridConfig, i: int, mode: str) -> nn.Module:
    p = f"blk.{i}."
    if p + "ffn_gate_inp.weight" not in g:
        return MLP(make_linear(g, [p + "ffn_gate.weight", p + "ffn_up.weight"], mode=mode),
                   make_linear(g, [p + "ffn_down.weight"], mode=mode), "silu")
    ex = _Experts(g)
    E = g.info(p + "ffn_gate_inp.weight").shape[0]
    if E != cfg.n_experts:
        raise MtpllmError(f"{g.path}: layer {i} has {E} experts, metadata says {cfg.n_experts}")
    experts = [MLP(make_linear(ex, [f"{p}ffn_gate_exps.weight@{e}", f"{p}ffn_up_exps.weight@{e}"], mode=mode),
                   make_linear(ex, [f"{p}ffn_down_exps.weight@{e}"], mode=mode), "silu") for e in range(E)]
    shared = gate = None
    if p + "ffn_gate_shexp.weight" in g:
        shared = MLP(make_linear(g, [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"], mode=mode),
                     make_linear(g, [p + "ffn_down_shexp.weight"], mode=mode), "silu")
        if p + "ffn_gate_inp_shexp.weight" in g:
            gate = make_linear(g, [p + "ffn_gate_inp_shexp.weight"], mode="f32")
    return MoE(make_linear(g, [p + "ffn_gate_inp.weight"], mode="f32"), experts, cfg.n_experts_used, shared, gate,
               cfg.norm_topk)


def build_block(g, cfg: HybridConfig, i: int, rotary: Rotary, mode: str, recurrent: bool) -> HybridBlock:
    """Block `blk.{i}.*` (also the MTP block, a full-attention block)."""
    p = f"blk.{i}."
    mixer = build_deltanet(g, cfg, i, mode) if recurrent else build_attention(g, cfg, i, rotary, mode)
    return HybridBlock(_norm(g, p + "attn_norm.weight", cfg.norm_eps), mixer,
                       _norm(g, p + "post_attention_norm.weight", cfg.norm_eps), build_ffn(g, cfg, i, mode))


def build_mtp_block(g, cfg: HybridConfig, L: int, mode: str) -> HybridBlock:
    """The MTP layer's decoder block `blk.{L}.*`: a gated full-attention block (dense or MoE FFN as
    the file has it), its own KV cache of one layer (`MTPHead.make_cache`)."""
    return build_block(g, cfg, L, make_rotary(cfg), mode, recurrent=False)


def make_rotary(cfg: HybridConfig) -> Rotary:
    """The NEOX rotary over the first `rope.dim` dims of each head. Interleaved MRoPE gives section s
    the frequencies i = s mod 3 (by index) with that section's position; text tokens have the same
    position in every section, so this is the plain rotary (`tests/test_qwen35.py` shows it)."""
    dim = cfg.rope.dim or cfg.head_dim
    inv, factor = rope_inv_freq(cfg.rope, dim)
    return Rotary(inv, factor, "neox", dim)


class HybridModel(nn.Module):
    """Embedding -> hybrid blocks -> final norm -> lm_head, over a `CacheGroup(kv=, rec=)`."""

    def __init__(self, cfg: HybridConfig, embed: nn.Module, blocks: list[HybridBlock], norm: RMSNorm,
                 lm_head: nn.Module):
        super().__init__()
        self.cfg, self.embed, self.blocks, self.norm, self.lm_head = cfg, embed, nn.ModuleList(blocks), norm, lm_head
        # each block's slot in its part of the cache (KV slots for attention, state slots for DeltaNet)
        n_rec = n_att = 0
        self.slots = []
        for b in blocks:
            self.slots.append(n_rec if b.recurrent else n_att)
            n_rec, n_att = n_rec + b.recurrent, n_att + (not b.recurrent)
        self.source: Path | None = None
        self.gguf = None
        self._stack = None  # all blocks as one C++ HybridStack (built on first use); False: not covered

    def _rotary(self) -> Rotary | None:
        """The rotary shared by the attention blocks (None without any)."""
        return next((b.mixer.rotary for b in self.blocks if not b.recurrent), None)

    def make_cache(self, max_len: int, device="cpu") -> CacheGroup:
        c = self.cfg
        kv = KVCache(c.n_attn, c.n_kv_heads, c.head_dim, max_len, device=device)
        rec = RecurrentCache(c.n_recurrent, c.conv_dim, c.conv_kernel - 1, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim,
                             max_len, max_rows=MAX_VERIFY_ROWS, device=device)
        return CacheGroup(kv=kv, rec=rec)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: CacheGroup) -> torch.Tensor:
        """tokens [T] at positions [cache.length, +T) -> final-normed hidden states [T, D]; commits T positions."""
        T = tokens.shape[0]
        start = cache.length
        if start + T > cache.max_len:
            raise MtpllmError(f"context overflow: {start} + {T} tokens exceed the context size {cache.max_len}")
        positions = cache.kv.positions[start:start + T]
        x = self.embed(tokens)
        if hybrid_native.native_rows(x, [cache], [T]):  # decoding / verification: every block in one C++ call
            stack = hybrid_native.cached(self, "_stack", list(self.blocks), self.slots)
            if stack is not None:
                x = hybrid_native.run(stack, self._rotary(), x, [cache], [T])
                cache.advance(T)
                return self.norm(x)
        for blk, slot in zip(self.blocks, self.slots):
            x = blk(x, positions, cache, slot)
        cache.advance(T)
        return self.norm(x)

    @torch.inference_mode()
    def forward_batch(self, tokens: list[torch.Tensor], caches: list[CacheGroup]) -> list[torch.Tensor]:
        """Several sequences' rows in one forward (continuous batching): tokens[s] [T_s] at positions
        [caches[s].length, +T_s) of caches[s] -> their final-normed hidden states [T_s, D]; commits T_s
        positions in each cache. On the C++ path the matrix products run once over all rows, the
        delta rule and attention per sequence in its own cache (each row's result is bit for bit
        what it gets alone); otherwise the sequences run one after another."""
        rows = batch_rows(tokens, caches)
        if len(caches) > 1:
            x = self.embed(torch.cat(tokens))
            if hybrid_native.native_rows(x, caches, rows):
                stack = hybrid_native.cached(self, "_stack", list(self.blocks), self.slots)
                if stack is not None:
                    x = hybrid_native.run(stack, self._rotary(), x, caches, rows)
                    for c, T in zip(caches, rows):
                        c.advance(T)
                    return list(self.norm(x).split(rows))
        return [self(t, c) for t, c in zip(tokens, caches)]

    @torch.inference_mode()
    def decode_batch(self, tokens: torch.Tensor, caches: list[CacheGroup]) -> torch.Tensor:
        """One token for each of B sequences (each in its own cache) -> hidden states [B, D]."""
        if tokens.shape[0] != len(caches) or not caches:
            raise MtpllmError(f"decode_batch: {tokens.shape[0]} tokens for {len(caches)} caches")
        return torch.cat(self.forward_batch(list(tokens.split(1)), caches))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] (float32)."""
        return self.lm_head(hidden)


def load_model(g, mode: str = "fast", cfg: HybridConfig | None = None) -> HybridModel:
    """Build the model from GGUF-named tensors (a `GGUFFile`, or a checkpoint read by `models/hf.py`)."""
    from .base import Embedding
    rotary = make_rotary(cfg)
    blocks = [build_block(g, cfg, i, rotary, mode, cfg.recurrent[i]) for i in range(cfg.n_layers)]
    emb = g.info("token_embd.weight")
    embed = Embedding(g.raw("token_embd.weight"), emb.qtype, emb.shape[0], emb.shape[1])
    lm_head = make_linear(g, ["token_embd.weight" if cfg.tied_embeddings else "output.weight"], mode=mode)
    model = HybridModel(cfg, embed, blocks, _norm(g, "output_norm.weight", cfg.norm_eps), lm_head)
    model.source = Path(g.path)
    model.gguf = g
    return model.eval()
