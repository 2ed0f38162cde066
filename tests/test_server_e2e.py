"""End to end: `mtpllm serve` as a real process on loopback (a tiny model with an MTP layer, MTP
speculation on, an API key and one CORS origin), driven by the official `openai` package and raw
HTTP. One server process for the module.

Cases marked "llama.cpp: FILE::TEST" reproduce a test of llama.cpp's own server suite
(tools/server/tests/unit/FILE) against our endpoints.
"""
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from mtpllm.runtime.engine import Engine  # noqa: E402
from mtpllm.runtime.sampling import SamplingParams  # noqa: E402
from server_proc import metric, metric_sum  # noqa: E402
from tiny import make_tiny  # noqa: E402

KEY = "sk-test-key-31"
ORIGIN = "http://allowed.example"
CTX = 512
UBATCH = 64  # -ub: long prompts (up to CTX) are evaluated in chunks between decoding steps
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tiny_dir):
    return make_tiny(tiny_dir / "e2e.gguf", "qwen2", seed=5, nextn=1, ctx=CTX)


@pytest.fixture(scope="module")
def srv(model, serve_process):
    # every step verifies 2 drafts (a fixed k): the random head's drafts are rejected, which keeps a
    # 450-token answer slower than the 0.5 s a leaving client waits for it
    return serve_process(model, "--api-key", KEY, "--cors-origin", ORIGIN, "--spec-type", "draft-mtp",
                         "--spec-draft-n-max", "2", "--spec-policy", "fixed", "-ub", str(UBATCH), ctx=CTX)


@pytest.fixture(scope="module")
def engine(model):
    e = Engine.load(str(model), n_ctx=CTX)
    e.prefill_chunk = UBATCH  # the server's prompt chunks: the same results, bit for bit
    return e


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(api_key=KEY, base_url=srv.url + "/v1", max_retries=0, timeout=120)


