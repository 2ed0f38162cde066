"""Continuous batching: several sequences share one forward per step, each with its own caches and
speculation, and each gets exactly what it gets alone; cancellation and failures stay per request."""
import threading

import pytest
import torch

from mtpllm.errors import MtpllmError
from mtpllm.runtime.engine import Engine
from mtpllm.runtime.sampling import SamplingParams
from mtpllm.runtime.scheduler import QueueFull, Scheduler, choose_slot
from mtpllm.runtime.sequence import Slot
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


@pytest.fixture(scope="module")
def eng_q(tiny_dir):
    """A tiny model whose output matrix is quantized too: its MTP head runs on the compressed kernels
    (with a float output matrix the head is built in float32, outside the C++ decode path)."""
    from gguf import GGMLQuantizationType as QT
    return Engine.load(str(make_tiny(tiny_dir / "sched-q8.gguf", "qwen2", seed=5, nextn=1, out_type=QT.Q8_0)),
                       n_ctx=192)


@torch.inference_mode()
def _ready(prop, model, ids):
    """An MTP state that has taken the prompt `ids` (the trunk's hidden states through the head)."""
    hidden = model(torch.tensor(ids), model.make_cache(64))
    st = prop.new_state()
    prop.begin(st, ids, hidden, 0)
    return st


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafting_together_equals_drafting_alone(eng_q, temperature):
    """The MTP head drafts for several sequences in one pass per draft position (its block's weights
    read once for all of them, never its one-sequence forward) and each sequence gets the drafts,
    draft distributions and head cache it gets drafting alone, bit for bit, greedy and sampled."""
    from mtpllm.runtime.sampling import Sampler
    eng = eng_q
    prop = SpecConfig("mtp", num_speculative_tokens=3, policy="fixed").build(eng).proposer
    m = eng.model
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:3]]
    ks = [3, 2, 3]
    params = SamplingParams(temperature=temperature, seed=7)

    alone, together = [_ready(prop, m, t) for t in ids], [_ready(prop, m, t) for t in ids]
    hists = [t + [t[0]] for t in ids]
    smp = [Sampler(params) for _ in ids]
    want = [prop.propose(st, h, k, s) for st, h, k, s in zip(alone, hists, ks, smp)]
    calls = []
    solo_forward = type(prop.head).forward
    prop.head.forward = lambda *a: (calls.append(1), solo_forward(prop.head, *a))[1]
    try:
        smp = [Sampler(params) for _ in ids]
        got = prop.propose_batch(together, hists, ks, smp)
    finally:
        del prop.head.forward
    assert calls == []  # every head pass ran over all sequences at once
    assert [d for d, _ in got] == [d for d, _ in want] and all(len(d) == k for (d, _), k in zip(want, ks))
    for (_, qa), (_, qb) in zip(want, got):
        assert len(qa) == len(qb) and all((a is None and b is None) or torch.equal(a, b) for a, b in zip(qa, qb))
    for a, b in zip(alone, together):
        n = a.cache.length
        assert b.cache.length == n and a.tokens == b.tokens
        assert torch.equal(a.cache.k[:, :, :n], b.cache.k[:, :, :n]) and torch.equal(a.cache.v[:, :, :n], b.cache.v[:, :, :n])


def test_a_failed_batch_of_drafts_leaves_every_state_as_it_was(eng_q):
    """When drafting for several sequences at once raises partway (here one sequence's keep rule,
    after every head cache has taken its catch-up entries and first drafts), every sequence's MTP
    state is rolled back to where it was: the others then draft alone exactly as if the batch had
    never run (the scheduler retries each sequence alone and fails only the faulty one)."""
    from mtpllm.runtime.sampling import Sampler
    eng = eng_q
    prop = SpecConfig("mtp", num_speculative_tokens=3, policy="fixed").build(eng).proposer
    m = eng.model
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0)

    hists = [t + [t[0]] for t in ids]
    fresh, tried = [_ready(prop, m, t) for t in ids], [_ready(prop, m, t) for t in ids]
    before = [(st.cache.length, list(st.tokens), st.pending_h.clone(), st.pending_start) for st in tried]

    def boom(i, p):
        if i == 1:
            raise RuntimeError("keep rule failed")
        return True
    with pytest.raises(RuntimeError, match="keep rule"):
        prop.propose_batch(tried, hists, [3, 3, 3], [Sampler(params) for _ in ids], keeps=[None, boom, None])
    for st, (n, toks, ph, ps) in zip(tried, before):
        assert st.cache.length == n and st.tokens == toks and torch.equal(st.pending_h, ph) and st.pending_start == ps
    for a, b, h in zip(fresh, tried, hists):
        got, want = prop.propose(b, h, 3, Sampler(params)), prop.propose(a, h, 3, Sampler(params))
        assert got[0] == want[0] and len(want[0]) == 3
        n = a.cache.length
        assert b.cache.length == n and torch.equal(a.cache.k[:, :, :n], b.cache.k[:, :, :n])


