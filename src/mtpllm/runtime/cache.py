"""The state a model keeps for one sequence, behind one small protocol.

Every per-sequence model state (a layer's keys and values, a recurrent layer's convolution and
delta-rule state, a whole model's set of them) is a `Cache`:

    length        positions committed
    max_len       positions it can hold
    advance(n)    commit the n positions the last forward wrote
    trim(n)       drop the last n committed positions (speculative rollback); returns how many
    max_trim()    how many positions `trim` can drop right now
    reset()       forget everything
    snapshot()    an opaque copy of the state ...
    restore(s)    ... and going back to it (e.g. a prompt prefix kept for later requests)
    nbytes()      memory held

A KV cache can drop any number of positions for free: later writes overwrite them. A recurrent
state cannot be un-applied, so `RecurrentCache` keeps what rollback needs explicitly: a forward of
up to `max_rows` rows (a speculative verification block) leaves the state after EVERY row in its
own slot of a small ring, and `trim(n)` moves the current slot back n rows: no copy, no replay.
(The alternative, a snapshot before each verification and a replay of the accepted rows after a
rejection, copies the whole state every step; the delta rule rewrites the whole state for every row
anyway, so writing each row's result to its own slot costs no extra memory traffic.) The
convolution state is rolled back the same way from a short history of its inputs.

Callers (the verifier, the engine's prefix reuse) see only the protocol: rolling back after a
verification is `cache.trim(rejected)` whatever the layers are.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..errors import MtpllmError


@runtime_checkable
class Cache(Protocol):
    length: int
    max_len: int

    def advance(self, n: int) -> None: ...

    def trim(self, n: int) -> int: ...

    def max_trim(self) -> int: ...

    def reset(self) -> None: ...

    def snapshot(self) -> object: ...

    def restore(self, snap: object) -> None: ...

    def nbytes(self) -> int: ...


class RecurrentCache:
    """Convolution + delta-rule states of `n_layers` recurrent (Gated DeltaNet) layers of one sequence.

    conv:  the last `conv_len + max_rows` inputs of each layer's causal depthwise convolution,
           [n_layers, conv_len + max_rows, conv_dim]; the layer's convolution state is the last
           `conv_len` (= kernel size - 1) committed rows.
    state: [n_layers, max_rows + 1, heads, k_dim, v_dim]: ring of slots; `cur` is the committed one.

    A forward of T rows over layer i:
      - reads `conv_state(i)` [conv_len, C] and `state(i)` [H, K, V] (the committed ones),
      - hands its T convolution inputs to `push_conv(i, x)` [T, C],
      - writes its states: for T <= max_rows the state after each row t to `row_state(i, t)`
        (a [H, K, V] view to write into); for a longer forward (a prompt chunk) only the final
        state, to `row_state(i, T - 1)`, and that forward cannot be trimmed;
    then `advance(T)` commits all T rows. `trim(n)` after it drops the last n of them (n < T).
    """

    def __init__(self, n_layers: int, conv_dim: int, conv_len: int, heads: int, k_dim: int, v_dim: int,
                 max_len: int, max_rows: int = 32, dtype=torch.float32, device="cpu"):
        if n_layers < 0 or min(conv_dim, heads, k_dim, v_dim, max_rows) <= 0 or conv_len < 0:
            raise MtpllmError(f"recurrent cache: invalid shape ({n_layers} layers, conv {conv_dim}x{conv_len}, "
                              f"{heads} heads {k_dim}x{v_dim}, {max_rows} rows)")
        self.max_len, self.max_rows, self.conv_len = max_len, max_rows, conv_len
        self.conv = torch.zeros(n_layers, conv_len + max_rows, conv_dim, dtype=dtype, device=device)
        self.state = torch.zeros(n_layers, max_rows + 1, heads, k_dim, v_dim, dtype=dtype, device=device)
        self.length = 0
        self.cur = 0  # committed state slot
        self._conv_n = 0  # valid rows at the end of `conv` (at most conv_len + max_rows)
        self._pending = 0  # rows written by the forward in progress (not committed yet)
        self._trimmable = 0  # rows of the last committed forward that `trim` can still drop

    # ---------------------------------------------------------------- for the layers
    def conv_state(self, layer: int) -> torch.Tensor:
        """The committed convolution inputs [conv_len, C] (zeros before the sequence start)."""
        n = self.conv.shape[1]
        return self.conv[layer, n - self.conv_len:] if self.conv_len else self.conv[layer, :0]

    def state_of(self, layer: int) -> torch.Tensor:
        """The committed delta-rule state [H, K, V]."""
        return self.state[layer, self.cur]

    def push_conv(self, layer: int, x: torch.Tensor) -> None:
        """This forward's convolution inputs x [T, C] (the same T for every layer)."""
        T = x.shape[0]
        buf = self.conv[layer]
        n = buf.shape[0]
        if T >= n:
            buf.copy_(x[T - n:])
        else:
            buf[:n - T] = buf[T:].clone()
            buf[n - T:] = x
        self._pending = T

    def row_state(self, layer: int, t: int) -> torch.Tensor:
        """Where the state after row t of this forward goes ([H, K, V] view, written by the layer)."""
        return self.state[layer, self._slot(t)]

    def _slot(self, t: int) -> int:
        S = self.max_rows + 1
        return (self.cur + 1 + min(t, self.max_rows - 1)) % S

    # ---------------------------------------------------------------- the protocol
    def advance(self, n: int) -> None:
        if n <= 0:
            return
        self.cur = self._slot(n - 1)
        self.length += n
        self._conv_n = min(self._conv_n + n, self.conv.shape[1])
        self._trimmable = n - 1 if n <= self.max_rows else 0
        self._pending = 0

    def max_trim(self) -> int:
        return self._trimmable

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        if n == 0:
            return 0
        if n > self._trimmable:
            raise MtpllmError(f"recurrent state cannot be rolled back {n} positions (at most {self._trimmable}: "
                              f"the rows of the last forward but its first)")
        S = self.max_rows + 1
        self.cur = (self.cur - n) % S
        # the convolution history: drop the last n inputs (shift right, zeros where nothing is left)
        buf = self.conv
        buf[:, n:] = buf[:, :-n].clone()
        buf[:, :n] = 0
        self._conv_n = max(0, self._conv_n - n)
        self.length -= n
        self._trimmable -= n
        return n

    def reset(self) -> None:
        self.conv.zero_()
        self.state[:, 0].zero_()
        self.cur = 0
        self.length = self._conv_n = self._pending = self._trimmable = 0

    def snapshot(self) -> tuple:
        return (self.length, self.conv.clone(), self.state[:, self.cur].clone())

    def restore(self, snap: tuple) -> None:
        length, conv, state = snap
        self.conv.copy_(conv)
        self.cur = 0
        self.state[:, 0].copy_(state)
        self.length, self._trimmable, self._pending = length, 0, 0
        self._conv_n = min(length, self.conv.shape[1])

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * self.state.element_size()