def greedy(engine, n, prompt=None, messages=None):
    ids = engine.encode_prompt(messages=messages) if messages else engine.tokenizer.encode(prompt)
    return engine.generate(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


# ------------------------------------------------------------------------ the openai package
def test_openai_chat_completion(oai, engine):
    # llama.cpp: test_chat_completion.py::test_chat_completion_with_openai_library
    ref = greedy(engine, 8, messages=CHAT)
    r = oai.chat.completions.create(model="anything", messages=CHAT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and len(r.choices) == 1
    assert r.system_fingerprint.startswith("fp_") and r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == ref.prompt_tokens
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens  # the last is always evaluated
    # the same conversation again: its prompt comes from the cache, all but the last token
    r2 = oai.chat.completions.create(model="anything", messages=CHAT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens_details.cached_tokens == ref.prompt_tokens - 1
    assert r2.choices[0].message.content == ref.text


def test_openai_chat_stream_equals_non_stream(oai):
    # llama.cpp: test_chat_completion.py::test_chat_completion_stream
    whole = oai.chat.completions.create(model="m", messages=CHAT, max_tokens=10, temperature=0)
    full = whole.choices[0]
    chunks = list(oai.chat.completions.create(model="m", messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert len({c.id for c in chunks}) == 1 and all(c.system_fingerprint == chunks[0].system_fingerprint
                                                     for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.message.content
    fins = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert fins == [full.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0


def test_openai_completions_and_stream(oai, engine):
    # llama.cpp: test_completion.py::test_completion_with_openai_library, ::test_completion_stream_with_openai_library
    ref = greedy(engine, 8, prompt="I believe the meaning of life is")
    r = oai.completions.create(model="davinci-002", prompt="I believe the meaning of life is", max_tokens=8,
                               temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.system_fingerprint is not None
    out = ""
    for c in oai.completions.create(model="davinci-002", prompt="I believe the meaning of life is", max_tokens=8,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
        if c.choices[0].finish_reason is None:
            out += c.choices[0].text
    assert out == ref.text


def test_openai_models(oai, model):
    # llama.cpp: test_basic.py::test_server_models
    ms = oai.models.list().data
    assert len(ms) == 1 and ms[0].id == model.name


def test_openai_errors_are_typed(oai, srv):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=CHAT, n=2)
    assert "'n'" in e.value.message
    bad = openai.OpenAI(api_key="wrong", base_url=srv.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_logit_bias_through_http(oai, engine, http):
    # llama.cpp: test_chat_completion.py::test_logit_bias (a +100 bias instead of bans: it must show)
    ref = greedy(engine, 6, messages=CHAT)
    target = next(t for t in range(300) if t not in ref.tokens)
    r = oai.chat.completions.create(model="m", messages=CHAT, max_tokens=6, temperature=0,
                                    logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == engine.tokenizer.decode([target] * 6, skip_special=True)
    # llama.cpp's forms on /completion: [[id, bias]] and `false` bans
    d = http.post("/completion", json={"prompt": "What is the best book", "n_predict": 6, "temperature": 0,
                                       "ignore_eos": True, "return_tokens": True,
                                       "logit_bias": [[target, 100]]}).json()
    assert d["tokens"] == [target] * 6
    first = greedy(engine, 1, prompt="What is the best book").tokens[0]
    d = http.post("/completion", json={"prompt": "What is the best book", "n_predict": 4, "temperature": 0,
                                       "ignore_eos": True, "return_tokens": True,
                                       "logit_bias": [[first, False]]}).json()
    assert first not in d["tokens"]
    # a text key biases its token (llama.cpp: [["text", bias]] and {"text": bias})
    tok = engine.tokenizer
    word = next(t for t in range(300) if t not in ref.tokens and tok.decode([t]).isalpha()
                and tok.encode(tok.decode([t]), add_special=False) == [t])
    text = tok.decode([word])
    for bias in ([[text, 100]], {text: 100}):
        d = http.post("/completion", json={"prompt": "What is the best book", "n_predict": 3, "temperature": 0,
                                           "ignore_eos": True, "return_tokens": True, "logit_bias": bias}).json()
        assert d["tokens"] == [word] * 3, bias


def test_logprobs_through_the_openai_package(oai, engine, http):
    """Chat `logprobs`/`top_logprobs` and /completion's `n_probs` from the MTP server: the plain
    engine's values; the same request with speculation off for it (k = 0) gives the same again."""
    ids = engine.encode_prompt(messages=CHAT)
    engine.reset()
    ref = [r for r in engine.stream(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=4))
           if r.token is not None]
    kw = dict(model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4)
    r = oai.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    # another process (its own thread count): equal up to float summation order
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in ref], abs=1e-4)
    assert [[a.logprob for a in c.top_logprobs] for c in content] == \
        [pytest.approx([v for _, v in x.top_logprobs], abs=1e-4) for x in ref]
    assert [bytes(c.bytes) for c in content] == [engine.tokenizer.token_bytes(x.token) for x in ref]
    off = oai.chat.completions.create(**kw, extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 0}})
    assert off.choices[0].logprobs.content == content
    streamed = [c for ch in oai.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
                if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert streamed == content
    d = http.post("/completion", json={"prompt": ids, "n_predict": 8, "temperature": 0, "ignore_eos": True,
                                       "n_probs": 4}).json()
    probs = d["completion_probabilities"]
    assert [p["id"] for p in probs] == [x.token for x in ref]
    assert [p["logprob"] for p in probs] == [c.logprob for c in content]  # the server's own: bit for bit
    assert [[a["id"] for a in p["top_logprobs"]] for p in d["completion_probabilities"]] == \
        [[i for i, _ in x.top_logprobs] for x in ref]


def _check_prob(tok, n_top, with_id=True):
    assert isinstance(tok["token"], str) and tok["logprob"] <= 0.0 and isinstance(tok["bytes"], list)
    assert bytes(tok["bytes"]).decode("utf-8", "ignore").startswith(tok["token"]) and (not with_id or tok["id"] >= 0)
    assert len(tok["top_logprobs"]) == n_top
    for p in tok["top_logprobs"]:
        assert isinstance(p["token"], str) and p["logprob"] <= 0.0 and isinstance(p["bytes"], list)
        assert not with_id or p["id"] >= 0


def test_n_probs_and_stream(http):
    # llama.cpp: test_completion.py::test_n_probs, ::test_n_probs_stream
    body = {"prompt": "I believe the meaning of life is", "n_probs": 10, "temperature": 0.0, "n_predict": 5,
            "ignore_eos": True}
    d = http.post("/completion", json=body).json()
    assert len(d["completion_probabilities"]) == 5
    for tok in d["completion_probabilities"]:
        _check_prob(tok, 10)
    streamed = []
    with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                e = json.loads(line[6:])
                if not e["stop"]:
                    assert len(e["completion_probabilities"]) == 1
                    streamed += e["completion_probabilities"]
    assert streamed == d["completion_probabilities"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(oai, stream):
    # llama.cpp: test_chat_completion.py::test_logprobs, ::test_logprobs_stream (the tokens' bytes
    # spell the answer: a token may hold part of a character, which its `token` text leaves out)
    res = oai.chat.completions.create(model="gpt-3.5-turbo-instruct", temperature=0.0, messages=CHAT, max_tokens=5,
                                      logprobs=True, top_logprobs=10, stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = [c for c in res if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        content = []
        for c in chunks[1:]:
            assert c.choices[0].delta.role is None and c.choices[0].logprobs is not None
            content += c.choices[0].logprobs.content
    else:
        text, content = res.choices[0].message.content, res.choices[0].logprobs.content
    assert len(content) == 5
    for t in content:
        _check_prob(t.model_dump(), 10, with_id=False)
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == text


# ------------------------------------------------------------------------ llama.cpp endpoints
def test_completion_fields(http, engine):
    # llama.cpp: test_completion.py::test_completion (return_tokens, truncated, has_new_line, timings)
    ref = greedy(engine, 8, prompt="I believe the meaning of life is")
    for return_tokens in (False, True):
        d = http.post("/completion", json={"prompt": "I believe the meaning of life is", "n_predict": 8,
                                           "temperature": 0, "ignore_eos": True, "return_tokens": return_tokens,
                                           "cache_prompt": False}).json()
        assert d["content"] == ref.text and d["stop"] is True and d["truncated"] is False
        assert d["tokens"] == (ref.tokens if return_tokens else [])
        assert d["timings"]["predicted_n"] == 8 and d["tokens_predicted"] == 8
        assert d["tokens_evaluated"] == ref.prompt_tokens and isinstance(d["has_new_line"], bool)
        assert d["stop_type"] == "limit" and d["generation_settings"]["n_predict"] == 8
        assert d["timings"]["draft_n"] >= d["timings"]["draft_n_accepted"] >= 0


def test_completion_stream(http, engine):
    # llama.cpp: test_completion.py::test_completion_stream and ::test_completion_stream_vs_non_stream
    body = {"prompt": "I believe the meaning of life is", "n_predict": 8, "temperature": 0, "ignore_eos": True}
    full = http.post("/completion", json=body).json()
    content, finals = "", []
    with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            assert isinstance(data["stop"], bool)
            if data["stop"]:
                finals.append(data)
            else:
                assert len(data["tokens"]) > 0 and all(isinstance(t, int) for t in data["tokens"])
                content += data["content"]
    assert content == full["content"] and len(finals) == 1
    f = finals[0]
    assert f["stop_type"] == "limit" and f["timings"]["predicted_n"] == 8 and f["truncated"] is False
    assert f["generation_settings"]["n_predict"] == 8 and "seed" in f["generation_settings"]


def test_stop_word_and_eos_stop_types(http, engine):
    ref = greedy(engine, 12, prompt="the cat")
    word = ref.text[3:5]  # a stop string that occurs in the output
    d = http.post("/completion", json={"prompt": "the cat", "n_predict": 12, "temperature": 0, "ignore_eos": True,
                                       "stop": [word]}).json()
    assert d["stop_type"] == "word" and d["stopping_word"] == word and word not in d["content"]
    assert d["content"] == ref.text[:ref.text.index(word)]


def test_consistent_result_same_seed(http):
    # llama.cpp: test_completion.py::test_consistent_result_same_seed and ::test_different_result_different_seed
    outs = [http.post("/completion", json={"prompt": "I believe the meaning of life is", "seed": 42,
                                           "temperature": 1.0, "n_predict": 16, "ignore_eos": True,
                                           "top_k": 0, "top_p": 1.0, "min_p": 0.0}).json()["content"]
            for _ in range(3)]
    assert outs[0] == outs[1] == outs[2]
    others = {http.post("/completion", json={"prompt": "I believe the meaning of life is", "seed": s,
                                             "temperature": 1.0, "n_predict": 16, "ignore_eos": True,
                                             "top_k": 0, "top_p": 1.0, "min_p": 0.0}).json()["content"]
              for s in range(4)}
    assert len(others) > 1


def test_completion_with_tokens_input(http):
    # llama.cpp: test_completion.py::test_completion_with_tokens_input (one prompt per request here:
    # several prompts in one list are refused with a 400)
    s = "I believe the meaning of life is"
    tokens = http.post("/tokenize", json={"content": s, "add_special": True}).json()["tokens"]
    base = {"n_predict": 6, "temperature": 0, "ignore_eos": True}
    a = http.post("/completion", json={"prompt": tokens, **base}).json()["content"]
    b = http.post("/completion", json={"prompt": s, **base}).json()["content"]
    assert a == b
    mixed = http.post("/completion", json={"prompt": [1, 2, 3, s], **base})
    assert mixed.status_code == 200 and isinstance(mixed.json()["content"], str)
    r = http.post("/completion", json={"prompt": [tokens, tokens], **base})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_nocache_long_input_prompt(http):
    # llama.cpp: test_completion.py::test_nocache_long_input_prompt
    r = http.post("/completion", json={"prompt": "I believe the meaning of life is" * 200, "seed": 42,
                                       "temperature": 1.0, "cache_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"


def test_tokenize_detokenize_and_pieces(http, engine):
    # llama.cpp: test_tokenize.py::test_tokenize_detokenize, ::test_tokenize_with_pieces
    content = "What is the capital of France ?"
    toks = http.post("/tokenize", json={"content": content}).json()["tokens"]
    assert toks == engine.tokenizer.encode(content, add_special=False) and len(toks) > 5
    assert http.post("/detokenize", json={"tokens": toks}).json()["content"].strip() == content
    pieces = http.post("/tokenize", json={"content": "This is a test string with unicode 媽 and emoji 🤗",
                                          "with_pieces": True}).json()["tokens"]
    assert all("id" in p and "piece" in p for p in pieces)


def test_apply_template_and_chat_parts(http, engine):
    # llama.cpp: test_chat_completion.py::test_apply_chat_template; text parts joined with "\n"
    msgs = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    p = http.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert p == engine.tokenizer.apply_chat_template(msgs)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best"}]}]
    p2 = http.post("/apply-template", json={"messages": parts}).json()["prompt"]
    assert p2 == engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is\nthe best"}])


def test_assistant_prefill(http, engine):
    # llama.cpp: test_chat_completion.py::test_chat_template_assistant_prefill
    msgs = CHAT + [{"role": "assistant", "content": [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]}]
    p = http.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert p == engine.tokenizer.apply_chat_template(CHAT) + "Wh\nill"
    d = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True}).json()
    ids = engine.tokenizer.encode(p)
    ref = engine.generate(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert d["choices"][0]["message"]["content"] == ref.text and d["usage"]["prompt_tokens"] == len(ids)


def test_props_slots_and_aliases(http, model):
    # llama.cpp: test_basic.py::test_server_props, ::test_server_slots
    p = http.get("/props").json()
    assert p["model_path"] == model.name and p["total_slots"] == 1
    assert p["default_generation_settings"]["n_ctx"] == CTX and "seed" in p["default_generation_settings"]["params"]
    s = http.get("/slots").json()
    assert len(s) == 1 and s[0]["n_ctx"] == CTX and s[0]["is_processing"] is False
    # /v1-less aliases as llama-server has them
    assert http.get("/models").json()["data"][0]["id"] == model.name
    r = http.post("/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = http.post("/completions", json={"prompt": "hi", "n_predict": 2})  # llama.cpp's format, as llama-server
    assert r.status_code == 200 and "content" in r.json()


def test_model_field_is_only_echoed(http, model):
    """No request field reads files or loads models: a path in `model` is not opened."""
    for m in ("/etc/passwd", "../../../../root/x.gguf", "qwen2.5-coder-0.5b", "http://example.com/m.gguf"):
        r = http.post("/v1/chat/completions", json={"model": m, "messages": CHAT, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == model.name


# ------------------------------------------------------------------------ security
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer invalid-key"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_api_key_required(srv, headers):
    # llama.cpp: test_security.py::test_incorrect_api_key
    for method, path in (("POST", "/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/metrics"), ("GET", "/slots"), ("GET", "/props"), ("POST", "/tokenize")):
        r = httpx.request(method, srv.url + path, json={"prompt": "I believe"}, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_api_key_accepted_and_health_public(srv):
    # llama.cpp: test_security.py::test_access_public_endpoint, ::test_correct_api_key,
    # ::test_correct_api_key_anthropic_header
    assert httpx.get(srv.url + "/health").status_code == 200
    for h in (AUTH, {"X-Api-Key": KEY}):
        r = httpx.post(srv.url + "/completions", json={"prompt": "I believe", "n_predict": 2}, headers=h)
        assert r.status_code == 200 and "content" in r.json()


def test_api_key_from_the_environment_is_enforced(model, serve_process):
    """MTPLLM_API_KEY (no --api-key, so the key stays out of the process list) guards the server
    as the flag does; /health stays public."""
    env_srv = serve_process(model, "--spec-type", "none", ctx=CTX, env={"MTPLLM_API_KEY": "sk-from-env"})
    body = {"prompt": "I believe", "n_predict": 2}
    assert httpx.post(env_srv.url + "/completion", json=body).status_code == 401
    assert httpx.post(env_srv.url + "/completion", json=body, headers=AUTH).status_code == 401
    r = httpx.post(env_srv.url + "/completion", json=body, headers={"Authorization": "Bearer sk-from-env"})
    assert r.status_code == 200 and "content" in r.json()
    assert httpx.get(env_srv.url + "/health").status_code == 200
    env_srv.stop()


def test_cors(srv):
    # llama.cpp: test_security.py::test_cors_options (only the configured origin is allowed)
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    r = httpx.options(srv.url + "/completions", headers={"Origin": ORIGIN, **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(srv.url + "/completions", headers={"Origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(srv.url + "/health", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(srv.url + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


# ------------------------------------------------------------------------ faults
def _raw(srv, payload: bytes) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", content=payload,
                      headers={**AUTH, "content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("payload,field", [
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "top_p": NaN}', "top_p"),
    (b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", None),
])
def test_inputs_that_used_to_500_are_400s_over_a_socket(srv, payload, field):
    r = _raw(srv, payload)
    assert r.status_code == 400 and r.json()["error"].get("param") == field
    assert httpx.get(srv.url + "/health").status_code == 200


def test_body_limit_keeps_health_responsive(srv):
    """A 20 MB prompt is refused at once (413, from Content-Length) without reading it into memory."""
    t0 = time.perf_counter()
    r = _raw(srv, b'{"prompt": "' + b"a" * (20 << 20) + b'"}')
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    assert time.perf_counter() - t0 < 60


def _wait_idle(http, timeout=20.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not http.get("/slots").json()[0]["is_processing"]:
            return True
        time.sleep(0.05)
    return False


def test_a_non_streaming_client_that_leaves_cancels_its_generation(srv, http):
    # llama.cpp: test_completion.py::test_cancel_request
    before = http.get("/metrics").text
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/completion", json={"prompt": "I believe the meaning of life is", "n_predict": 450,
                                                  "ignore_eos": True, "temperature": 0}, headers=AUTH, timeout=0.5)
    assert _wait_idle(http)
    after = http.get("/metrics").text
    cancelled = metric(after, "mtpllm_generations_total", finish="cancelled") - metric(
        before, "mtpllm_generations_total", finish="cancelled")
    generated = metric(after, "mtpllm_generated_tokens_total") - metric(before, "mtpllm_generated_tokens_total")
    assert cancelled == 1 and generated < 450


def test_a_streaming_client_that_leaves_cancels_its_generation(srv, http):
    before = http.get("/metrics").text
    with httpx.stream("POST", srv.url + "/v1/completions", headers=AUTH, timeout=30,
                      json={"prompt": "I believe", "max_tokens": 450, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert _wait_idle(http)
    after = http.get("/metrics").text
    assert metric(after, "mtpllm_generations_total", finish="cancelled") - metric(
        before, "mtpllm_generations_total", finish="cancelled") == 1
    assert metric(after, "mtpllm_generated_tokens_total") - metric(before, "mtpllm_generated_tokens_total") < 450


def test_concurrent_clients_get_their_solo_answers(oai):
    """8 streaming clients at once (MTP on): greedy ones byte-identical to the same request alone,
    sampled ones with a seed equal to their solo runs."""
    prompts = ["the cat sat", "I believe the meaning", "What is the best book", "def f(x):"]
    reqs = [dict(prompt=p, max_tokens=12, temperature=0) for p in prompts]
    reqs += [dict(prompt=p, max_tokens=12, temperature=1.0, seed=100 + i, top_p=1.0) for i, p in enumerate(prompts)]

    def run(kw):
        return "".join(c.choices[0].text for c in oai.completions.create(
            model="m", stream=True, **kw, extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0}))
    solo = [run(kw) for kw in reqs]
    out = [None] * len(reqs)

    def worker(i):
        out[i] = run(reqs[i])
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out == solo


# ------------------------------------------------------------------------ observability
def test_metrics_add_up(http):
    # llama.cpp: test_metrics.py (its counters, under our names)
    before = http.get("/metrics").text
    n = 0
    for p in ("the cat", "a dog"):
        n += http.post("/v1/completions", json={"prompt": p, "max_tokens": 7, "temperature": 0,
                                                "ignore_eos": True}).json()["usage"]["completion_tokens"]
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = r.text
    d = lambda name, **lb: metric_sum(after, name, **lb) - metric_sum(before, name, **lb)  # noqa: E731
    assert n == 14 and d("mtpllm_generated_tokens_total") == 14
    assert d("mtpllm_requests_total", endpoint="/v1/completions", status="200") == 2
    assert d("mtpllm_time_to_first_token_seconds_count") == 2
    assert d("mtpllm_time_per_output_token_seconds_count") == 12  # 6 gaps per 7-token request
    assert metric(after, "mtpllm_slots_total") == 1 and metric(after, "mtpllm_slots_busy") == 0
    assert metric(after, "mtpllm_requests_waiting") == 0
    m = "mtp:2"
    drafted, accepted = d("mtpllm_spec_draft_tokens_total", method=m), d("mtpllm_spec_accepted_tokens_total", method=m)
    assert drafted > 0 and 0 <= accepted <= drafted and d("mtpllm_spec_drafts_total", method=m) > 0
    assert d("mtpllm_spec_drafted_tokens_per_position_total", method=m) == drafted
    assert d("mtpllm_spec_accepted_tokens_per_position_total", method=m) == accepted
    assert metric(after, "mtpllm_requests_total", endpoint="(unauthorized)", status="401") >= 0


def test_access_log_lines(srv, http):
    http.post("/v1/completions", json={"prompt": "log me", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    time.sleep(0.2)
    lines = [json.loads(x) for x in srv.log().splitlines() if x.startswith('{"ts"')]
    mine = [x for x in lines if x["path"] == "/v1/completions" and x.get("completion_tokens") == 3]
    assert mine and mine[-1]["method"] == "POST" and mine[-1]["status"] == 200 and mine[-1]["duration_ms"] > 0
    assert mine[-1]["prompt_tokens"] > 0 and mine[-1]["finish"] == "length" and mine[-1]["id"].startswith("cmpl-")
    assert any(x["status"] == 401 for x in lines)


def test_chat_completion_with_timings_per_token(http):
    # llama.cpp: test_chat_completion.py::test_chat_completion_with_timings_per_token
    events = []
    with http.stream("POST", "/v1/chat/completions", json={
            "max_tokens": 10, "messages": [{"role": "user", "content": "test"}], "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" not in events[0]
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:] if e["choices"])
    assert all("timings" in e for e in events[1:])
    last = events[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] <= 10 and "predicted_per_second" in last["timings"]


def test_completion_response_fields(http):
    # llama.cpp: test_completion.py::test_completion_response_fields
    d = http.post("/completion", json={"prompt": "I believe the meaning of life is", "n_predict": 8,
                                       "response_fields": ["content", "generation_settings/n_predict", "prompt"]}).json()
    assert set(d) == {"content", "generation_settings/n_predict", "prompt"}
    assert d["generation_settings/n_predict"] == 8 and d["prompt"] == "I believe the meaning of life is"
    full = http.post("/completion", json={"prompt": "I believe the meaning of life is", "n_predict": 8,
                                          "ignore_eos": True}).json()
    assert "generation_settings" in full and len(full["content"]) > 0


def test_default_bind_is_loopback_only(srv):
    """Started without --host: reachable on 127.0.0.1, not on this machine's network address."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            ip = None
    if ip is None or ip.startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{ip}:{srv.port}/health", timeout=2)
    assert httpx.get(f"http://127.0.0.1:{srv.port}/health").status_code == 200


@pytest.mark.parametrize("n_predict,fills", [(64, False), (-1, True)])
def test_generation_to_the_end_of_the_context(http, n_predict, fills):
    # llama.cpp: test_ctx_shift.py::test_ctx_shift_disabled_short_prompt (no context shift here)
    d = http.post("/completion", json={"prompt": "Hi how are you", "n_predict": n_predict, "ignore_eos": True,
                                       "temperature": 0}).json()
    if fills:
        assert CTX - 2 <= d["tokens_evaluated"] + d["tokens_predicted"] <= CTX
    else:
        assert d["tokens_predicted"] == 64
    assert d["truncated"] is fills and d["stop_type"] == "limit"


def test_openai_stream_to_the_length_limit(http):
    # llama.cpp: test_ctx_shift.py::test_ctx_shift_disabled_stream (n_predict accepted on /v1/completions)
    content, fins = "", []
    with http.stream("POST", "/v1/completions", json={"n_predict": 256, "prompt": "Once", "stream": True,
                                                      "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                if choice["finish_reason"] is None:
                    content += choice["text"]
                else:
                    fins.append(choice["finish_reason"])
    assert fins == ["length"] and len(content) > 0


def test_speculation_near_the_end_of_the_context(http, engine):
    # llama.cpp: test_speculative.py::test_slot_ctx_not_exceeded and ::test_with_and_without_draft
    # (the server runs MTP; the in-process engine is plain)
    ids = engine.tokenizer.encode("Hello " * 4000)[:CTX - 10]
    d = http.post("/completion", json={"prompt": ids, "temperature": 0, "top_k": 1, "ignore_eos": True,
                                       "return_tokens": True}).json()
    room = CTX - len(ids) - 1  # n_predict's default: to the end of the context
    ref = engine.generate(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=room, ignore_eos=True))
    assert d["tokens"] == ref.tokens and len(ref.tokens) == room and d["truncated"] is True


def test_prompt_cache_metrics(http):
    # llama.cpp: test_metrics.py::test_prompt_cache_metrics (our metric names)
    req = {"prompt": "I believe the meaning of life is", "temperature": 0.0, "top_k": 1, "n_predict": 8,
           "cache_prompt": True}
    assert http.post("/completion", json={**req, "prompt": "something else first"}).status_code == 200
    http.post("/completion", json=req)
    before = metric(http.get("/metrics").text, "mtpllm_prompt_tokens_cached_total")
    d = http.post("/completion", json=req).json()
    assert d["timings"]["cache_n"] > 0 and d["tokens_cached"] == d["timings"]["cache_n"]
    after = metric(http.get("/metrics").text, "mtpllm_prompt_tokens_cached_total")
    assert after - before == d["timings"]["cache_n"]
