"""The decoder-only transformer shared by the dense architectures, and the model loader.

Contract of an architecture file (`qwen2.py`, `gemma3.py`, `qwen35.py`, ...), module level:
  adjust_config(g, cfg: dict)    set the architecture's config fields from GGUF metadata (required)
  CONFIG                         its config dataclass (default `ModelConfig`)
  load_model(g, mode, cfg)       build its own model class from GGUF-named tensors (default: the
                                 shared `Transformer` below, driven by the config flags)
  build_mtp_block(g, cfg, L, mode)  its MTP block type (default: the shared `Block`)
  HF_MAP, HF_MTP_MAP             Hugging Face -> GGUF tensor names, for checkpoints read in place
                                 (`models/hf.py`)
"""
from __future__ import annotations

import importlib
import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq
from torch import nn

from ..errors import MtpllmError
from ..gguf.reader import GGUFFile
from ..runtime import kernels
from ..runtime.kv_cache import BatchKV, KVCache, kv_cache_bytes
from ..runtime.linear import GEMM_MIN_ROWS, NATIVE_TYPES, Linear, decode_rows, make_linear
from .config import ModelConfig, config_from_gguf
from .layers import (MLP, Attention, Block, RMSNorm, Rotary, batch_rows, cached_stack, native_rows, rope_inv_freq,
                     run_stack)

ARCH_NAMES = ("qwen2", "qwen3", "llama", "gemma3", "qwen35", "qwen35moe", "qwen3next")


class _ArchRegistry(dict):
    """arch name -> architecture module, imported on first use."""

    def __missing__(self, key):
        if key not in ARCH_NAMES:
            raise KeyError(key)
        mod = importlib.import_module(f".{key}", __package__)
        self[key] = mod
        return mod

    def __contains__(self, key):
        return key in ARCH_NAMES


ARCHITECTURES = _ArchRegistry()


class Embedding(nn.Module):
    """Token embedding kept in its GGUF storage type; rows are dequantized on lookup."""

    def __init__(self, raw: np.ndarray, qtype: QT, vocab: int, dim: int, scale: float = 1.0):
        super().__init__()
        self.raw, self.qtype, self.vocab, self.dim, self.scale = raw, qtype, vocab, dim, scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        idx = tokens.cpu().numpy()
        rows = self.raw[idx]
        if self.qtype in NATIVE_TYPES and kernels.available():
            e = kernels.gguf_dequantize([torch.from_numpy(rows)], [int(self.qtype)], self.dim).to(tokens.device)
            return e * self.scale if self.scale != 1.0 else e
        if self.qtype == QT.F32:
            out = np.asarray(rows, dtype=np.float32)
        elif self.qtype == QT.F16:
            out = rows.astype(np.float32)
        else:
            out = gq.dequantize(rows, self.qtype)
        e = torch.from_numpy(np.array(out, dtype=np.float32)).reshape(len(idx), self.dim).to(tokens.device)
        return e * self.scale if self.scale != 1.0 else e



def cache_windows(cfg: ModelConfig) -> tuple[int, ...]:
    """Per trunk layer: its sliding window (0 = full attention), for the KV cache layout."""
    if not cfg.sliding_window or not cfg.swa_layers:
        return ()
    return tuple(cfg.sliding_window if s else 0 for s in cfg.swa_layers)


def model_kv_bytes(cfg: ModelConfig, n_ctx: int) -> int:
    """KV-cache bytes for a context of n_ctx tokens: trunk and in-file MTP layers, sliding layers
    counted at their ring size (what `make_cache` allocates); an architecture with other state
    (recurrent layers) says itself (`cfg.cache_bytes`)."""
    if hasattr(cfg, "cache_bytes"):
        return cfg.cache_bytes(n_ctx)
    return kv_cache_bytes(cfg.n_layers + cfg.n_nextn, cfg.n_kv_heads, cfg.head_dim, n_ctx,
                          windows=cache_windows(cfg))