class CacheGroup:
    """Several caches of one sequence that move together (a hybrid model: the KV cache of its
    attention layers and the recurrent cache of its DeltaNet layers). `parts` are reachable by name."""

    def __init__(self, **parts):
        if not parts:
            raise MtpllmError("a cache group needs at least one cache")
        self.parts = parts
        for name, c in parts.items():
            setattr(self, name, c)
        lens = {c.max_len for c in parts.values()}
        if len(lens) != 1:
            raise MtpllmError(f"caches of one sequence must have one context size, got {sorted(lens)}")
        self.max_len = lens.pop()

    @property
    def length(self) -> int:
        return next(iter(self.parts.values())).length

    def advance(self, n: int) -> None:
        for c in self.parts.values():
            c.advance(n)

    def max_trim(self) -> int:
        return min(c.max_trim() for c in self.parts.values())

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        if n > self.max_trim():
            raise MtpllmError(f"cannot roll back {n} positions (at most {self.max_trim()})")
        for c in self.parts.values():
            c.trim(n)
        return n

    def reset(self) -> None:
        for c in self.parts.values():
            c.reset()

    def snapshot(self) -> dict:
        return {k: c.snapshot() for k, c in self.parts.items()}

    def restore(self, snap: dict) -> None:
        for k, c in self.parts.items():
            c.restore(snap[k])

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.parts.values())
