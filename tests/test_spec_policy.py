"""The cost policy's choice of draft length: the arithmetic on given costs and acceptances
(deterministic, nothing timed), its convergence to plain steps under bad drafts and to the full
draft length under good ones, and the same on tiny real models (costs given through
`set_step_costs`, the seam that replaces the timing)."""
import math

import pytest

from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.speculative import policy
from mtpllm.speculative import SpecConfig
from mtpllm.speculative.policy import (PROBE_MAX, BatchTable, batch_rows, Calibration, ChainPolicyState, CostPolicy, Costs,
                                       PolicyState, StepCosts, best_k, depth_band,
                                       expected_tokens, keeps, set_step_costs, step_costs)
from tiny import gpt2_vocab, make_tiny

GREEDY = dict(temperature=0, max_tokens=60, ignore_eos=True)
PROMPT = "the cat the cat the cat sat on the mat; the cat sat on the"


def test_expected_tokens_and_best_k_by_hand():
    assert expected_tokens([0.5, 0.5]) == [1.0, 1.5, 1.75]
    rows = [1.0, 1.1, 1.5, 2.0]
    # k = 1: 1.5 / 1.15 = 1.30 per unit; k = 2: 1.55 / 1.6 = 0.97; plain: 1
    assert best_k([0.5, 0.1, 0.1], rows, 0.05) == 1
    # drafts that are rarely accepted never beat a plain step: (1 + 0.1) / (1.1 + 0.05) < 1
    assert best_k([0.1, 0.1, 0.1], rows, 0.05) == 0
    # good drafts and cheap rows: k = 3 gives 1 + .9 + .81 + .729 = 3.44 tokens for 1.15 + .3
    assert best_k([0.9, 0.9, 0.9], [1.0, 1.05, 1.1, 1.15], 0.1) == 3
    # the same drafts where a row costs as much as a step: (1 + .9) / 2.1 < 1
    assert best_k([0.9, 0.9, 0.9], [1.0, 2.0, 3.0, 4.0], 0.1) == 0
    # never more than the rows measured
    assert best_k([0.9] * 5, [1.0, 1.05], 0.0) == 1


def test_keep_rule_is_the_break_even_of_one_more_row():
    rows, d = [1.0, 1.2, 1.4], 0.1
    # draft 0 pays when (1 + a) / (1.2 + .1) > 1 / (1 + .1), i.e. a > 1.3 / 1.1 - 1 = 0.1818...
    edge = (rows[1] + d) / (rows[0] + d) - 1
    assert keeps(0, edge + 1e-6, 1.0, 1.0, rows, d)
    assert not keeps(0, edge - 1e-6, 1.0, 1.0, rows, d)
    # beyond the rows measured nothing is kept
    assert not keeps(2, 1.0, 3.0, 1.0, rows, d)


def _run(policy_state, costs, k_max, steps, accept, conf=0.9):
    """Drive the policy: each step asks for a draft length, keeps drafts of confidence `conf` while
    the keep rule says so, and `accept(step, n_kept)` says how many the target accepted."""
    chosen = []
    for t in range(steps):
        k = CostPolicy.limit(policy_state, costs, k_max)
        keep = CostPolicy.keeper(policy_state, costs)
        n = 0
        while n < k and keep(n, conf):
            n += 1
        policy_state.observe(policy_state.confs[:n], accept(t, n))
        chosen.append(n)
    return chosen


COSTS = Costs([1.0, 1.1, 1.2, 1.3], 0.05)


def test_bad_drafts_converge_to_plain_steps():
    """An over-confident head whose drafts are never accepted: after a few steps the policy stops
    drafting, and only single-draft probes remain, ever rarer (4, 8, ... up to 64 plain steps apart)."""
    st = PolicyState()
    chosen = _run(st, COSTS, 3, 400, lambda t, n: 0)
    assert chosen[0] == 3  # the prior (60% acceptance) makes the first step draft
    tail = chosen[200:]
    assert set(tail) <= {0, 1}
    assert sum(tail) <= len(tail) // PROBE_MAX + 1
    assert st.wait == PROBE_MAX
    assert st.calibrated(0, 0.9) < 0.2  # the head's 90% confidence is discounted


def test_good_drafts_keep_the_full_length():
    st = PolicyState()
    chosen = _run(st, COSTS, 3, 100, lambda t, n: n)
    assert chosen == [3] * 100


def test_recovery_after_bad_stretch():
    """Bad drafts for 300 steps, then drafts that are always right: the next probe succeeds and the
    policy is back at the full length within one probe interval plus a few steps."""
    st = PolicyState()
    chosen = _run(st, COSTS, 3, 600, lambda t, n: 0 if t < 300 else n)
    back = next(t for t in range(300, 600) if chosen[t] == 3)
    assert back <= 300 + PROBE_MAX + 10
    assert chosen[-50:] == [3] * 50


def test_partly_good_drafts_stop_where_they_stop_paying():
    """First drafts always right, later ones never: the policy settles on one draft per step."""
    st = PolicyState()
    chosen = _run(st, COSTS, 3, 200, lambda t, n: min(n, 1))
    assert chosen[-100:].count(1) >= 95


def test_one_rejection_deep_in_a_run_does_not_cut_every_later_step():
    """Drafts of confidence 1 (lookup copying a file) accepted at every position, but for the
    first step's rejection of the 4th: the keep rule then stops before the 4th, whose record only
    learns from verified drafts, so without an extension now and then every later step would
    verify 3 (what a 32K-token edit on a Zen 4 VM did, one lookup draft per step). Extensions,
    after 4 verifications without one, are accepted and lift the record: the steps are back at
    the full length."""
    rows = Costs([1.0, 1.35, 1.7, 2.05, 2.4, 2.75], 0.0)  # a 4th draft at 2/3 acceptance does not pay
    st = PolicyState()
    chosen = _run(st, rows, 5, 60, lambda t, n: min(n, 3) if t == 0 else n, conf=1.0)
    assert chosen[:2] == [5, 3]  # the first step's rejection stops the next one at 3
    back = next(t for t in range(1, 60) if chosen[t] == 5)
    assert back <= 2 * policy.PROBE_MIN + 2  # two accepted extensions lift the record past the rule
    assert chosen[-40:] == [5] * 40


def test_extensions_that_are_rejected_get_rarer():
    """First drafts always accepted, later ones never: once the keep rule stops at one draft, a
    step verifies one draft past it only after a wait that each rejected extension doubles (a step
    extends after `ext_wait` verifications without one) up to PROBE_MAX, and never stops doing so."""
    st = PolicyState()
    chosen = _run(st, COSTS, 3, 600, lambda t, n: min(n, 1))
    settled = chosen.index(1)
    ext = [t for t in range(settled, 600) if chosen[t] > 1]
    gaps = [b - a for a, b in zip(ext, ext[1:])]
    assert len(gaps) >= 5 and gaps[-1] == PROBE_MAX + 1 and st.ext_wait == PROBE_MAX
    assert all(b == min(2 * a - 1, PROBE_MAX + 1) for a, b in zip(gaps, gaps[1:]))  # wait + 1, doubled


def test_extension_only_where_a_sequence_steps_alone():
    """In a step several sequences share, the batch's plan prices every draft again (it would cut an
    extension the keep rule turned down): no extension there; none into a row priced infinite
    (one the cache cannot hold); and drafting again from position 0 (a failed batched pass run
    alone) starts the step's record afresh."""
    rows = [1.0, 1.35, 1.7, 2.05, 2.4, 2.75]
    st = PolicyState()
    _run(st, Costs(rows, 0.0), 5, 1, lambda t, n: min(n, 3), conf=1.0)  # position 3 rejected once
    st.ext_idle = st.ext_wait  # an extension is due
    for costs, extended in ((Costs(rows, 0.0, batch=2), False), (Costs(rows[:4] + [math.inf] * 2, 0.0), False),
                            (Costs(rows, 0.0), True)):
        keep = CostPolicy.keeper(st, costs)
        n = 0
        while n < 5 and keep(n, 1.0):
            n += 1
        assert (n == 4) == extended and (st.ext_at == 3) == extended
    keep = CostPolicy.keeper(st, Costs(rows, 0.0))
    assert [keep(i, 1.0) for i in range(5)] == [True] * 4 + [False]
    assert [keep(i, 1.0) for i in range(5)] == [True] * 4 + [False] and len(st.confs) == 4


