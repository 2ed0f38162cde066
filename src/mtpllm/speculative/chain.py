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

import time


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
        got = self.propose_priced_batch([st], [history], [k], [sampler], p_min, p_cum, [pol], [costs])[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def propose_priced_batch(self, sts: list, histories: list, ks: list[int], samplers: list, p_min: float,
                             p_cum: float, pols: list, costs: list, ms: list | None = None) -> list:
        """`propose_priced` for several sequences that share a step: each member drafts once for all
        the sequences that reach it (one `propose_batch` pass of a head for all of them: its weights
        read once per draft position, each sequence's drafts exactly those it drafts alone).
        -> [(drafts, qs)] per sequence, or the exception that sequence's drafting raised (a member's
        batched pass that fails is run again for each sequence alone, so the others still draft and
        no record counts a step twice); `ms`, when given, gets each sequence's share of the drafting
        time added (a pass's time split among the sequences it drafted for)."""
        from dataclasses import replace

        from .policy import CostPolicy
        out: list = [([], []) for _ in sts]
        for pol in pols:
            pol.active = None
        todo = list(range(len(sts)))
        for i, (p, kp) in enumerate(zip(self.proposers, self.ks)):
            got: dict[int, tuple] = {}
            t0 = time.perf_counter()
            if not hasattr(p, "probe_ms"):  # free to propose: look first, then price the rows
                run = todo
                for j in todo:
                    try:
                        drafts, qs = p.propose(sts[j].states[i], histories[j], min(ks[j], kp), samplers[j], p_min, p_cum)
                    except Exception as e:  # noqa: BLE001 - this sequence's failure only
                        got[j] = e
                        continue
                    if not drafts:
                        continue  # no match: not a plain step of this member's
                    rec, c = pols[j].members[i], replace(costs[j], draft=0.0)
                    n, keep = CostPolicy.limit(rec, c, len(drafts)), CostPolicy.keeper(rec, c)
                    m = 0
                    while m < n and keep(m, 1.0):  # a match's drafts all have confidence 1
                        m += 1
                    got[j] = (drafts[:m], qs[:m])
            else:
                asked = {j: CostPolicy.limit(pols[j].members[i], costs[j], min(ks[j], kp)) for j in todo}
                run = [j for j in todo if asked[j] > 0]
                keeps = [CostPolicy.keeper(pols[j].members[i], costs[j]) for j in run]
                args = ([sts[j].states[i] for j in run], [histories[j] for j in run], [asked[j] for j in run],
                        [samplers[j] for j in run])
                res = None
                if len(run) > 1 and hasattr(p, "propose_batch"):
                    try:
                        res = p.propose_batch(*args, p_min, p_cum, keeps)
                    except Exception:  # noqa: BLE001 - states as before the call: each one alone below
                        res = None
                if res is None:
                    res = []
                    for st, h, n, smp, kp_ in zip(*args, keeps):
                        try:
                            res.append(p.propose(st, h, n, smp, p_min, p_cum, keep=kp_))
                        except Exception as e:  # noqa: BLE001 - this sequence's failure only
                            res.append(e)
                got.update(zip(run, res))
            if ms is not None and run:
                share = (time.perf_counter() - t0) * 1e3 / len(run)
                for j in run:
                    ms[j] += share
            left = []
            for j in todo:
                if isinstance(got.get(j), BaseException):
                    out[j] = got[j]
                    continue
                drafts, qs = got.get(j, ([], []))
                if drafts:
                    pols[j].active, sts[j].last = i, self.names[i]
                    out[j] = (drafts, qs)
                else:
                    if j in got or hasattr(p, "probe_ms"):
                        pols[j].skip(i)
                    left.append(j)
            todo = left
        for j in todo:
            sts[j].last = None
        return out

    def take_catchup_ms(self, st: ChainState) -> float:
        """The members' catch-up time since the last call (MTPProposer.take_catchup_ms), reset."""
        return sum(p.take_catchup_ms(s) for p, s in zip(self.proposers, st.states) if hasattr(p, "take_catchup_ms"))

    def probe_ms(self, st: ChainState, hidden, token: int) -> float | None:
        """The slowest member's drafting of one token (n-gram lookup is not timed: it is free)."""
        ms = [p.probe_ms(s, hidden, token) for p, s in zip(self.proposers, st.states) if hasattr(p, "probe_ms")]
        ms = [m for m in ms if m is not None]
        return max(ms) if ms else None

    def accept(self, st: ChainState, history, n_accepted, target_hidden) -> None:
        for p, s in zip(self.proposers, st.states):
            p.accept(s, history, n_accepted, target_hidden)
