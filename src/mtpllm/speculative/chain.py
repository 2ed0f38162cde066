"""Several proposers in order of preference: at each step the first one that has a draft drafts.

The useful pair is n-gram lookup first, MTP otherwise (`--spec-type ngram-simple,draft-mtp`):
where the output repeats earlier text (code that reuses its own names, quoted input), lookup drafts
long runs that are accepted as a whole at no drafting cost; elsewhere the MTP head drafts. Each
proposer keeps its own draft length (lookup is best long, a small MTP head short). Verification is
the same whoever drafted, so the chain is exactly as lossless as its members.

Every member sees every step's `begin`/`accept`, drafting or not, so stateful proposers (the MTP
head's cache of trunk hidden states) stay in step with the trunk.
"""
from __future__ import annotations


class ChainProposer:
    def __init__(self, proposers: list, ks: list[int], names: list[str]):
        assert len(proposers) == len(ks) == len(names) >= 2
        self.proposers, self.ks, self.names = proposers, ks, names
        self.last: str | None = None  # the member that drafted this step (for the statistics)

    def reusable_prefix(self, prompt: list[int]) -> int:
        return min(p.reusable_prefix(prompt) for p in self.proposers)

    def reset(self) -> None:
        for p in self.proposers:
            if hasattr(p, "reset"):
                p.reset()

    def begin(self, engine, prompt, prompt_hidden, start) -> None:
        for p in self.proposers:
            p.begin(engine, prompt, prompt_hidden, start)

    def propose(self, history: list[int], k: int, sampler, p_min: float = 0.0, p_cum: float = 0.0):
        for i, (p, kp) in enumerate(zip(self.proposers, self.ks)):
            drafts, qs = p.propose(history, min(k, kp), sampler, p_min, p_cum)
            if drafts:
                self.last = self.names[i]
                return drafts, qs
        self.last = None
        return [], []

    def accept(self, history, n_accepted, target_hidden) -> None:
        for p in self.proposers:
            p.accept(history, n_accepted, target_hidden)