def test_no_drafts_where_rows_cost_a_step_each():
    """Where a verification row costs as much as a step, not even drafts that are always accepted
    pay: no step drafts, not even a probe."""
    st = PolicyState()
    assert _run(st, Costs([1.0, 2.0, 3.0, 4.0], 0.1), 3, 100, lambda t, n: n) == [0] * 100


def test_accepted_probes_that_do_not_pay_stay_rare():
    """Drafts accepted two times in five where a row costs 0.6 of a step ((1 + .4) / 1.7 < 1): the
    policy stays plain, and probes get rarer although some of them are accepted."""
    st = PolicyState()
    chosen = _run(st, Costs([1.0, 1.6, 2.2, 2.8], 0.1), 3, 1000, lambda t, n: min(n, 1) if t % 5 < 2 else 0)
    assert sum(1 for n in chosen[200:] if n) <= 800 // PROBE_MAX * 2


def test_a_new_request_starts_from_what_earlier_requests_showed():
    """A proposer whose drafts all say confidence 1 (n-gram lookup) but are accepted half the time:
    a request's record learns that, and so does the decoder's `Calibration`, from which the next
    request starts: its first drafts are priced at about 1/2 each, not at face value, and its own
    record then pulls it from there. A proposer whose confidence was right (the head) keeps its word;
    one early rejection does not switch a proposer off."""
    base = Calibration()
    first = PolicyState(base=base)
    assert first.calibrated(0, 1.0) == 1.0  # nothing seen yet anywhere: the proposer's word
    first.observe([1.0], 0)  # one rejection: shrunk towards face value, not to 0
    assert 0.5 < PolicyState(base=base).calibrated(0, 1.0) < 1.0
    for t in range(200):  # drafts 0 and 1 verified; the first accepted every other step
        first.observe([1.0, 1.0], 1 if t % 2 else 0)
    assert base.scale(0) == pytest.approx(0.5, abs=0.02)
    fresh = PolicyState(base=base)
    assert fresh.calibrated(0, 1.0) == pytest.approx(0.5, abs=0.02)
    assert PolicyState().calibrated(0, 1.0) == 1.0  # without a base: face value
    # position 1 was verified only after an accepted first draft (never accepted here): its own figure
    assert fresh.calibrated(1, 1.0) < 0.05
    # the request's own record weighs against the base: three accepted drafts lift it part of the way
    for _ in range(3):
        fresh.observe([1.0], 1)
    assert 0.55 < fresh.calibrated(0, 1.0) < 0.95
    head = Calibration()
    rec = PolicyState(base=head)
    for t in range(200):  # confidence 0.6, accepted 3 times in 5: calibrated
        rec.observe([0.6], 1 if t % 5 < 3 else 0)
    assert PolicyState(base=head).calibrated(0, 0.6) == pytest.approx(0.6, abs=0.02)
    chain = ChainPolicyState(2, [base, head])  # a chain's members each learn their own
    assert chain.members[0].base is base and chain.members[1].base is head


def test_depth_bands():
    assert [depth_band(d) for d in (0, 511, 512, 1023, 1024, 8192, 32768)] == [0, 0, 1, 1, 2, 5, 7]


# ------------------------------------------------------------------ tiny real models
@pytest.fixture(scope="module")
def target(tiny_dir):
    return Engine.load(str(make_tiny(tiny_dir / "pol.gguf", "qwen2", seed=5, nextn=1, ctx=1024)), n_ctx=1024)


def _plain(engine, params=GREEDY, prompt=PROMPT):
    return engine.generate(prompt, SamplingParams(**params), chat=False)


@pytest.mark.parametrize("chain", [True, False])
def test_decoder_shares_its_calibration_across_requests(target, chain):
    """The same decoder serving two requests in turn: its calibration (one per proposer) receives
    both requests' verified drafts, a decoder made from it with another draft length (a request's
    own `speculative.n_max` in the server) shares it, and every request gives plain decoding's text."""
    ref = _plain(target)
    cfg = SpecConfig("ngram", 3, policy="cost", fallback=SpecConfig("mtp") if chain else None)
    dec = cfg.build(target)
    assert len(dec._calib) == (2 if chain else 1)
    seen = []
    for cal in dec._calib:  # count the verifications each calibration receives
        cal.observe = (lambda f, c: lambda confs, n: (seen.append(c), f(confs, n)))(cal.observe, cal)
    set_step_costs(target, [1.0, 1.1, 1.2, 1.3], 0.05)
    try:
        outs = [target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=dec)]
        n_first = len(seen)
        outs.append(target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=dec))
        n_second = len(seen)
        shorter = dec.with_draft_length(2)
        outs.append(target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=shorter))
    finally:
        set_step_costs(target, None)
    assert all(o.tokens == ref.tokens for o in outs)
    assert 0 < n_first < n_second < len(seen)


def test_bad_head_converges_to_plain_on_a_model(target):
    """The tiny model's MTP block has random weights: its drafts are almost never accepted. With
    verification rows as cheap as on a fast CPU, the default policy still ends up at plain steps."""
    ref = _plain(target)
    set_step_costs(target, [1.0, 1.1, 1.2, 1.3], 0.05)
    try:
        cfg = SpecConfig("mtp", 3)
        assert cfg.policy == "cost"  # the default for MTP
        out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=cfg.build(target))
    finally:
        set_step_costs(target, None)
    assert out.tokens == ref.tokens
    h = out.stats.k_hist
    assert sum(h) == out.stats.num_steps
    assert h[0] >= 0.8 * out.stats.num_steps  # mostly plain steps
    assert "steps by drafts verified [0:" in out.stats.summary()
    assert out.stats.to_dict()["draft_length_histogram"] == h


@pytest.fixture(scope="module")
def confident(tiny_dir):
    """A tiny model with a peaked output distribution, and itself as its draft model: confident
    drafts that are mostly accepted (three in four here)."""
    e = Engine.load(str(make_tiny(tiny_dir / "pol-peaky.gguf", "qwen2", seed=5, ctx=1024, out_scale=0.6)), n_ctx=1024)
    return e, SpecConfig("draft_model", 4, draft_model=str(e.model.source), policy="cost")


def test_good_drafts_keep_k_high_on_a_model(confident):
    """Good drafts and cheap drafting: the policy verifies the full draft length on (nearly) every step."""
    engine, cfg = confident
    params = dict(GREEDY, max_tokens=100)
    ref = _plain(engine, params)
    set_step_costs(engine, [1.0, 1.05, 1.1, 1.15, 1.2], 0.02)
    try:
        out = engine.generate(PROMPT, SamplingParams(**params), chat=False, speculative=cfg.build(engine))
    finally:
        set_step_costs(engine, None)
    assert out.tokens == ref.tokens
    h = out.stats.k_hist
    assert h[4] >= 0.8 * sum(h)
    assert out.stats.acceptance_rate > 0.5


def test_same_drafts_where_drafting_costs_a_step(confident):
    """The same drafts when drafting a token costs as much as a step: never worth it."""
    engine, cfg = confident
    set_step_costs(engine, [1.0, 1.05, 1.1, 1.15, 1.2], 1.0)
    try:
        out = engine.generate(PROMPT, SamplingParams(**dict(GREEDY, max_tokens=100)), chat=False,
                              speculative=cfg.build(engine))
    finally:
        set_step_costs(engine, None)
    h = out.stats.k_hist
    assert h[0] >= 0.8 * sum(h)


