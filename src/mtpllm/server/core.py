"""The server object: the model, the request defaults and the one door to generation.

`Server.generate` is the only code that runs generation: through the scheduler, which owns the
slots and their caches. The HTTP layer (app.py) validates requests with `prepare` (in a worker
thread) and consumes `generate`'s Responses, setting `cancel` when the client goes away.
"""
from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator

from .. import __version__
from ..runtime.sampling import SamplingParams
from ..runtime.scheduler import QueueFull, Scheduler, ShuttingDown
from . import logprobs
from . import protocol as P
from .metrics import Metrics
from .spec_stream import request_spec


class Server:
    def __init__(self, engine, model_id: str, spec_cfg=None, defaults: SamplingParams | None = None,
                 parallel: int = 1, max_queue: int = 64, scheduler_thread: bool = True):
        """`scheduler_thread=False`: the caller runs `self.scheduler.run()` (`serve` does, on the
        thread that loaded the model: see `Scheduler.run`)."""
        self.engine = engine
        self.model_id = model_id
        self.spec = spec_cfg.build(engine) if spec_cfg is not None else None
        self.spec_label = spec_cfg.label() if spec_cfg is not None else None
        self.defaults = defaults or SamplingParams()
        self.parallel = parallel  # slots: sequences generated at once
        self.max_queue = max_queue  # requests that may wait for a slot; beyond: 429
        # every generation runs through the continuous-batching scheduler (one forward per step for
        # all running sequences; with one slot, one sequence at a time)
        self.scheduler = Scheduler(engine, self.spec, n_slots=parallel, max_queue=max_queue + parallel,
                                   start=scheduler_thread)
        self.metrics = Metrics(parallel)
        self.cancelled = 0  # generations stopped early because their client went away
        self.busy = 0  # generations running
        self.waiting = 0  # generations waiting for a slot
        self._count = threading.Lock()
        tok = engine.tokenizer
        longest = max((len(t) for t in tok.tokens), default=1)
        self.pieces = logprobs.Pieces(tok)  # token texts and bytes for log-probabilities
        self.limits = P.Limits(engine.n_ctx, engine.n_ctx * max(longest, 1))
        self.fingerprint = "fp_" + hashlib.sha256(
            f"mtpllm {__version__} {model_id} {engine.n_ctx} {self.spec_label}".encode()).hexdigest()[:12]

    # ------------------------------------------------------------------ requests -> engine inputs
    def prepare(self, kind: str, body: dict) -> P.Job:
        """A validated Job for `kind` in {"chat", "completions" (OpenAI), "completion" (llama.cpp)}.
        Tokenizes and renders the chat template: run it in a worker thread."""
        tok = self.engine.tokenizer
        if kind == "chat":
            msgs, prefill = P.chat_messages(body, self.limits)
            text = P.render_chat(tok, msgs, prefill)
            self.limits.check_text(text, "messages")
            ids = P.encode_rendered(tok, text)
        else:
            ids, text = P.completion_prompt(body.get("prompt"), tok, self.limits)
        self.check_context(ids)
        room = max(self.engine.n_ctx - len(ids) - 1, 0)
        n_probs = logprobs.requested(body, kind)
        if kind == "completion":
            params = P.sampling_params(body, self.defaults, ("n_predict", "max_tokens"), room, tok, self.engine.n_ctx,
                                       n_probs)
        else:
            params = P.sampling_params(body, self.defaults, ("max_completion_tokens", "max_tokens", "n_predict"),
                                       16 if kind == "completions" else room, tok, self.engine.n_ctx, n_probs)
        so = body.get("stream_options") or {}
        spec = request_spec(self.spec, body)  # a request may ask for a shorter draft length, or none
        return P.Job(ids, params, stream=P.get_bool(body, "stream"),
                     include_usage=P.get_bool(so, "include_usage") if kind != "completion" else False,
                     return_tokens=P.get_bool(body, "return_tokens"), prompt=text,
                     extra={"cache_prompt": P.get_bool(body, "cache_prompt", True),
                            "timings_per_token": P.get_bool(body, "timings_per_token"),
                            "response_fields": P.response_fields(body)}, spec=spec)

    def check_context(self, ids: list[int]) -> None:
        n_ctx = self.engine.n_ctx
        if not ids:
            raise P.BadRequest("the prompt is empty", "prompt")
        if len(ids) >= n_ctx:
            raise P.ApiError(f"the prompt is {len(ids)} tokens but the context size is {n_ctx}: shorten it or "
                             f"start the server with a larger context (-c)", 400, "exceed_context_size_error",
                             n_prompt_tokens=len(ids), n_ctx=n_ctx)

    def tokens_of_text(self, ids: list[int]) -> list[dict]:
        tok = self.engine.tokenizer
        return [{"id": i, "piece": tok.decode([i])} for i in ids]

    # ------------------------------------------------------------------ admission
    def admit(self) -> None:
        """Count a generation request in, or refuse it: 429 when the queue is full, 503 once the
        scheduler has stopped accepting (shutting down)."""
        with self._count:
            if not self.scheduler.accepting:
                raise _gone("the server is shutting down")
            if self.waiting + self.busy >= self.parallel + self.max_queue:
                raise _busy(f"the server is busy: {self.busy} generating and {self.waiting} waiting "
                            f"(at most {self.max_queue} may wait); retry shortly")
            self.waiting += 1
            self.metrics.queue_depth.set(self.waiting)

    def _started(self, req, on_slot) -> None:
        if on_slot is not None and req.slot is not None:
            on_slot(req.slot)
        with self._count:
            self.waiting -= 1
            self.busy += 1
            self.metrics.queue_depth.set(self.waiting)
            self.metrics.slots_busy.set(self.busy)

    def _left(self, started: bool) -> None:
        with self._count:
            if started:
                self.busy -= 1
            else:
                self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)
            self.metrics.slots_busy.set(self.busy)

    # ------------------------------------------------------------------ generation
    def generate(self, ids: list[int], params: SamplingParams, cancel: threading.Event, spec=...,
                 on_slot=None) -> Iterator:
        """The Responses of one generation (the engine's, one per token, the last with a
        finish_reason), through the scheduler: the request joins the running batch when a slot is
        free. Runs in a worker thread, one per request. Contract with the HTTP layer: setting
        `cancel` (or closing this generator) stops it within one step, waiting for a slot or
        generating; `_started()` is called when the sequence has a slot (its prompt being
        evaluated or its first token out) and `_left(started)` when it ends (the caller has
        `admit`ted it); an exception fails this request only.

        `spec`: this request's speculative decoder (... = the server's, None = plain decoding);
        `on_slot(index)`: called once the request has a slot."""
        started = False
        req = None
        try:
            try:
                req = self.scheduler.submit(ids, params, self.spec if spec is ... else spec)
            except QueueFull as exc:  # admitted above, but the scheduler's own queue is full
                raise _busy(str(exc)) from None
            except ShuttingDown as exc:  # it stopped accepting since the request was admitted
                raise _gone(str(exc)) from None
            while True:
                try:
                    item = req.queue.get(timeout=0.05)
                except queue.Empty:
                    if cancel.is_set():
                        req.cancel()
                    if not started and req.slot is not None:  # admitted: its prompt is being evaluated
                        self._started(req, on_slot)
                        started = True
                    continue
                if isinstance(item, BaseException):
                    raise item
                if not started:
                    self._started(req, on_slot)
                    started = True
                yield item
                if item.finish_reason is not None:
                    return
                if cancel.is_set():
                    req.cancel()
        finally:
            if req is not None:
                req.cancel()  # a consumer that stopped early; nothing once the request has finished
            self._left(started)

    def slots(self) -> list[dict]:
        """llama.cpp's `/slots`: one entry per slot."""
        return [{**d, "speculative": self.spec_label} for d in self.scheduler.slots_info()]


def _busy(message: str) -> P.ApiError:
    """429 with Retry-After: the queue is full, retry shortly."""
    return P.ApiError(message, 429, "unavailable_error", headers={"Retry-After": "1"})


def _gone(message: str) -> P.ApiError:
    """503: this server is shutting down."""
    return P.ApiError(message, 503, "unavailable_error")
