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

from ..errors import MtpllmError
from ..runtime.kv_cache import KVCache
from .layers import Block, RMSNorm


class MTPHead(nn.Module):
    def __init__(self, enorm: RMSNorm, hnorm: RMSNorm, eh_proj: nn.Module, block: Block, out_norm: RMSNorm,
                 lm_head: nn.Module | None = None, embed: nn.Module | None = None):
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj, self.block, self.out_norm = enorm, hnorm, eh_proj, block, out_norm
        self.lm_head = lm_head  # own head (`nextn.shared_head_head`), else the trunk's
        self.embed = embed  # own embedding (`nextn.embed_tokens`), else the trunk's

    @property
    def window(self) -> int:
        """The keys each position's attention in the head's block sees: the last `window` (0 = all)."""
        return self.block.attn.window

    def set_window(self, window: int) -> None:
        """Attend over the last `window` positions of the head's cache only (0 = all of them): the
        head's cost per drafted token stops growing with the context. Its cache still keeps every
        position (the C++ kernels read the window's keys in place)."""
        if window < 0:
            raise ValueError(f"MTP head window must be >= 0, got {window}")
        self.block.attn.window = int(window)
        self.block._native = None  # its C++ stack is built again with the window

    def make_cache(self, cfg, max_len: int, device="cpu") -> KVCache:
        return KVCache(1, cfg.n_kv_heads, cfg.head_dim, max_len, device=device)

    def _input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj(concat(enorm(emb), hnorm(hidden))): the block's input rows."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """emb, hidden [T, D] for positions [cache.length, +T) -> normed output hidden [T, D]."""
        T = emb.shape[0]
        positions = cache.positions[cache.length:cache.length + T]
        x = self.block(self._input(emb, hidden), positions, cache, 0)
        cache.advance(T)
        return self.out_norm(x)

    def fill(self, emb: torch.Tensor, hidden: torch.Tensor, cache: KVCache) -> None:
        """The cache entries of positions [cache.length, +T) without the head's output: a block's
        keys and values at a position depend on its own input only, so rows whose output is not
        read (a prompt, the catch-up before the last position) need the input projection and the
        key/value projections, not attention, MLP or norm (~1/7 of the 1.5B head's block)."""
        T = emb.shape[0]
        positions = cache.positions[cache.length:cache.length + T]
        if positions.shape[0] != T:
            raise MtpllmError(f"MTP head: {cache.length} + {T} positions exceed its cache of {cache.max_len}")
        self.block.store(self._input(emb, hidden), positions, cache, 0)
        cache.advance(T)

    def forward_batch(self, embs: list[torch.Tensor], hiddens: list[torch.Tensor], caches: list) -> list[torch.Tensor]:
        """`forward` for several sequences: embs[s], hiddens[s] [T_s, D] at positions
        [caches[s].length, +T_s) of caches[s] -> their normed output states. Where the C++ decode
        path covers the block and every cache, its weights are read once for all rows (attention per
        sequence in its own cache) and the row-wise products run in `decode_rows` slices, so every
        row gets the bits it gets alone; otherwise one sequence after another."""
        from ..runtime.linear import GEMM_MIN_ROWS, decode_rows
        from . import hybrid_native
        from .deltanet import HybridBlock
        from .layers import cached_stack, native_rows
        rows = [int(e.shape[0]) for e in embs]
        stack, blk = None, self.block
        if len(caches) > 1 and max(rows) < GEMM_MIN_ROWS and all(c.length + T <= c.max_len
                                                                for c, T in zip(caches, rows)):
            one = embs[0][:1]
            if isinstance(blk, Block) and all(native_rows(one, c) for c in caches):
                stack = cached_stack(blk, "_native", [blk])
            elif isinstance(blk, HybridBlock) and not blk.recurrent and hybrid_native.native_rows(one, caches, rows):
                stack = hybrid_native.cached(blk, "_native", [blk], [0])  # as `HybridBlock.forward` on layer 0
        if stack is None:
            return [self(e, h, c) for e, h, c in zip(embs, hiddens, caches)]
        x = torch.cat([self.enorm(torch.cat(embs)), self.hnorm(torch.cat(hiddens))], dim=-1)
        x = decode_rows(self.eh_proj, x)
        if isinstance(blk, HybridBlock):
            x = hybrid_native.run(stack, blk.mixer.rotary, x, caches, rows)
        else:
            cos, sin = blk.attn.rotary.tables(max(c.length + T for c, T in zip(caches, rows)), x.device)
            x = stack.forward_batch(x, [c.k for c in caches], [c.v for c in caches], [c.length for c in caches],
                                    rows, cos, sin, 0, 1)
        for c, T in zip(caches, rows):
            c.advance(T)
        return list(self.out_norm(x).split(rows))
