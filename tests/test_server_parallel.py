"""`mtpllm serve -np N`: requests are decoded together by the scheduler, each with its own
speculation, and each answer equals the same request served alone."""
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