def test_chain_drafts_lookup_matches_under_the_cost_policy(tiny_dir):
    """A chain under the cost policy: the tiny model writes only tokens 5, 6 and 7, so its output
    repeats and lookup finds matches that are often accepted, while the random MTP head's drafts
    seldom are. Rows cost 0.3 of a step: the head's record soon says plain, but lookup, tried before
    any gate and priced on its own record, keeps drafting. The output is plain greedy decoding's."""
    V = len(gpt2_vocab()[0])
    e = Engine.load(str(make_tiny(tiny_dir / "pol-357.gguf", "qwen2", seed=5, nextn=1, ctx=1024,
                                  never=[t for t in range(V) if t not in (5, 6, 7)])), n_ctx=1024)
    prompt, params = [5, 6, 7, 8] * 6, SamplingParams(**dict(GREEDY, max_tokens=100))
    ref = e.generate(prompt_ids=prompt, params=params)
    cfg = SpecConfig("ngram", 4, policy="cost", fallback=SpecConfig("mtp", 3))
    set_step_costs(e, [1.0, 1.3, 1.6, 1.9, 2.2], 0.05)
    try:
        out = e.generate(prompt_ids=prompt, params=params, speculative=cfg.build(e))
    finally:
        set_step_costs(e, None)
    assert out.tokens == ref.tokens
    m, st = out.stats.members, out.stats
    assert m["ngram"][0] >= 25 and m["ngram"][2] >= 30  # lookup drafted on most steps, much of it accepted
    assert m.get("mtp", [0])[0] < m["ngram"][0] // 4
    assert [sum(x[i] for x in m.values()) for i in range(3)] == [st.num_drafts, st.num_draft_tokens,
                                                                   st.num_accepted_tokens]
    assert st.k_hist[0] > 0 and "ngram:" in st.summary()  # plain steps where the head alone would draft


def test_chain_members_are_priced_on_their_own_records(confident):
    """`ChainProposer.propose_priced`: a member whose record says plain does not stop the other from
    drafting. Lookup (ngram) and a draft model (itself, a member with drafting costs) as a chain."""
    import torch

    from mtpllm.runtime.sampling import Sampler
    from mtpllm.speculative.policy import ChainPolicyState
    engine, dcfg = confident
    chain = SpecConfig("ngram", 4, prompt_lookup_min=1, policy="cost",
                       fallback=SpecConfig("draft_model", 2, draft_model=dcfg.draft_model)).build(engine).proposer
    st, sampler = chain.new_state(), Sampler(SamplingParams(temperature=0))
    costs = Costs([1.0, 1.3, 1.6, 1.9, 2.2], 0.05)
    repeats, fresh = [5, 6, 7, 8] * 3 + [5, 6], [30 + i for i in range(14)]

    def bad(rec):  # a record of drafts all rejected, with no probe due
        for _ in range(20):
            rec.observe([0.9, 0.9], 0)

    pol = ChainPolicyState(2)
    bad(pol.members[1])  # the draft model's drafts do not pay: a plain step for it...
    assert chain.propose_priced(st, repeats, 4, sampler, 0.0, 0.0, pol, costs)[0] == [7, 8, 5, 6]
    assert (pol.active, st.last) == (0, "ngram")  # ...but lookup, on its own record, drafts
    assert chain.propose_priced(st, fresh, 4, sampler, 0.0, 0.0, pol, costs) == ([], [])
    assert pol.active is None and pol.members[1].idle == 1 and pol.members[0].idle == 0  # no match: not lookup's

    pol = ChainPolicyState(2)
    bad(pol.members[0])  # lookup's matches are rejected: its match is dropped, the draft model drafts
    drafts, _ = chain.propose_priced(st, repeats, 4, sampler, 0.0, 0.0, pol, costs)
    assert 1 <= len(drafts) <= 2 and (pol.active, st.last) == (1, "draft_model") and pol.members[0].idle == 1
    pol.observe([0.9] * len(drafts), len(drafts))  # the verification goes to the member that drafted
    assert pol.members[1].reached[0] == 1.0 and pol.members[0].reached[0] < 20 and pol.active is None


def test_a_chain_drafts_a_batch_as_each_sequence_alone_and_fails_only_the_faulty_one(confident, monkeypatch):
    """`ChainProposer.propose_priced_batch` gives each sequence the drafts, active member and record
    that `propose_priced` gives it alone; a sequence whose drafting raises gets its exception back
    while the others draft, and no record counts the step twice."""
    import copy

    import torch

    from mtpllm.runtime.sampling import Sampler
    from mtpllm.speculative.policy import ChainPolicyState
    engine, dcfg = confident
    chain = SpecConfig("ngram", 4, prompt_lookup_min=1, policy="cost",
                       fallback=SpecConfig("draft_model", 2, draft_model=dcfg.draft_model)).build(engine).proposer
    costs = Costs([1.0, 1.3, 1.6, 1.9, 2.2], 0.05)
    hists = [[5, 6, 7, 8] * 3 + [5, 6], [30 + i for i in range(14)], [40 + i for i in range(9)]]

    def run(batched, fail=None):
        sts, pols = [chain.new_state() for _ in hists], [ChainPolicyState(2) for _ in hists]
        for pol in pols:  # lookup's matches do not pay on this record: its step goes to the draft model
            for _ in range(20):
                pol.members[0].observe([0.9, 0.9], 0)
        real = type(chain.proposers[1]).propose

        def propose(self, st, history, *a, **k):
            if history == fail:
                raise RuntimeError("drafting failed")
            return real(self, st, history, *a, **k)
        monkeypatch.setattr(type(chain.proposers[1]), "propose", propose)
        smp = [Sampler(SamplingParams(temperature=0)) for _ in hists]
        if batched:
            got = chain.propose_priced_batch(sts, hists, [4] * 3, smp, 0.0, 0.0, pols, [costs] * 3)
        else:
            got = []
            for st, h, sm, pol in zip(sts, hists, smp, pols):
                try:
                    got.append(chain.propose_priced(st, h, 4, sm, 0.0, 0.0, pol, costs))
                except RuntimeError as e:
                    got.append(e)
        monkeypatch.setattr(type(chain.proposers[1]), "propose", real)
        return got, [(p.active, st.last, [copy.copy(vars(m)) for m in p.members]) for p, st in zip(pols, sts)]

    alone, alone_recs = run(False)
    together, together_recs = run(True)
    assert together == alone and together_recs == alone_recs
    assert alone[0][0] and alone_recs[0][:2] == (1, "draft_model")  # the draft model drafted
    assert alone_recs[0][2][0]["idle"] == 1  # lookup's dropped match: one plain step of its, once
    got, recs = run(True, fail=hists[0])
    assert isinstance(got[0], RuntimeError) and got[1:] == alone[1:] and recs[1:] == alone_recs[1:]
    assert recs[0][2][0]["idle"] == 1


def test_costs_are_measured_once_per_depth_band_and_leave_the_cache_as_it_was(target):
    set_step_costs(target, None)
    table = step_costs(target)
    ref = _plain(target)
    spec = SpecConfig("mtp", 3).build(target)
    out = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=spec)
    assert out.tokens == ref.tokens  # the timing forwards were rolled back
    assert table.timings == 1
    rows, one_ms = table.rows[0]
    assert len(rows) == 4 and rows[0] == 1.0 and all(r > 0 for r in rows) and one_ms > 0
    assert [v > 0 for (_, band), v in table.draft_ms.items() if band == 0] == [True]  # the head's draft too
    # another request, another decoder on the same model: the table is reused, nothing re-timed
    again = target.generate(PROMPT, SamplingParams(**GREEDY), chat=False, speculative=SpecConfig("mtp", 3).build(target))
    assert again.tokens == ref.tokens and table.timings == 1
    # a prompt past 512 tokens is another band: timed there once
    long_prompt = list(range(3, 200)) * 3
    ref_long = target.generate(prompt_ids=long_prompt, params=SamplingParams(**dict(GREEDY, max_tokens=8)))
    out_long = target.generate(prompt_ids=long_prompt, params=SamplingParams(**dict(GREEDY, max_tokens=8)),
                               speculative=spec)
    assert out_long.tokens == ref_long.tokens
    assert table.timings == 2 and 1 in table.rows


