"""One verifier for every proposer; the acceptance rule lives here and only here.

Per step: the proposer drafts d1..dk after the last emitted token x0; the target runs ONCE over
[x0, d1..dk] (k+1 positions, logits L0..Lk, L_i predicts the token after d_i with d_0 = x0).
Left to right:
  greedy (temperature 0): accept d_i while d_i == argmax(L_{i-1}); at the first mismatch emit
      argmax(L_{i-1}) and stop; if all k match, emit the bonus token argmax(L_k).
  sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
      Chen et al. 2023): p = target distribution, q = draft distribution, both AFTER the same
      temperature/top-k/top-p/min-p/penalty transforms. Accept d_i with probability
      min(1, p(d_i)/q(d_i)); on rejection sample from normalize(max(0, p - q)) and stop; if all
      are accepted, sample the bonus token from p(L_k). A one-hot draft (n-gram, greedy draft)
      has q(d_i) = 1. The emitted tokens are then distributed exactly as plain sampling from p.
Rejected positions are rolled back in one place, `SpeculativeDecoder.commit`, through the cache
protocol (`runtime/cache.py`): `cache.trim(rejected)` for KV caches and recurrent state alike.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from ..runtime.kernels import argmax
from ..runtime.sampling import Sampler
from .policy import Calibration, ChainPolicyState, CostPolicy, PolicyState, batch_rows, depth_band, step_costs
# proposers import common_prefix from here
from ..runtime.sequence import Block, common_prefix, run_steps  # noqa: F401


@dataclass
class SpecStats:
    """vLLM-style speculative metrics for one generation."""
    num_drafts: int = 0  # verification steps that checked at least one draft token
    num_steps: int = 0  # every target forward after the prefill, with or without drafts (a p-min cut-off)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    # a chain of proposers: per member, [steps it drafted, draft tokens, accepted tokens]
    members: dict[str, list[int]] = field(default_factory=dict)
    # steps by the number of drafts they verified: [steps with 0 (plain steps), with 1, ...]
    k_hist: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per target forward (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of steps that drafted position i whose draft i was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target forward, the steps without a draft included: the speed-up's
        upper bound. Equal to the mean acceptance length unless a p-min cut-off left steps undrafted."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 1.0

    def record(self, n_drafted: int, n_accepted: int, member: str | None = None) -> None:
        self.num_steps += 1
        while len(self.k_hist) <= n_drafted:
            self.k_hist.append(0)
        self.k_hist[n_drafted] += 1
        if n_drafted == 0:
            return
        if member is not None:
            m = self.members.setdefault(member, [0, 0, 0])
            m[0] += 1
            m[1] += n_drafted
            m[2] += n_accepted
        self.num_drafts += 1
        self.num_draft_tokens += n_drafted
        self.num_accepted_tokens += n_accepted
        while len(self.drafted_per_pos) < n_drafted:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(n_drafted):
            self.drafted_per_pos[i] += 1
            if i < n_accepted:
                self.accepted_per_pos[i] += 1

    def merge(self, other: "SpecStats") -> None:
        """Add another generation's counts to these (pooled statistics over several requests)."""
        self.num_drafts += other.num_drafts
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.draft_ms += other.draft_ms
        self.verify_ms += other.verify_ms
        for name, counts in other.members.items():
            m = self.members.setdefault(name, [0, 0, 0])
            for i in range(3):
                m[i] += counts[i]
        for i, n in enumerate(other.k_hist):
            if i >= len(self.k_hist):
                self.k_hist.append(0)
            self.k_hist[i] += n
        for i, (d, a) in enumerate(zip(other.drafted_per_pos, other.accepted_per_pos)):
            if i >= len(self.drafted_per_pos):
                self.drafted_per_pos.append(0)
                self.accepted_per_pos.append(0)
            self.drafted_per_pos[i] += d
            self.accepted_per_pos[i] += a

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "num_steps": self.num_steps, "tokens_per_step": self.tokens_per_step,
                "per_position_acceptance": self.per_position_acceptance,
                "drafted_per_pos": list(self.drafted_per_pos), "accepted_per_pos": list(self.accepted_per_pos),
                "draft_ms": self.draft_ms, "verify_ms": self.verify_ms, "draft_length_histogram": list(self.k_hist),
                **({"members": self.members_dict()} if self.members else {})}

    def members_dict(self) -> dict:
        """A chain's per-member counts by name: {name: {drafts, draft_tokens, accepted_tokens}}."""
        return {k: dict(zip(("drafts", "draft_tokens", "accepted_tokens"), v)) for k, v in self.members.items()}

    def summary(self) -> str:
        pos = " ".join(f"{r:.2f}" for r in self.per_position_acceptance)
        chain = "".join(f"; {k}: {v[0]} drafts, {v[2]}/{v[1]} accepted" for k, v in self.members.items())
        hist = " ".join(f"{k}:{n}" for k, n in enumerate(self.k_hist) if n)
        return (f"{'speculative':>16} = {self.num_drafts} drafts, {self.num_accepted_tokens}/{self.num_draft_tokens} "
                f"accepted ({100 * self.acceptance_rate:.1f}%), mean acceptance length "
                f"{self.mean_acceptance_length:.2f}, per position [{pos}], draft {self.draft_ms:.0f} ms, "
                f"verify {self.verify_ms:.0f} ms, steps by drafts verified [{hist}]{chain}")


