"""N-gram / prompt-lookup proposer: drafts the continuation of the latest earlier occurrence
of the sequence's last n tokens (n from max down to min), searching prompt and output."""
from __future__ import annotations


class NgramIndex:
    """One sequence's lookup table: for each n, every n-gram of its history (ending before the last
    token) -> the start of its latest occurrence. Kept up to date as the history grows, so a step
    costs the new tokens' n-grams, not a scan of the whole history (at 32K tokens a scan per step
    cost several ms); built again when the history is another list or shorter than indexed."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.history = None
        self.end = 0  # n-grams ending at positions < end are indexed
        self.maps: dict[int, dict[tuple, int]] = {}

    def update(self, history: list[int], ns: range) -> None:
        L = len(history)
        if self.history is not history or self.end > max(L - 1, 0):
            self.reset()
            self.history = history
        for n in ns:
            self.maps.setdefault(n, {})
        for e in range(self.end, L - 1):  # n-grams ending at e <= L - 2: earlier than the pattern's
            for n in ns:
                s = e - n + 1
                if s >= 0:
                    self.maps[n][tuple(history[s:e + 1])] = s
        self.end = max(self.end, L - 1)


class NgramProposer:
    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def new_state(self) -> NgramIndex:
        return NgramIndex()

    def reusable_prefix(self, st, prompt: list[int]) -> int:
        return len(prompt)

    def begin(self, st, prompt, prompt_hidden, start) -> None:
        pass

    def propose(self, st, history: list[int], k: int, sampler=None, p_min: float = 0.0, p_cum: float = 0.0,
                keep=None):
        idx = st if isinstance(st, NgramIndex) else NgramIndex()
        idx.update(history, range(self.n_min, self.n_max + 1))
        L = len(history)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            s = idx.maps[n].get(tuple(history[L - n:]))
            if s is not None:
                start = s + n
                cont = list(history[start:start + k])
                if keep is not None:  # a match's drafts all have confidence 1
                    n = 0
                    while n < len(cont) and keep(n, 1.0):
                        n += 1
                    cont = cont[:n]
                if cont:
                    return cont, [None] * len(cont)  # one-hot drafts: q(d) = 1
        return [], []

    def accept(self, st, history, n_accepted, target_hidden) -> None:
        pass
