"""A prompt prefix kept for later requests on a cache that cannot be rolled back far.

A KV cache goes back to any earlier position by trimming. A recurrent cache (the DeltaNet layers
of a hybrid model) holds only the state after its last position, plus the few rows speculation
needs: a later request that shares only part of what the slot holds (the same prompt sent again,
a chat turn whose earlier answer the client re-tokenized differently, a regenerated answer) would
start from scratch. So when a prompt is evaluated, the state of those parts at the end of the
prompt (before its last token, which is always evaluated alone) is copied once, `PrefixSnapshot`;
a later prompt that starts with those tokens restores it, trims the trimmable parts back to the
same position, and evaluates only the rest. Restoring gives exactly the state evaluation left.

Memory: one copy of the recurrent state per slot (conv history + delta-rule state per DeltaNet
layer, independent of the context length); KV caches are never copied.
"""
from __future__ import annotations

from .cache import RecurrentCache


def untrimmable_parts(cache) -> list[str]:
    """Names of the parts of a cache group that cannot be trimmed back arbitrarily (recurrent state)."""
    parts = getattr(cache, "parts", None) or {}
    return [name for name, c in parts.items() if isinstance(c, RecurrentCache)]


class PrefixSnapshot:
    """The untrimmable parts' state after `tokens` (the other parts are trimmed back on restore)."""

    def __init__(self, cache, tokens: list[int]):
        if cache.length != len(tokens):
            raise ValueError(f"a prefix of {len(tokens)} tokens on a cache at position {cache.length}")
        self.tokens = list(tokens)
        self.state = {name: cache.parts[name].snapshot() for name in untrimmable_parts(cache)}

    def usable(self, cache, prompt: list[int], common: int) -> bool:
        """Whether restoring this prefix serves `prompt`: its tokens start the prompt, at most
        `common` positions (what the slot's cache still holds of the prompt) are reused, and every
        other part can be trimmed back to it."""
        n = len(self.tokens)
        if not 0 < n <= common or prompt[:n] != self.tokens:
            return False
        return all(c.max_trim() >= c.length - n for name, c in cache.parts.items() if name not in self.state)

    def restore(self, cache) -> int:
        """Put the cache at the end of the prefix; returns its length."""
        n = len(self.tokens)
        for name, c in cache.parts.items():
            if name in self.state:
                c.restore(self.state[name])
            else:
                c.trim(c.length - n)
        return n
