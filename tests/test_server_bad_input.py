"""Bad input, row by row: every body a client can send gets a 4xx JSON error that names the field,
never a 500 or a dropped connection (the app runs in-process: an exception escaping a handler fails
the test instead of hiding behind a 500)."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient  # noqa: E402

from mtpllm.runtime.engine import Engine  # noqa: E402
from mtpllm.server import Server, create_app  # noqa: E402
from tiny import make_tiny  # noqa: E402

VOCAB = 273  # tokens of tiny.py's byte-level vocabulary (256 bytes, 14 merges, 3 control tokens)
LIMIT = 64 * 1024  # a small body limit for this app, to test the 413 without megabytes of data


@pytest.fixture(scope="module")
def server(tiny_dir):
    eng = Engine.load(str(make_tiny(tiny_dir / "bad.gguf", "qwen2", seed=3)), n_ctx=128)
    return Server(eng, "bad.gguf")


@pytest.fixture(scope="module")
def client(server):
    return TestClient(create_app(server, max_body_bytes=LIMIT, access_log=False))


C, CH, L = "/v1/completions", "/v1/chat/completions", "/completion"
MSG = [{"role": "user", "content": "hi"}]

ROWS = [
    # (path, body: dict/list or raw bytes, status, text the message must contain, field)
    (C, b"{not json", 400, "not valid JSON", None),
    (C, b"", 400, "not valid JSON", None),
    (C, b"\xff\xfe\xfd", 400, "not valid JSON", None),
    (C, b"[1, 2]", 400, "must be a JSON object", None),
    (C, b'"text"', 400, "must be a JSON object", None),
    (C, b"[" * 10000 + b"]" * 10000, 400, "nested too deeply", None),
    (C, b'{"prompt": ' + b'{"a":' * 10000 + b"1" + b"}" * 10001, 400, "nested too deeply", None),
    (C, b'{"prompt": "hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "nested too deeply", None),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400, "finite", "temperature"),
    (C, b'{"prompt": "hi", "temperature": Infinity}', 400, "finite", "temperature"),
    (C, b'{"prompt": "hi", "top_p": -Infinity}', 400, "finite", "top_p"),
    (C, b'{"prompt": "\\ud800"}', 400, "not valid Unicode", "prompt"),
    (C, b'{"prompt": "ok", "stop": ["\\udfff"]}', 400, "not valid Unicode", "stop[0]"),
    (CH, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "not valid Unicode",
     "messages[0].content"),
    (C, b'{"prompt": "hi", "\\ud800": 1}', 400, "not valid Unicode", None),
    (C, {}, 400, "'prompt' must be", "prompt"),
    (C, {"prompt": None}, 400, "'prompt' must be", "prompt"),
    (C, {"prompt": ""}, 400, "'prompt' is empty", "prompt"),
    (C, {"prompt": 5}, 400, "'prompt' must be", "prompt"),
    (C, {"prompt": {"a": 1}}, 400, "'prompt' must be", "prompt"),
    (C, {"prompt": [1, 10 ** 9]}, 400, "outside the vocabulary", "prompt"),
    (C, {"prompt": [1, -1]}, 400, "outside the vocabulary", "prompt"),
    (C, {"prompt": [1, True]}, 400, "'prompt[1]' must be", "prompt"),
    (C, {"prompt": [1, 2.5]}, 400, "'prompt[1]' must be", "prompt"),
    (C, {"prompt": ["a", "b"]}, 400, "one prompt", "prompt"),
    (C, {"prompt": [[1], [2]]}, 400, "one prompt", "prompt"),
    (C, {"prompt": "word " * 200}, 400, "context size", None),
    (C, {"prompt": "x" * 60000}, 400, "context of 128 tokens", "prompt"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "'temperature' must be a number", "temperature"),
    (C, {"prompt": "hi", "temperature": -1}, 400, "'temperature' must be in", "temperature"),
    (C, {"prompt": "hi", "temperature": 10 ** 400}, 400, "'temperature' is out of range", "temperature"),
    (C, {"prompt": "hi", "temperature": [1]}, 400, "'temperature' must be a number", "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "'top_p' must be in (0, 1]", "top_p"),
    (C, {"prompt": "hi", "top_p": 2}, 400, "'top_p' must be in (0, 1]", "top_p"),
    (C, {"prompt": "hi", "min_p": 1.5}, 400, "'min_p' must be in", "min_p"),
    (C, {"prompt": "hi", "top_k": 1.5}, 400, "'top_k' must be an integer", "top_k"),
    (C, {"prompt": "hi", "top_k": "5"}, 400, "'top_k' must be an integer", "top_k"),
    (C, {"prompt": "hi", "repeat_penalty": 0}, 400, "repeat_penalty", "repeat_penalty"),
    # values that overflow float32 logits (NaN probabilities) are refused, not a 500
    (L, {"prompt": "hi", "temperature": 1e308}, 400, "'temperature' must be in [0.0, 1000.0]", "temperature"),
    (L, {"prompt": "hi", "repeat_penalty": 1e-300}, 400, "'repeat_penalty' must be in", "repeat_penalty"),
    (L, {"prompt": "hi", "repetition_penalty": 1e300}, 400, "'repetition_penalty' must be in", "repetition_penalty"),
    (L, {"prompt": "hi", "frequency_penalty": -1e308}, 400, "'frequency_penalty' must be in", "frequency_penalty"),
    (L, {"prompt": "hi", "presence_penalty": 1e308}, 400, "'presence_penalty' must be in", "presence_penalty"),
    (C, {"prompt": "hi", "repeat_last_n": -2}, 400, "'repeat_last_n' must be in", "repeat_last_n"),
    (C, {"prompt": "hi", "presence_penalty": None, "frequency_penalty": "x"}, 400, "'frequency_penalty' must be",
     "frequency_penalty"),
    (C, {"prompt": "hi", "max_tokens": -5}, 400, "'max_tokens' must be", "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 1.5}, 400, "'max_tokens' must be", "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "10"}, 400, "'max_tokens' must be", "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": True}, 400, "'max_tokens' must be", "max_tokens"),
    (CH, {"messages": MSG, "max_completion_tokens": -3}, 400, "'max_completion_tokens' must be",
     "max_completion_tokens"),
    (C, {"prompt": "hi", "seed": "x"}, 400, "'seed' must be an integer", "seed"),
    (C, {"prompt": "hi", "seed": 2 ** 64}, 400, "'seed' must be less than 2^64", "seed"),
    (C, {"prompt": "hi", "seed": 10 ** 30}, 400, "'seed' must be less than 2^64", "seed"),
    (C, {"prompt": "hi", "seed": 1.5}, 400, "'seed' must be an integer", "seed"),
    (C, {"prompt": "hi", "stop": 7}, 400, "'stop' must be", "stop"),
    (C, {"prompt": "hi", "stop": ["a", 1]}, 400, "'stop' must be", "stop"),
    (C, {"prompt": "hi", "stop": ["a"] * 65}, 400, "at most 64", "stop"),
    (C, {"prompt": "hi", "stop": "s" * 1001}, 400, "at most 1000 characters", "stop"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "'stream' must be true or false", "stream"),
    (C, {"prompt": "hi", "stream": 1}, 400, "'stream' must be true or false", "stream"),
    (C, {"prompt": "hi", "ignore_eos": "no"}, 400, "'ignore_eos' must be", "ignore_eos"),
    (C, {"prompt": "hi", "stream_options": "x"}, 400, "'stream_options' must be an object", "stream_options"),
    (C, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "y"}}, 400, "'include_usage'",
     "include_usage"),
    (C, {"prompt": "hi", "model": 5}, 400, "'model' must be a string", "model"),
    (C, {"prompt": "hi", "logit_bias": 5}, 400, "'logit_bias' must be", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "must be in [-100, 100]", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": "x"}}, 400, "must be a number", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "outside the vocabulary", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": [[5]]}, 400, "must be a pair", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": [[None, 1]]}, 400, "keys must be token ids or text", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "outside the vocabulary", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"x" * 1001: 1}}, 400, "at most 1000 characters", "logit_bias"),
    # this server does not speculate: a draft length above 0 is refused, naming the field
    (C, {"prompt": "hi", "speculative": {"num_speculative_tokens": 2}}, 400, "in 0..0", "speculative"),
    (C, {"prompt": "hi", "speculative": 3}, 400, "'speculative' must be an object", "speculative"),
    (L, {"prompt": "hi", "speculative.n_max": "two"}, 400, "'speculative.n_max' must be an integer",
     "speculative.n_max"),
    (L, {"prompt": "hi", "speculative.n_max": 0, "speculative": {"num_speculative_tokens": 0}}, 400, "once",
     "speculative"),
    (C, {"prompt": "hi", "temperature": 1, "logit_bias": [[t, False] for t in range(VOCAB)]}, 400,
     "bans every token", "logit_bias"),
    # refused: a clear 400 naming the field, never a silent ignore
    (C, {"prompt": "hi", "n": 2}, 400, "'n' must be 1", "n"),
    (C, {"prompt": "hi", "best_of": 3}, 400, "'best_of' is not supported", "best_of"),
    (C, {"prompt": "hi", "echo": True}, 400, "'echo' is not supported", "echo"),
    (C, {"prompt": "hi", "suffix": "end"}, 400, "'suffix' is not supported", "suffix"),
    # log-probabilities: counts in 0..20, each endpoint its own fields
    (C, {"prompt": "hi", "logprobs": 21}, 400, "'logprobs' must be an integer in 0..20", "logprobs"),
    (C, {"prompt": "hi", "logprobs": -1}, 400, "'logprobs' must be an integer in 0..20", "logprobs"),
    (C, {"prompt": "hi", "logprobs": True}, 400, "'logprobs' must be an integer", "logprobs"),
    (C, {"prompt": "hi", "logprobs": 2.5}, 400, "'logprobs' must be an integer", "logprobs"),
    (C, {"prompt": "hi", "top_logprobs": 2}, 400, "'top_logprobs' is not a field of this endpoint", "top_logprobs"),
    (C, {"prompt": "hi", "n_probs": 2}, 400, "'n_probs' is not a field of this endpoint", "n_probs"),
    (CH, {"messages": MSG, "logprobs": 5}, 400, "'logprobs' must be true or false", "logprobs"),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs' must be an integer in 0..20",
     "top_logprobs"),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": "3"}, 400, "'top_logprobs' must be an integer",
     "top_logprobs"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true", "top_logprobs"),
    (CH, {"messages": MSG, "n_probs": 2}, 400, "'n_probs' is not a field of this endpoint", "n_probs"),
    (L, {"prompt": "hi", "n_probs": 99}, 400, "'n_probs' must be an integer in 0..20", "n_probs"),
    (L, {"prompt": "hi", "n_probs": [3]}, 400, "'n_probs' must be an integer", "n_probs"),
    (L, {"prompt": "hi", "logprobs": -2}, 400, "'logprobs' must be an integer in 0..20", "logprobs"),
    (L, {"prompt": "hi", "top_logprobs": 2}, 400, "'top_logprobs' is not a field of this endpoint", "top_logprobs"),
    (L, {"prompt": "hi", "n_probs": 2, "post_sampling_probs": True}, 400, "'post_sampling_probs' is not supported",
     "post_sampling_probs"),
    (L, {"prompt": "hi", "grammar": "root ::= \"a\""}, 400, "'grammar' is not supported", "grammar"),
    (CH, {"messages": MSG, "json_schema": {"const": "42"}}, 400, "'json_schema' is not supported", "json_schema"),
    (CH, {"messages": MSG, "response_format": {"type": "json_object"}}, 400, "'response_format'", "response_format"),
    (CH, {"messages": MSG, "response_format": {"type": "sound"}}, 400, "'response_format'", "response_format"),
    (CH, {"messages": MSG, "response_format": "json"}, 400, "'response_format' must be", "response_format"),
    (CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "'tools' is not supported", "tools"),
    (CH, {"messages": MSG, "tool_choice": "required"}, 400, "'tool_choice' is not supported", "tool_choice"),
    (L, {"prompt": "hi", "mirostat": 2}, 400, "'mirostat' is not supported", "mirostat"),
    (L, {"prompt": "hi", "samplers": ["top_k"]}, 400, "'samplers' is not supported", "samplers"),
    # chat messages (llama.cpp test_chat_completion.py::test_invalid_chat_completion_req and more)
    (CH, {}, 400, "'messages' must be", "messages"),
    (CH, {"messages": None}, 400, "'messages' must be", "messages"),
    (CH, {"messages": "string"}, 400, "'messages' must be", "messages"),
    (CH, {"messages": []}, 400, "'messages' must be", "messages"),
    (CH, {"messages": [123]}, 400, "'messages[0]' must be an object", "messages"),
    (CH, {"messages": [{}]}, 400, "'messages[0]' must be an object", "messages"),
    (CH, {"messages": [{"role": 123}]}, 400, "'messages[0]' must be an object", "messages"),
    (CH, {"messages": [{"content": "hi"}]}, 400, "string 'role'", "messages"),
    (CH, {"messages": [{"role": "system", "content": 123}]}, 400, "'messages[0].content' must be", "messages"),
    (CH, {"messages": [{"role": "system", "content": "test"}, {}]}, 400, "'messages[1]' must be", "messages"),
    (CH, {"messages": [{"role": "user", "content": "t"}, {"role": "assistant", "content": "t"},
                       {"role": "assistant", "content": "t"}]}, 400, "two assistant messages", "messages"),
    (CH, {"messages": [{"role": "assistant", "content": "t"}]}, 400, "before the assistant's prefill", "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     400, "only text parts", "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "only text parts", "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 70000}]}]}, 413, "limit", None),
    (CH, {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, 400,
     "tool calling is not supported", "messages"),
    (CH, {"messages": [{"role": "user", "content": "x" * 60000}]}, 400, "context of 128 tokens", "messages"),
    # llama.cpp endpoints
    (L, {"prompt": "hi", "n_predict": "many"}, 400, "'n_predict' must be", "n_predict"),
    (L, {"prompt": "hi", "return_tokens": "yes"}, 400, "'return_tokens' must be", "return_tokens"),
    (L, {"prompt": "hi", "cache_prompt": 1}, 400, "'cache_prompt' must be", "cache_prompt"),
    ("/tokenize", {"content": 3}, 400, "'content' must be a string", "content"),
    ("/tokenize", {}, 400, "'content' must be a string", "content"),
    ("/tokenize", {"content": "a", "add_special": "yes"}, 400, "'add_special' must be", "add_special"),
    ("/tokenize", {"content": "a", "with_pieces": 1}, 400, "'with_pieces' must be", "with_pieces"),
    ("/tokenize", b'{"content": "\\udc00"}', 400, "not valid Unicode", "content"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "list of integers", "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "list of integers", "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "outside the vocabulary", "tokens"),
    ("/detokenize", {"tokens": [2 ** 70]}, 400, "outside the vocabulary", "tokens"),
    ("/apply-template", {"messages": 3}, 400, "'messages' must be", "messages"),
    # over the body limit: 413
    (C, {"prompt": "x" * (LIMIT + 1)}, 413, "larger than the limit", None),
]


@pytest.mark.parametrize("path,body,status,text,field", ROWS,
                         ids=[f"{i}-{r[0]}" for i, r in enumerate(ROWS)])
def test_bad_input_is_a_4xx_json_error_naming_the_field(client, path, body, status, text, field):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert text in err["message"], err
    assert err["code"] == status and isinstance(err["type"], str)
    if field is not None:
        assert err.get("param") == field, err


def test_the_server_still_answers_after_every_bad_row(client):
    """A bad request fails itself only: the next good one is served."""
    r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_odd_but_valid_values_are_served(client):
    """Values at the edges that are valid: text keys of logit_bias that look like numbers to
    str.isdigit ("²") or nearly ("--5"), and a temperature so small that every logit but the
    largest divides to -inf (a one-hot: the greedy answer)."""
    r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3, "logit_bias": {"--5": 1, "²": -1}})
    assert r.status_code == 200, r.text
    greedy = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True}).json()
    for t in (1e-38, 5e-324):
        r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 6, "temperature": t, "seed": 1,
                                                 "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_a_scheduler_that_stopped_accepting_gives_503(client, server):
    """Once the scheduler takes no new generation (shut down by an application embedding the
    server), a request is a 503 at admission, counted neither waiting nor busy."""
    server.scheduler.accepting = False
    try:
        r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2, "stream": True})
        assert r.status_code == 503
    finally:
        server.scheduler.accepting = True
    assert server.waiting == 0 and server.busy == 0
    assert client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2}).status_code == 200


def test_a_chunked_body_over_the_limit_is_413(client):
    def chunks():  # no Content-Length: the limit is found while reading
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'
    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than the limit" in r.json()["error"]["message"]


def test_context_overflow_has_llama_cpp_fields(client, server):
    """llama.cpp test_chat_completion.py::test_context_size_exceeded: type exceed_context_size_error,
    n_prompt_tokens and n_ctx in the error."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Book"},
                                                               {"role": "user", "content": "What is the best"}] * 10})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] > 128 and err["n_ctx"] == 128


