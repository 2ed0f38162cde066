"""Routes: the OpenAI and llama.cpp endpoints, as a FastAPI app around a `Server`.

Every request body is read with a size limit, parsed, validated, tokenized and rendered through the
chat template in a worker thread (`Server.prepare`); generation runs behind `Server.generate` in its
own thread and reaches the route through an asyncio queue. A client that goes away, streaming or
not, sets the generation's cancel flag: it stops at the next token.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ..errors import MtpllmError
from . import protocol as P
from .core import Server
from .logprobs import Collector
from .metrics import CONTENT_TYPE_LATEST
from .spec_stream import SpecTrace, max_draft_length
from .security import AccessLogMiddleware, ApiKeyMiddleware, BodyLimitMiddleware, BodyTooLarge

DEFAULT_MAX_BODY = 8 * 1024 * 1024
log = logging.getLogger("mtpllm.server")


def _error(exc: P.ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends (the client went
    away included): closing it cancels the generation."""

    def __init__(self, content, generation: "Generation"):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.generation.cancel.set()  # never started (the client left at once) or already done


class Generation:
    """One generation: `Server.generate` in a thread, its Responses through an asyncio queue, the
    metrics of its tokens. Iterate `items()`; leaving the iteration early cancels it."""

    def __init__(self, server: Server, job: P.Job, t_arrival: float):
        self.server, self.job, self.t_arrival = server, job, t_arrival
        self.cancel = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.last = None
        self.tokens: list[int] = []
        self.finished = False
        self.outcome = "cancelled"  # stop, length, context, cancelled or error once items() has ended
        self.slot = -1  # the slot it runs on, once it has one (llama.cpp's id_slot)
        server.admit()  # 429 when the queue is full
        threading.Thread(target=self._work, daemon=True, name="mtpllm-generate").start()

    def _on_slot(self, index: int) -> None:
        self.slot = index

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
            self.cancel.set()

    def _work(self) -> None:
        try:
            for r in self.server.generate(self.job.ids, self.job.params, self.cancel, self.job.spec,
                                          on_slot=self._on_slot):
                self._put(r)
        except Exception as exc:  # fails this request only
            if isinstance(exc, (P.ApiError, MtpllmError)):  # the request's fault or a refusal: no traceback
                log.info("generation refused: %s", exc)
            else:
                log.exception("generation failed")
            self._put(exc)
        finally:
            self._put(None)

    async def items(self):
        m = self.server.metrics
        t_prev = None
        outcome = "cancelled"
        try:
            while True:
                r = await self.q.get()
                if r is None:
                    break
                if isinstance(r, Exception):
                    outcome = "error"
                    raise r
                now = time.perf_counter()
                if r.token is not None:
                    self.tokens.append(r.token)
                    if t_prev is None:
                        m.ttft.observe(now - self.t_arrival)
                    else:
                        m.token_latency.observe(now - t_prev)
                    t_prev = now
                self.last = r
                if r.finish_reason is not None:  # before the yield: the consumer may stop at this one
                    self.finished = True
                    outcome = r.finish_reason
                yield r
        finally:
            self.outcome = outcome
            if not self.finished:
                self.cancel.set()
                if outcome == "cancelled":
                    self.server.cancelled += 1
            last = self.last
            t = last.timings if last is not None else None
            m.record_generation(t.prompt_n if t else 0, t.cached_n if t else 0, len(self.tokens), outcome,
                                last.stats if last is not None else None, self.server.spec_label)

    async def collect(self, request: Request, each=None) -> str:
        """Run to the end for a non-streaming client; its disconnection cancels the generation.
        `each`: called with every Response."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.cancel.set()
        watcher = asyncio.create_task(watch())
        parts = []
        try:
            async with aclosing(self.items()) as rs:
                async for r in rs:
                    parts.append(r.text)
                    if each is not None:
                        each(r)
                    if self.cancel.is_set():
                        break
        finally:
            watcher.cancel()
        return "".join(parts)


def create_app(server: Server, api_key: str | None = None, cors_origins: list[str] | tuple = (),
               max_body_bytes: int = DEFAULT_MAX_BODY, access_log: bool = True, log_stream=None,
               webui: bool = True) -> FastAPI:
    app = FastAPI(title="mtpllm", docs_url=None, redoc_url=None, openapi_url=None)
    if webui:  # the chat page at / (src/mtpllm/webui), its files under /webui/
        from ..webui import mount_webui
        mount_webui(app)
    eng = server.engine
    tok = eng.tokenizer

    # each add_middleware wraps the ones before: the access log (outermost) sees every answer, CORS
    # answers preflights before the key is asked for and puts its headers on 401s, and the body
    # limit is only reached with a valid key
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], allow_credentials="*" not in cors_origins, max_age=600)
    app.add_middleware(AccessLogMiddleware, metrics=server.metrics, stream=log_stream, enabled=access_log)

    @app.exception_handler(P.ApiError)
    async def api_error(_, exc: P.ApiError):
        return _error(exc)

    @app.exception_handler(MtpllmError)
    async def engine_error(_, exc: MtpllmError):
        return _error(P.BadRequest(str(exc)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return _error(P.ApiError(f"no such endpoint: {request.method} {request.url.path}", 404, "not_found_error"))
        if exc.status_code == 405:
            return _error(P.ApiError(f"{request.method} is not allowed on {request.url.path}", 405))
        return _error(P.ApiError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def server_fault(_, exc: Exception):
        log.error("internal error: %r", exc)
        return _error(P.ApiError(f"internal server error ({type(exc).__name__})", 500, "server_error"))

    async def body_of(request: Request) -> dict:
        try:
            raw = await request.body()
        except BodyTooLarge as exc:
            raise P.ApiError(str(exc), 413, "request_too_large") from None
        return await run_in_threadpool(P.parse_json, raw)

    def note(request: Request, job: P.Job, g: Generation, rid: str | None = None) -> None:
        """What the access-log line of this request adds: its tokens and how its generation ended."""
        info = {"id": rid} if rid else {}
        info.update(prompt_tokens=len(job.ids), completion_tokens=len(g.tokens), finish=g.outcome)
        request.scope.get("mtpllm.log", {}).update(info)

    def usage(job: P.Job, g: Generation) -> dict:
        n = len(g.tokens)
        t = g.last.timings if g.last is not None else None
        return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n,
                "prompt_tokens_details": {"cached_tokens": t.cached_n if t else 0}}

    def timings(g: Generation) -> dict:
        last = g.last
        t = last.timings.to_dict() if last is not None and last.timings is not None else {}
        st = last.stats if last is not None else None
        if st is not None:
            t.update(draft_n=st.num_draft_tokens, draft_n_accepted=st.num_accepted_tokens,
                     mean_acceptance_length=st.mean_acceptance_length, speculative=server.spec_label)
        return t

    def finish(g: Generation) -> str:
        last = g.last
        if last is None or last.finish_reason in (None, "stop"):
            return "stop"
        return "length"  # the token limit or the end of the context

    # ---------------------------------------------------------------- small endpoints
    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": 0,
                                            "owned_by": "mtpllm", "meta": {"n_ctx": eng.n_ctx,
                                                                           "speculative": server.spec_label}}]}

    def settings(params, n_predict=None) -> dict:
        return {"n_ctx": eng.n_ctx, "n_predict": params.max_tokens if n_predict is None else n_predict,
                "seed": -1 if params.seed is None else params.seed, "temperature": params.temperature,
                "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
                "repeat_penalty": params.repetition_penalty, "repeat_last_n": params.penalty_last_n,
                "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                "stop": list(params.stop), "ignore_eos": params.ignore_eos,
                "logit_bias": [[t, b if b != float("-inf") else False] for t, b in params.logit_bias.items()],
                "speculative": server.spec_label, "model": server.model_id}

    @app.get("/props")
    async def props():
        d = server.defaults
        return {"model_path": server.model_id, "total_slots": server.parallel, "n_ctx": eng.n_ctx,
                "chat_template": tok.chat_template or "", "speculative": server.spec_label,
                "speculative_n_max": max_draft_length(server.spec),
                "system_fingerprint": server.fingerprint, "modalities": {"vision": False, "audio": False},
                "default_generation_settings": {"id": 0, "n_ctx": eng.n_ctx, "temperature": d.temperature,
                                                "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                                                "params": settings(d)}}

    @app.get("/slots")
    async def slots():
        return server.slots()

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise P.BadRequest("'content' must be a string", "content")
        add_special = P.get_bool(body, "add_special")
        with_pieces = P.get_bool(body, "with_pieces")
        server.limits.check_text(content, "content")
        ids = await run_in_threadpool(tok.encode, content, add_special)
        return {"tokens": await run_in_threadpool(server.tokens_of_text, ids) if with_pieces else ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        ids = P.token_ids(body.get("tokens"), "tokens", tok.vocab_size)
        return {"content": await run_in_threadpool(tok.decode, ids)}

    @app.post("/apply-template")
    async def apply_template(request: Request):
        body = await body_of(request)

        def render():
            msgs, prefill = P.chat_messages(body, server.limits)
            return P.render_chat(tok, msgs, prefill)
        return {"prompt": await run_in_threadpool(render)}

    # ---------------------------------------------------------------- OpenAI
    async def openai(request: Request, chat: bool):
        t_arrival = time.perf_counter()
        body = await body_of(request)
        job = await run_in_threadpool(server.prepare, "chat" if chat else "completions", body)
        trace = SpecTrace()  # the "mtpllm" object of each chunk: which tokens were accepted drafts
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": server.model_id, "system_fingerprint": server.fingerprint}
        lp = Collector(server.pieces, "chat" if chat else "completions") if job.params.logprobs is not None else None
        g = Generation(server, job, t_arrival)

        if not job.stream:
            text = await g.collect(request, lp.add if lp else None)
            note(request, job, g, rid)
            choice = {"index": 0, "finish_reason": finish(g)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = lp.everything() if lp else None
            else:
                choice.update(text=text, logprobs=lp.everything() if lp else None)
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": usage(job, g), "timings": timings(g)}

        def chunk(text, fin, r):
            lps = lp.take() if lp else None
            if chat:
                c = {**head, "choices": [{"index": 0, "delta": {"content": text} if text else {},
                                          "logprobs": lps, "finish_reason": fin}]}
            else:
                c = {**head, "choices": [{"index": 0, "text": text, "logprobs": lps, "finish_reason": fin}]}
            if job.extra["timings_per_token"]:
                c["timings"] = timings(g)
            c["mtpllm"] = trace.field(r)  # an extension OpenAI clients ignore
            return c

        async def events():
            try:
                if chat:
                    yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                                     "logprobs": None, "finish_reason": None}]})
                async with aclosing(g.items()) as rs:
                    async for r in rs:
                        trace.add(r)
                        if lp:
                            lp.add(r)
                        if r.text:
                            yield _sse(chunk(r.text, None, r))
                        if r.finish_reason:
                            yield _sse(chunk("", finish(g), r))
                if job.include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(job, g), "timings": timings(g)})
                yield "data: [DONE]\n\n"
            except Exception as exc:  # after the headers: the error goes in the stream
                yield _sse(_stream_error(exc))
            finally:
                note(request, job, g, rid)
        return SSEResponse(events(), g)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai(request, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await openai(request, chat=True)

    # ---------------------------------------------------------------- llama.cpp
    def final(job: P.Job, g: Generation, text: str) -> dict:
        last = g.last
        t = last.timings if last is not None else None
        word = ""
        if last is None:
            stop_type = "none"
        elif last.finish_reason in ("length", "context"):
            stop_type = "limit"
        elif last.finish_reason == "stop" and last.token is not None:  # a stop string matched
            stop_type = "word"
            full = tok.decode(g.tokens, skip_special=True)
            done = tok.decode(g.tokens[:-1], skip_special=True)  # the match ends in the last token
            word = next((s for s in job.params.stop if s in full[max(0, len(done) - len(s)):]), "")
        elif last.finish_reason == "stop":
            stop_type = "eos"
        else:
            stop_type = "none"
        return {"index": 0, "content": text, "tokens": list(g.tokens) if job.return_tokens else [], "id_slot": g.slot,
                "stop": True, "model": server.model_id, "tokens_predicted": len(g.tokens),
                "tokens_evaluated": len(job.ids), "generation_settings": settings(job.params),
                "prompt": job.prompt, "has_new_line": "\n" in text, "stop_type": stop_type,
                # llama.cpp: the context filled up (prompts themselves are never cut: too long is a 400)
                "truncated": stop_type == "limit" and len(job.ids) + len(g.tokens) >= eng.n_ctx - 1,
                "stopping_word": word, "tokens_cached": (t.cached_n if t else 0), "timings": timings(g)}

    async def llama_completion(request: Request):
        t_arrival = time.perf_counter()
        body = await body_of(request)
        job = await run_in_threadpool(server.prepare, "completion", body)
        lp = Collector(server.pieces, "completion") if job.params.logprobs is not None else None
        g = Generation(server, job, t_arrival)
        if not job.stream:
            text = await g.collect(request, lp.add if lp else None)
            note(request, job, g)
            out = final(job, g, text)
            if lp and lp.items:  # llama.cpp: only when there are some
                out["completion_probabilities"] = lp.everything()
            fields = job.extra["response_fields"]
            return P.pick_fields(out, fields) if fields else out

        async def events():
            parts = []
            try:
                async with aclosing(g.items()) as rs:
                    async for r in rs:
                        parts.append(r.text)
                        if lp:
                            lp.add(r)
                        if r.token is not None or r.text:
                            c = {"index": 0, "content": r.text, "tokens": [] if r.token is None else [r.token],
                                 "stop": False, "id_slot": g.slot, "tokens_predicted": len(g.tokens),
                                 "tokens_evaluated": len(job.ids)}
                            if lp and len(lp.items) > lp.sent:
                                c["completion_probabilities"] = lp.take()
                            yield _sse(c)
                yield _sse({**final(job, g, ""), "has_new_line": "\n" in "".join(parts)})
            except Exception as exc:
                yield _sse(_stream_error(exc))
            finally:
                note(request, job, g)
        return SSEResponse(events(), g)

    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request):
        return await llama_completion(request)

    return app


def _stream_error(exc: Exception) -> dict:
    if isinstance(exc, P.ApiError):
        return exc.body()
    if isinstance(exc, MtpllmError):
        return P.BadRequest(str(exc)).body()
    return {"error": {"message": f"internal server error ({type(exc).__name__})", "type": "server_error", "code": 500}}


def serve(server: Server, host: str, port: int, api_key: str | None = None, cors_origins=(),
          max_body_bytes: int = DEFAULT_MAX_BODY, shutdown_timeout: float = 20.0, access_log: bool = True,
          webui: bool = True) -> None:
    """Run the app under uvicorn. SIGTERM / SIGINT: stop accepting, let running requests finish for
    up to `shutdown_timeout` seconds, then cancel what is left (its generations stop at the next token).

    A server made with `scheduler_thread=False` runs its scheduler on this thread (the one that
    loaded the model: `Scheduler.run` says why) and uvicorn on another; the signals are caught
    here and handed to uvicorn."""
    import signal
    import threading

    import uvicorn
    app = create_app(server, api_key, cors_origins, max_body_bytes, access_log, webui=webui)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout)
    http = uvicorn.Server(config)
    if server.scheduler.thread is not None:
        http.run()
        return
    worker = threading.Thread(target=http.run, name="mtpllm-http")
    previous = {sig: signal.signal(sig, http.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    worker.start()
    try:
        server.scheduler.run(stop=lambda: not worker.is_alive())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        http.should_exit = True
        worker.join()