def test_rows_are_timed_once_deep_in_a_context(target, monkeypatch):
    """From LONG_TIMING_DEPTH on, the row counts are timed in one pass after one untimed forward;
    shallower, REPS passes (the fastest kept). The cache is left as it was either way."""
    import torch
    from types import SimpleNamespace
    rows = []
    real = policy.step_logits
    monkeypatch.setattr(policy, "step_logits", lambda model, h: rows.append(h.shape[0]) or real(model, h))
    cache = target.model.make_cache(64)
    with torch.inference_mode():
        target.model(torch.arange(3, 20), cache)
    seq = SimpleNamespace(slot=SimpleNamespace(cache=cache), x0=7)
    for depth, want in ((18, [1, 2, 3] * policy.REPS), (17, [1] + [1, 2, 3, 1])):
        rows.clear()
        monkeypatch.setattr(policy, "LONG_TIMING_DEPTH", depth)  # the cache holds 17 positions
        table = StepCosts()
        assert table.measure(target, seq, 3, None, "lookup")
        assert rows == want and len(table.rows[0][0]) == 3 and cache.length == 17


def test_deep_rows_lie_on_their_least_squares_line():
    """One pass deep in a context: the counts from 2 rows on are replaced by their least-squares
    line (here the 1.5B's one-pass table at 8K positions, whose 2 and 3 rows read 1.21 both), never
    falling with the rows; one row stays the unit."""
    raw = [1.0, 1.21, 1.21, 1.54, 1.76, 2.12, 2.23, 2.43, 2.85]
    got = policy._deep_rows({r: 0.1 * x for r, x in enumerate(raw, 1)}, 9)
    # by hand: mean of rows 2..9 at r = 5.5 is 15.35 / 8; slope sum((r - 5.5)(y - mean)) / 42 = 10.005 / 42
    mean, slope = 15.35 / 8, 10.005 / 42
    assert got == pytest.approx([1.0] + [mean + slope * (r - 5.5) for r in range(2, 10)])
    assert got[1] < 1.1 and got[2] - got[1] == pytest.approx(slope)  # 2 and 3 rows no longer tied
    # a falling pass (noise only): flat, at least one row
    assert policy._deep_rows({1: 1.0, 2: 0.99, 3: 0.98, 4: 0.97}, 4) == [1.0, 1.0, 1.0, 1.0]
    # two counts: nothing to fit
    assert policy._deep_rows({1: 2.0, 2: 2.5}, 2) == [1.0, 1.25]


def test_a_deep_table_is_the_line_of_its_pass(target, monkeypatch):
    """`measure` deep in a context keeps the fastest of one row's two timings and the line of the
    other counts; shallower, every count as timed (the fastest of REPS passes)."""
    import torch
    from types import SimpleNamespace
    cache = target.model.make_cache(64)
    with torch.inference_mode():
        target.model(torch.arange(3, 20), cache)
    seq = SimpleNamespace(slot=SimpleNamespace(cache=cache), x0=7)
    ones = iter([2.0, 1.0, 2.0, 1.0])  # one row: 2 ms, then 1 ms

    def ms(r):
        return next(ones) if r == 1 else {2: 1.3, 3: 1.2, 4: 1.6}[r]
    _fake_timer(monkeypatch, [], ms)
    monkeypatch.setattr(policy, "LONG_TIMING_DEPTH", 17)
    deep = StepCosts()
    assert deep.measure(target, seq, 4, None, "lookup")
    assert deep.rows[0] == (pytest.approx(policy._deep_rows({1: 1.0, 2: 1.3, 3: 1.2, 4: 1.6}, 4)), pytest.approx(1.0))
    monkeypatch.setattr(policy, "LONG_TIMING_DEPTH", 18)
    ones = iter([1.0] * policy.REPS)
    shallow = StepCosts()
    assert shallow.measure(target, seq, 4, None, "lookup")
    assert shallow.rows[0] == (pytest.approx([1.0, 1.3, 1.2, 1.6]), pytest.approx(1.0))


def test_decoding_borrows_the_band_below_only():
    """A decoding sequence crossing into a band not yet timed is priced by the band directly
    below where that one is timed for its rows and proposer; a request starting there, or a band
    two below, is timed."""
    t = StepCosts()
    t.rows[0] = ([1.0, 1.2, 1.4], 10.0)
    t.draft_ms[("k", 0)] = 0.5
    assert not t.needs(600, 3, "k", decoding=True) and t.needs(600, 3, "k")  # band 1: borrows band 0
    assert t.needs(1100, 3, "k", decoding=True)  # band 2: band 0 is two below
    assert t.needs(600, 4, "k", decoding=True) and t.needs(600, 3, "other", decoding=True)  # not timed so
    got = t.get(600, 3, "k")
    assert got.rows == [1.0, 1.2, 1.4] and got.step_ms == 10.0
    for _ in range(300):  # its steps, twice band 0's timing, and its drafting follow it as they run
        t.observe_pace(600, 2, 0.024)
        t.observe_draft("k", 600, 3.0, 2)
    got = t.get(600, 3, "k")
    assert t.pace == {0: pytest.approx(2.0)} and got.step_ms == pytest.approx(20.0)
    assert got.draft == pytest.approx(1.5 / 20.0)  # 1.5 ms a token against the 20 ms step observed
    # a band timed for its rows but not for this proposer: only the proposer is timed, decoding or not
    t.rows[1] = ([1.0, 1.3, 1.6], 15.0)
    assert t.needs(600, 3, "k", decoding=True)
    t.draft_ms[("k", 1)] = 0.6
    assert not t.needs(600, 3, "k") and not t.needs(600, 3, "k", decoding=True)


def test_decoding_into_a_deeper_band_is_not_timed(target):
    """A request whose decoding crosses 512 positions (a new depth band) is not stopped to time
    that band: band 0 prices its steps, and the next request that starts past 512 times band 1
    before its first token. Plain decoding's tokens either way."""
    set_step_costs(target, None)
    table = step_costs(target)
    prompt = list(range(3, 250)) * 2  # 494 tokens
    params = SamplingParams(**dict(GREEDY, max_tokens=40))
    spec = SpecConfig("mtp", 3).build(target)
    out = target.generate(prompt_ids=prompt, params=params, speculative=spec)
    assert out.tokens == target.generate(prompt_ids=prompt, params=params).tokens
    assert table.timings == 1 and list(table.rows) == [0]
    deeper = prompt + list(range(3, 40))  # 531 tokens
    out = target.generate(prompt_ids=deeper, params=params, speculative=spec)
    assert out.tokens == target.generate(prompt_ids=deeper, params=params).tokens
    assert table.timings == 2 and sorted(table.rows) == [0, 1]


def _fake_timer(monkeypatch, calls, ms):
    """Forward times replaced by ms(r) for r rows (the real forwards still run; only their times
    are replaced, so the cache roll-back is the real one); each timing's row counts go to `calls`."""
    real = StepCosts._time_rows

    def fake(engine, seq, counts, reps):
        calls.append(tuple(counts))
        _, hidden = real(engine, seq, counts, 1)
        got = {}
        for r in counts:  # a count timed twice: the fastest, as `_time_rows`
            got[r] = min(got.get(r, math.inf), ms(r) * 1e-3)
        return got, hidden
    monkeypatch.setattr(StepCosts, "_time_rows", staticmethod(fake))


