"""`mtpllm serve -np N`: requests are decoded together by the scheduler, each with its own
speculation, and each answer equals the same request served alone."""
import json
import threading

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from mtpllm.runtime.engine import Engine  # noqa: E402
from mtpllm.server import Server, create_app  # noqa: E402
from mtpllm.speculative import SpecConfig  # noqa: E402
from tiny import make_tiny  # noqa: E402

PROMPTS = ["the cat sat", "a b c a b c", "one two three", "dog cat dog cat"]


@pytest.fixture(scope="module")
def model(tiny_dir):
    return str(make_tiny(tiny_dir / "par.gguf", "qwen2", seed=5, nextn=1))


def _answers(client, n_tokens, seeds=None):
    out = {}

    def one(i):
        body = {"prompt": PROMPTS[i], "max_tokens": n_tokens, "temperature": 0 if seeds is None else 0.9,
                "ignore_eos": True}
        if seeds is not None:
            body["seed"] = seeds[i]
        r = client.post("/v1/completions", json=body)
        out[i] = (r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    return [out[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("seeds", [None, [3, 4, 5, 6]])
def test_parallel_slots_answer_as_alone(model, seeds):
    alone = Engine.load(model, n_ctx=128)
    with TestClient(create_app(Server(alone, "par", SpecConfig("mtp", 3, policy="fixed")), webui=False, access_log=False)) as c:
        want = [_answers_one(c, i, seeds) for i in range(len(PROMPTS))]
    eng = Engine.load(model, n_ctx=128)
    server = Server(eng, "par", SpecConfig("mtp", 3, policy="fixed"), parallel=3)
    try:
        with TestClient(create_app(server, webui=False, access_log=False)) as c:
            got = _answers(c, 20, seeds)
            slots = c.get("/slots").json()
            props = c.get("/props").json()
        assert got == want
        assert len(slots) == 3 and not any(s["is_processing"] for s in slots)
        assert props["total_slots"] == 3
        assert server.scheduler.steps < 4 * 20  # the requests shared forward passes
    finally:
        server.scheduler.shutdown(1)


def _answers_one(client, i, seeds):
    body = {"prompt": PROMPTS[i], "max_tokens": 20, "temperature": 0 if seeds is None else 0.9, "ignore_eos": True}
    if seeds is not None:
        body["seed"] = seeds[i]
    r = client.post("/v1/completions", json=body)
    return (r.status_code, r.json()["choices"][0]["text"])


def test_metrics_add_up_after_concurrent_requests(model):
    """Six streamed requests at once on three slots, with a chain of methods (n-gram lookup, then
    MTP) and some asking for a shorter draft: /metrics' speculative counters (totals, per draft
    position, per member of the chain) are the sums of the statistics each answer carries."""
    pytest.importorskip("prometheus_client")
    from server_proc import metric_sum
    eng = Engine.load(model, n_ctx=128)
    server = Server(eng, "par", SpecConfig("ngram", 2, fallback=SpecConfig("mtp", 3, policy="fixed"), policy="fixed"), parallel=3)
    label = server.spec_label
    out = [None] * 6

    def one(c, i):
        body = {"prompt": PROMPTS[i % 4] * 2, "max_tokens": 14 + i, "temperature": 0 if i % 2 else 0.8, "seed": i,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if i % 3 == 2:
            body["speculative"] = {"num_speculative_tokens": 1}
        ev = [json.loads(x[6:]) for x in c.post("/v1/completions", json=body).text.splitlines()
              if x.startswith("data: ") and x != "data: [DONE]"]
        fin = [e for e in ev if e["choices"] and e["choices"][0]["finish_reason"]]
        out[i] = (fin[0]["mtpllm"]["stats"], ev[-1]["usage"]["completion_tokens"])

    try:
        with TestClient(create_app(server, webui=False, access_log=False)) as c:
            before = c.get("/metrics").text
            ts = [threading.Thread(target=one, args=(c, i)) for i in range(6)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=120)
            after = c.get("/metrics").text
    finally:
        server.scheduler.shutdown(1)
    stats = [s for s, _ in out]

    def d(name, **labels):
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert d("mtpllm_generated_tokens_total") == sum(n for _, n in out) == sum(14 + i for i in range(6))
    assert d("mtpllm_generations_total", finish="length") == 6
    total = {k: sum(s[k] for s in stats) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert total["num_drafts"] > 0 and total["num_accepted_tokens"] > 0
    assert d("mtpllm_spec_drafts_total", method=label) == total["num_drafts"]
    assert d("mtpllm_spec_draft_tokens_total", method=label) == total["num_draft_tokens"]
    assert d("mtpllm_spec_accepted_tokens_total", method=label) == total["num_accepted_tokens"]
    for key, name in (("drafted_per_pos", "mtpllm_spec_drafted_tokens_per_position_total"),
                      ("accepted_per_pos", "mtpllm_spec_accepted_tokens_per_position_total")):
        for pos in range(3):
            want = sum(s[key][pos] for s in stats if len(s[key]) > pos)
            assert d(name, method=label, position=str(pos)) == want, (key, pos)
        assert d(name, method=label) == sum(sum(s[key]) for s in stats)
    assert sum(sum(s["drafted_per_pos"]) for s in stats) == total["num_draft_tokens"]
    assert sum(sum(s["accepted_per_pos"]) for s in stats) == total["num_accepted_tokens"]
    members = {m for s in stats for m in s.get("members", {})}
    assert members <= {"ngram", "mtp"} and "mtp" in members
    for m in members:
        for field in ("drafts", "draft_tokens", "accepted_tokens"):
            want = sum(s.get("members", {}).get(m, {}).get(field, 0) for s in stats)
            assert d(f"mtpllm_spec_member_{field}_total", method=label, member=m) == want, (m, field)
    assert sum(d("mtpllm_spec_member_drafts_total", method=label, member=m) for m in members) == total["num_drafts"]
