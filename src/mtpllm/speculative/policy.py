"""The draft length chosen step by step from costs and expected acceptance (`policy: "cost"`).

A step that verifies k drafts emits E(k) = 1 + a1 + a1 a2 + ... + a1..ak tokens on average
(a_i: the chance that draft i is accepted once drafts 1..i-1 were) and costs
C(k) = T(k + 1 rows) / T(1 row) + k * d (d: drafting one token, in units of a one-row step).
The policy picks the k with the most tokens per unit of time, E(k) / C(k); k = 0 is a plain step,
E = C = 1, so a draft is verified only when it is expected to pay for its rows.

The three inputs:

- costs: the target's forward (with its logits) timed on this machine at 1..K+1 rows, at the
  sequence's own depth (attention grows with the cache, so the table is re-measured each time the
  depth doubles; `StepCosts`), and one drafted token of the proposer (`proposer.probe_ms`). Each
  is measured once per model and depth band and cached, before a request's first token; where
  decoding crosses into a band not yet timed whose lower neighbour is, that one prices its steps
  (`StepCosts.needs`). Decoding then corrects both with what its steps really cost
  (`observe_draft`, `observe_step`): drafting as the requests run it (its Python included,
  which one timed token leaves out; the head's catch-up over the tokens accepted since it last
  drafted left out, as it grows with the plain steps before a draft; priced against one
  sequence's steps as they run, `observe_pace`, so load on the machine that slows both does not
  make drafting look dearer), and,
  for steps several sequences share, the whole step's wall time (its bookkeeping included) at the
  row counts it ran. Where a batch's drafting or rows cost more than timed, the policy drafts less.
- the head's confidence: the probability it gives each draft. Before a draft is kept, its
  expected acceptance is that probability times this request's calibration at its position
  (accepted / sum of confidences so far; heads are over-confident at long contexts they were not
  trained on), pulled by CALIB_N observations towards the calibration the decoder's earlier
  requests showed for that proposer (`Calibration`; n-gram lookup says 1 for every draft), and
  drafting stops at the first draft whose expected tokens do not pay its row.
- this request's acceptance: per position, the (discounted) share of verified drafts accepted.
  Before drafting, when even the best k on that record does not beat a plain step, the step is
  plain and nothing is drafted. A single-draft probe every few plain steps (4, doubling up to 64
  while probes fail or do not pay) notices when the drafts become good again. Where even drafts
  sure to be accepted would not pay for their rows, nothing is drafted at all. Past the drafts the
  keep rule stops at, the record of the next position only learns when that position is verified:
  one rejection there (a rare thing for a lookup that is copying a file) would otherwise stop every
  later step short of it for the rest of the request. So now and then (after 4 verifications,
  doubling up to 64 while these extensions are rejected) one draft past that point is verified too,
  in steps of one sequence (a shared step's plan prices every draft again, `batch_rows`).

A chain (n-gram lookup first, MTP otherwise) keeps one record per member (`ChainPolicyState`), so
each member's drafts are priced by its own acceptance. Lookup costs nothing to propose, so it is tried
before any gate: a match's drafts then pass the same tests as a head's, at confidence 1 calibrated by
lookup's record and at no drafting cost; only where there is no match (or none of it is worth its
rows) does the next member plan its step.

Losslessness does not depend on any of this: which drafts are verified is decided from the drafts
and past steps only, never from the target's distribution at the verified positions.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..models.base import step_logits

GAMMA = 0.9  # discount of a position's older observations per new one (~10 of memory)
PRIOR = 0.6  # acceptance assumed before any verification, weight PRIOR_N observations
PRIOR_N = 2.0
CALIB_N = 2.0  # observations' worth of the calibration a request starts from (`Calibration`)
CROSS_GAMMA = 0.99  # discount of a proposer's older verified drafts across requests (~100 of memory)
PROBE_MIN, PROBE_MAX = 4, 64  # plain steps between single-draft probes while drafts do not pay
DEPTH_BAND0 = 512  # depths below this share one cost table; each doubling beyond gets its own
DEFAULT_DRAFT = 0.05  # draft cost per token (step units) when the proposer cannot be timed
REPS = 3  # timings per row count (the fastest is kept)
# From this depth on the row counts are timed in one pass, after one untimed forward (the first at
# a depth pays for cold caches), where three passes over 1..9 rows added ~1.5 s (the 0.5B at 8K
# positions) to ~4 s (the 1.5B at 8K, the 0.5B at 32K) before the first generated token. One pass
# on a busy machine can misorder single counts (the 1.5B at 8K: 1.21 for 2 rows and for 3, where
# medians of 7 gave 1.09 and 1.45), so there the counts from 2 rows on are put on their least-squares
# line (attention, linear in the rows, is most of a step that deep; `_deep_rows`), and one row,
# which every other count is divided by, is timed twice. Shallower, where a timing is short and
# the kernels' tiles make the rows far from a line, the fastest of REPS passes is kept.
LONG_TIMING_DEPTH = 4096
BATCH_REPS = 1  # the same for a batch's table: the shared steps' observed times correct it (`observe_step`)
OBSERVE_WEIGHT = 0.1  # weight of one observed step in the running estimates (~10 steps of memory)


def depth_band(depth: int) -> int:
    """0 for depth < 512, then 1 per doubling: [512, 1024) -> 1, [1024, 2048) -> 2, ..."""
    return max(0, int(depth).bit_length() - (DEPTH_BAND0.bit_length() - 1))


def expected_tokens(acc: list[float]) -> list[float]:
    """E(k) for k = 0..len(acc): tokens a step emits when it verifies k drafts."""
    out, e, p = [1.0], 1.0, 1.0
    for a in acc:
        p *= a
        e += p
        out.append(e)
    return out


def best_k(acc: list[float], rows: list[float], draft: float) -> int:
    """The k in 0..min(len(acc), len(rows) - 1) with the most tokens per unit of time.
    acc[i]: chance that draft i + 1 is accepted given the earlier ones were; rows[r - 1]: the cost
    of an r-row step relative to one row (rows[0] == 1); draft: cost of drafting one token."""
    e = expected_tokens(acc)
    best, best_rate = 0, 1.0 / rows[0]
    for k in range(1, min(len(acc), len(rows) - 1) + 1):
        rate = e[k] / (rows[k] + draft * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def _deep_rows(t: dict[int, float], n: int) -> list[float]:
    """Row costs relative to one row from one pass deep in a context (`LONG_TIMING_DEPTH`): t[r]
    the seconds of r rows, r = 1..n; rows 2..n on their least-squares line (never falling with the
    rows, never below the row before)."""
    one = max(t[1], 1e-9)
    rel = [t[r] / one for r in range(1, n + 1)]
    if n < 3:
        return [1.0] + [max(1.0, x) for x in rel[1:]]
    xs = range(2, n + 1)
    xm, ym = sum(xs) / len(xs), sum(rel[1:]) / len(xs)
    slope = max(0.0, sum((x - xm) * (y - ym) for x, y in zip(xs, rel[1:])) / sum((x - xm) ** 2 for x in xs))
    out = [1.0]
    for x in xs:
        out.append(max(out[-1], ym + slope * (x - xm)))
    return out


def keeps(i: int, a: float, e: float, p: float, rows: list[float], draft: float) -> bool:
    """Whether draft i (0-based), accepted with chance a once drafts 0..i-1 (which give e expected
    tokens, all accepted with chance p) are, is worth its verification row. The draft's own cost is
    spent already and counts on both sides."""
    if i + 1 >= len(rows):
        return False
    spent = draft * (i + 1)
    return (e + p * a) / (rows[i + 1] + spent) > e / (rows[i] + spent)


@dataclass
class Costs:
    rows: list[float]  # cost of r rows relative to one, r = 1..len
    draft: float  # drafting one token, relative to a one-row step
    step_ms: float = 0.0  # the one-row step measured
    batch: int = 1  # sequences sharing the step these rows are priced in


class BatchTable:
    """Seconds of a step that n sequences share at every total row count n, n + 1, ... (index
    R - n): the timed estimate, corrected by the steps that run. A count that steps have run is
    priced at their running mean (the price it had before counts as one observation). A count no
    step has run is priced at its timed time plus an error read off the counts that have run:
    between two of them, on the line between their errors; above the highest, that count's error
    (what every step adds to its timed forward, its bookkeeping for one: the counts that run often
    cannot make the ones never run look cheap); below the lowest, that count's error scaled by the
    rows (a step with fewer rows is not assumed to carry all the extra time of one with more: a
    batch whose timed rows were too cheap and that only ever ran its highest count would otherwise
    see every count as dear as that one, and never try fewer rows to learn that they cost less)."""

    def __init__(self, timed: list[float], n: int = 1):
        self.timed = list(timed)
        self.now = list(timed)
        self.n = max(1, int(n))  # rows at index 0 (one per sequence)
        self.hits = [0] * len(self.timed)  # steps observed at each count

    def __len__(self) -> int:
        return len(self.now)

    def seconds(self) -> list[float]:
        seen = [i for i, h in enumerate(self.hits) if h]
        if not seen:
            return list(self.timed)
        err = {i: self.now[i] - self.timed[i] for i in seen}
        lo, hi, out, j = seen[0], seen[-1], [], 0
        for i, t in enumerate(self.timed):
            if i in err:
                out.append(self.now[i])
                continue
            if i < lo:
                e = err[lo] * (self.n + i) / (self.n + lo)
            elif i > hi:
                e = err[hi]
            else:
                while seen[j + 1] < i:
                    j += 1
                a, b = seen[j], seen[j + 1]
                e = err[a] + (err[b] - err[a]) * (i - a) / (b - a)
            out.append(max(t + e, 1e-9))
        return out

    def observe(self, i: int, seconds: float, weight: float) -> None:
        if not self.hits[i]:
            self.now[i] = self.seconds()[i]
        self.hits[i] += 1
        w = max(weight, 1.0 / (self.hits[i] + 1))
        self.now[i] = max(self.now[i] + w * (seconds - self.now[i]), 1e-9)


class StepCosts:
    """The costs of one model on this machine by depth band: measured on first use (`measure`), or
    given (`fixed`: the same at every depth, never timed)."""

    def __init__(self, fixed: Costs | None = None):
        self.fixed = fixed
        self.rows: dict[int, tuple[list[float], float]] = {}  # band -> (row costs, one-row ms)
        self.draft_ms: dict[tuple, float | None] = {}  # (proposer key, band) -> ms per drafted token
        self.draft_seen: dict[tuple, float] = {}  # the same, as decoding observes it (running mean)
        self.batch: dict[tuple, BatchTable] = {}  # (band, sequences n) -> seconds at n, n + 1, ... rows
        self.pace: dict[int, float] = {}  # band -> one sequence's steps as they run / as timed (running mean)
        self.timings = 0  # measurements run (observability, tests)
        self.observed = 0  # steps observed into the batch tables (observability, tests)

    def get(self, depth: int, n_rows: int, key, batch: int = 1) -> Costs | None:
        """The costs at this depth (the deepest band measured at or below it); drafting as steps of
        `batch` sequences observed it, else as timed."""
        if self.fixed is not None:
            return self.fixed
        b = self._band(depth, n_rows)
        if b is None:
            return None
        rows, ms = self.rows[b]
        seen = self.draft_seen.get((key, b, batch))
        if seen is not None:  # drafting as steps ran it, against the steps as they ran
            now = ms * self.pace.get(b, 1.0)
            return Costs(rows[:n_rows], seen / now, now)
        d_ms = self.draft_ms.get((key, b))
        return Costs(rows[:n_rows], DEFAULT_DRAFT if d_ms is None else d_ms / ms, ms)

    def _band(self, depth: int, n_rows: int) -> int | None:
        """The deepest band measured at or below this depth with at least n_rows row costs."""
        band = depth_band(depth)
        measured = [b for b in self.rows if b <= band and self._has_rows(b, n_rows)]
        return max(measured) if measured else None

    def _has_rows(self, band: int, n_rows: int) -> bool:
        got = self.rows.get(band)
        return got is not None and len(got[0]) >= n_rows

    def observe_pace(self, depth: int, n_rows: int, seconds: float) -> None:
        """A step of one sequence (`n_rows` rows at this depth) took `seconds`, forward and logits:
        its ratio to the timed cost of those rows moves the band's pace (a running mean, 1 until
        observed). Observed drafting is priced against the steps as observed (`get`): drafting
        and steps slow down together when another process takes the cores, while the rows were
        timed once, maybe on a quiet machine; priced against those, drafting would look dearer
        the busier the machine, and the policy would stop drafting for as long as the load lasts."""
        if self.fixed is not None or not seconds > 0 or n_rows < 1:
            return
        b = self._band(depth, n_rows)  # the table `get` prices this depth with (`needs`: a band below)
        if b is None:
            return
        rows, ms = self.rows[b]
        ratio = seconds * 1e3 / (rows[n_rows - 1] * ms)
        old = self.pace.get(b, 1.0)
        self.pace[b] = old + OBSERVE_WEIGHT * (ratio - old)

    def observe_draft(self, key, depth: int, ms: float, n_drafted: int, batch: int = 1) -> None:
        """A step's drafting as it ran: `ms` for `n_drafted` tokens, what the proposer did for them
        (a head's catch-up over the tokens accepted since it last drafted taken out by the caller,
        `SpeculativeDecoder._observe_draft`; in a step of `batch` sequences drafted together, this
        sequence's share). Blended into the running cost per drafted token at the band `get` prices
        this depth with and this batch size, which `get` uses from then on (the one timed token,
        `proposer.probe_ms`, is where it starts)."""
        if self.fixed is not None or n_drafted <= 0 or not ms >= 0:
            return
        band = self._band(depth, 1)  # where `get` reads it
        band = depth_band(depth) if band is None else band
        per = ms / n_drafted
        old = self.draft_seen.get((key, band, batch), self.draft_ms.get((key, band)))
        self.draft_seen[(key, band, batch)] = per if old is None else old + OBSERVE_WEIGHT * (per - old)

    def observe_step(self, depths: list[int], n_rows: int, seconds: float) -> None:
        """A step that `len(depths)` sequences shared (their cache depths), `n_rows` rows in all,
        took `seconds` (its forward, logits and bookkeeping; drafting not included): the batch
        table of each of their depth bands moves its time at `n_rows` towards it (a running mean),
        and prices the counts no step has run from it (`BatchTable`), so the table follows what
        steps of this batch really cost on this machine now."""
        n = len(depths)
        if self.fixed is not None or n <= 1 or not seconds > 0 or OBSERVE_WEIGHT <= 0:
            return
        for band in {depth_band(d) for d in depths}:
            tab = self.batch.get((band, n))
            i = n_rows - n
            if tab is None or i < 0 or i >= len(tab):  # a stored table is finite at every count
                continue
            tab.observe(i, seconds, OBSERVE_WEIGHT)
            self.observed += 1

    def needs(self, depth: int, n_rows: int, key, decoding: bool = False) -> bool:
        """Whether this depth's band has to be timed for n_rows rows and the proposer `key`.
        `decoding`: asked as a decoding sequence crosses into the band. Timing the rows there would
        stop its tokens, and those of every sequence sharing its steps, for the 1-4 s of the
        forwards (the 1.5B at 8K positions: ~2 s in the middle of a streamed answer), so where the
        band directly below is timed, that band prices the steps (its pace and drafting follow them
        as they run) until a request starts in this band and times it before its first token. A
        band two or more below is not trusted that deep: then the rows are timed there and then
        (and a shared step's batch table, `batch_costs`, is timed where its band has none). Where
        only the proposer is missing, its one drafted token is timed (a few milliseconds)."""
        if self.fixed is not None:
            return False
        band = depth_band(depth)
        if self._has_rows(band, n_rows):
            return (key, band) not in self.draft_ms
        below = band - 1
        return not (decoding and below >= 0 and self._has_rows(below, n_rows) and (key, below) in self.draft_ms)

    @staticmethod
    @torch.inference_mode()
    def _time_rows(engine, seq, counts: list[int], reps: int):
        """Fastest of `reps` timings of the target's forward + logits at each row count on the
        sequence's own cache (rolled back after each) -> ({count: seconds}, the 1-row hidden state)."""
        cache = seq.slot.cache
        from ..runtime.kv_cache import KVCache
        by_trim = type(cache) is KVCache and not any(cache.ring)
        model, dev = engine.model, engine.device
        best = {r: math.inf for r in counts}
        hidden = None
        for _ in range(reps):
            for r in counts:
                snap = None if by_trim else cache.snapshot()
                t0 = time.perf_counter()
                h = model(torch.full((r,), int(seq.x0), dtype=torch.long, device=dev), cache)
                step_logits(model, h)  # as the scheduler computes a batched step's logits
                best[r] = min(best[r], time.perf_counter() - t0)
                if by_trim:
                    cache.trim(r)
                else:
                    cache.restore(snap)
                if r == 1:
                    hidden = h
        return best, hidden

    def batch_costs(self, engine, seq, n_seqs: int, n_rows: int, base: Costs) -> Costs:
        """The costs of a step that `n_seqs` sequences share, as one sequence's plan sees them:
        rows[r - 1] = (T(n) + n (r - 1) m) / T(n), m the time of one more row once the step has more
        rows than sequences (the batch table's slope from n + 1 to 2 n rows), as if every sequence
        verified as many rows as this one (each one's rows delay all n: then each one's tokens per
        unit of time is E(k) / (rows[k] + k d n T(1) / T(n))). The first row past n can cost more
        than m (the kernels run rows in tiles: a new tile decodes the weights again); whether a step
        opens one is decided for the whole batch after drafting (`batch_rows`, on `batch_table`),
        so a sequence drafts what would pay at m. Row counts the caches cannot hold cost infinity
        (never chosen)."""
        if self.fixed is not None or n_seqs <= 1:
            return base
        cache, n = seq.slot.cache, n_seqs
        got = self.batch_table(cache.length, n)
        if got is None or len(got) < n * (n_rows - 1) + 1:
            got = self._time_batch(engine, seq, n, n_rows)
            if got is None:
                return base
        one = max(got[0], 1e-9)
        inner = (got[n] - got[1]) / (n - 1) if len(got) > n else math.inf  # per row from n + 1 to 2 n
        inner = max(inner, 0.0) if math.isfinite(inner) else math.inf
        # every sequence's rows delay all n of them: priced as if each verified as many (n (r - 1) rows)
        rows = [1.0] + [(got[0] + n * (r - 1) * inner) / one
                        if n * r - n < len(got) and math.isfinite(got[n * r - n]) else math.inf
                        for r in range(2, n_rows + 1)]
        return Costs(rows, base.draft * n_seqs * base.step_ms / (one * 1e3), one * 1e3, n_seqs)

    def _time_batch(self, engine, seq, n: int, n_rows: int) -> list[float] | None:
        """The batch table of n sequences at this sequence's depth band (seconds at every total row
        count n .. n n_rows), timed on its cache at n, n + 1 and 2 n rows only (every sequence of
        the batch waits for these forwards: timing every count up to n (k + 1), 72 rows for 8
        sequences and lookup's 8 drafts, stalled a fresh server's first batch of 8 for ~14 s on a
        2-core VM): n + 1 .. 2 n on the line from the time at n + 1 to 2 n (a tile of n rows, as
        on a machine whose kernels take 8 rows per tile with 8 sequences), past 2 n the average
        slope from n to 2 n. Stored (and then corrected by the steps that run, `observe_step`)
        only when the cache had room for every count; None when it has no room for n rows."""
        cache = seq.slot.cache
        cap = cache.max_len - cache.length - 1
        counts = sorted({c for c in ((n, n + 1, 2 * n) if n_rows > 1 else (n,)) if c <= cap})
        if n > cap or seq.x0 is None:
            return None
        t, _ = self._time_rows(engine, seq, counts, BATCH_REPS)
        t1, tj, t2 = t[n], t.get(n + 1, math.inf), t.get(2 * n, math.inf)
        finite = math.isfinite(tj) and math.isfinite(t2)
        inner = max(t2 - tj, 0.0) / (n - 1) if finite else math.inf
        outer = max(t2 - t1, 0.0) / n if finite else math.inf
        got = []
        for r in range(n, n * n_rows + 1):
            if r > cap:
                got.append(math.inf)
            elif r == n:
                got.append(t1)
            elif r == n + 1:
                got.append(tj)
            elif r <= 2 * n:
                got.append(tj + (r - n - 1) * inner)
            else:
                got.append(t2 + (r - 2 * n) * outer)
        self.timings += 1
        if all(math.isfinite(x) for x in got):  # a cache short of room says nothing of the rows it could not hold
            self.batch[(depth_band(cache.length), n)] = BatchTable(got, n)
        return got

    def batch_table(self, depth: int, n_seqs: int) -> list[float] | None:
        """Seconds of a step of `n_seqs` sequences at n_seqs, n_seqs + 1, ... rows in all, at this
        depth band, as the steps run have corrected it (None: not timed)."""
        tab = self.batch.get((depth_band(depth), n_seqs))
        return None if tab is None else tab.seconds()

    @torch.inference_mode()
    def measure(self, engine, seq, n_rows: int, proposer, key, reps: int = REPS) -> bool:
        """Time the target's forward + logits at 1..n_rows rows on the sequence's own cache (rolled
        back after each), and one drafted token of the proposer. False when the cache has no room."""
        cache = seq.slot.cache
        n_rows = min(n_rows, cache.max_len - cache.length - 1)
        if n_rows < 1 or seq.x0 is None:
            return False
        band = depth_band(cache.length)
        timed = not self._has_rows(band, n_rows)  # else only the proposer is timed
        deep = cache.length >= LONG_TIMING_DEPTH
        counts = list(range(1, (n_rows if timed else 1) + 1))
        if timed and deep:
            self._time_rows(engine, seq, [1], 1)  # untimed: see LONG_TIMING_DEPTH
            counts.append(1)  # one row twice (the fastest kept): every count is divided by it
        t, hidden = self._time_rows(engine, seq, counts, reps if timed and not deep else 1)
        if timed:
            one = max(t[1], 1e-9)
            rows = _deep_rows(t, n_rows) if deep else [t[r] / one for r in range(1, n_rows + 1)]
            self.rows[band] = (rows, one * 1e3)
        probe = getattr(proposer, "probe_ms", None)
        if probe is None:  # n-gram lookup: nothing worth timing
            self.draft_ms[(key, band)] = 0.0
        else:
            ms = [m for m in (probe(seq.draft, hidden, int(seq.x0)) for _ in range(reps)) if m is not None]
            self.draft_ms[(key, band)] = min(ms) if ms else None  # None: not timed (DEFAULT_DRAFT)
        self.timings += 1
        return True


_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def step_costs(engine) -> StepCosts:
    """The engine's model's cost table (one per model, shared by every decoder built on it)."""
    c = _COSTS.get(engine.model)
    if c is None:
        c = _COSTS[engine.model] = StepCosts()
    return c


def set_step_costs(engine, rows: list[float] | None, draft: float = 0.0) -> None:
    """Give the engine's model fixed costs instead of measured ones (rows[r - 1]: r rows relative to
    one; draft: one drafted token), or None to measure again."""
    _COSTS[engine.model] = StepCosts(None if rows is None else Costs([float(x) for x in rows], float(draft)))


def batch_rows(n_rows: int, gains: list[list[float]], musts: list[int], seconds, fixed: int = 0) -> list[int]:
    """How many of each sequence's drafts a step that several sequences share verifies.
    n_rows: the step's rows without drafts (one per sequence); gains[j][i]: the tokens draft i of
    sequence j is expected to add (the chance that it and every earlier draft of j are accepted:
    non-increasing in i); musts[j]: its leading drafts verified whatever they cost (a probe);
    seconds(R): the step's time at R rows in all; fixed: draft rows of the step that this plan does
    not cut (counted in its rows, not in its tokens). Drafts join in order of gain, and the count
    with the most expected tokens per second wins: a row that opens a new tile of the kernels
    costs more than the rows after it, so a few drafts alone may not pay where more would
    (and the step stays plain where none would). -> per sequence, how many of its drafts."""
    tokens = float(n_rows) + sum(sum(g[:m]) for g, m in zip(gains, musts))
    rows = n_rows + fixed + sum(musts)
    order = sorted(((g[i], i, j) for j, g in enumerate(gains) for i in range(musts[j], len(g))),
                   key=lambda x: (-x[0], x[1], x[2]))
    best, best_rate = 0, tokens / seconds(rows)
    for n, (gain, _, _) in enumerate(order, 1):
        tokens += gain
        rate = tokens / seconds(rows + n)
        if rate > best_rate:
            best, best_rate = n, rate
    keep = list(musts)
    for _, i, j in order[:best]:
        keep[j] = max(keep[j], i + 1)
    return keep


class Calibration:
    """What one proposer's confidence was worth across the requests a decoder served: per draft
    position, discounted sums (CROSS_GAMMA per new verification) of the confidences of its verified
    drafts and of its accepted ones. A request's record starts from this calibration (accepted per
    unit of confidence) instead of taking the proposer at its word: n-gram lookup gives every draft
    confidence 1 while far fewer of its drafts are accepted, so a request that began at face value
    verified runs of lookup drafts it expected all of."""

    def __init__(self):
        self.accepted: list[float] = []
        self.confidence: list[float] = []

    def scale(self, i: int) -> float:
        """Accepted per unit of confidence at position i (all positions pooled while i's verified
        drafts add up to less than one unit of confidence), pulled towards face value (1) by
        CALIB_N units: one early rejection or one lucky low-confidence draft does not decide it."""
        a, c = (self.accepted[i], self.confidence[i]) if i < len(self.confidence) else (0.0, 0.0)
        if c < 1.0:
            a, c = sum(self.accepted), sum(self.confidence)
        return (a + CALIB_N) / (c + CALIB_N)

    def observe(self, confs: list[float], n_accepted: int) -> None:
        for i in range(min(len(confs), n_accepted + 1)):  # the positions verified
            if i == len(self.confidence):
                self.accepted.append(0.0)
                self.confidence.append(0.0)
            self.accepted[i] = self.accepted[i] * CROSS_GAMMA + (i < n_accepted)
            self.confidence[i] = self.confidence[i] * CROSS_GAMMA + confs[i]


@dataclass
class PolicyState:
    """One sequence's record: discounted counts per draft position; `base`: its proposer's
    calibration across requests (None: confidence taken at its word until this request's own
    record says otherwise)."""
    reached: list[float] = field(default_factory=list)  # verified with every earlier draft accepted
    accepted: list[float] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)  # sum of the head's confidence in those
    idle: int = 0  # plain steps since the last verified draft
    wait: int = PROBE_MIN  # plain steps before the next probe
    probing: bool = False
    probe_ok: bool = False  # the last probe's draft was accepted
    confs: list[float] = field(default_factory=list)  # confidences of this step's kept drafts
    gains: list[float] = field(default_factory=list)  # their expected tokens: P(accepted with all before)
    must: int = 0  # leading drafts verified whatever a batch's plan says (a probe: the record's only way to learn)
    gate: bool = True  # whether this step's record said drafting pays (else only a probe is drafted)
    # one draft past where the keep rule stops, verified now and then (its position's record only
    # learns from verified drafts): verifications since the last, how many to wait, and this step's
    ext_idle: int = 0
    ext_wait: int = PROBE_MIN
    ext_at: int | None = None  # the position of this step's extension, if it has one
    base: Calibration | None = None

    def _grow(self, n: int) -> None:
        while len(self.reached) < n:
            self.reached.append(0.0)
            self.accepted.append(0.0)
            self.confidence.append(0.0)

    def acceptance(self, k: int) -> list[float]:
        """Per position, this request's acceptance so far (PRIOR before any observation)."""
        self._grow(k)
        return [(self.accepted[i] + PRIOR_N * PRIOR) / (self.reached[i] + PRIOR_N) for i in range(k)]

    def calibrated(self, i: int, conf: float) -> float:
        """The chance that draft i is accepted, from the proposer's confidence in it and how this
        request's accepted drafts compared with that confidence so far."""
        self._grow(i + 1)
        base = 1.0 if self.base is None else self.base.scale(i)
        r, a, c = self.reached[i], self.accepted[i], self.confidence[i]
        if r < 0.5:  # hardly verified at this position yet: all positions together
            r, a, c = sum(self.reached), sum(self.accepted), sum(self.confidence)
        if r <= 0 or c <= 0:
            return min(1.0, max(0.0, conf * base))  # nothing verified: as earlier requests went
        # accepted / expected, in units of observations, pulled towards the base by CALIB_N of them
        scale = (a * r / c + CALIB_N * base) / (r + CALIB_N)
        return min(1.0, max(0.0, conf * scale))

    def observe(self, confs: list[float], n_accepted: int) -> None:
        """A verification of len(confs) drafts of which the first n_accepted were accepted."""
        n = len(confs)
        at, self.ext_at = self.ext_at, None
        if n == 0:
            self.idle += 1
            self.probing = False
            return
        if at is not None and at < n:  # an extension verified; if reached, how it went sets the wait
            if n_accepted >= at:
                self.ext_wait = PROBE_MIN if n_accepted > at else min(2 * self.ext_wait, PROBE_MAX)
            self.ext_idle = 0
        else:
            self.ext_idle += 1
        self._grow(n)
        if self.base is not None:
            self.base.observe(confs, n_accepted)
        for i in range(min(n, n_accepted + 1)):  # positions reached: older observations weigh less
            self.reached[i] *= GAMMA
            self.accepted[i] *= GAMMA
            self.confidence[i] *= GAMMA
            self.reached[i] += 1.0
            self.confidence[i] += confs[i]
            if i < n_accepted:
                self.accepted[i] += 1.0
        if self.probing:  # a rejected probe: probe half as often; an accepted one: see `limit`
            if n_accepted:
                self.probe_ok = True
            else:
                self.wait = min(2 * self.wait, PROBE_MAX)
        self.probing = False
        self.idle = 0


class ChainPolicyState:
    """A chain's records, one `PolicyState` per member; `active`: the member whose drafts this step
    verifies (None: a plain step). Members asked this step that did not draft have counted it as a
    plain step already (`skip`); `observe` records the verification on the member that drafted."""

    def __init__(self, n: int, bases: list[Calibration] | None = None):
        assert bases is None or len(bases) == n
        self.members = [PolicyState(base=b) for b in (bases or [None] * n)]
        self.active: int | None = None

    @property
    def confs(self) -> list[float]:
        return self.members[self.active].confs if self.active is not None else []

    def skip(self, i: int) -> None:
        self.members[i].observe([], 0)

    def observe(self, confs: list[float], n_accepted: int) -> None:
        if self.active is not None:
            self.members[self.active].observe(confs, n_accepted)
        self.active = None


class CostPolicy:
    """Plans a step for a sequence: `limit(state, costs, k_max)` -> how many drafts to ask for (0:
    a plain step), then `keep(...)` per draft while drafting; `observe` after verification."""

    @staticmethod
    def limit(st: PolicyState, costs: Costs, k_max: int) -> int:
        k_max = min(k_max, len(costs.rows) - 1)
        if k_max <= 0 or best_k([1.0] * k_max, costs.rows, costs.draft) == 0:
            return 0  # rows so dear that even drafts sure to be accepted would not pay
        # after `wait` plain steps the first draft is verified whatever its confidence says: the
        # record only learns from verified drafts
        st.probing = st.idle >= st.wait
        gate = best_k(st.acceptance(k_max), costs.rows, costs.draft) > 0
        if st.probe_ok:  # the last probe was accepted: probe often again only if drafting now pays
            st.probe_ok = False
            if gate:
                st.wait = PROBE_MIN
        st.gate = gate
        if gate:
            return k_max
        return 1 if st.probing else 0  # the record says plain: one draft now and then

    @staticmethod
    def keeper(st: PolicyState, costs: Costs):
        """The per-draft test for this step: keep(i, confidence) -> bool, recording kept confidences.
        Drafting starts at i = 0 (again, where a batched pass failed and a sequence drafts alone).
        One draft past the keep rule's last is kept after ext_wait verifications without one, in a
        step of this sequence alone: in a shared step the batch's plan prices every draft again
        and would cut it (and a head would have drafted it for nothing)."""
        st.confs, st.gains, st.must, st.ext_at = [], [], 0, None
        e = p = 1.0

        def keep(i: int, conf: float) -> bool:
            nonlocal e, p
            if i == 0:
                st.confs, st.gains, st.must, st.ext_at = [], [], 0, None
                e = p = 1.0
            if st.ext_at is not None:  # an extension is this step's last draft
                return False
            a = st.calibrated(i, conf)
            probe = st.probing and i == 0
            if not probe and not keeps(i, a, e, p, costs.rows, costs.draft):
                if (i == 0 or costs.batch > 1 or st.ext_idle < st.ext_wait or i + 1 >= len(costs.rows)
                        or not math.isfinite(costs.rows[i + 1])):
                    return False
                st.ext_at = i
            p *= a
            e += p
            st.confs.append(float(conf))
            st.gains.append(p)
            st.must += probe and not st.gate  # a probe the record asked for, not a first draft's pass
            return True
        return keep