def _timed_setup(confident, monkeypatch, ms, draft_ms: float):
    """The confident model's engine, speculative decoder, prompt ids, 40 greedy tokens and the
    list of timed row counts, with forward times ms(r) (default: a CPU whose rows are nearly free
    up to 5 and then cost a step each, 1 + 0.02 r ms for r <= 5, r ms beyond) and drafting
    `draft_ms` per token; the steps' observed times do not move the tables (a tiny model's)."""
    engine, cfg = confident
    set_step_costs(engine, None)
    calls = []
    _fake_timer(monkeypatch, calls, ms or (lambda r: 1 + 0.02 * r if r <= 5 else float(r)))
    monkeypatch.setattr(policy, "OBSERVE_WEIGHT", 0.0)
    spec = cfg.build(engine)
    monkeypatch.setattr(type(spec.proposer), "probe_ms", lambda self, st, hidden, x0: draft_ms)
    return engine, spec, engine.tokenizer.encode(PROMPT), SamplingParams(**dict(GREEDY, max_tokens=40)), calls


def test_rows_are_priced_in_the_batch_that_shares_the_step(confident, monkeypatch):
    """The same good drafts: alone, rows are cheap and the policy verifies 4 drafts a step; with 3
    sequences in the step, 3 x 2 rows already fall past the cliff, so none of them drafts."""
    # the draft's time replaced too, in the same units as the rows (ms): 0.02 of a step
    engine, spec, ids, params, calls = _timed_setup(confident, monkeypatch, None, 0.02)
    try:
        engine.reset()
        alone = engine.generate(prompt_ids=ids, params=params, speculative=spec)
        assert alone.stats.k_hist[4] >= 0.8 * sum(alone.stats.k_hist)
        assert calls == [(1, 2, 3, 4, 5)]  # the one-sequence table: 1..k+1 rows
        outs = _shared(engine, spec, ids, params, 3)
    finally:
        set_step_costs(engine, None)
    # the batch's table timed once (then reused), at n, n + 1 and 2 n rows: the rest continues those lines
    assert (3, 4, 6) in calls and calls.count((3, 4, 6)) == 1
    for rs in outs:
        toks = [x.token for x in rs if x.token is not None]
        assert toks == alone.tokens  # lossless whatever was chosen
        h = rs[-1].stats.k_hist
        assert h[0] >= 0.8 * sum(h), h  # steps shared by 3 sequences: plain


def _shared(engine, spec, ids, params, n):
    from mtpllm.runtime.scheduler import Scheduler
    engine.reset()
    sched = Scheduler(engine, spec, n_slots=n)
    try:
        reqs = [sched.submit(ids, params) for _ in range(n)]
        return [list(r) for r in reqs]
    finally:
        sched.shutdown(1)


def test_a_batch_step_opens_a_tile_only_for_drafts_that_pay_for_it(confident, monkeypatch):
    """Rows priced inside a tile cost almost nothing (0.01 ms), the first row past the 3 sequences
    opens a tile (9 ms): each sequence drafts (its rows look free), and the step's plan cuts the
    drafts, because no 3 x 4 drafts of a 3-token step make up for 10x its time. Without the plan
    (every draft kept) the same run verifies drafts on most steps. Lossless either way."""
    engine, spec, ids, params, calls = _timed_setup(
        confident, monkeypatch, lambda r: 1 + 0.01 * r + (9.0 if r > 3 else 0.0), 0.0)  # 10 ms past 3 rows
    try:
        engine.reset()
        alone = engine.generate(prompt_ids=ids, params=params)
        planned = _shared(engine, spec, ids, params, 3)
        assert (3, 4, 6) in calls
        monkeypatch.setattr(policy, "batch_rows", lambda n, gains, musts, seconds, fixed=0: [len(g) for g in gains])
        from mtpllm.speculative import verifier
        monkeypatch.setattr(verifier, "batch_rows", policy.batch_rows)
        unplanned = _shared(engine, spec, ids, params, 3)
    finally:
        set_step_costs(engine, None)
    for rs in planned + unplanned:
        assert [x.token for x in rs if x.token is not None] == alone.tokens
    for rs in planned:
        h = rs[-1].stats.k_hist
        assert h[0] >= 0.9 * sum(h), h
    for rs in unplanned:
        h = rs[-1].stats.k_hist
        assert h[0] <= 0.5 * sum(h), h


def test_batch_costs_arithmetic():
    """A sequence's rows are priced at the batch's row past its first one, every sequence assumed
    to verify as many (rows[r - 1] = (T(n) + n (r - 1) m) / T(n)); the draft cost is scaled to the
    batch's step."""
    t = StepCosts()
    t.batch[(0, 2)] = BatchTable([2e-3, 2.5e-3, 3e-3, 5e-3, 8e-3], 2)  # 2..6 rows: 0.5 ms per row from 3 to 4
    base = Costs([1.0, 1.1, 1.2], 0.05, 1.0)

    class Seq:  # only the cache's depth is read when the table already has the batch's times
        class slot:
            class cache:
                length, max_len = 10, 100
        x0 = 1
    c = t.batch_costs(None, Seq, 2, 3, base)
    assert c.rows == pytest.approx([1.0, 1.5, 2.0]) and c.step_ms == 2.0
    assert c.draft == pytest.approx(0.05 * 2 * 1.0 / 2.0)
    assert t.batch_costs(None, Seq, 1, 3, base) is base  # one sequence: its own table
    assert t.batch_table(10, 2) == t.batch[(0, 2)].timed and t.batch_table(600, 2) is None
    t.batch[(0, 2)].observe(0, 3e-3, 1.0)  # plain steps 1 ms dearer than timed: so is every count above
    assert t.batch_table(10, 2) == pytest.approx([3e-3, 3.5e-3, 4e-3, 6e-3, 9e-3])
    assert t.batch_costs(None, Seq, 2, 3, base).rows == pytest.approx([1.0, 4 / 3, 5 / 3])


def test_a_batch_table_is_timed_at_n_n_plus_1_and_2n_rows_and_extended(monkeypatch):
    """A batch of n sequences times its forward at n, n + 1 and 2 n rows only (what every sequence
    waits for): the first row past n may open a tile of the kernels, the rows after it up to 2 n
    continue the line from n + 1 to 2 n, the rows past 2 n the average slope from n to 2 n. Counts
    the cache cannot hold cost infinity and the table is then not stored."""
    calls = []

    def fake(engine, seq, counts, reps):  # 3 ms, a 2 ms jump to the 5th row, then 0.5 ms per row
        calls.append(tuple(counts))
        return {c: (3.0 + (2.0 + 0.5 * (c - 5) if c > 4 else 0.0)) * 1e-3 for c in counts}, None
    monkeypatch.setattr(StepCosts, "_time_rows", staticmethod(fake))

    class Seq:
        class slot:
            class cache:
                length, max_len = 10, 100
        x0 = 1
    t = StepCosts()
    base = Costs([1.0] * 5, 0.0, 1.0)
    c = t.batch_costs(None, Seq, 4, 5, base)
    assert calls == [(4, 5, 8)]
    tab = t.batch_table(10, 4)
    assert len(tab) == 17  # 4 .. 20 rows
    assert tab[:5] == pytest.approx([3e-3, 5e-3, 5.5e-3, 6e-3, 6.5e-3])  # 4, 5 (the jump), 6, 7, 8
    assert tab[16] == pytest.approx(6.5e-3 + 12 * 3.5e-3 / 4)  # 20 rows: 12 past 2 n at (6.5 - 3) / 4 ms
    assert c.rows == pytest.approx([1.0 + 4 * r * 0.5 / 3 for r in range(5)])
    t.batch_costs(None, Seq, 4, 5, base)
    assert calls == [(4, 5, 8)]  # reused
    Seq.slot.cache.length = 80  # room for 19 more rows: 4 x 5 = 20 does not fit
    t2 = StepCosts()
    c = t2.batch_costs(None, Seq, 4, 5, base)
    assert c.rows[-1] == float("inf") and c.rows[:4] == pytest.approx([1.0 + 4 * r * 0.5 / 3 for r in range(4)])
    assert t2.batch == {}  # a short cache's table is not kept
    Seq.slot.cache.length = 93  # room for 6 more rows: n = 4 fits, 2 n does not
    for n_rows in (1, 3):
        c = StepCosts().batch_costs(None, Seq, 4, n_rows, base)
        assert c.rows[0] == 1.0 and c.step_ms == pytest.approx(3.0) and all(r == float("inf") for r in c.rows[1:])


