"""Speculation made visible in the HTTP server's streams, and the draft length chosen per request.

Each streamed chunk of `/v1/chat/completions` and `/v1/completions` carries an extension object
that OpenAI clients ignore (unknown top-level keys):

    "mtpllm": {"draft": [true, false, ...],   # per token since the previous chunk: an accepted
                                              # draft token (true) or the target model's (false)
               "accepted": 2,                 # how many of them are accepted draft tokens
               "stats": {...},                # speculative statistics so far (SpecStats.to_dict())
               "timings": {...}}              # timings so far (predicted_n, predicted_per_second, ...)

`stats` (only when speculation is on) and `timings` come at most every LIVE_EVERY_S seconds and
always in the chunk that ends the answer (the one with a finish_reason), so the final figures are
the generation's own. A chunk's text comes from the tokens in its `draft` list; a token whose text
is held back (part of a UTF-8 character or of a possible stop string) is listed with the chunk
that finally carries its text.

A request may ask for a shorter draft length than the server's with
`"speculative": {"num_speculative_tokens": k}`, 0 <= k <= the server's k (0: no speculation for
this request), or llama.cpp's `"speculative.n_max": k`, clamped to that range. The same proposer
(its weights) is used, only its k changes; its draft state is the request's own, on its slot.
"""
from __future__ import annotations

import time

from .protocol import BadRequest


LIVE_EVERY_S = 0.25


class SpecTrace:
    """Builds the `mtpllm` object of each chunk of one stream."""

    def __init__(self):
        self.flags: list[bool] = []
        self.last_live = float("-inf")

    def add(self, r) -> None:
        """Every Response of the stream, whether or not it becomes a chunk."""
        if r.token is not None:
            self.flags.append(bool(r.draft))

    def field(self, r) -> dict:
        """The object for the chunk that `r` (the latest Response) produces."""
        out = {"draft": self.flags, "accepted": sum(self.flags)}
        self.flags = []
        now = time.monotonic()
        if r.finish_reason is not None or now - self.last_live >= LIVE_EVERY_S:
            self.last_live = now
            if r.stats is not None:
                out["stats"] = r.stats.to_dict()
            if r.timings is not None:
                out["timings"] = r.timings.to_dict()
        return out


def max_draft_length(spec) -> int:
    """The server's draft length k (0 without speculation)."""
    return spec.cfg.num_speculative_tokens if spec is not None else 0


def request_spec(spec, body: dict):
    """The speculative decoder for one request: the server's `spec`, or the same proposer with the
    draft length the request asks for, or None (plain decoding) for k = 0. The length comes from
    `"speculative": {"num_speculative_tokens": k}` or llama.cpp's `"speculative.n_max": k`."""
    s, flat = body.get("speculative"), body.get("speculative.n_max")
    if s is None and flat is None:
        return spec
    if s is not None and flat is not None:
        raise BadRequest("give the draft length once: 'speculative' or 'speculative.n_max'", "speculative")
    if s is not None:
        if not isinstance(s, dict) or set(s) != {"num_speculative_tokens"}:
            raise BadRequest("'speculative' must be an object {\"num_speculative_tokens\": k}", "speculative")
        k, name, field = s["num_speculative_tokens"], "speculative.num_speculative_tokens", "speculative"
    else:
        k, name, field = flat, "speculative.n_max", "speculative.n_max"
    hi = max_draft_length(spec)
    if isinstance(k, bool) or not isinstance(k, int):
        raise BadRequest(f"'{name}' must be an integer, got {k!r}", field)
    if flat is not None:  # llama.cpp's n_max is a ceiling: clamped to 0..k, as llama-server does
        k = min(max(k, 0), hi)
    elif not 0 <= k <= hi:
        raise BadRequest(f"'{name}' must be an integer in 0..{hi} (this server's draft length), got {k!r}", field)
    if k == 0:
        return None
    if k == hi:
        return spec
    return spec.with_draft_length(k)  # the server's proposer and calibration, shared
