"""Request bodies -> validated engine inputs. Everything here is untrusted client data: each problem is
an `ApiError` (a 4xx with an OpenAI-style JSON body naming the field), never an exception that
escapes as a 500.

The parsers are plain functions, run in a worker thread by the routes: a large body, its JSON,
its tokenization and the chat template never occupy the event loop.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from ..errors import MtpllmError
from ..runtime.sampling import SamplingParams

MAX_DEPTH = 64  # JSON nesting: OpenAI and llama.cpp bodies need 5 or 6 levels
MAX_STOP = 64  # stop strings per request
MAX_STOP_CHARS = 1000  # characters of one stop string (held-back text grows with it)
_TOKEN_ID = re.compile(r"\s*-?[0-9]+\s*")  # a logit_bias key that is a token id (else it is text)
MAX_SEED = 2 ** 64  # torch generators take 64-bit seeds
MAX_SCALE = 1000.0  # temperature, penalties: at most this (and repeat_penalty at least its inverse)


class ApiError(Exception):
    """A request that cannot be served: HTTP `status`, OpenAI-style `kind`, `param` (the field)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.kind, self.param, self.headers, self.extra = status, kind, param, headers, extra

    def body(self) -> dict:
        err = {"message": str(self), "type": self.kind, "code": self.status}
        if self.param is not None:
            err["param"] = self.param
        err.update(self.extra)
        return {"error": err}


class BadRequest(ApiError):
    def __init__(self, message: str, param: str | None = None, **extra):
        super().__init__(message, 400, param=param, **extra)


def _q(path: str) -> str:
    return f"'{path}'"