class Transformer(nn.Module):
    """Embedding -> blocks -> final norm -> (shared) lm_head. One sequence at a time."""

    def __init__(self, cfg: ModelConfig, embed: Embedding, blocks: list[Block], norm: RMSNorm, lm_head: Linear):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.lm_head = lm_head
        self.source: Path | None = None
        self.gguf = None  # the opened model file (GGUF or Hugging Face checkpoint), set by load_model
        self._stack = None  # all blocks as one C++ DecodeStack (built on first use); False: not covered

    def make_cache(self, max_len: int, device="cpu") -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, max_len, device=device, windows=cache_windows(c))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [T] at positions [cache.length, +T) -> final-normed hidden states [T, D]; commits T positions."""
        T = tokens.shape[0]
        positions = cache.positions[cache.length:cache.length + T] if cache.length + T <= cache.max_len else None
        if positions is None or positions.shape[0] != T:
            raise MtpllmError(f"context overflow: {cache.length} + {T} tokens exceed the context size {cache.max_len}")
        x = self.embed(tokens)
        if native_rows(x, cache):  # decoding / verification: every block in one C++ call
            stack = cached_stack(self, "_stack", list(self.blocks))
            if stack is not None:
                x = run_stack(stack, self.blocks[0].attn.rotary, x, cache.length, cache, 0, len(self.blocks))
                cache.advance(T)
                return self.norm(x)
        for i, blk in enumerate(self.blocks):
            x = blk(x, positions, cache, i)
        cache.advance(T)
        return self.norm(x)

    @torch.inference_mode()
    def forward_batch(self, tokens: list[torch.Tensor], caches: list) -> list[torch.Tensor]:
        """Several sequences' rows in one forward (continuous batching): tokens[s] [T_s] at positions
        [caches[s].length, +T_s) of caches[s] -> their final-normed hidden states [T_s, D]; commits
        T_s positions in each cache. Where every cache and block is covered by the C++ decode path,
        the matrix products run once over all rows and attention per sequence (each row's result
        is bit for bit what it gets alone); otherwise the sequences run one after another."""
        rows = batch_rows(tokens, caches)
        x = self.embed(torch.cat(tokens)) if len(caches) > 1 else None
        stack = None
        if x is not None and max(rows) < GEMM_MIN_ROWS and all(native_rows(x[:1], c) for c in caches):
            stack = cached_stack(self, "_stack", list(self.blocks))
        if stack is None:
            return [self(t, c) for t, c in zip(tokens, caches)]
        cos, sin = self.blocks[0].attn.rotary.tables(max(c.length + T for c, T in zip(caches, rows)), x.device)
        x = stack.forward_batch(x, [c.k for c in caches], [c.v for c in caches], [c.length for c in caches], rows,
                                cos, sin, 0, len(self.blocks))
        for c, T in zip(caches, rows):
            c.advance(T)
        return list(self.norm(x).split(rows))

    @torch.inference_mode()
    def decode_batch(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One token for each of B sequences: tokens[b] at position caches[b].length -> final-normed
        hidden states [B, D]; commits one position in every cache. The matrix products see B rows
        (each row computed as in one-token decoding), attention runs per sequence in its own cache."""
        if tokens.shape[0] != len(caches) or not caches:
            raise MtpllmError(f"decode_batch: {tokens.shape[0]} tokens for {len(caches)} caches")
        for c in caches:
            if c.length + 1 > c.max_len:
                raise MtpllmError(f"context overflow: position {c.length + 1} exceeds the context size {c.max_len}")
        kv = BatchKV(caches)
        x = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, kv.positions, kv, i)
        for c in caches:
            c.advance(1)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] (float32)."""
        out = self.lm_head(hidden)
        if self.cfg.final_softcap:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out


def step_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of decoding and verification rows [R, D] -> [R, V], any number of rows (several
    sequences' rows of one batched step): one pass of the output matrix for all of them, each row
    with its one-row bits (`decode_rows`)."""
    return decode_rows(model.logits, hidden)


def _norm(g: GGUFFile, name: str, eps: float) -> RMSNorm:
    return RMSNorm(g.load(name), eps)


