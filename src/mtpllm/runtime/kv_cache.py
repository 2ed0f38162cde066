"""Static, preallocated KV cache for one sequence, with `trim(n)` for speculative rollback."""
from __future__ import annotations

import torch

from ..errors import MtpllmError


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype=torch.float32) -> int:
    """Bytes a KVCache of this shape allocates (keys and values)."""
    return 2 * n_layers * n_kv_heads * head_dim * max_len * torch.finfo(dtype).bits // 8


class KVCache:
    """Keys/values for `n_layers` layers, preallocated for `max_len` positions.

    `length` is the number of positions committed; a forward over T tokens writes positions
    [length, length+T) in every layer and then `advance(T)` commits them. `trim(n)` drops the
    last n positions (rejected draft tokens): nothing is copied, later writes overwrite them.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype=torch.float32, device="cpu"):
        self.max_len = max_len
        self.k = torch.zeros(n_layers, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.arange(max_len, device=device)
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Store k, v [T, KV, D] at `positions`; return keys, values [KV, L, D] and key positions [L]."""
        start, T = int(positions[0]), k.shape[0]
        end = start + T
        if end > self.max_len:
            raise MtpllmError(f"context overflow: position {end} exceeds the context size {self.max_len}")
        self.k[layer, :, start:end] = k.transpose(0, 1).to(self.k.dtype)
        self.v[layer, :, start:end] = v.transpose(0, 1).to(self.v.dtype)
        return self.k[layer, :, :end], self.v[layer, :, :end], self.positions[:end]

    def advance(self, n: int) -> None:
        self.length += n

    def trim(self, n: int) -> int:
        """Drop the last n positions; returns the number actually dropped."""
        n = max(0, min(n, self.length))
        self.length -= n
        return n

    def reset(self) -> None:
        self.length = 0

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
