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
state cannot be un-applied, so `RecurrentCache` keeps what rollback needs explicitly, by lazy replay:
a forward of up to `max_rows` rows (a speculative verification block) writes only its final state,
keeps the state it started from in a second slot, and records each row's delta-rule inputs (k, v,
decay, beta: a few small vectors). `trim(n)` only marks the committed state as "the state before the
last forward + its first rows - n rows"; the next forward replays those kept rows in the same pass
that reads the state (compute on a state already in cache, no extra memory traffic), and
`materialize()` applies them where the state itself is read (a snapshot, the PyTorch path). Writing
every row's state to its own slot instead (what rollback by a slot move needs) costs a full state
write per verification row. The convolution state is rolled back from a short history of its inputs.

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


def delta_rule_update(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                      beta: torch.Tensor) -> torch.Tensor:
    """One row of the (gated) delta rule, per head: S [H, dk, dv], k [H, dk], v [H, dv], decay
    (= exp(g)) and beta [H] -> S decay + k (beta (v - (S decay)^T k))^T. The PyTorch path's row update
    (models/deltanet.py) and the replay of its recorded rows both use it, so a replayed state has the
    bits the forward computed."""
    S = S * decay[:, None, None]
    kv_mem = torch.einsum("hkv,hk->hv", S, k)
    delta = (v - kv_mem) * beta[:, None]
    return S + k[:, :, None] * delta[:, None, :]


