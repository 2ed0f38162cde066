"""N-gram / prompt-lookup proposer: drafts the continuation of the latest earlier occurrence
of the sequence's last n tokens (n from max down to min), searching prompt and output."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def new_state(self) -> None:
        return None  # stateless: drafts come from the history alone

    def reusable_prefix(self, st, prompt: list[int]) -> int:
        return len(prompt)

    def begin(self, st, prompt, prompt_hidden, start) -> None:
        pass

    def propose(self, st, history: list[int], k: int, sampler=None, p_min: float = 0.0, p_cum: float = 0.0,
                keep=None):
        arr = np.asarray(history, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            pattern = arr[L - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # earlier windows only
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                cont = arr[start:start + k].tolist()
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
