"""Several proposers in order of preference: at each step the first one that has a draft drafts.

The useful pair is n-gram lookup first, MTP otherwise (`--spec-type ngram-simple,draft-mtp`):
where the output repeats earlier text (code that reuses its own names, quoted input), lookup drafts
long runs that are accepted as a whole at no drafting cost; elsewhere the MTP head drafts. Each
proposer keeps its own draft length (lookup is best long, a small MTP head short). Verification is
the same whoever drafted, so the chain is exactly as lossless as its members.

Under the cost policy (`propose_priced`) each member's drafts are priced by that member's own
acceptance record, and lookup, free to propose, is tried before any gate (policy.py).

Every member sees every step's `begin`/`accept`, drafting or not, so stateful proposers (the MTP
head's cache of trunk hidden states) stay in step with the trunk.
"""
from __future__ import annotations


class ChainState:
    """The members' states of one sequence, and which member drafted its last step."""

    def __init__(self, states: list):
        self.states = states
        self.last: str | None = None

    def reset(self) -> None:
        for st in self.states:
            if hasattr(st, "reset"):
                st.reset()


class ChainProposer:
    def __init__(self, proposers: list, ks: list[int], names: list[str]):
        assert len(proposers) == len(ks) == len(names) >= 2
        self.proposers, self.ks, self.names = proposers, ks, names

    def new_state(self) -> ChainState:
        return ChainState([p.new_state() for p in self.proposers])

    def reusable_prefix(self, st: ChainState, prompt: list[int]) -> int:
        return min(p.reusable_prefix(s, prompt) for p, s in zip(self.proposers, st.states))

    def begin(self, st: ChainState, prompt, prompt_hidden, start) -> None:
        for p, s in zip(self.proposers, st.states):
            p.begin(s, prompt, prompt_hidden, start)

    def begin_steps(self, st: ChainState, prompt, prompt_hidden, start, chunk: int):
        """`begin` as steps, for the members whose prompt processing runs in steps (a draft model)."""
        for p, s in zip(self.proposers, st.states):
            if hasattr(p, "begin_steps"):
                yield from p.begin_steps(s, prompt, prompt_hidden, start, chunk)
            else:
                p.begin(s, prompt, prompt_hidden, start)

    def propose(self, st: ChainState, history: list[int], k: int, sampler, p_min: float = 0.0, p_cum: float = 0.0,
                keep=None):
        for i, (p, s, kp) in enumerate(zip(self.proposers, st.states, self.ks)):
            drafts, qs = p.propose(s, history, min(k, kp), sampler, p_min, p_cum, keep=keep)
            if drafts:
                st.last = self.names[i]
                return drafts, qs
        st.last = None
        return [], []

    def propose_priced(self, st: ChainState, history: list[int], k: int, sampler, p_min: float, p_cum: float,
                       pol, costs):
        """`propose` under the cost policy: pol, a `ChainPolicyState`; costs, the step's `Costs`
        (drafting priced at the slowest member's, which lookup does not pay). A member without
        `probe_ms` (lookup) drafts first and its drafts are then kept while they pay for their rows
        on its record; a member with one plans its length from its record before it drafts."""
        from dataclasses import replace

        from .policy import CostPolicy
        pol.active = None
        for i, (p, s, kp) in enumerate(zip(self.proposers, st.states, self.ks)):
            rec, ki = pol.members[i], min(k, kp)
            if not hasattr(p, "probe_ms"):  # free to propose: look first, then price the rows
                drafts, qs = p.propose(s, history, ki, sampler, p_min, p_cum)
                if not drafts:
                    continue  # no match: not a plain step of this member's
                c = replace(costs, draft=0.0)
                n, keep = CostPolicy.limit(rec, c, len(drafts)), CostPolicy.keeper(rec, c)
                m = 0
                while m < n and keep(m, 1.0):  # a match's drafts all have confidence 1
                    m += 1
                drafts, qs = drafts[:m], qs[:m]
            else:
                n = CostPolicy.limit(rec, costs, ki)
                drafts, qs = p.propose(s, history, n, sampler, p_min, p_cum,
                                       keep=CostPolicy.keeper(rec, costs)) if n > 0 else ([], [])
            if drafts:
                pol.active, st.last = i, self.names[i]
                return drafts, qs
            pol.skip(i)
        st.last = None
        return [], []

    def probe_ms(self, st: ChainState, hidden, token: int) -> float | None:
        """The slowest member's drafting of one token (n-gram lookup is not timed: it is free)."""
        ms = [p.probe_ms(s, hidden, token) for p, s in zip(self.proposers, st.states) if hasattr(p, "probe_ms")]
        ms = [m for m in ms if m is not None]
        return max(ms) if ms else None

    def accept(self, st: ChainState, history, n_accepted, target_hidden) -> None:
        for p, s in zip(self.proposers, st.states):
            p.accept(s, history, n_accepted, target_hidden)