class RecurrentCache:
    """Convolution + delta-rule states of `n_layers` recurrent (Gated DeltaNet) layers of one sequence.

    conv:  the last `conv_len + max_rows` inputs of each layer's causal depthwise convolution,
           [n_layers, conv_len + max_rows, conv_dim]; the layer's convolution state is the last
           `conv_len` (= kernel size - 1) committed rows.
    state: [n_layers, 2, heads, k_dim, v_dim]: slot `cur` holds the state after the last forward,
           slot `prev` the state it started from.
    rows:  [n_layers, max_rows, heads, k_dim + v_dim + 2]: the last forward's rows as the delta rule
           consumed them, per head [k | v | decay | beta] (k L2-normed, decay = exp(g)).

    The committed state is state[cur], or, after `trim`, state[prev] with the first `kept` recorded
    rows replayed (pending until a forward or `materialize` applies them).

    A forward of T rows over layer i (the PyTorch path; the C++ one does the same in hybrid.cpp):
      - reads `conv_state(i)` [conv_len, C] and `state_of(i)` [H, K, V] (the committed ones),
      - hands its T convolution inputs to `push_conv(i, x)` [T, C],
      - for T <= max_rows records each row's inputs with `record_row(i, t, ...)`, and writes its
        final state to `final_state(i)` (a longer forward, a prompt chunk, records nothing and
        cannot be trimmed);
    then `advance(T)` commits all T rows. `trim(n)` after it drops the last n of them (n < T).
    """

    def __init__(self, n_layers: int, conv_dim: int, conv_len: int, heads: int, k_dim: int, v_dim: int,
                 max_len: int, max_rows: int = 32, dtype=torch.float32, device="cpu"):
        if n_layers < 0 or min(conv_dim, heads, k_dim, v_dim, max_rows) <= 0 or conv_len < 0:
            raise MtpllmError(f"recurrent cache: invalid shape ({n_layers} layers, conv {conv_dim}x{conv_len}, "
                              f"{heads} heads {k_dim}x{v_dim}, {max_rows} rows)")
        self.max_len, self.max_rows, self.conv_len = max_len, max_rows, conv_len
        self.k_dim, self.v_dim = k_dim, v_dim
        self.conv = torch.zeros(n_layers, conv_len + max_rows, conv_dim, dtype=dtype, device=device)
        self.state = torch.zeros(n_layers, 2, heads, k_dim, v_dim, dtype=dtype, device=device)
        self.rows = torch.zeros(n_layers, max_rows, heads, k_dim + v_dim + 2, dtype=dtype, device=device)
        self.length = 0
        self.cur, self.prev = 0, 1  # state slots: after the last forward, before it
        self.native = False  # the recorded rows come from the C++ forward (replayed with its arithmetic)
        self._conv_n = 0  # valid rows at the end of `conv` (at most conv_len + max_rows)
        self._pending = 0  # rows written by the forward in progress (not committed yet)
        self._rows = 0  # rows of the last committed forward recorded in `rows` (0: not trimmable)
        self._kept = 0  # how many of them are still committed (< _rows after a trim: a pending replay)

    # ---------------------------------------------------------------- for the layers
    def conv_state(self, layer: int) -> torch.Tensor:
        """The committed convolution inputs [conv_len, C] (zeros before the sequence start)."""
        n = self.conv.shape[1]
        return self.conv[layer, n - self.conv_len:] if self.conv_len else self.conv[layer, :0]

    def state_of(self, layer: int) -> torch.Tensor:
        """The committed delta-rule state [H, K, V] (a pending replay applied first)."""
        self.materialize()
        return self.state[layer, self.cur]

    def final_state(self, layer: int) -> torch.Tensor:
        """Where this forward's final state goes ([H, K, V] view, written by the layer)."""
        self.materialize()
        return self.state[layer, 1 - self.cur]

    def record_row(self, layer: int, t: int, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                   beta: torch.Tensor) -> None:
        """Row t's delta-rule inputs (k [H, K], v [H, V], decay, beta [H]), for a replay after a trim."""
        K, V = self.k_dim, self.v_dim
        r = self.rows[layer, t]
        r[:, :K] = k
        r[:, K:K + V] = v
        r[:, K + V] = decay
        r[:, K + V + 1] = beta
        self.native = False

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

    def replay(self) -> tuple[int, int]:
        """(the slot a forward starts from, how many recorded rows it replays first): (cur, 0), or
        after a trim (prev, kept). The C++ forward replays them itself, writes the state they give
        back to that slot (for a trim of its own rows) and its final state to the other slot."""
        return (self.prev, self._kept) if self._kept < self._rows else (self.cur, 0)

    def materialize(self) -> None:
        """Apply a pending replay: the committed state in slot `cur`, with the bits the forward that
        recorded the rows computed (its own arithmetic: PyTorch's or the C++ kernels')."""
        base, n = self.replay()
        if n == 0:
            return
        K, V = self.k_dim, self.v_dim
        if self.native:
            from . import kernels
            kernels.replay_delta_rule(self.state, self.rows, base, n)
        else:
            for layer in range(self.state.shape[0]):
                S = self.state[layer, base]
                for t in range(n):
                    r = self.rows[layer, t]
                    S = delta_rule_update(S, r[:, :K].contiguous(), r[:, K:K + V].contiguous(),
                                          r[:, K + V].contiguous(), r[:, K + V + 1].contiguous())
                self.state[layer, 1 - base].copy_(S)
        self.cur, self._rows = 1 - base, n

    # ---------------------------------------------------------------- the protocol
    def advance(self, n: int) -> None:
        if n <= 0:
            return
        base, _ = self.replay()
        self.prev, self.cur = base, 1 - base
        self.length += n
        self._conv_n = min(self._conv_n + n, self.conv.shape[1])
        self._rows = self._kept = n if n <= self.max_rows else 0
        self._pending = 0

    def max_trim(self) -> int:
        return max(0, self._kept - 1)

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        if n == 0:
            return 0
        if n > self.max_trim():
            raise MtpllmError(f"recurrent state cannot be rolled back {n} positions (at most {self.max_trim()}: "
                              f"the rows of the last forward but its first)")
        # the convolution history: drop the last n inputs (shift right, zeros where nothing is left)
        buf = self.conv
        buf[:, n:] = buf[:, :-n].clone()
        buf[:, :n] = 0
        self._conv_n = max(0, self._conv_n - n)
        self.length -= n
        self._kept -= n
        return n

    def reset(self) -> None:
        self.conv.zero_()
        self.state[:, 0].zero_()
        self.cur, self.prev = 0, 1
        self.length = self._conv_n = self._pending = self._rows = self._kept = 0

    def snapshot(self) -> tuple:
        self.materialize()
        return (self.length, self.conv.clone(), self.state[:, self.cur].clone())

    def restore(self, snap: tuple) -> None:
        length, conv, state = snap
        self.conv.copy_(conv)
        self.cur, self.prev = 0, 1
        self.state[:, 0].copy_(state)
        self.length, self._rows, self._kept, self._pending = length, 0, 0, 0
        self._conv_n = min(length, self.conv.shape[1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.state, self.rows))


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