@pytest.mark.parametrize("k", [0, 2])
def test_a_step_reads_the_output_matrix_once(eng, k):
    """The logits of all sequences' rows in a step come from one pass of the output matrix (per
    sequence it would be read once per sequence), and each sequence still gets its solo tokens."""
    spec = SpecConfig("mtp", num_speculative_tokens=k, policy="fixed").build(eng) if k else None
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    want = [_solo(eng, i, params, spec)[0] for i in ids]
    eng.reset()
    sched = Scheduler(eng, spec, n_slots=3, start=False)
    reqs = [sched.submit(i, params) for i in ids]
    got = [[] for _ in reqs]

    def drain():
        for g, r in zip(got, reqs):
            while not r.queue.empty():
                x = r.queue.get()
                if getattr(x, "token", None) is not None:
                    g.append(x.token)
    for _ in range(50):  # until every prompt is evaluated and has its first token
        sched.step()
        drain()
        if all(got):
            break
    calls, logits = [], eng.model.logits
    eng.model.logits = lambda h: (calls.append(h.shape[0]), logits(h))[1]
    try:
        sched.step()
    finally:
        del eng.model.logits
    assert calls == [3 * (k + 1)]  # every sequence verified its k drafts (fixed policy) in one pass
    for _ in range(50):
        drain()
        if all(len(g) >= 9 for g in got):
            break
        sched.step()
    assert got == want


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


@pytest.mark.parametrize("model", ["eng", "eng_q"])
def test_batched_sampling_with_seed_equals_solo(request, model):
    """Sampled with seeds, each sequence of a batch gets its solo tokens, the MTP head's drafting
    included (eng_q: drafted for all sequences in one pass per position on the compressed kernels)."""
    eng = request.getfixturevalue(model)
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


def test_a_request_cancelled_while_it_waits_never_takes_a_slot(eng):
    """One slot, busy: the second request waits; cancelled there, it ends 'cancelled' with no token
    at the next step and never takes the slot, and the first one goes on to its end."""
    sched = Scheduler(eng, None, n_slots=1)
    try:
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        first = sched.submit(eng.tokenizer.encode(PROMPTS[0]), params)
        it = iter(first)
        head = next(it)
        queued = sched.submit(eng.tokenizer.encode(PROMPTS[1]), params)
        assert sched.queue_depth() == 1
        queued.cancel()
        got = list(queued)
        assert [r.finish_reason for r in got] == ["cancelled"] and got[0].token is None
        assert queued.slot is None and sched.queue_depth() == 0
        rest = list(it)
        assert rest[-1].finish_reason == "length" and sum(r.token is not None for r in [head] + rest) == 60
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
            except RuntimeError as e:  # as raised: a fault, not the request's (the server answers 500)
                out[i] = e
        assert isinstance(out[1], RuntimeError) and "draft failure" in str(out[1])
        assert out[0] == want[0][0] and out[2] == want[1][0]
    finally:
        sched.shutdown(1)


