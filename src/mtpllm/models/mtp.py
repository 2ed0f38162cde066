"""The Multi-Token Prediction (next-n) module, as released with DeepSeek-V3, GLM-4.5 and Qwen3.5:

    e = enorm(embed(t_{i+1}))            # embedding of the token AFTER position i
    h = hnorm(h_i)                       # trunk hidden state at position i (after the final norm)
    x = eh_proj(concat([e, h]))          # Linear 2D -> D, embedding first
    x = block(x)                         # one full-attention decoder block, its own KV cache
    g = out_norm(x)                      # shared_head_norm; logits_{i+2} = lm_head(g)

For k > 1 the output g and the drafted token are fed back in as (h, t). Module only: loading is
in `speculative/mtp.py`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.kv_cache import KVCache
from .layers import Block, RMSNorm


class MTPHead(nn.Module):
    def __init__(self, enorm: RMSNorm, hnorm: RMSNorm, eh_proj: nn.Module, block: Block, out_norm: RMSNorm,
                 lm_head: nn.Module | None = None, embed: nn.Module | None = None):
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj, self.block, self.out_norm = enorm, hnorm, eh_proj, block, out_norm
        self.lm_head = lm_head  # own head (`nextn.shared_head_head`), else the trunk's
        self.embed = embed  # own embedding (`nextn.embed_tokens`), else the trunk's

    def make_cache(self, cfg, max_len: int, device="cpu") -> KVCache:
        return KVCache(1, cfg.n_kv_heads, cfg.head_dim, max_len, device=device)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """emb, hidden [T, D] for positions [cache.length, +T) -> normed output hidden [T, D]."""
        T = emb.shape[0]
        positions = cache.positions[cache.length:cache.length + T]
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        x = self.block(x, positions, cache, 0)
        cache.advance(T)
        return self.out_norm(x)