def draft_token(logits: torch.Tensor, sampler: Sampler, history: list[int],
                p_min: float = 0.0) -> tuple[int, torch.Tensor | None, float]:
    """A proposer's choice from its own logits [V]: (token, q or None when one-hot, draft's top probability).

    q is taken after the same transforms as the target's p (the sampler is built from the same
    parameters); greedy drafts are one-hot (q = None). The top probability is only computed when
    a p-min cut-off asks for it (a softmax over the whole vocabulary per draft step); else 1.0."""
    if sampler.p.greedy and not sampler.p.uses_penalties:
        d = argmax(logits)
        q = None
    else:
        q = sampler.probs(logits, history)
        d = sampler.sample_from(q)
        if sampler.p.greedy:
            q = None
    top = float(torch.softmax(logits, -1).max()) if p_min > 0 else 1.0
    return d, q, top


def draft_token_in(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, sampler: Sampler,
                   history: list[int], p_min: float = 0.0) -> tuple[int, torch.Tensor | None, float]:
    """`draft_token` for a proposer that drafts from some tokens only: logits [n] of the tokens
    `ids` [n] (distinct), every other token of the vocabulary at -inf. The sampling transforms
    then run on the n logits (with penalties, which look tokens up by id, on the whole vector):
    q, scattered back to the vocabulary, is what `draft_token` gives for the whole vector, without
    a top-k and a cumulative sum over all 151,936 tokens per drafted token."""
    if sampler.p.greedy or sampler.p.uses_penalties:
        full = torch.full((vocab_size,), float("-inf"), device=logits.device).index_copy_(0, ids, logits)
        return draft_token(full, sampler, history, p_min)
    j, q_in, top = draft_token(logits, sampler, history, p_min)  # j: a position among the n tokens
    return int(ids[j]), torch.zeros(vocab_size, device=logits.device).index_copy_(0, ids, q_in), top


def stop_drafting(top: float, cum: float, p_min: float, p_cum: float) -> bool:
    """The draft cut-offs: the draft's top probability below p_min, or the product of this step's
    draft probabilities (the proposer's estimate that the whole draft is accepted) below p_cum."""
    return top < p_min or cum < p_cum


def draft_chain_steps(k: int, next_draft, advance, history: list[int], p_min: float = 0.0, p_cum: float = 0.0,
                      keep=None):
    """Up to k drafts, each from the proposer's state after the previous one: `next_draft(hist, cut)`
    -> (token, q, top probability) as `draft_token` gives them (hist: the history with the drafts so
    far; cut: what the top probability is needed for, see `draft_token`), `advance(token)` moves the
    proposer past a kept draft (not after the k-th). Stops before the first draft a cut-off
    (`stop_drafting`) or `keep(i, top)` refuses. Returns (drafts, their q).

    A generator: `next_draft` and `advance` are generators too, and whatever they yield (requests
    for the proposer's weights, see `MTPProposer.propose_batch`) passes through, so one driver can
    serve several sequences' requests together. `draft_chain` runs it with plain functions."""
    cut = 1.0 if keep is not None else max(p_min, p_cum)  # top probabilities only for a cut-off or `keep`
    drafts, qs = [], []
    hist = list(history)
    cum = 1.0
    for i in range(k):
        d, q, top = yield from next_draft(hist, cut)
        cum *= top
        if stop_drafting(top, cum, p_min, p_cum) or (keep is not None and not keep(i, top)):
            break
        drafts.append(d)
        qs.append(q)
        hist.append(d)
        if i + 1 < k:
            yield from advance(d)
    return drafts, qs