def test_observed_steps_move_the_batch_table():
    """A step's observed time moves the table's time at its own row count (a running mean); the
    counts no step has run yet are priced at their timed time plus the error of the counts run:
    above the highest with its error (plain steps, the most frequent, carry bookkeeping the timed
    forwards lack: the counts never run must not look cheap beside them), between two on the line
    between their errors; a count once run keeps its own time."""
    t = StepCosts()
    t.batch[(0, 2)] = BatchTable([2e-3, 3e-3, 8e-3], 2)
    for _ in range(300):
        t.observe_step([10, 20], 2, 2.5e-3)  # plain steps: 0.5 ms more than timed
    tab = t.batch_table(10, 2)
    assert tab == pytest.approx([2.5e-3, 3.5e-3, 8.5e-3])
    for _ in range(300):
        t.observe_step([10, 20], 4, 12e-3)  # the 4-row steps: 4 ms dearer than timed
    tab = t.batch_table(10, 2)
    assert tab[0] == pytest.approx(2.5e-3) and tab[2] == pytest.approx(12e-3)
    assert tab[1] == pytest.approx(3e-3 + (0.5e-3 + 4e-3) / 2)  # never run: between its neighbours' errors
    assert t.observed == 600
    # every band the sequences are in learns from the step; other batch sizes and bands do not
    t.batch[(1, 2)] = BatchTable([4e-3, 6e-3], 2)
    t.batch[(0, 3)] = BatchTable([4e-3, 6e-3], 3)
    t.observe_step([10, 600], 2, 2e-3)
    assert t.batch_table(10, 2)[0] < 2.5e-3 and t.batch_table(600, 2)[0] < 4e-3
    assert t.batch_table(10, 3) == [4e-3, 6e-3]

    def state():
        return {k: (list(v.now), list(v.hits)) for k, v in t.batch.items()}
    before = state()
    t.observe_step([10], 1, 1.0)  # one sequence: its own table, not a batch's
    t.observe_step([10, 20], 5, 1.0)  # past the table's last count: nothing to move
    t.observe_step([10, 20], 1, 1.0)  # fewer rows than sequences: not a step of theirs
    assert state() == before
    fixed = StepCosts(Costs([1.0, 1.2], 0.1))
    fixed.observe_step([1, 2], 2, 1.0)
    fixed.observe_draft("k", 1, 100.0, 1)
    assert fixed.get(1, 2, "k").draft == 0.1  # given costs stay as given


def test_a_batch_seen_only_at_many_rows_prices_fewer_rows_by_their_rows():
    """Three sequences whose rows were timed nearly free (1 ms at 3..15 rows) but whose steps all
    ran 15 rows at 125 ms: were the extra time priced as a cost of every step, 3 rows would look as
    dear as 15, drafts free, and the batch would never run fewer rows to learn otherwise. Below the
    lowest count run, the error scales with the rows: the prices rise with the rows, and the first
    plain step observed sets its own count and the line from it to 15 rows."""
    tab = BatchTable([1e-3] * 13, 3)
    for _ in range(5):
        tab.observe(12, 0.125, 0.1)
    got = tab.seconds()
    err = got[12] - 1e-3
    assert got[12] == pytest.approx((1e-3 + 5 * 0.125) / 6)  # the first observations average, the price counting as one
    assert got == pytest.approx([1e-3 + err * (3 + i) / 15 for i in range(12)] + [got[12]])
    assert all(b > a for a, b in zip(got, got[1:]))
    tab.observe(0, 3e-3, 0.1)  # plain steps: 3 ms
    tab.observe(0, 3e-3, 0.1)
    got = tab.seconds()
    first = 1e-3 + err * 3 / 15  # its price before: (price + 3 ms) / 2, then (that + 3 ms) / 2 (weights 1/2, 1/3)
    assert got[0] == pytest.approx(((first + 3e-3) / 2) * 2 / 3 + 3e-3 / 3)
    slope = (got[12] - got[0]) / 12
    assert got[6] == pytest.approx(got[0] + 6 * slope)  # between the two: on the line
    # errors below the timed times shrink towards nothing with fewer rows as well
    neg = BatchTable([10e-3] * 5, 4)
    neg.observe(4, 2e-3, 1.0)
    assert neg.seconds()[0] == pytest.approx(10e-3 - 8e-3 * 4 / 8)


def test_batch_rows_opens_a_tile_only_when_its_drafts_pay():
    """The whole step's plan: drafts join in order of expected tokens while tokens per second
    grow. Past n rows a tile of the kernels opens at a price (here 8 sequences, 80 ms, the 9th row
    12 ms, each further one 5 ms): a few middling drafts do not pay for it, enough of them do, and
    a probe is verified whatever it costs (the others then ride on its tile)."""
    tab = [80.0, 92.0] + [92.0 + 5 * i for i in range(1, 24)]  # 8 .. 32 rows, ms

    def seconds(rows):
        return tab[rows - 8]
    none = [[] for _ in range(8)]
    assert batch_rows(8, none, [0] * 8, seconds) == [0] * 8
    # one sequence with 0.8, 0.64: the 9th row alone costs 1.2 tokens' time (80 / 8 = 10 ms per token)
    few = [[0.8, 0.64]] + [[] for _ in range(7)]
    assert batch_rows(8, few, [0] * 8, seconds) == [0] * 8
    # eight sequences with a draft each at 0.8: 6.4 tokens for 8 rows at 47 ms: worth it
    many = [[0.8] for _ in range(8)]
    assert batch_rows(8, many, [0] * 8, seconds) == [1] * 8
    # a probe opens the tile: the good drafts after it join, the poor one does not
    mixed = [[0.3], [0.9, 0.81], [0.9], [0.05]] + [[] for _ in range(4)]
    got = batch_rows(8, mixed, [1, 0, 0, 0] + [0] * 4, seconds)
    assert got == [1, 2, 1, 0] + [0] * 4
    # draft rows the plan cannot cut (another decoder's) have opened the tile already: good drafts join
    assert batch_rows(8, many[:1] + none[1:], [0] * 8, seconds, fixed=4) == [1] + [0] * 7
    assert batch_rows(8, many[:1] + none[1:], [0] * 8, seconds) == [0] * 8
    # a sequence's drafts join in order (on equal gains, first drafts before second ones), and row
    # counts past the table are never chosen
    ties = [[0.9, 0.9, 0.9]] + [[0.9] for _ in range(7)]
    got = batch_rows(8, ties, [0] * 8, lambda r: 80.0 + 5.0 * (r - 8) if r <= 12 else float("inf"))
    assert got == [1, 1, 1, 1, 0, 0, 0, 0]


def test_observed_drafting_is_what_drafts_cost():
    """The one timed token starts the running cost per drafted token; steps' drafting moves it."""
    t = StepCosts()
    t.rows[0] = ([1.0, 1.1, 1.2], 10.0)
    t.draft_ms[("k", 0)] = 0.5
    assert t.get(100, 3, "k").draft == pytest.approx(0.05)
    t.observe_draft("k", 100, 20.0, 2)  # 10 ms per token as decoding drafted them
    assert t.get(100, 3, "k").draft == pytest.approx((0.5 + 0.1 * (10.0 - 0.5)) / 10.0)
    for _ in range(200):
        t.observe_draft("k", 100, 20.0, 2)
    assert t.get(100, 3, "k").draft == pytest.approx(1.0)
    t.observe_draft("k", 100, 20.0, 0)  # nothing drafted: nothing to divide by
    assert t.get(100, 3, "k").draft == pytest.approx(1.0) and t.get(100, 3, "other").draft == policy.DEFAULT_DRAFT  # untimed


