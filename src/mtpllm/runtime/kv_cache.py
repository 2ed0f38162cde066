"""Static, preallocated KV cache for one sequence: a `runtime.cache.Cache` (trim, snapshot/restore)."""
from __future__ import annotations

import torch

from ..errors import MtpllmError


# A sliding-window layer keeps its window plus this many positions: speculative rollback (`trim`)
# of up to SWA_SLACK - 1 positions never needs an entry that a rejected draft overwrote.
SWA_SLACK = 64


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype=torch.float32,
                   windows: tuple[int, ...] = ()) -> int:
    """Bytes a KVCache of this shape allocates (keys and values). `windows`: per layer, the sliding
    window (0 = full attention); such a layer holds min(max_len, window + SWA_SLACK) positions."""
    per_pos = 2 * n_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    lens = [ring_len(w, max_len) for w in windows] + [max_len] * (n_layers - len(windows))
    return per_pos * sum(lens)


def ring_len(window: int, max_len: int) -> int:
    return max_len if window <= 0 else min(max_len, window + SWA_SLACK)


class KVCache:
    """Keys/values for `n_layers` layers, preallocated for `max_len` positions.

    `length` is the number of positions committed; a forward over T tokens writes positions
    [length, length+T) in every layer and then `advance(T)` commits them. `trim(n)` drops the
    last n positions (rejected draft tokens): nothing is copied, later writes overwrite them.

    Sliding-window layers (`windows[i] > 0`) keep only the last window + SWA_SLACK positions in a
    ring buffer: long contexts cost those layers a constant amount of memory. `update` then returns
    the ring's entries in position order followed by the new ones; `span(layer)` tells attention how
    far back one-token decoding looks, so verification rows can use exactly the same key range.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype=torch.float32, device="cpu", windows: tuple[int, ...] = ()):
        self.max_len = max_len
        windows = tuple(windows) + (0,) * (n_layers - len(windows))
        # ring size per layer, 0 where the layer keeps every position (full attention, or a window
        # so large the ring would not be smaller)
        self.ring = [r if r < max_len else 0 for r in (ring_len(w, max_len) for w in windows)]
        full = [i for i in range(n_layers) if not self.ring[i]]
        swa = [i for i in range(n_layers) if self.ring[i]]
        self.slot = {i: j for j, i in enumerate(full)} | {i: j for j, i in enumerate(swa)}
        self.k = torch.zeros(len(full), n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        R = max(self.ring) if swa else 0
        self.rk = torch.zeros(len(swa), n_kv_heads, R, head_dim, dtype=dtype, device=device)
        self.rv = torch.zeros_like(self.rk)
        self.positions = torch.arange(max_len, device=device)
        self.length = 0

    def span(self, layer: int) -> int:
        """How many earlier positions one-token decoding sees in this layer (0 = all)."""
        return self.ring[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Store k, v [T, KV, D] at `positions`; return keys, values [KV, L, D] and key positions [L]."""
        start, T = int(positions[0]), k.shape[0]
        end = start + T
        if end > self.max_len:
            raise MtpllmError(f"context overflow: position {end} exceeds the context size {self.max_len}")
        j, R = self.slot[layer], self.ring[layer]
        if not R:
            self.k[j, :, start:end] = k.transpose(0, 1).to(self.k.dtype)
            self.v[j, :, start:end] = v.transpose(0, 1).to(self.v.dtype)
            return self.k[j, :, :end], self.v[j, :, :end], self.positions[:end]
        n_old = min(start, R)
        kt, vt = k.transpose(0, 1).to(self.rk.dtype), v.transpose(0, 1).to(self.rv.dtype)
        if n_old:
            idx = self.positions[start - n_old:start] % R
            keys = torch.cat([self.rk[j, :, idx], kt], dim=1)
            values = torch.cat([self.rv[j, :, idx], vt], dim=1)
        else:
            keys, values = kt, vt
        w = min(T, R)  # only the last R new positions can stay
        slots = self.positions[end - w:end] % R
        self.rk[j, :, slots] = kt[:, T - w:]
        self.rv[j, :, slots] = vt[:, T - w:]
        return keys, values, self.positions[start - n_old:end]

    def advance(self, n: int) -> None:
        self.length += n

    def max_trim(self) -> int:
        """How many positions `trim` can drop: all of them, except that a ring keeps only
        SWA_SLACK - 1 positions of slack once it has wrapped (older entries were overwritten)."""
        wrapped = [R for R in self.ring if R and self.length > R]
        return min(self.length, SWA_SLACK - 1) if wrapped else self.length

    def trim(self, n: int) -> int:
        """Drop the last n positions; returns the number actually dropped."""
        n = max(0, min(n, self.length))
        if n > self.max_trim():
            raise MtpllmError(f"KV cache: cannot drop {n} positions of a sliding-window ring "
                              f"(at most {self.max_trim()}): entries before them were overwritten")
        self.length -= n
        return n

    def reset(self) -> None:
        self.length = 0

    def snapshot(self) -> tuple:
        """A copy of the committed entries (full layers up to `length`, rings whole)."""
        n = self.length
        return (n, self.k[:, :, :n].clone(), self.v[:, :, :n].clone(), self.rk.clone(), self.rv.clone())

    def restore(self, snap: tuple) -> None:
        n, k, v, rk, rv = snap
        if n > self.max_len:
            raise MtpllmError(f"KV cache: a snapshot of {n} positions does not fit {self.max_len}")
        self.k[:, :, :n] = k
        self.v[:, :, :n] = v
        self.rk.copy_(rk)
        self.rv.copy_(rv)
        self.length = n

    def nbytes(self) -> int:
        return (self.k.numel() * self.k.element_size() + self.rk.numel() * self.rk.element_size()) * 2


class BatchKV:
    """One new position in each of several sequences' caches: `Transformer.decode_batch` runs the
    matrix products of B sequences' next tokens as one B-row batch (the weights are read once per
    step for all of them) and attention row by row, each row in its own cache at its own position."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches
        self.positions = torch.tensor([c.length for c in caches], device=caches[0].positions.device)
