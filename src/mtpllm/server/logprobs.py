"""Log-probabilities over HTTP, in the three shapes clients expect.

The values are the engine's (`Response.logprob` / `Response.top_logprobs`: the log-softmax of the
target model's own logits for the row that chose each token, the same with and without
speculation); this module only asks for them (`requested`) and lays them out:

  /v1/chat/completions  OpenAI: "logprobs": true, "top_logprobs": n
                        -> choice.logprobs = {"content": [{token, logprob, bytes, top_logprobs}]}
  /v1/completions       OpenAI legacy: "logprobs": n
                        -> choice.logprobs = {tokens, token_logprobs, top_logprobs, text_offset}
  /completion           llama.cpp: "n_probs": n
                        -> "completion_probabilities": [{id, token, bytes, logprob, top_logprobs}]

Streams carry the entries of the tokens that arrived since the previous chunk, with the chunk that
carries their text.
"""
from __future__ import annotations

import json

from ..runtime.sampling import SamplingParams
from .protocol import BadRequest

MAX_TOP = SamplingParams.MAX_LOGPROBS  # 20, OpenAI's limit for top_logprobs


def _count(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP:
        raise BadRequest(f"'{key}' must be an integer in 0..{MAX_TOP}, got {json.dumps(v)}", key)
    return v


def requested(body: dict, kind: str) -> int | None:
    """How many alternatives per token the request asks for (0: the chosen token's only), or None
    for no log-probabilities. `kind`: "chat", "completions" (OpenAI) or "completion" (llama.cpp)."""
    for key, where in (("n_probs", "completion"), ("top_logprobs", "chat")):
        if kind != where and body.get(key) not in (None, 0):
            use = {"chat": "'logprobs': true and 'top_logprobs'", "completions": "'logprobs': n",
                   "completion": "'n_probs'"}[kind]
            raise BadRequest(f"'{key}' is not a field of this endpoint: use {use}", key)
    if kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest(f"'logprobs' must be true or false, got {json.dumps(lp)}", "logprobs")
        top = _count(body, "top_logprobs")
        if not lp:
            if top:
                raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return top or 0
    if kind == "completions":
        return _count(body, "logprobs")
    # llama.cpp: "logprobs" is an alias of "n_probs"; 0 = none
    n = _count(body, "n_probs") if body.get("n_probs") is not None else _count(body, "logprobs")
    return n or None


class Pieces:
    """Token id -> (text, bytes), cached: the text is the bytes' longest valid UTF-8 prefix (as
    llama.cpp sends a token that holds part of a character), `bytes` the token's own."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, t: int) -> tuple[str, list[int]]:
        got = self.cache.get(t)
        if got is None:
            b = self.tok.token_bytes(t)
            try:
                text = b.decode("utf-8")
            except UnicodeDecodeError as e:
                text = b[:e.start].decode("utf-8")
            got = self.cache[t] = (text, list(b))
        return got


def entry(pieces: Pieces, t: int, lp: float, top, with_id: bool) -> dict:
    """One token's object (OpenAI chat's ChatCompletionTokenLogprob; llama.cpp adds the id)."""
    text, b = pieces(t)
    alts = []
    for i, v in top or ():
        at, ab = pieces(i)
        alts.append({"id": i, "token": at, "bytes": ab, "logprob": v} if with_id else
                    {"token": at, "logprob": v, "bytes": ab})
    if with_id:
        return {"id": t, "token": text, "bytes": b, "logprob": lp, "top_logprobs": alts}
    return {"token": text, "logprob": lp, "bytes": b, "top_logprobs": alts}


class Collector:
    """The log-probabilities of one generation, taken from its Responses as they come; `take()`
    hands over those since the previous call (a stream's chunk), `everything` the whole list."""

    def __init__(self, pieces: Pieces, kind: str):
        self.pieces, self.kind = pieces, kind
        self.items: list[tuple[int, float, list]] = []
        self.sent = 0
        self.offset = 0  # /v1/completions: characters of the tokens laid out so far

    def add(self, r) -> None:
        if r.token is not None and r.logprob is not None:
            self.items.append((r.token, r.logprob, r.top_logprobs))

    def take(self):
        part = self.items[self.sent:]
        self.sent = len(self.items)
        return self.layout(part)

    def everything(self):
        self.offset = 0
        return self.layout(self.items)

    def layout(self, items):
        if self.kind == "chat":
            return {"content": [entry(self.pieces, t, lp, top, False) for t, lp, top in items], "refusal": None}
        if self.kind == "completion":
            return [entry(self.pieces, t, lp, top, True) for t, lp, top in items]
        tokens, lps, tops, offsets = [], [], [], []
        for t, lp, top in items:
            text = self.pieces(t)[0]
            tokens.append(text)
            lps.append(lp)
            tops.append({self.pieces(i)[0]: v for i, v in reversed(top or ())})  # the likeliest wins a tie
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