def build_block(g: GGUFFile, cfg: ModelConfig, i: int, rotary: Rotary, mode: str, window: int = 0) -> Block:
    """One decoder block from the GGUF tensors `blk.{i}.*` (also used for MTP blocks)."""
    p = f"blk.{i}."
    qkv_names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    biases = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"] if cfg.qkv_bias else None
    qkv = make_linear(g, qkv_names, biases, mode)
    out = make_linear(g, [p + "attn_output.weight"], mode=mode)
    q_norm = k_norm = None
    if cfg.qk_norm:
        q_norm, k_norm = _norm(g, p + "attn_q_norm.weight", cfg.norm_eps), _norm(g, p + "attn_k_norm.weight", cfg.norm_eps)
    attn = Attention(cfg, qkv, out, rotary, q_norm, k_norm, window)
    mlp = MLP(make_linear(g, [p + "ffn_gate.weight", p + "ffn_up.weight"], mode=mode),
              make_linear(g, [p + "ffn_down.weight"], mode=mode), cfg.act)
    post_attn = post_ffn = None
    if cfg.sandwich_norm:
        post_attn = _norm(g, p + "post_attention_norm.weight", cfg.norm_eps)
        post_ffn = _norm(g, p + "post_ffw_norm.weight", cfg.norm_eps)
    return Block(_norm(g, p + "attn_norm.weight", cfg.norm_eps), attn, _norm(g, p + "ffn_norm.weight", cfg.norm_eps),
                 mlp, post_attn, post_ffn)


def make_rotaries(g: GGUFFile, cfg: ModelConfig) -> tuple[Rotary, Rotary]:
    """(global rotary, sliding-window rotary). The window layers never use context scaling."""
    dim = cfg.rope.dim or cfg.head_dim
    inv, factor = rope_inv_freq(cfg.rope, dim)
    if "rope_freqs.weight" in g:  # llama3-style per-frequency factors stored in the file
        inv = inv / g.load("rope_freqs.weight").reshape(-1)[: inv.shape[0]]
    full = Rotary(inv, factor, cfg.rope.style, dim)
    if cfg.rope.base_swa is None:
        return full, full
    inv_s, f_s = rope_inv_freq(cfg.rope, dim, base=cfg.rope.base_swa, scaling="none")
    return full, Rotary(inv_s, f_s, cfg.rope.style, dim)


def load_model(path: str | Path, mode: str = "fast", cfg_overrides: dict | None = None,
               gguf_file: GGUFFile | None = None) -> Transformer:
    """Load a GGUF model, or a Hugging Face checkpoint of an architecture that `models/hf.py` reads.
    mode: "fast" (compressed kernels) or "f32" (everything dequantized)."""
    if mode not in ("fast", "f32"):
        raise MtpllmError(f"unknown weight mode '{mode}' (fast|f32)")
    if gguf_file is None:
        from .hf import open_model_file
        gguf_file = open_model_file(path)
    g = gguf_file
    cfg = config_from_gguf(g)
    for k, v in (cfg_overrides or {}).items():
        if k.startswith("rope."):
            setattr(cfg.rope, k[5:], v)
        else:
            setattr(cfg, k, v)
    cfg.rope.__post_init__()
    arch = ARCHITECTURES[cfg.arch]
    if hasattr(arch, "load_model"):  # an architecture with its own model class
        return arch.load_model(g, mode, cfg)
    full_rot, swa_rot = make_rotaries(g, cfg)
    blocks = []
    for i in range(cfg.n_layers):
        swa = cfg.swa_layers[i] and cfg.sliding_window > 0
        blocks.append(build_block(g, cfg, i, swa_rot if swa else full_rot, mode, cfg.sliding_window if swa else 0))
    emb = g.info("token_embd.weight")
    embed = Embedding(g.raw("token_embd.weight"), emb.qtype, emb.shape[0], emb.shape[1], cfg.embed_scale)
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    lm_head = make_linear(g, [head_name], mode=mode)
    model = Transformer(cfg, embed, blocks, _norm(g, "output_norm.weight", cfg.norm_eps), lm_head)
    model.source = g.path
    model.gguf = g
    model.eval()
    return model