# ---------------------------------------------------------------------------- JSON
def parse_json(raw: bytes) -> dict:
    """The body as a JSON object. Rejects what Python's json accepts but JSON does not (NaN,
    Infinity), nesting beyond MAX_DEPTH, and strings that are not valid Unicode (lone surrogates
    such as "\\ud800", which cannot be encoded to UTF-8 for the tokenizer)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    stack = [(body, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRequest(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", path or None)
        if isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else k
                if not _is_unicode(k):
                    raise BadRequest(f"a key in {_q(path or 'the body')} is not valid Unicode (a lone surrogate?)",
                                     path or None)
                if isinstance(x, (dict, list)):
                    stack.append((x, p, depth + 1))
                else:
                    _check_scalar(x, p)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                p = f"{path}[{i}]"
                if isinstance(x, (dict, list)):
                    stack.append((x, p, depth + 1))
                else:
                    _check_scalar(x, p)


def _check_scalar(x, path: str) -> None:
    if isinstance(x, float) and not math.isfinite(x):
        raise BadRequest(f"{_q(path)} must be a finite number, got {x}", path)
    if isinstance(x, str) and not _is_unicode(x):
        raise BadRequest(f"{_q(path)} is not valid Unicode (a lone surrogate such as \\ud800?)", path)


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# ---------------------------------------------------------------------------- scalar fields
def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{_q(key)} must be true or false, got {json.dumps(v)}", key)
    return v


def get_num(body: dict, key: str, default, kind=float, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{_q(key)} must be {'an integer' if kind is int else 'a number'}, got {json.dumps(v)}", key)
    if kind is int and not (isinstance(v, int) or v.is_integer()):
        raise BadRequest(f"{_q(key)} must be an integer, got {v}", key)
    try:
        v = kind(v)
    except OverflowError:  # an integer beyond float's range
        raise BadRequest(f"{_q(key)} is out of range, got {v}", key) from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{_q(key)} must be in [{lo}, {hi}], got {v}", key)
    return v


def get_max_tokens(body: dict, keys: tuple[str, ...], default: int | None) -> int | None:
    for key in keys:
        n = body.get(key)
        if n is None:
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise BadRequest(f"{_q(key)} must be a non-negative integer (or -1), got {json.dumps(n)}", key)
        return default if n == -1 else n
    return default


def get_seed(body: dict, default: int | None) -> int | None:
    seed = body.get("seed", default)
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest(f"'seed' must be an integer, got {json.dumps(seed)}", "seed")
    if seed >= MAX_SEED:
        raise BadRequest(f"'seed' must be less than 2^64, got {seed}", "seed")
    return None if seed < 0 else seed  # llama.cpp: -1 = random


def get_stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or not all(isinstance(x, str) for x in s):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(s) > MAX_STOP:
        raise BadRequest(f"'stop' has {len(s)} strings, at most {MAX_STOP}", "stop")
    for x in s:
        if len(x) > MAX_STOP_CHARS:
            raise BadRequest(f"'stop' strings must be at most {MAX_STOP_CHARS} characters", "stop")
    return [x for x in s if x]


# ---------------------------------------------------------------------------- refused fields
# Fields that change the output and that this server does not implement: a 400 naming the field
# unless the value is one that asks for nothing (the OpenAI / llama.cpp default).
REFUSED = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "post_sampling_probs": (None, False),
    "grammar": (None, ""), "json_schema": (None,), "tools": (None, []), "functions": (None, []),
    "function_call": (None, "none", "auto"), "tool_choice": (None, "none", "auto"),
    "mirostat": (None, 0), "typical_p": (None, 1, 1.0), "dynatemp_range": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0), "dry_multiplier": (None, 0, 0.0), "top_n_sigma": (None, -1, -1.0),
    "samplers": (None,), "lora": (None, []), "image_data": (None, []), "input_extra": (None, []),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}
WHY = {
    "n": "one completion per request ('n' must be 1)",
    "post_sampling_probs": "probabilities come from the model's own distribution (n_probs without it)",
    "grammar": "grammars are not supported", "json_schema": "JSON schemas are not supported",
    "tools": "tool calling is not supported", "functions": "function calling is not supported",
}


def check_refused(body: dict) -> None:
    for key, allowed in REFUSED.items():
        v = body.get(key)
        if not any(v == a and type(v) is type(a) or (isinstance(a, float) and isinstance(v, int) and
                                                      not isinstance(v, bool) and v == a) for a in allowed):
            why = WHY.get(key, "it is not supported by this server")
            raise BadRequest(f"{_q(key)} is not supported: {why}", key)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise BadRequest("'response_format' must be an object with a string 'type'", "response_format")
        if rf["type"] != "text":
            raise BadRequest(f"'response_format' of type {json.dumps(rf['type'])} is not supported "
                             "(structured output is not available; use type 'text')", "response_format")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):  # only echoed; never opened or loaded
        raise BadRequest("'model' must be a string", "model")


# ---------------------------------------------------------------------------- sampling
def sampling_params(body: dict, defaults: SamplingParams, max_keys: tuple[str, ...], default_max: int | None,
                    tokenizer, n_ctx: int, logprobs: int | None = None) -> SamplingParams:
    d = defaults
    check_refused(body)
    n = get_max_tokens(body, max_keys, default_max)
    last_n = get_num(body, "repeat_last_n", None, int, lo=-1)
    # the bounds keep the logits finite in float32 (a temperature of 1e308 is infinity there, and
    # -inf / inf is NaN); far beyond any useful value
    penalties = dict(
        repetition_penalty=get_num(body, "repeat_penalty", get_num(body, "repetition_penalty", d.repetition_penalty,
                                                                   hi=MAX_SCALE), hi=MAX_SCALE),
        presence_penalty=get_num(body, "presence_penalty", d.presence_penalty, lo=-MAX_SCALE, hi=MAX_SCALE),
        frequency_penalty=get_num(body, "frequency_penalty", d.frequency_penalty, lo=-MAX_SCALE, hi=MAX_SCALE))
    if penalties["repetition_penalty"] < 1 / MAX_SCALE:
        key = "repeat_penalty" if "repeat_penalty" in body else "repetition_penalty"
        raise BadRequest(f"'{key}' must be in [{1 / MAX_SCALE}, {MAX_SCALE}], got {penalties['repetition_penalty']}",
                         key)
    if last_n == 0:  # llama.cpp: 0 = penalties off
        penalties = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    top_k = get_num(body, "top_k", d.top_k, int)
    try:
        return SamplingParams(
            temperature=get_num(body, "temperature", d.temperature, lo=0.0, hi=MAX_SCALE),
            top_k=max(top_k, 0),  # llama.cpp: <= 0 = off
            top_p=get_num(body, "top_p", d.top_p), min_p=get_num(body, "min_p", d.min_p), **penalties,
            penalty_last_n=d.penalty_last_n if last_n in (None, 0) else (n_ctx if last_n == -1 else last_n),
            seed=get_seed(body, d.seed), max_tokens=n if n is not None else d.max_tokens,
            stop=get_stop(body) or list(d.stop), ignore_eos=get_bool(body, "ignore_eos"),
            logit_bias=logit_bias(body.get("logit_bias"), tokenizer), logprobs=logprobs)
    except MtpllmError as exc:  # out of range: name the field the message names
        msg = str(exc).removeprefix("invalid sampling parameter: ")
        key = msg.split(" ", 1)[0]
        raise BadRequest(f"'{key}' {msg.split(' ', 1)[1]}" if " " in msg else msg,
                         {"repetition_penalty": "repeat_penalty"}.get(key, key)) from None


def logit_bias(v, tokenizer) -> dict[int, float]:
    """OpenAI's {"token id": bias} and llama.cpp's forms ([[id or text, bias], ...], a text key
    biases each of its tokens, `false` bans). Bias values in [-100, 100] (OpenAI's range)."""
    if v is None:
        return {}
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = []
        for i, e in enumerate(v):
            if not isinstance(e, list) or len(e) != 2:
                raise BadRequest(f"'logit_bias[{i}]' must be a pair [token id or text, bias]", "logit_bias")
            items.append((e[0], e[1]))
    else:
        raise BadRequest("'logit_bias' must be an object mapping token ids to biases (or a list of pairs)",
                         "logit_bias")
    V = tokenizer.vocab_size
    if len(items) > V:
        raise BadRequest(f"'logit_bias' has {len(items)} entries, more than the vocabulary ({V})", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in items:
        where = f"logit_bias[{json.dumps(key)}]"
        if bias is False:
            b = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise BadRequest(f"'{where}' must be a number in [-100, 100] (or false to ban the token)", "logit_bias")
        elif not -100 <= bias <= 100:
            raise BadRequest(f"'{where}' must be in [-100, 100], got {bias}", "logit_bias")
        else:
            b = float(bias)
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            if len(key.strip()) > 12:  # int() of thousands of digits is slow, and no vocabulary is that large
                raise BadRequest(f"'logit_bias' has a token id outside the vocabulary (0..{V - 1}): "
                                 f"{key.strip()[:20]}...", "logit_bias")
            ids = [int(key)]
        elif isinstance(key, str) and key:
            if len(key) > MAX_STOP_CHARS:
                raise BadRequest(f"'logit_bias' text keys must be at most {MAX_STOP_CHARS} characters", "logit_bias")
            ids = tokenizer.encode(key, add_special=False)
        else:
            raise BadRequest(f"'logit_bias' keys must be token ids or text, got {json.dumps(key)}", "logit_bias")
        for t in ids:
            if not 0 <= t < V:
                raise BadRequest(f"'logit_bias' has a token id outside the vocabulary (0..{V - 1}): {t}", "logit_bias")
            out[t] = b
    if sum(b == float("-inf") for b in out.values()) >= V:
        raise BadRequest("'logit_bias' bans every token of the vocabulary", "logit_bias")
    return out


# ---------------------------------------------------------------------------- prompts
def token_ids(ids, field_name: str, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(f"{_q(field_name)} must be a list of integers", field_name)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{_q(field_name)} has token ids outside the vocabulary (0..{vocab_size - 1}): {bad[:5]}",
                         field_name)
    return list(ids)


@dataclass
class Limits:
    """What a prompt may be before it is tokenized: a text of more than n_ctx * (longest token's
    characters) characters cannot fit the context, whatever its tokens."""
    n_ctx: int
    max_chars: int

    def check_text(self, text: str, where: str) -> None:
        if len(text) > self.max_chars:
            raise BadRequest(f"{_q(where)} is {len(text)} characters: more than a context of {self.n_ctx} tokens "
                             f"can hold", where)


def completion_prompt(prompt, tokenizer, limits: Limits) -> tuple[list[int], str]:
    """A completion prompt -> (token ids, its text). Accepted: a string, a list with one string, a list
    of token ids, or llama.cpp's mix of token ids and strings in one list."""
    V = tokenizer.vocab_size
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", "prompt")
        limits.check_text(prompt, "prompt")
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, list) and prompt:
        if any(isinstance(p, list) for p in prompt) or all(isinstance(p, str) for p in prompt):
            raise BadRequest("'prompt' must be one prompt: several prompts in one request are not supported", "prompt")
        ids: list[int] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                limits.check_text(p, f"prompt[{i}]")
                ids += tokenizer.encode(p, add_special=i == 0)
            elif isinstance(p, int) and not isinstance(p, bool):
                if not 0 <= p < V:
                    raise BadRequest(f"'prompt' has token ids outside the vocabulary (0..{V - 1}): {[p]}", "prompt")
                ids.append(p)
            else:
                raise BadRequest(f"'prompt[{i}]' must be a token id or a string", "prompt")
            if len(ids) > limits.n_ctx:
                break  # too long already; the context check names the size
        return ids, tokenizer.decode(ids)
    raise BadRequest("'prompt' must be a non-empty string, a list with one string, or a list of token ids", "prompt")


def chat_messages(body: dict, limits: Limits) -> tuple[list[dict], str | None]:
    """OpenAI `messages` -> ([{role, content}], assistant prefill or None). Text content parts are
    joined with "\\n" (as llama.cpp's server does for templates that take a string). A conversation
    that ends with an assistant message is a prefill: the reply continues that message."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    out, total = [], 0
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise BadRequest(f"{_q(where)} must be an object with a string 'role'", "messages")
        if m.get("tool_calls") not in (None, []):
            raise BadRequest(f"'{where}.tool_calls': tool calling is not supported", "messages")
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for j, p in enumerate(c):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise BadRequest(f"'{where}.content[{j}]': only text parts are supported "
                                     "({\"type\": \"text\", \"text\": ...})", "messages")
                parts.append(p["text"])
            c = "\n".join(parts)
        if c is None:
            c = ""
        if not isinstance(c, str):
            raise BadRequest(f"'{where}.content' must be a string or a list of text parts", "messages")
        total += len(c)
        out.append({"role": m["role"], "content": c})
    if total > limits.max_chars:
        raise BadRequest(f"'messages' hold {total} characters: more than a context of {limits.n_ctx} tokens can hold",
                         "messages")
    prefill = None
    if out[-1]["role"] == "assistant":
        if len(out) > 1 and out[-2]["role"] == "assistant":
            raise BadRequest("'messages' cannot end with two assistant messages", "messages")
        prefill = out.pop()["content"]
        if not out:
            raise BadRequest("'messages' needs a message before the assistant's prefill", "messages")
    return out, prefill


def render_chat(tokenizer, msgs: list[dict], prefill: str | None) -> str:
    if not tokenizer.chat_template:
        raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True) + (prefill or "")
    except MtpllmError as exc:
        raise BadRequest(f"cannot render the chat template: {exc}", "messages") from None


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: the BOS token is added unless the template wrote it."""
    bos = tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None and tokenizer.add_bos else None
    return tokenizer.encode(text, add_special=not (bos and text.startswith(bos)))


def response_fields(body: dict) -> list[str] | None:
    """llama.cpp's `response_fields`: the /completion answer keeps only these ("a/b" reaches into objects)."""
    v = body.get("response_fields")
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise BadRequest("'response_fields' must be a list of field names", "response_fields")
    return v


def pick_fields(d: dict, fields: list[str]) -> dict:
    out = {}
    for f in fields:
        v = d
        for k in f.split("/"):
            v = v.get(k) if isinstance(v, dict) else None
        if v is not None:
            out[f] = v
    return out


@dataclass
class Job:
    """A validated generation request."""
    ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_tokens: bool = False
    prompt: str = ""
    extra: dict = field(default_factory=dict)
    spec: object = ...  # the speculative decoder for this request (... = the server's)