def draft_chain(k: int, next_draft, advance, history: list[int], p_min: float = 0.0, p_cum: float = 0.0,
                keep=None) -> tuple[list[int], list]:
    """`draft_chain_steps` with plain functions `next_draft(hist, cut)` and `advance(token)`."""
    def nd(hist, cut):
        return next_draft(hist, cut)
        yield  # noqa: unreachable - makes this a generator that yields nothing

    def adv(d):
        advance(d)
        return
        yield  # noqa

    return run_steps(draft_chain_steps(k, nd, adv, history, p_min, p_cum, keep))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)): where to sample after rejecting a draft (this is what makes it lossless)."""
    residual = (p - q).clamp_min(0)
    total = float(residual.sum())
    if total <= 0:  # p == q numerically: the residual is empty and p itself is the right law
        return p / float(p.sum())
    return residual / total


def accept_drafts(logits: torch.Tensor, drafts: list[int], qs: list, sampler: Sampler,
                  history: list[int]) -> tuple[int, int]:
    """Apply the acceptance rule. logits [len(drafts)+1, V]; qs[i] = draft distribution [V] or None (one-hot).

    Returns (number of drafts accepted, the next token: correction on rejection, bonus otherwise).
    """
    params = sampler.p
    if params.greedy and not params.uses_penalties:
        target = argmax(logits)  # all positions at once
        n = common_prefix(drafts, target)
        return n, target[n]
    hist = list(history)
    for i, d in enumerate(drafts):
        p = sampler.probs(logits[i], hist)
        q = qs[i] if i < len(qs) else None
        q_d = 1.0 if q is None else float(q[d])
        if params.greedy:
            ok = bool(p[d] == 1.0)
        else:
            r = float(torch.rand((), generator=sampler.gen, device=sampler.gen.device))
            ok = r * q_d < float(p[d])  # r < min(1, p/q)
        if ok:
            hist.append(d)
            continue
        if params.greedy:
            return i, argmax(p)
        if q is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        return i, sampler.sample_from(residual_distribution(p, q))
    return len(drafts), sampler.sample_from(sampler.probs(logits[len(drafts)], hist))


class SpeculativeDecoder:
    """Speculative decoding with any proposer (see module docstring), one step split in two:
    `plan` drafts and returns the rows to verify ([x0] + drafts), `commit` applies the acceptance
    rule to the target's hidden states of those rows, rolls back the rejected ones and tells the
    proposer. The proposer's weights are shared; its per-sequence state is `seq.draft`."""
    speculative = True

    def __init__(self, proposer, cfg, calib: list | None = None):
        self.proposer = proposer
        self.cfg = cfg
        # the cost policy's calibration per proposer (`Calibration`), shared by the requests this
        # decoder serves (and by decoders made from it with another draft length: `calib`)
        self._calib: list[Calibration] = calib or [Calibration() for _ in getattr(proposer, "names", None) or [None]]

    def with_draft_length(self, k: int) -> "SpeculativeDecoder":
        """The same proposer (its weights) and calibration with at most k drafts per step (a
        request's own draft length in the server)."""
        cfg = replace(self.cfg, num_speculative_tokens=k,
                      min_speculative_tokens=min(self.cfg.min_speculative_tokens, k))
        return type(self)(self.proposer, cfg, self._calib)

    def new_state(self, seq):
        return seq.slot.draft_state(self.proposer)

    def new_stats(self) -> SpecStats:
        return SpecStats()

    def start(self, engine, seq) -> list[int]:
        """Prefill (the target's, then the proposer's) and sample the first token: its Block."""
        return run_steps(self.start_steps(engine, seq))

    def start_steps(self, engine, seq):
        """`start` one prefill forward at a time (see `Engine.prefill_steps`): the target's, then a
        draft model's (a proposer with `begin_steps`; the others' prompt work is one step)."""
        prop, st = self.proposer, seq.draft
        hidden_last = yield from engine.prefill_steps(seq, max_reuse=prop.reusable_prefix(st, seq.prompt))
        logits = engine.model.logits(hidden_last)
        x0 = seq.sampler.sample(logits[0], seq.history)
        if hasattr(prop, "begin_steps"):
            yield from prop.begin_steps(st, seq.prompt, seq.prompt_hidden, seq.cached_n, engine.prefill_chunk)
        else:
            prop.begin(st, seq.prompt, seq.prompt_hidden, seq.cached_n)
        seq.history.append(x0)
        seq.x0 = x0
        if self.cfg.policy == "cost":
            chain = getattr(self.proposer, "names", None)
            seq.policy = ChainPolicyState(len(chain), self._calib) if chain else PolicyState(base=self._calib[0])
            self._costs(engine, seq)  # measured at this depth before the first step, if not yet
        return seq.block([x0], 0, logits)

    def _cost_key(self):
        c = self.cfg
        return (c.label(), tuple(getattr(self.proposer, "names", ())), c.mtp_head, c.draft_model)

    def _costs(self, engine, seq, decoding: bool = False):
        """This depth's costs for the cost policy, timed on first use of the model at this depth band
        (`decoding`: as the sequence's decoding crosses into it; `StepCosts.needs`)."""
        table = step_costs(engine)
        n_rows, depth = self.cfg.num_speculative_tokens + 1, seq.slot.cache.length
        if table.needs(depth, n_rows, self._cost_key(), decoding):
            table.measure(engine, seq, n_rows, self.proposer, self._cost_key())
        seq.costs = table.get(depth, n_rows, self._cost_key())

    def plan(self, seq, engine=None, batch: int = 1) -> list[int] | None:
        """This step's rows for `seq`: x0 and its drafts. `batch`: how many sequences share the
        step's forward (the scheduler's; with `engine`, the cost policy prices rows in that batch)."""
        rows = self.plan_batch([seq], engine, batch)[0]
        if isinstance(rows, BaseException):
            raise rows
        return rows

    def plan_batch(self, seqs: list, engine=None, batch: int | None = None) -> list:
        """`plan` for sequences that share one step (`batch`: all the step's sequences, default
        these): each one's draft length from its own record and costs, then one drafting pass for
        all of them where the proposer has one (`propose_batch`: the head's weights read once per
        draft position, each sequence's drafts exactly those it drafts alone), then, under the cost
        policy with several sequences in the step, the cut of the drafts that do not pay for the
        whole step (`_fit_to_batch`). -> per sequence its rows, None where its context is full, or
        the exception its planning raised (it fails that sequence only)."""
        batch = len(seqs) if batch is None else batch
        cfg = self.cfg
        plans: list = []
        for seq in seqs:
            try:
                plans.append(self._limit(seq, engine, batch))
            except Exception as e:  # noqa: BLE001 - this sequence's fault only
                plans.append(e)
        ms = [0.0] * len(seqs)
        ok = [i for i, pl in enumerate(plans) if isinstance(pl, tuple)]
        # a chain priced member by member (pl[2], its costs) or one proposer with its keep rule
        chained = [i for i in ok if plans[i][2] is not None]
        single = [i for i in ok if plans[i][2] is None and plans[i][0] > 0]
        together = []
        for group, batched in ((chained, "propose_priced_batch"), (single, "propose_batch")):
            if len(group) < 2 or not hasattr(self.proposer, batched):
                continue
            args = ([seqs[i].draft for i in group], [seqs[i].history for i in group], [plans[i][0] for i in group],
                    [seqs[i].draft_sampler for i in group], cfg.p_min, cfg.p_cum)
            t0 = time.perf_counter()
            shares = [0.0] * len(group)
            try:
                if group is chained:  # each member's pass split among the sequences it drafted for
                    got = self.proposer.propose_priced_batch(*args, [seqs[i].policy for i in group],
                                                             [plans[i][2] for i in group], shares)
                else:
                    got = self.proposer.propose_batch(*args, [plans[i][1] for i in group])
                    shares = [(time.perf_counter() - t0) * 1e3 / len(group)] * len(group)  # the pass's time, shared
            except Exception:  # noqa: BLE001 - find whose it is: each one alone below
                continue
            for i, pending, m in zip(group, got, shares):
                if isinstance(pending, BaseException):  # that sequence's own failure (a chain's member alone)
                    plans[i] = pending
                else:
                    seqs[i].pending = pending
                ms[i] = m
            together += group
        for i, (seq, pl) in enumerate(zip(seqs, plans)):
            if not isinstance(pl, tuple) or i in together:
                continue
            k, keep, costs = pl
            t0 = time.perf_counter()
            try:
                if costs is not None:  # a chain: each member priced on its own record
                    seq.pending = self.proposer.propose_priced(seq.draft, seq.history, k, seq.draft_sampler,
                                                               cfg.p_min, cfg.p_cum, seq.policy, costs)
                else:
                    seq.pending = self.proposer.propose(seq.draft, seq.history, k, seq.draft_sampler,
                                                        cfg.p_min, cfg.p_cum, keep=keep) if k > 0 else ([], [])
            except Exception as e:  # noqa: BLE001
                plans[i] = e
            ms[i] = (time.perf_counter() - t0) * 1e3
        for seq, pl, m in zip(seqs, plans, ms):
            if isinstance(pl, tuple):
                seq.stats.draft_ms += m
                seq.step_draft_ms = m
                if cfg.policy == "cost" and seq.costs is not None and engine is not None:
                    self._observe_draft(engine, seq, m, batch)  # per drafted token, verified or not
        if cfg.policy == "cost" and engine is not None and batch > 1:
            self._fit_to_batch([s for s, pl in zip(seqs, plans) if isinstance(pl, tuple)], engine, batch)
        return [pl if not isinstance(pl, tuple) else [seq.x0] + seq.pending[0] for seq, pl in zip(seqs, plans)]

    @staticmethod
    def _fit_to_batch(seqs: list, engine, batch: int) -> None:
        """Cut the step's drafts to those that pay for the whole batch's step (`policy.batch_rows`
        on the batch's timed table): each sequence drafted what would pay at the price of a row
        inside a tile of the kernels; the first row past one sequence each may cost more. Which
        drafts are verified still depends on the drafts and past steps only: lossless."""
        live = [s for s in seqs if s.pending[0] and s.costs is not None]
        if not live:
            return
        fixed = sum(len(s.pending[0]) for s in seqs if s.pending[0] and s.costs is None)  # not priced: all verified
        tab = step_costs(engine).batch_table(max(s.slot.cache.length for s in live), batch)
        if tab is None:
            return

        def seconds(rows: int) -> float:
            i = rows - batch
            return tab[max(i, 0)] if i < len(tab) else math.inf

        gains, musts = [], []
        for s in live:
            pol, n = s.policy, len(s.pending[0])
            rec = pol.members[pol.active] if isinstance(pol, ChainPolicyState) and pol.active is not None else pol
            g = list(getattr(rec, "gains", [])[:n])
            gains.append(g if len(g) == n else [1.0] * n)
            musts.append(min(rec.must, n) if len(g) == n else n)  # drafts it cannot price: all verified
        for s, m in zip(live, batch_rows(batch, gains, musts, seconds, fixed)):
            d, q = s.pending
            if m < len(d):
                s.pending = (d[:m], q[:m])

    def _limit(self, seq, engine, batch: int):
        """How many drafts `seq` asks for this step -> (k, keep rule, a chain's `Costs` or None), or
        None when its context is full."""
        cache, cfg = seq.slot.cache, self.cfg
        # verification stores x0 + drafts, and the emitted token must still fit: total <= n_ctx
        room = cache.max_len - cache.length - 2
        if room < 0:
            return None
        # a step emits at most k + 1 tokens: drafts past the tokens still allowed are never used
        left = seq.params.max_tokens - (len(seq.history) - len(seq.prompt))
        k = max(0, min(seq.k, room, left - 1))
        costs = seq.costs
        if cfg.policy != "cost" or costs is None:
            return k, None, None
        if engine is not None:
            table = step_costs(engine)
            costs = table.get(cache.length, len(costs.rows), self._cost_key(), batch) or costs  # as steps showed
            if batch > 1:
                costs = table.batch_costs(engine, seq, batch, len(costs.rows), costs)
        if isinstance(seq.policy, ChainPolicyState):  # each member priced on its own record
            return k, None, costs
        return CostPolicy.limit(seq.policy, costs, k), CostPolicy.keeper(seq.policy, costs), None

    def _observe_draft(self, engine, seq, ms: float, batch: int) -> None:
        """This step's drafting time into the cost table, when a timed proposer drafted (n-gram
        lookup is free and priced so). Time it spent without keeping a draft is carried to its next
        draft. A head's catch-up (the cache entries of the tokens accepted or decoded plainly since
        it last drafted) is not a cost of this step's drafts: it grows with the plain steps before
        them, so priced per drafted token it made a request that had decoded plainly for a while
        see drafting as dearer the longer it had waited, and its probes could not bring the price
        back down."""
        take = getattr(self.proposer, "take_catchup_ms", None)
        if take is not None:
            ms = max(0.0, ms - take(seq.draft))
        n = len(seq.pending[0])
        prop = self.proposer
        if isinstance(seq.policy, ChainPolicyState):
            i = seq.policy.active
            prop = None if i is None else prop.proposers[i]
        if n and prop is not None and not hasattr(prop, "probe_ms"):
            return
        seq.draft_carry_ms += ms
        if n:
            step_costs(engine).observe_draft(self._cost_key(), seq.slot.cache.length, seq.draft_carry_ms, n, batch)
            seq.draft_carry_ms = 0.0

    def commit(self, engine, seq, hidden: torch.Tensor, forward_ms: float = 0.0,
               logits: torch.Tensor | None = None) -> Block:
        """hidden [1 + len(drafts), D]: the target's states of this step's rows (already in its cache);
        `logits`, theirs when the caller computed them with other sequences' (the scheduler)."""
        t0 = time.perf_counter()
        drafts, qs = seq.pending
        if logits is None:  # a step of this sequence alone: its forward and logits time its pace
            logits = engine.model.logits(hidden)
            if self.cfg.policy == "cost" and seq.costs is not None:
                step_costs(engine).observe_pace(seq.slot.cache.length - hidden.shape[0], hidden.shape[0],
                                                forward_ms / 1e3 + time.perf_counter() - t0)
        n, y = accept_drafts(logits, drafts, qs, seq.sampler, seq.history)
        seq.slot.cache.trim(len(drafts) - n)  # the one rollback: KV entries and recurrent state alike
        seq.slot.tokens.extend([seq.x0] + drafts[:n])
        t1 = time.perf_counter()
        new = drafts[:n] + [y]
        seq.history.extend(new)
        self.proposer.accept(seq.draft, seq.history, n, hidden[: n + 1])
        stats = seq.stats
        stats.record(len(drafts), n, getattr(seq.draft, "last", None))
        stats.draft_ms += (time.perf_counter() - t1) * 1e3
        stats.verify_ms += forward_ms + (t1 - t0) * 1e3
        cfg = self.cfg
        if cfg.policy == "cost" and seq.costs is not None:
            seq.policy.observe(seq.policy.confs[:len(drafts)], n)
        if cfg.policy == "adaptive" and drafts:
            if n == len(drafts) == seq.k:
                seq.k = min(seq.k + 1, cfg.num_speculative_tokens)
            elif n == 0:
                seq.k = max(seq.k - 1, cfg.min_speculative_tokens)
        seq.x0 = y
        seq.pending = ([], [])
        if cfg.policy == "cost" and depth_band(seq.slot.cache.length) != depth_band(seq.slot.cache.length - n - 1):
            self._costs(engine, seq, decoding=True)  # a deeper band: its own costs, or the band below's
        return seq.block(new, n, logits)
