"""End to end with 8 slots: `mtpllm serve -np 8` as a real process on loopback (a tiny model with an
MTP layer, MTP drafts verified on every step), driven over HTTP by clients running at once.

Cases marked "llama.cpp: FILE::TEST" reproduce a test of llama.cpp's own server suite
(tools/server/tests/unit/FILE) against our endpoints.
"""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from server_proc import metric, metric_sum  # noqa: E402
from tiny import make_tiny  # noqa: E402

CTX = 512
SLOTS = 8
PROMPTS = ["the cat sat", "I believe the meaning", "What is the best book", "def f(x):"]


@pytest.fixture(scope="module")
def srv(tiny_dir, serve_process):
    model = make_tiny(tiny_dir / "np.gguf", "qwen2", seed=5, nextn=1, ctx=CTX)
    # a fixed k: every step of every sequence verifies 3 drafts (rejections roll back each one's own state)
    return serve_process(model, "-np", str(SLOTS), "--spec-type", "draft-mtp", "--spec-draft-n-max", "3",
                         "--spec-policy", "fixed", ctx=CTX)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def stream(url: str, body: dict) -> tuple[str, list[int], set[int], tuple[float, float]]:
    """A streamed /completion: its text, its tokens, the slot ids its chunks named, and when its
    first and last tokens arrived."""
    text, tokens, slots, when = [], [], set(), []
    with httpx.stream("POST", url + "/completion", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                c = json.loads(line[6:])
                assert "error" not in c, c
                text.append(c["content"])
                tokens += c["tokens"]
                slots.add(c["id_slot"])
                if c["tokens"]:
                    when.append(time.monotonic())
    return "".join(text), tokens, slots, (when[0], when[-1])


def at_once(fn, args: list) -> list:
    """fn(*a) for every a in args, all started together; an exception in one is raised here."""
    with ThreadPoolExecutor(len(args)) as ex:
        return list(ex.map(lambda a: fn(*a), args))


def test_eight_streaming_clients_at_once_get_their_solo_answers(srv, http):
    # llama.cpp: test_completion.py::test_completion_parallel_slots,
    # test_speculative.py::test_multi_requests_parallel
    reqs = [dict(prompt=p, n_predict=40, temperature=0, ignore_eos=True) for p in PROMPTS]
    reqs += [dict(prompt=p, n_predict=40, temperature=1.0, seed=100 + i, top_k=0, top_p=1.0, min_p=0.0,
                  ignore_eos=True) for i, p in enumerate(PROMPTS)]
    solo = [stream(srv.url, r)[:2] for r in reqs]
    before = http.get("/metrics").text
    out = at_once(lambda r: stream(srv.url, r), [(r,) for r in reqs])
    assert [o[:2] for o in out] == solo  # byte- and token-identical, greedy and seeded sampling alike
    assert all(len(o[1]) == 40 for o in out)
    slot_ids = [o[2] for o in out]
    assert all(len(s) == 1 for s in slot_ids)  # each request stays on its slot
    assert len(set().union(*slot_ids)) >= 2
    # the requests ran together, not one after another: the last to start did so before the first ended
    assert max(o[3][0] for o in out) < min(o[3][1] for o in out)
    after = http.get("/metrics").text
    assert metric(after, "mtpllm_generated_tokens_total") - metric(before, "mtpllm_generated_tokens_total") == 320
    assert metric(after, "mtpllm_slots_total") == SLOTS and metric(after, "mtpllm_slots_busy") == 0


def test_same_seed_same_result_different_seed_different_result(srv):
    # llama.cpp: test_completion.py::test_consistent_result_same_seed[n_slots=2],
    # ::test_different_result_different_seed[n_slots=2]
    body = dict(prompt="I believe the meaning of life is", n_predict=16, temperature=1.0, top_k=0, top_p=1.0,
                min_p=0.0, ignore_eos=True)
    same = at_once(lambda s: stream(srv.url, {**body, "seed": s})[0], [(42,)] * 4)
    assert len(set(same)) == 1
    other = at_once(lambda s: stream(srv.url, {**body, "seed": s})[0], [(s,) for s in (1, 2, 3, 4)])
    assert len(set(other + same[:1])) > 1


def test_a_new_conversation_takes_a_free_slot_and_an_old_one_finds_its_prefix(srv, http):
    """llama-server's choice of slot: the one caching most of the prompt (if that is most of what
    it caches), else the least recently used, so a new conversation does not evict another's prefix
    while slots are free."""
    a = dict(prompt="the cat sat on the mat and then the cat sat on the dog", n_predict=4, temperature=0)
    b = dict(prompt="What is the best book to read about the sea and its fish", n_predict=4, temperature=0)
    r1 = http.post("/completion", json=a).json()
    r2 = http.post("/completion", json=b).json()
    r3 = http.post("/completion", json=a).json()
    assert r1["id_slot"] != r2["id_slot"] and r3["id_slot"] == r1["id_slot"]
    assert r3["tokens_cached"] == r3["tokens_evaluated"] - 1 and r3["content"] == r1["content"]


def test_a_client_that_leaves_frees_its_slot_while_the_others_go_on(srv, http):
    long = dict(prompt="I believe", n_predict=400, temperature=0, ignore_eos=True)
    before = http.get("/metrics").text
    with ThreadPoolExecutor(1) as ex:
        other = ex.submit(stream, srv.url, {**long, "prompt": "the cat sat"})
        with httpx.stream("POST", srv.url + "/completion", json={**long, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    mine = json.loads(line[6:])["id_slot"]
                    break
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            slots = {s["id"]: s for s in http.get("/slots").json()}
            if not slots[mine]["is_processing"]:
                break
            time.sleep(0.02)
        assert not slots[mine]["is_processing"]
        assert len(other.result(120)[1]) == 400  # the other one went on to its end
    after = http.get("/metrics").text
    cancelled = metric(after, "mtpllm_generations_total", finish="cancelled") - metric(
        before, "mtpllm_generations_total", finish="cancelled")
    generated = metric(after, "mtpllm_generated_tokens_total") - metric(before, "mtpllm_generated_tokens_total")
    assert cancelled == 1 and 400 < generated < 800  # the one that left stopped short of its 400


def test_a_request_asks_for_a_shorter_draft_on_completion(srv, http):
    # llama.cpp: test_speculative.py::test_different_draft_min_draft_max (its speculative.n_max field)
    body = {"prompt": "the cat", "n_predict": 12, "temperature": 0, "ignore_eos": True}
    ref = http.post("/completion", json=body).json()
    drafted = {}
    for k in (0, 1, 3, 16):  # above the server's 3: clamped to it, as llama-server does
        r = http.post("/completion", json={**body, "speculative.n_max": k})
        assert r.status_code == 200 and r.json()["content"] == ref["content"]
        drafted[k] = r.json()["timings"].get("draft_n", 0)
    # every step verifies k drafts (a fixed k): the draft tokens follow the length asked for
    assert drafted[0] == 0 < drafted[1] < drafted[3] == drafted[16] == ref["timings"]["draft_n"]
    r = http.post("/completion", json={**body, "speculative.n_max": "two"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.n_max"


@pytest.mark.slow
def test_real_model_four_clients_at_once_with_default_speculation(serve_process):
    """The shipped 0.5B with its MTP head behind `mtpllm serve -np 4` as users start it (default
    speculation: lookup, else the head, under the cost policy): four chat requests streamed at once
    answer exactly what plain greedy decoding gives each alone."""
    from mtpllm.runtime.engine import Engine
    from mtpllm.runtime.sampling import SamplingParams
    srv = serve_process("qwen2.5-coder-0.5b", "-np", "4", ctx=1024, threads=None, timeout=600)
    tasks = ["Write a Python function that returns the square of a number.",
             "Write a Python function that reverses a string.",
             "Explain what a hash map is in two sentences.",
             "Write a Python function that checks whether a number is prime."]

    def chat(content):
        text = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=600,
                          json={"messages": [{"role": "user", "content": content}], "temperature": 0,
                                "max_tokens": 48, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    c = json.loads(line[6:])
                    text += [ch["delta"].get("content") or "" for ch in c["choices"]]
        return "".join(text)
    out = at_once(chat, [(t,) for t in tasks])
    m = httpx.get(srv.url + "/metrics", timeout=30).text
    assert metric_sum(m, "mtpllm_spec_draft_tokens_total") > 0  # drafts were verified, batched
    eng = Engine.load("qwen2.5-coder-0.5b", n_ctx=1024)
    for t, got in zip(tasks, out):
        ref = eng.generate(messages=[{"role": "user", "content": t}], params=SamplingParams(temperature=0, max_tokens=48))
        assert got == ref.text