def test_observed_drafting_is_priced_against_observed_steps():
    """Load that slows drafting and steps alike (another process on the cores) leaves drafting's
    price, relative to a step, where it was: the rows were timed once, on a quiet machine, and
    priced against those, drafting would look dearer the busier the machine. The timed token
    (measured with the rows, at the same pace) is not rescaled."""
    t = StepCosts()
    t.rows[0] = ([1.0, 1.2, 1.4], 10.0)
    t.draft_ms[("k", 0)] = 0.5
    t.observe_pace(100, 2, 0.024)  # before any drafting is observed: the timed price holds
    assert t.get(100, 3, "k").draft == pytest.approx(0.05)
    for _ in range(300):  # twice as slow: a 2-row step 24 ms instead of 12, drafting 1 ms a token
        t.observe_draft("k", 100, 2.0, 2)
        t.observe_pace(100, 2, 0.024)
    got = t.get(100, 3, "k")
    assert t.pace[0] == pytest.approx(2.0) and got.draft == pytest.approx(0.05) and got.step_ms == pytest.approx(20.0)
    # a batch recovers the drafting's milliseconds whatever the pace (its own table prices its steps)
    assert got.draft * got.step_ms == pytest.approx(1.0)
    for _ in range(300):  # the load gone: steps as timed, drafting as timed
        t.observe_draft("k", 100, 1.0, 2)
        t.observe_pace(100, 3, 0.014)
    assert t.pace[0] == pytest.approx(1.0) and t.get(100, 3, "k").draft == pytest.approx(0.05)
    # a step of more rows than measured, or at a depth below every measured band, moves nothing
    t.observe_pace(100, 4, 1.0)
    u = StepCosts()
    u.rows[2] = ([1.0, 1.2], 10.0)
    u.observe_pace(100, 1, 1.0)
    assert t.pace[0] == pytest.approx(1.0) and u.pace == {}


def test_drafting_dearer_than_timed_turns_the_policy_plain(confident, monkeypatch):
    """A proposer whose one timed token is cheap but whose drafting, as requests run it, costs
    several steps (here: a sleep in each `propose`, as a slow draft model's would): the policy
    learns it from the steps and stops drafting. Priced on the timed token alone, the same good
    drafts are verified four at a time (test_good_drafts_keep_k_high_on_a_model)."""
    import time
    engine, cfg = confident
    set_step_costs(engine, None)
    params = dict(GREEDY, max_tokens=60)
    ref = _plain(engine, params)
    spec = cfg.build(engine)
    prop = spec.proposer
    monkeypatch.setattr(type(prop), "probe_ms", lambda self, st, hidden, x0: 0.01)
    real = type(prop).propose

    def slow(self, *a, **kw):
        time.sleep(0.05)
        return real(self, *a, **kw)
    monkeypatch.setattr(type(prop), "propose", slow)
    try:
        out = engine.generate(PROMPT, SamplingParams(**params), chat=False, speculative=spec)
        pace = dict(step_costs(engine).pace)
    finally:
        set_step_costs(engine, None)
    assert out.tokens == ref.tokens
    h = out.stats.k_hist
    assert h[0] >= 0.6 * sum(h), h
    # the steps' own pace was observed, the drafting's sleep not in it: counted, 50 ms on a step of a
    # few ms would put it far above 10
    assert list(pace) == [0] and 0 < pace[0] < 10, pace


def test_a_heads_catch_up_is_not_priced_as_drafting(target):
    """The head's catch-up (cache entries of the positions accepted or decoded plainly since it
    last drafted, `MTPHead.fill`) grows with the plain steps before a draft. Priced per drafted
    token it made drafting look dearer the longer a request had waited, until it stopped drafting
    for good. The proposer times it apart (`take_catchup_ms`) and the decoder prices only the rest."""
    import torch

    from mtpllm.runtime.sampling import Sampler
    from mtpllm.runtime.sequence import Slot
    set_step_costs(target, None)
    spec = SpecConfig("mtp", 3, policy="cost").build(target)
    prop, m = spec.proposer, target.model
    ids = target.tokenizer.encode(PROMPT)
    cache = m.make_cache(256)
    h = m(torch.tensor(ids), cache)
    st = prop.new_state()
    prop.begin(st, ids, h, 0)
    # three plain steps: tokens a, b, c decoded, their trunk states pending for the head
    hist = list(ids)
    for tok in (5, 6, 7):
        hist.append(tok)
        prop.accept(st, hist, 0, m(torch.tensor([tok]), cache))
    assert st.catchup_ms == 0.0
    drafts, _ = prop.propose(st, hist + [8], 2, Sampler(SamplingParams(**GREEDY)))
    caught = prop.take_catchup_ms(st)
    assert len(drafts) == 2 and caught > 0 and st.catchup_ms == 0.0  # timed, then reset
    # the decoder prices a step's drafting without it
    seq = target.new_sequence(ids, SamplingParams(**GREEDY), spec, Slot(m.make_cache(256)))
    seq.pending = (drafts, [None, None])
    seq.draft.catchup_ms = 40.0
    spec._observe_draft(target, seq, 41.0, 1)
    assert list(step_costs(target).draft_seen.values()) == [pytest.approx(0.5)]  # (41 - 40) ms for 2 drafts
    assert seq.draft.catchup_ms == 0.0
    set_step_costs(target, None)


def _rows_timed_at_1ms(monkeypatch):
    """The cost table's timings replaced by about 1 ms per step at every row count (the forwards
    still run, for the hidden state the proposer is timed on)."""
    _fake_timer(monkeypatch, [], lambda r: 1 + 0.001 * r)


def test_batch_steps_dearer_than_timed_turn_the_batch_plain(confident, monkeypatch):
    """Rows timed nearly free, but the batch's real steps cost 10 ms per extra row (here: a sleep
    in the batched forward, as a CPU that is compute-bound at those rows would): the steps'
    observed times correct the table and the sequences that share a step stop drafting."""
    import time

    from mtpllm.runtime.scheduler import Scheduler
    engine, cfg = confident
    set_step_costs(engine, None)
    _rows_timed_at_1ms(monkeypatch)
    spec = cfg.build(engine)
    monkeypatch.setattr(type(spec.proposer), "probe_ms", lambda self, st, hidden, x0: 0.01)
    real_fb = engine.model.forward_batch

    def slow(tokens, caches):
        time.sleep(0.002 + 0.01 * (sum(t.shape[0] for t in tokens) - len(tokens)))
        return real_fb(tokens, caches)
    monkeypatch.setattr(engine.model, "forward_batch", slow)
    params = SamplingParams(**dict(GREEDY, max_tokens=40))
    ids = engine.tokenizer.encode(PROMPT)
    ref = _plain(engine, dict(GREEDY, max_tokens=40))
    engine.reset()
    sched = Scheduler(engine, spec, n_slots=3)
    try:
        outs = [list(r) for r in [sched.submit(ids, params) for _ in range(3)]]
        assert step_costs(engine).observed > 0
    finally:
        sched.shutdown(1)
        set_step_costs(engine, None)
    for rs in outs:
        assert [x.token for x in rs if x.token is not None] == ref.tokens
        h = rs[-1].stats.k_hist
        assert h[0] >= 0.6 * sum(h), h