def test_unknown_routes_and_methods_are_json(client):
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = client.put("/completion", json={})
    assert r.status_code == 405


VALUES = [None, True, False, 0, 1, -1, 2 ** 64, -2 ** 70, 1.5, -0.0, 1e308, "", "x", "\u0000", [], [1], ["a"],
          [[1, 2]], {}, {"a": 1}, {"type": "text"}, [{"type": "text", "text": "hi"}],
          [{"role": "user", "content": "hi"}], 10 ** 6, "5", [None], [[]]]
FIELDS = ["prompt", "messages", "max_tokens", "n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
          "stream", "logit_bias", "n", "logprobs", "top_logprobs", "n_probs", "response_format", "stream_options", "ignore_eos", "repeat_last_n",
          "repeat_penalty", "presence_penalty", "tools", "tool_choice", "model", "return_tokens", "content", "tokens",
          "with_pieces", "add_special", "response_fields", "timings_per_token", "cache_prompt",
          "max_completion_tokens"]


def test_random_field_values_never_500(client):
    """Every field set to values of every JSON type, a few at a time (seeded): each answer is a 200
    or a 4xx JSON error; no exception escapes, no stream carries an error."""
    import random
    rnd = random.Random(31)
    paths = ["/v1/completions", "/v1/chat/completions", "/completion", "/tokenize", "/detokenize", "/apply-template"]
    for _ in range(200):
        path = rnd.choice(paths)
        body = {"prompt": "the cat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n_predict": 2}
        for _ in range(rnd.randint(1, 4)):
            body[rnd.choice(FIELDS)] = rnd.choice(VALUES)
        for k in ("max_tokens", "n_predict"):  # keep generations short
            if body.get(k) not in (None, 0, 1, 2):
                body[k] = 2
        r = client.post(path, json=body)
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code != 200:
            assert "message" in r.json()["error"], (path, body)
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert '"error"' not in r.text, (path, body, r.text)