def test_run_on_the_calling_thread(eng):
    """`Scheduler.run(stop)` serves on the caller's thread (as `mtpllm serve` does, on the thread that
    loaded the model) until `stop()` says so; what still runs or waits then is cancelled."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:2]]
    want = [_solo(eng, i, params, None)[0] for i in ids]
    eng.reset()
    sched = Scheduler(eng, None, n_slots=2, start=False)
    finished = []
    sched.listeners.append(lambda req, r: finished.append(req.id))
    reqs = [sched.submit(i, params) for i in ids]
    sched.run(stop=lambda: len(finished) == 2)
    assert [[x.token for x in r if x.token is not None] for r in reqs] == want
    long_ = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    reqs = [sched.submit(ids[0], long_), sched.submit(ids[1], long_), sched.submit(ids[0], long_)]
    steps = sched.steps
    sched.run(stop=lambda: sched.steps >= steps + 3)  # stopped with two running and one waiting
    outs = [list(r) for r in reqs]
    assert [o[-1].finish_reason for o in outs] == ["cancelled"] * 3
    assert sched.steps <= steps + 5 and not sched.running and not sched.waiting
    with pytest.raises(MtpllmError, match="shutting down"):
        sched.submit(ids[0], params)


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


# ---------------------------------------------------------------------------- chunked prefill
CHUNK = 32  # prompt tokens per prefill forward in these tests


@pytest.fixture(scope="module")
def eng_long(tiny_dir):
    e = Engine.load(str(make_tiny(tiny_dir / "sched-long.gguf", "qwen2", seed=5, nextn=1, ctx=1024)), n_ctx=512)
    e.prefill_chunk = CHUNK
    return e


def _solo_stream(eng, ids, params, spec=None):
    eng.reset()
    return [(r.token, r.logprob, r.top_logprobs) for r in eng.stream(ids, params, spec) if r.token is not None]


def _drain(req) -> list:
    out = []
    while not req.queue.empty():
        out.append(req.queue.get())
    return out


@pytest.mark.parametrize("method", [None, "mtp", "draft_model"])
def test_a_long_prefill_does_not_stall_the_others(eng_long, method):
    """A 300-token prompt arrives while another sequence decodes: it is evaluated at most CHUNK
    tokens per step (a draft model's prefill of it too) and the other gets a token in every one of
    those steps; both answers (tokens and log-probabilities) are the ones each gets alone."""
    eng = eng_long
    spec = None
    if method:
        draft = str(eng.model.source) if method == "draft_model" else None
        spec = SpecConfig(method, num_speculative_tokens=2, draft_model=draft).build(eng)
    short = eng.tokenizer.encode("the cat sat")
    long_ = eng.tokenizer.encode("the cat sat on the mat and " * 60)[:300]
    pa = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=2)
    pb = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    want_a, want_b = _solo_stream(eng, short, pa, spec), _solo_stream(eng, long_, pb, spec)
    eng.reset()
    sched = Scheduler(eng, spec, n_slots=2, start=False)  # stepped by hand: the order of events is exact
    a = sched.submit(short, pa)
    sched.step()
    got_a = _drain(a)
    assert got_a and sched.prefill_rows == len(short) * (2 if method == "draft_model" else 1)
    b = sched.submit(long_, pb)
    per_step = []  # (tokens `a` received, prompt tokens evaluated) in each step while `b` prefills
    while b.queue.empty():
        rows = sched.prefill_rows
        sched.step()
        per_step.append((len([r for r in _drain_into(a, got_a) if r.token is not None]), sched.prefill_rows - rows))
        assert len(per_step) < 100
    assert all(n >= 1 for n, _ in per_step)  # a token (or an accepted draft block) in every step
    assert all(0 < rows <= CHUNK for _, rows in per_step)
    drafted = len(long_) if method == "draft_model" else 0  # the draft model's own prefill
    assert sum(rows for _, rows in per_step) == len(long_) + drafted
    if method != "draft_model":
        # ceil(299 / 32) = 10 steps: 9 full chunks, then 11 tokens and the last token alone in one step
        assert len(per_step) == -(-(len(long_) - 1) // CHUNK)
    got_b = _drain(b)
    while got_a[-1].finish_reason is None or not got_b or got_b[-1].finish_reason is None:
        sched.step()
        _drain_into(a, got_a)
        _drain_into(b, got_b)
    key = lambda rs: [(r.token, r.logprob, r.top_logprobs) for r in rs if r.token is not None]  # noqa: E731
    assert key(got_a) == want_a and key(got_b) == want_b
    assert got_b[-1].timings.prompt_n == len(long_) and got_b[-1].timings.prompt_ms > 0


def _drain_into(req, into: list) -> list:
    new = _drain(req)
    into.extend(new)
    return new


def test_chunked_prefill_equals_a_prefill_at_once(eng_long):
    """The scheduler's chunks are the engine's own: a long prompt served through it gives what
    `Engine.stream` gives (tokens and log-probabilities, bit for bit)."""
    eng = eng_long
    ids = eng.tokenizer.encode("one two three four five six seven eight nine ten " * 20)[:200]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    want = _solo_stream(eng, ids, p)
    eng.reset()
    sched = Scheduler(eng, None, n_slots=1)
    try:
        rs = list(sched.submit(ids, p))
    finally:
        sched.shutdown(1)
    assert [(r.token, r.logprob, r.top_logprobs) for r in rs if r.token is not None] == want


def test_cancel_during_prefill_keeps_the_evaluated_prefix(eng_long):
    """A request cancelled while its prompt is evaluated stops within a step; the chunks done so
    far stay in the slot's cache, and the same prompt again reuses them."""
    eng = eng_long
    ids = eng.tokenizer.encode("a b c d e f g h i j k l m n o p " * 20)[:250]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _solo_stream(eng, ids, p)
    eng.reset()
    sched = Scheduler(eng, None, n_slots=1, start=False)
    r = sched.submit(ids, p)
    sched.step()
    sched.step()
    assert r.queue.empty() and sched.slots_info()[0]["is_prefilling"]
    r.cancel()
    sched.step()
    out = _drain(r)
    assert [x.finish_reason for x in out] == ["cancelled"] and not sched.slots_info()[0]["is_processing"]
    assert sched.slots[0].tokens == ids[:2 * CHUNK] and sched.slots[0].cache.length == 2 * CHUNK
    again = sched.submit(ids, p)
    rs = []
    while not rs or rs[-1].finish_reason is None:
        sched.step()
        _drain_into(again, rs)
    assert [(x.token, x.logprob, x.top_logprobs) for x in rs if x.token is not None] == want
    assert rs[-1].timings.cached_n == 2 * CHUNK


def test_chunked_prefill_on_a_hybrid_model(tmp_path):
    """Recurrent (gated delta-net) layers carry their state from chunk to chunk: a prompt prefilled
    in CHUNK-token steps beside a decoding sequence gives both their solo answers."""
    tiny_hybrid = pytest.importorskip("tiny_hybrid")
    pytest.importorskip("transformers")
    d, _ = tiny_hybrid.make_tiny_hf(tmp_path / "q35", "qwen35", mtp=False)
    eng = Engine.load(str(tiny_hybrid.hf_to_gguf(d, tmp_path / "q35.gguf")), n_ctx=256)
    eng.prefill_chunk = CHUNK
    short = [5, 17, 200, 33]
    long_ = [5, 17, 200, 33, 9, 101, 44, 3, 250, 7, 66, 12] * 10
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    want = [_solo_stream(eng, short, p), _solo_stream(eng, long_, p)]
    eng.reset()
    sched = Scheduler(eng, None, n_slots=2, start=False)
    a = sched.submit(short, p)
    sched.step()
    b = sched.submit(long_, p)
    got = [[], []]
    steps = 0
    while not got[1] or got[1][-1].finish_reason is None or got[0][-1].finish_reason is None:
        sched.step()
        steps += 1
        _drain_into(a, got[0])
        _drain_into(b, got[1])
        assert steps < 200
    assert [[(r.token, r.logprob, r.top_logprobs) for r in g if r.token is not None] for g in got] == want


def test_choose_slot_as_llama_server():
    """The slot sharing the longest prefix, when that prefix is over half of what it caches; else the
    least recently used (never used first, then by index)."""
    def slot(i, tokens, used):
        s = Slot(None, i)
        s.tokens, s.last_used = tokens, used
        return s
    a, b, c = slot(0, [1, 2, 3, 4, 5, 6], 5), slot(1, [], 0), slot(2, [1, 2, 9, 9, 9, 9, 9], 3)
    assert choose_slot([a, b, c], [1, 2, 3, 4, 7]) is a  # 4 of a's 6 cached tokens
    assert choose_slot([a, b, c], [1, 2, 3, 8]) is b  # 3 of 6 is not over half: the empty slot
    assert choose_slot([a, c], [1, 2, 3, 8]) is c  # no empty one: the least recently used
    assert choose_slot([a, c], [5]) is c
    d = slot(3, [], 0)
    assert choose_slot([d, b], [1]) is b  # among never used ones, the lowest index
