"""The HTTP server on a tiny real GGUF model: OpenAI and llama.cpp endpoints, streaming, speculative
decoding (same tokens as plain), and bad requests answered with 4xx JSON errors."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from mtpllm.runtime.engine import Engine  # noqa: E402
from mtpllm.runtime.sampling import SamplingParams  # noqa: E402
from mtpllm.runtime.sequence import PlainDecoder  # noqa: E402
from mtpllm.server import Server, create_app  # noqa: E402
from mtpllm.speculative import SpecConfig  # noqa: E402
from tiny import make_tiny  # noqa: E402

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.load(str(make_tiny(tiny_dir / "srv.gguf", "qwen2", seed=5, nextn=1)), n_ctx=128)


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(Server(engine, "srv.gguf")))


@pytest.fixture(scope="module")
def spec_client(engine):
    return TestClient(create_app(Server(engine, "srv.gguf", SpecConfig("mtp", 3, policy="fixed"))))


def _events(resp) -> list:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_completions_match_the_engine(client, engine):
    ref = engine.generate("the cat sat", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    r = client.post("/v1/completions", json={"model": "x", "prompt": "the cat sat", **GREEDY})
    assert r.status_code == 200
    d = r.json()
    assert d["object"] == "text_completion" and d["model"] == "srv.gguf"
    assert d["choices"][0]["text"] == ref.text and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 12 and d["usage"]["prompt_tokens"] == ref.prompt_tokens
    # token-id prompts and the llama.cpp endpoint give the same text
    ids = engine.tokenizer.encode("the cat sat")
    assert client.post("/v1/completions", json={"prompt": ids, **GREEDY}).json()["choices"][0]["text"] == ref.text
    c = client.post("/completion", json={"prompt": "the cat sat", "n_predict": 12, "temperature": 0,
                                         "ignore_eos": True}).json()
    assert c["content"] == ref.text and c["stop"] is True and c["tokens_predicted"] == 12
    assert c["stop_type"] == "limit" and c["timings"]["predicted_n"] == 12


def test_streaming_gives_the_same_text(client):
    full = client.post("/v1/completions", json={"prompt": "the cat sat", **GREEDY}).json()["choices"][0]["text"]
    r = client.post("/v1/completions", json={"prompt": "the cat sat", "stream": True, **GREEDY,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = _events(r)
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 12
    chunks = [e for e in ev[:-2]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    ll = _events(client.post("/completion", json={"prompt": "the cat sat", "n_predict": 12, "temperature": 0,
                                                  "ignore_eos": True, "stream": True}))
    assert "".join(e["content"] for e in ll) == full and ll[-1]["stop"] is True


def test_chat_completions(client, engine):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ref = engine.generate(messages=msgs, params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    d = client.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 10,
                                                  "ignore_eos": True}).json()
    assert d["object"] == "chat.completion"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    # content given as text parts: joined with "\n", as llama.cpp's server does
    # (common_chat_msg::to_json_oaicompat with concat_typed_text)
    joined = [msgs[0], {"role": "user", "content": "hello\nthere"}]
    ref2 = engine.generate(messages=joined, params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    ev = _events(client.post("/v1/chat/completions", json={"messages": parts, "temperature": 0, "max_tokens": 10,
                                                           "ignore_eos": True, "stream": True}))
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and ev[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in ev[:-1]) == ref2.text
    assert ev[-2]["choices"][0]["finish_reason"] == "length"


def test_speculative_server_gives_plain_tokens_and_reports(client, spec_client):
    body = {"prompt": "the cat the cat the cat sat on the", **GREEDY}
    plain = client.post("/v1/completions", json=body).json()
    spec = spec_client.post("/v1/completions", json=body).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    t = spec["timings"]
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"] and t["speculative"] == "mtp:3"
    assert "draft_n" not in plain["timings"]
    assert spec_client.get("/props").json()["speculative"] == "mtp:3"


def test_tokenize_models_health(client, engine):
    toks = client.post("/tokenize", json={"content": "the cat"}).json()["tokens"]
    assert toks == engine.tokenizer.encode("the cat", add_special=False)
    assert client.post("/detokenize", json={"tokens": toks}).json()["content"] == "the cat"
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "srv.gguf"
    assert client.get("/props").json()["n_ctx"] == 128


def test_unknown_paths_and_methods(client):
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


class _Hooked(PlainDecoder):
    """Plain decoding that calls `hook(seq)` before each step's commit (on the scheduler's thread)."""

    def __init__(self, hook):
        self.hook = hook

    def commit(self, engine, seq, hidden, forward_ms=0.0, logits=None):
        self.hook(seq)
        return super().commit(engine, seq, hidden, forward_ms, logits)


def _hook_steps(monkeypatch, engine, hook) -> None:
    real = engine.new_sequence

    def new_sequence(*a, **k):
        seq = real(*a, **k)
        seq.decoder = _Hooked(hook)
        return seq
    monkeypatch.setattr(engine, "new_sequence", new_sequence)


def test_a_broken_stream_stops_its_generation(engine, monkeypatch):
    """A client that leaves in the middle of a stream: its generation stops (it does not run on to
    max_tokens holding its slot) and the next request is served."""
    import threading
    server = Server(engine, "srv.gguf")
    c = TestClient(create_app(server))
    gate = threading.Event()
    _hook_steps(monkeypatch, engine, lambda seq: gate.wait(0.02))  # one token per 20 ms
    with c.stream("POST", "/v1/completions", json={"prompt": "the cat", "stream": True, "temperature": 0,
                                                   "max_tokens": 100, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event
    d = c.post("/v1/completions", json={"prompt": "the cat", **GREEDY}).json()
    assert d["usage"]["completion_tokens"] == 12
    assert server.cancelled == 1


def test_cli_serve_rejects_bad_options(capsys):
    from mtpllm.cli import main
    assert main(["serve", "--port", "70000"]) == 1
    assert "--port must be at most 65535" in capsys.readouterr().err
    assert main(["serve", "--spec-type", "bogus"]) == 1
    assert main(["serve", "--shutdown-timeout", "-1"]) == 1
    assert "--shutdown-timeout must be >= 0" in capsys.readouterr().err
    assert main(["serve", "--api-key", "two words"]) == 1
    assert "--api-key must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "-ub", "0"])
    assert e.value.code == 2 and "expected a positive integer" in capsys.readouterr().err


def test_cli_serve_reads_the_key_from_the_environment(monkeypatch, capsys):
    from mtpllm.cli import main
    monkeypatch.setenv("MTPLLM_API_KEY", "bad key")  # checked before the model loads
    assert main(["serve"]) == 1
    assert "--api-key must be" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_command_real_model_with_mtp():
    """`mtpllm serve` as users start it: the default model with its shipped MTP head behind uvicorn,
    an OpenAI chat request over a socket (raw and through the openai package, streaming), the same
    answer as the engine's plain greedy decoding."""
    import socket
    import subprocess
    import sys
    import time
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mtpllm", "serve", "-m", "qwen2.5-coder-0.5b", "-c", "1024",
                             "--port", str(port), "--spec-type", "draft-mtp", "--spec-draft-n-max", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        msgs = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
        d = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 32},
                       timeout=300).json()
        text = d["choices"][0]["message"]["content"]
        assert d["timings"]["draft_n"] > 0 and d["usage"]["completion_tokens"] > 0
        bad = httpx.post(url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
        assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
        # the official client, streaming: the same text; the speculative counters in /metrics
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        chunks = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=msgs, temperature=0,
                                                max_tokens=32, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        from server_proc import metric
        m = httpx.get(url + "/metrics", timeout=30).text
        drafted = metric(m, "mtpllm_spec_draft_tokens_total", method="mtp:2")
        assert drafted >= 2 * d["timings"]["draft_n"] and metric(m, "mtpllm_spec_accepted_tokens_total") > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    eng = Engine.load("qwen2.5-coder-0.5b", n_ctx=1024)
    assert text == eng.generate(messages=msgs, params=SamplingParams(temperature=0, max_tokens=32)).text


def test_an_exception_in_one_request_fails_that_request_only(engine, monkeypatch):
    """A fault inside generation: a 500 with a JSON body for that request (an error event for a stream);
    the server goes on serving."""
    server = Server(engine, "srv.gguf")
    c = TestClient(create_app(server, access_log=False), raise_server_exceptions=False)

    def boom(seq):  # two tokens, then a fault
        if len(seq.history) - len(seq.prompt) >= 2:
            raise RuntimeError("boom")
    with monkeypatch.context() as m:
        _hook_steps(m, engine, boom)
        body = {"prompt": "the cat", "temperature": 0, "max_tokens": 50, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "boom" not in r.text  # internals stay in the server's log
        ev = _events(c.post("/v1/completions", json={**body, "stream": True}))
        assert ev[-1]["error"]["code"] == 500
    assert c.post("/v1/completions", json={"prompt": "the cat", **GREEDY}).json()["usage"]["completion_tokens"] == 12
    assert server.busy == 0 and server.waiting == 0


def test_a_full_queue_is_429_with_retry_after(engine, monkeypatch):
    import threading
    server = Server(engine, "srv.gguf", max_queue=0)  # one generating, none waiting
    c = TestClient(create_app(server, access_log=False))
    gate = threading.Event()
    _hook_steps(monkeypatch, engine, lambda seq: gate.wait(10))  # the first request holds its slot
    out = {}
    t = threading.Thread(target=lambda: out.update(r=c.post("/v1/completions", json={"prompt": "the cat", **GREEDY})))
    t.start()
    for _ in range(3000):  # at most 30 s: a first request that never starts fails the test, not hangs it
        if server.busy:
            break
        gate.wait(0.01)
    assert server.busy == 1
    r = c.post("/v1/completions", json={"prompt": "the cat", **GREEDY})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "busy" in r.json()["error"]["message"]
    gate.set()
    t.join(30)
    assert out["r"].status_code == 200 and server.busy == 0

def _ref_logprobs(engine, ids, n, top):
    engine.reset()
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=top)
    return [(r.token, r.logprob, [tuple(x) for x in r.top_logprobs]) for r in engine.stream(ids, p)
            if r.token is not None]


@pytest.mark.parametrize("spec", [None, "mtp", "ngram"])
def test_logprobs_over_http_are_the_engines(engine, spec):
    """`n_probs` (/completion), `logprobs` (/v1/completions), `logprobs` + `top_logprobs` (chat),
    streamed and not: the engine's plain-decoding values exactly, whatever speculation serves them."""
    c = TestClient(create_app(Server(engine, "srv.gguf", SpecConfig(spec, 3, policy="fixed") if spec else None)))
    prompt = "the cat the cat the cat sat on the"
    ref = _ref_logprobs(engine, engine.tokenizer.encode(prompt), 12, 3)
    assert len(ref) == 12

    # llama.cpp: completion_probabilities [{id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}]
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "ignore_eos": True, "n_probs": 3}
    d = c.post("/completion", json=body).json()
    probs = d["completion_probabilities"]
    assert [(p["id"], p["logprob"], [(a["id"], a["logprob"]) for a in p["top_logprobs"]]) for p in probs] == ref
    assert bytes(b for p in probs for b in p["bytes"]).decode("utf-8", "replace") == d["content"]
    for p in probs:  # the text: the bytes' valid UTF-8 (all of them but a cut character)
        assert p["bytes"] == list(engine.tokenizer.token_bytes(p["id"]))
        assert bytes(p["bytes"]).startswith(p["token"].encode()) and len(p["bytes"]) - len(p["token"].encode()) < 4
    ev = _events(c.post("/completion", json={**body, "stream": True}))
    assert [p for e in ev for p in e.get("completion_probabilities", [])] == probs
    assert "completion_probabilities" not in c.post("/completion", json={**body, "n_probs": 0}).json()

    # OpenAI legacy: {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}
    body = {"prompt": prompt, **GREEDY, "logprobs": 3}
    d = c.post("/v1/completions", json=body).json()["choices"][0]
    lp = d["logprobs"]
    assert lp["token_logprobs"] == [r[1] for r in ref] and len(lp["tokens"]) == 12
    assert all(len(t) <= 3 and max(t.values()) == r[2][0][1] for t, r in zip(lp["top_logprobs"], ref))
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(12)]
    ev = _events(c.post("/v1/completions", json={**body, "stream": True}))
    parts = [e["choices"][0]["logprobs"] for e in ev if e != "[DONE]" and e["choices"]]
    assert [x for p in parts for x in p["token_logprobs"]] == lp["token_logprobs"]
    assert [x for p in parts for x in p["text_offset"]] == lp["text_offset"]
    assert c.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"][
        "top_logprobs"] == [{}] * 12
    assert c.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]["logprobs"] is None

    # OpenAI chat: logprobs.content [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]
    msgs = [{"role": "user", "content": "hello there"}]
    cref = _ref_logprobs(engine, engine.encode_prompt(messages=msgs), 10, 2)
    body = {"messages": msgs, "temperature": 0, "max_tokens": 10, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2}
    d = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = d["logprobs"]["content"]
    assert [(e["logprob"], [a["logprob"] for a in e["top_logprobs"]]) for e in content] == \
        [(r[1], [a[1] for a in r[2]]) for r in cref]
    assert [e["bytes"] for e in content] == [list(engine.tokenizer.token_bytes(r[0])) for r in cref]
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    ev = _events(c.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = [x for e in ev[1:] if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]
                for x in e["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    d = c.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert d["choices"][0]["logprobs"] is None
    d = c.post("/v1/chat/completions", json={**body, "top_logprobs": 0}).json()
    assert all(e["top_logprobs"] == [] for e in d["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_token_bytes_spell_the_text(tiny_models, arch):
    """The bytes of each token (byte-level BPE; SentencePiece with byte fallback and '▁' for
    spaces) put together are the text's UTF-8: what log-probabilities report per token."""
    from mtpllm.gguf import GGUFFile
    from mtpllm.tokenizer import GGUFTokenizer
    g = GGUFFile(tiny_models[arch])
    tok = GGUFTokenizer(g.metadata, g.arch)
    text = "the cat  sat on \u00e9t\u00e9 \u4e2d"
    ids = tok.encode(text, add_special=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)  # a cut character