def test_a_request_alone_in_the_scheduler_sets_the_pace(confident, monkeypatch):
    """One request in the scheduler: its steps' forward and logits against their timed cost move the
    pace (here every forward sleeps 5 ms, rows timed at about 1 ms: each step is observed at 5x or
    more); a plain request's steps on the same model (no cost policy) leave it where it was."""
    import time

    from mtpllm.runtime.scheduler import Scheduler
    engine, cfg = confident
    set_step_costs(engine, None)
    _rows_timed_at_1ms(monkeypatch)
    real_fb = engine.model.forward_batch
    nap = [0.005]

    def slow(tokens, caches):
        time.sleep(nap[0])
        return real_fb(tokens, caches)
    monkeypatch.setattr(engine.model, "forward_batch", slow)
    params = SamplingParams(**dict(GREEDY, max_tokens=40))
    ids = engine.tokenizer.encode(PROMPT)
    engine.reset()
    try:
        sched = Scheduler(engine, cfg.build(engine), n_slots=1)
        try:
            list(sched.submit(ids, params))
        finally:
            sched.shutdown(1)
        table = step_costs(engine)
        # a running mean from 1 towards >= 5 over the request's (>= 10) steps: above 3
        assert list(table.pace) == [0] and table.pace[0] > 3, table.pace
        before = dict(table.pace)
        nap[0] = 0.05
        plain = Scheduler(engine, None, n_slots=1)
        try:
            list(plain.submit(ids, SamplingParams(**dict(GREEDY, max_tokens=5))))
        finally:
            plain.shutdown(1)
        assert table.pace == before
    finally:
        set_step_costs(engine, None)


def test_given_costs_are_never_timed():
    t = StepCosts(Costs([1.0, 1.2], 0.1))
    assert not t.needs(10_000, 2, "k") and t.get(10_000, 2, "k").rows == [1.0, 1.2]


# ------------------------------------------------------------------ defaults: flags, chat and serve
def _args(*argv, default_mtp=False):
    import argparse

    from mtpllm.speculative.config import add_spec_args
    ap = argparse.ArgumentParser()
    add_spec_args(ap, default_mtp=default_mtp)
    return ap.parse_args(list(argv))


def test_flags_and_defaults():
    from mtpllm.errors import MtpllmError
    from mtpllm.speculative.config import parse_speculative_json, spec_from_args
    cfg = spec_from_args(_args("--spec-type", "draft-mtp"))
    assert cfg.policy == "cost" and not cfg.auto
    assert spec_from_args(_args("--spec-type", "draft-mtp", "--spec-policy", "fixed")).policy == "fixed"
    assert spec_from_args(_args("--spec-type", "draft-mtp", "--spec-adaptive")).policy == "adaptive"
    assert spec_from_args(_args("--spec-type", "ngram-simple")).policy == "fixed"
    assert spec_from_args(_args("--spec-type", "ngram-simple,draft-mtp")).policy == "fixed"
    assert parse_speculative_json('{"method":"mtp","policy":"fixed"}').policy == "fixed"
    assert parse_speculative_json('{"method":"mtp","adaptive":true}').policy == "adaptive"
    # run: nothing asked, nothing used
    assert spec_from_args(_args()) is None
    # chat / serve: n-gram lookup, else the MTP head, where the model has a head, unless turned off
    cfg = spec_from_args(_args(default_mtp=True), default_mtp=True)
    assert (cfg.method, cfg.fallback.method) == ("ngram", "mtp") and cfg.auto and cfg.policy == "cost"
    assert cfg.label() == "ngram:8+mtp:3"
    cfg = spec_from_args(_args("--spec-draft-n-max", "5", "--spec-policy", "fixed", default_mtp=True), default_mtp=True)
    assert cfg.auto and cfg.policy == "fixed"
    assert (cfg.num_speculative_tokens, cfg.fallback.num_speculative_tokens) == (8, 5)  # the head's draft length
    assert spec_from_args(_args("--spec-type", "none", default_mtp=True), default_mtp=True) is None
    assert not spec_from_args(_args("--spec-mtp-head", "h.gguf", default_mtp=True), default_mtp=True).auto
    for argv, msg in [(("--spec-policy", "cost"), "without a method"),
                      (("--spec-type", "draft-mtp", "--spec-adaptive", "--spec-policy", "cost"), "contradict")]:
        with pytest.raises(MtpllmError, match=msg):
            spec_from_args(_args(*argv))
    with pytest.raises(MtpllmError, match="unknown draft-length policy"):
        parse_speculative_json('{"method":"mtp","policy":"fast"}')
    with pytest.raises(MtpllmError, match="policy"):
        parse_speculative_json('{"method":"mtp","policy":3}')


def test_default_speculation_needs_a_head(target, tiny_models):
    assert SpecConfig("mtp", auto=True).usable(target)  # MTP layers in the file
    plain = Engine.load(str(tiny_models["qwen2"]), n_ctx=64)
    assert not SpecConfig("mtp", auto=True).usable(plain)
    assert SpecConfig("mtp").usable(plain)  # asked for by name: tried (and fails with its message)


@pytest.mark.parametrize("command", ["chat", "run"])
def test_chat_and_run_speculate_by_default_where_the_model_has_a_head(target, tiny_models, command):
    import subprocess
    import sys

    def cli(model, *extra):
        args = ["--timings"] if command == "chat" else ["-p", "hello", "--no-chat"]
        r = subprocess.run([sys.executable, "-m", "mtpllm", command, "-m", str(model), "-n", "12", "--temp", "0",
                            *args, *extra], input="hello\n/exit\n" if command == "chat" else None,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r
    with_head, off = cli(target.model.source), cli(target.model.source, "--spec-type", "none")
    assert "steps by drafts verified" in with_head.stderr
    assert "steps by drafts verified" not in off.stderr
    assert with_head.stdout == off.stdout  # lossless
    assert "steps by drafts verified" not in cli(tiny_models["qwen2"]).stderr  # no head: plain


def test_bench_spec_names_a_policy():
    from mtpllm.bench.runner import parse_spec, split_policy
    from mtpllm.errors import MtpllmError
    assert parse_spec("mtp:3~fixed") == ("mtp:3~fixed", "mtp", 3, None)
    assert parse_spec("mtp:2@c0.3~adaptive") == ("mtp:2@c0.3~adaptive", "mtp", 2, None)
    assert parse_spec("ngram:4+mtp:2~cost") == ("ngram:4+mtp:2~cost", "chain", 4, None)
    assert split_policy("draft:~/m.gguf:2") == ("draft:~/m.gguf:2", None)  # a '~' of a path is no policy
    with pytest.raises(MtpllmError, match="needs a method"):
        parse_spec("none~fixed")


def test_serve_speculates_by_default_where_the_model_has_a_head(target, tiny_models, tmp_path):
    import httpx
    from server_proc import ServerProcess
    for model, extra, want in [(target.model.source, (), "ngram:8+mtp:3"), (target.model.source, ("--spec-type", "none"), None),
                               (tiny_models["qwen2"], (), None)]:
        s = ServerProcess(model, *extra, log_dir=tmp_path)
        try:
            assert httpx.get(s.url + "/props", timeout=30).json()["speculative"] == want
            if want:
                r = httpx.post(s.url + "/completion", json={"prompt": "the cat", "n_predict": 16, "temperature": 0},
                               timeout=60).json()
                assert r["timings"]["predicted_n"] == 16
        finally:
            s.stop()


@pytest.mark.slow
def test_shipped_head_keeps_k_high_on_code_where_rows_are_cheap():
    """The 0.5B's shipped head on a coding prompt, with the row costs of a fast CPU given (a 4-row
    step 1.3x a 1-row step, as measured on an AVX-512 Zen 5; drafting 5% of a step): most steps verify
    two or three drafts, and the output is plain decoding's."""
    from mtpllm.registry import DEFAULT_MODEL
    eng = Engine.load(DEFAULT_MODEL, n_ctx=1024)
    ids = eng.encode_prompt(messages=[{"role": "user", "content": "Write a Python function that merges "
                                       "overlapping intervals, with a docstring and tests."}])
    p = SamplingParams(temperature=0, max_tokens=96)
    ref = eng.generate(prompt_ids=ids, params=p)
    set_step_costs(eng, [1.0, 1.1, 1.2, 1.3], 0.05)
    out = eng.generate(prompt_ids=ids, params=p, speculative=SpecConfig("mtp", 3).build(eng))
    assert out.tokens == ref.tokens
    h = out.stats.k_hist
    assert h[2] + h[3] >= 0.6 * sum(h), h
