"""Continuous batching: several sequences share one forward per step, each with its own caches and
speculation, and each gets exactly what it gets alone; cancellation and failures stay per request."""
import threading

import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.runtime.scheduler import QueueFull, Scheduler
from mtpllm.speculative import SpecConfig
from tiny import make_tiny

PROMPTS = ["the cat the cat the cat sat on the mat", "a b c a b c a b", "one two three four five six seven",
           "the mat sat on the cat", "x y z", "hello hello hello world world", "dog cat dog cat dog", "zz top"]


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return Engine.load(str(make_tiny(tiny_dir / "sched.gguf", "qwen2", seed=5, nextn=1)), n_ctx=192)


def _solo(eng, ids, params, spec):
    eng.reset()
    out = eng.generate(prompt_ids=ids, params=params, speculative=spec)
    return out.tokens, out.text, out.finish_reason


def _run_all(sched, reqs):
    """Collect every request's responses from client threads, as a server would."""
    res = {}

    def client(i, r):
        rs = list(r)
        res[i] = ([x.token for x in rs if x.token is not None], "".join(x.text for x in rs), rs[-1].finish_reason, rs)

    ts = [threading.Thread(target=client, args=(i, r)) for i, r in enumerate(reqs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    return res


def test_forward_batch_rows_equal_rows_alone(eng):
    """Rows of several sequences in one forward get the hidden states each gets alone, bit for bit."""
    m = eng.model
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:3]]
    solo, caches = [], []
    for t in ids:
        c = m.make_cache(64)
        m(torch.tensor(t[:-3]), c)
        solo.append(m(torch.tensor(t[-3:]), c))
        c2 = m.make_cache(64)
        m(torch.tensor(t[:-3]), c2)
        caches.append(c2)
    rows = [torch.tensor(t[-3:]) for t in ids]
    rows[1] = rows[1][:1]  # 1 row beside 3-row blocks
    solo[1] = solo[1][:1]
    batch = m.forward_batch(rows, caches)
    for a, b in zip(batch, solo):
        assert torch.equal(a, b)
    assert [c.length for c in caches] == [len(t) - 3 + len(r) for t, r in zip(ids, rows)]


@pytest.mark.parametrize("method,k,policy", [(None, 0, None), ("mtp", 3, "fixed"), ("mtp", 3, "cost"),
                                             ("ngram", 2, None)])
def test_batched_greedy_equals_solo(eng, method, k, policy):
    """With the cost policy, verification rows and drafting are made free (the tiny model's measured
    costs would make it decode plainly): each sequence chooses its own draft lengths in the batch."""
    from mtpllm.speculative.policy import set_step_costs
    spec = SpecConfig(method, num_speculative_tokens=k, policy=policy).build(eng) if method else None
    set_step_costs(eng, [1.0] * (k + 1) if policy == "cost" else None, 0.0)
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=12 + 5 * i, ignore_eos=True) for i in range(len(ids))]
    try:
        want = [_solo(eng, i, p, spec) for i, p in zip(ids, params)]
        eng.reset()
        sched = Scheduler(eng, spec, n_slots=3)  # fewer slots than requests: some wait and join later
        try:
            got = _run_all(sched, [sched.submit(i, p) for i, p in zip(ids, params)])
        finally:
            sched.shutdown(1)
    finally:
        set_step_costs(eng, None)
    for i, w in enumerate(want):
        assert got[i][:3] == w, f"request {i}"
    if spec is not None:
        assert sum(g[3][-1].stats.num_drafts for g in got.values()) > 0
    assert sched.steps < sum(len(w[0]) for w in want)  # steps were shared


def test_batched_sampling_with_seed_equals_solo(eng):
    spec = SpecConfig("mtp", num_speculative_tokens=2, policy="fixed").build(eng)
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=16, ignore_eos=True)
              for i in range(4)]
    want = [_solo(eng, i, p, spec) for i, p in zip(ids, params)]
    eng.reset()
    sched = Scheduler(eng, spec, n_slots=4)
    try:
        got = _run_all(sched, [sched.submit(i, p) for i, p in zip(ids, params)])
    finally:
        sched.shutdown(1)
    assert [got[i][:3] for i in range(4)] == want


def test_cancel_frees_the_slot_within_a_step(eng):
    sched = Scheduler(eng, None, n_slots=1)
    try:
        long = sched.submit(eng.tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=150,
                                                                            ignore_eos=True))
        it = iter(long)
        next(it)
        steps = sched.steps
        long.cancel()
        rest = list(it)
        assert rest[-1].finish_reason == "cancelled"
        assert sched.steps <= steps + 2  # the step in flight, and at most one more
        assert len(rest) < 150
        assert not sched.slots_info()[0]["is_processing"]
        short = list(sched.submit(eng.tokenizer.encode(PROMPTS[1]), SamplingParams(temperature=0, max_tokens=3,
                                                                                   ignore_eos=True)))
        assert short[-1].finish_reason == "length"
    finally:
        sched.shutdown(1)


def test_a_failing_request_fails_alone(eng, monkeypatch):
    """An exception in one sequence's step (here: its proposer raises) fails that request with an
    error; the others finish as if it were not there."""
    spec = SpecConfig("ngram", num_speculative_tokens=2).build(eng)
    bad = eng.tokenizer.encode("x y z")
    real = spec.proposer.propose

    def propose(st, history, *a, **kw):
        if history[:len(bad)] == bad:
            raise RuntimeError("draft failure")
        return real(st, history, *a, **kw)

    monkeypatch.setattr(spec.proposer, "propose", propose)
    good = [eng.tokenizer.encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    monkeypatch.undo()
    want = [_solo(eng, i, params, spec) for i in good]
    monkeypatch.setattr(spec.proposer, "propose", propose)
    eng.reset()
    sched = Scheduler(eng, spec, n_slots=3)
    try:
        reqs = [sched.submit(good[0], params), sched.submit(bad, params), sched.submit(good[1], params)]
        out = {}
        for i, r in enumerate(reqs):
            try:
                out[i] = [x.token for x in r if x.token is not None]
            except MtpllmError as e:
                out[i] = e
        assert isinstance(out[1], MtpllmError) and "draft failure" in str(out[1])
        assert out[0] == want[0][0] and out[2] == want[1][0]
    finally:
        sched.shutdown(1)


def test_queue_limit_and_shutdown(eng):
    sched = Scheduler(eng, None, n_slots=1, max_queue=1)
    p = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ids = eng.tokenizer.encode(PROMPTS[2])
    try:
        first = sched.submit(ids, p)
        next(iter(first))  # running: the queue is empty again
        sched.submit(ids, p)
        with pytest.raises(QueueFull):
            sched.submit(ids, p)
    finally:
        sched.shutdown(0.0)  # no time to drain: what is left is cancelled
    assert list(first)[-1].finish_reason in ("cancelled", "length")
    with pytest.raises(MtpllmError, match="shutting down"):
        sched.submit(ids, p)
