"""HTTP server with OpenAI- and llama.cpp-compatible endpoints (`mtpllm serve`).

- OpenAI: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
  `"stream": true` as server-sent events ending in `data: [DONE]`).
- llama.cpp server: `POST /completion` (`n_predict`, `stream`), `POST /tokenize`, `POST /detokenize`,
  `GET /health`, `GET /props`.

One model, one generation at a time (requests queue on a lock: the engine has one KV cache, whose
common prefix with the next prompt is reused). Speculative decoding is configured when the server
starts (the same flags as `mtpllm run`) and applies to every request (a request may ask for a
shorter draft length); its statistics come back in `timings` (llama.cpp's `draft_n`,
`draft_n_accepted`), and streamed chunks say which tokens were accepted drafts (spec_stream.py).
The chat page at `/` is webui/; `--api-key` is apikey.py. Bad requests get a 400 with an
OpenAI-style JSON error body naming the problem; nothing a client sends raises past the handlers.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .errors import MtpllmError
from .runtime.sampling import SamplingParams
from .spec_stream import SpecTrace, max_draft_length, request_spec


class BadRequest(Exception):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _num(body: dict, key: str, default, kind=float, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {json.dumps(v)}")
    v = kind(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}], got {v}")
    return v


def _is_int_list(v: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        return [s] if s else []
    if isinstance(s, list) and all(isinstance(x, str) for x in s):
        return [x for x in s if x]
    raise BadRequest("'stop' must be a string or a list of strings")


class Server:
    def __init__(self, engine, model_id: str, spec_cfg=None, defaults: SamplingParams | None = None):
        self.engine = engine
        self.model_id = model_id
        self.spec = spec_cfg.build(engine) if spec_cfg is not None else None
        self.spec_label = spec_cfg.label() if spec_cfg is not None else None
        self.defaults = defaults or SamplingParams()
        self.lock = threading.Lock()
        self.cancelled = 0  # streams stopped early because their client went away

    # ------------------------------------------------------------------ requests -> engine inputs
    def params(self, body: dict, max_key: str, default_max: int | None) -> SamplingParams:
        d = self.defaults
        n = body.get(max_key, body.get("max_completion_tokens") if max_key == "max_tokens" else None)
        if n is None or n == -1:
            n = default_max
        elif isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise BadRequest(f"'{max_key}' must be a non-negative integer (or -1), got {json.dumps(n)}")
        if body.get("n", 1) != 1:
            raise BadRequest("'n' must be 1: one completion per request")
        for key, allowed in (("logprobs", (None, False, 0)), ("echo", (None, False)), ("best_of", (None, 1)),
                             ("suffix", (None, "")), ("tools", (None, [])), ("response_format", (None,)),
                             ("grammar", (None, ""))):
            if body.get(key) not in allowed:
                raise BadRequest(f"'{key}' is not supported by this server")
        seed = body.get("seed", d.seed)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest(f"'seed' must be an integer, got {json.dumps(seed)}")
        if seed is not None and seed < 0:  # llama.cpp: -1 = random
            seed = None
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadRequest("'ignore_eos' must be true or false")
        # out-of-range values raise MtpllmError: a 400 like BadRequest (see create_app)
        return SamplingParams(
            temperature=_num(body, "temperature", d.temperature, lo=0.0),
            top_k=_num(body, "top_k", d.top_k, int, lo=0), top_p=_num(body, "top_p", d.top_p),
            min_p=_num(body, "min_p", d.min_p),
            repetition_penalty=_num(body, "repeat_penalty", _num(body, "repetition_penalty", d.repetition_penalty)),
            presence_penalty=_num(body, "presence_penalty", d.presence_penalty),
            frequency_penalty=_num(body, "frequency_penalty", d.frequency_penalty),
            seed=seed, max_tokens=n, stop=_stop(body) or list(d.stop), ignore_eos=ignore_eos)

    def prompt_ids(self, prompt) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("'prompt' is empty")
            return tok.encode(prompt)
        if isinstance(prompt, list) and prompt and _is_int_list(prompt):
            return self.token_ids(prompt, "prompt")
        raise BadRequest("'prompt' must be a non-empty string, a list with one string, or a list of token ids")

    def token_ids(self, ids: list, field: str) -> list[int]:
        """A list of integers, checked against the vocabulary."""
        if not isinstance(ids, list) or not _is_int_list(ids):
            raise BadRequest(f"'{field}' must be a list of integers")
        n = self.engine.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < n]
        if bad:
            raise BadRequest(f"'{field}' has token ids outside the vocabulary (0..{n - 1}): {bad[:5]}")
        return list(ids)

    def chat_ids(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                parts = []
                for p in c:
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise BadRequest(f"messages[{i}].content: only text parts are supported")
                    parts.append(p["text"])
                c = "".join(parts)
            if c is None:
                c = ""
            if not isinstance(c, str):
                raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
            out.append({"role": m["role"], "content": c})
        if not self.engine.tokenizer.chat_template:
            raise BadRequest("this model has no chat template: use /v1/completions")
        try:
            return self.engine.encode_prompt(messages=out)
        except MtpllmError as exc:
            raise BadRequest(f"cannot render the chat template: {exc}") from None

    # ------------------------------------------------------------------ generation
    def generate(self, ids, params, spec=...):  # spec: ... = the server's
        spec = self.spec if spec is ... else spec
        with self.lock:
            last, parts = None, []
            for r in self.engine.stream(ids, params, spec):
                parts.append(r.text)
                last = r
            return "".join(parts), last

    async def responses(self, ids, params, spec=...):
        """The Responses of one generation, as an async iterator (an exception is passed on as an
        item). Generation runs in a worker thread that stops at the next token once this iterator is
        closed early (the client went away), so a dropped connection never holds the lock."""
        q: queue.Queue = queue.Queue()
        cancel = threading.Event()
        spec = self.spec if spec is ... else spec

        def work():
            try:
                with self.lock:
                    gen = self.engine.stream(ids, params, spec)
                    try:
                        for r in gen:
                            q.put(r)
                            if cancel.is_set() and r.finish_reason is None:
                                self.cancelled += 1
                                break
                    finally:
                        gen.close()
            except Exception as exc:  # reported in the stream, not lost
                q.put(exc)
            q.put(None)

        threading.Thread(target=work, daemon=True).start()
        try:
            while True:
                r = await run_in_threadpool(q.get)
                if r is None:
                    return
                yield r
        finally:
            cancel.set()

    async def sse(self, ids, params, render, head: tuple = (), tail=lambda last: (), spec=...):
        """Server-sent events: `head` objects, render(r) per Response (None: nothing), tail(last)."""
        for h in head:
            yield _sse(h)
        last = None
        async with aclosing(self.responses(ids, params, spec)) as rs:
            async for r in rs:
                if isinstance(r, Exception):
                    yield _sse({"error": {"message": str(r), "type": "server_error", "code": 500}})
                    return
                last = r
                obj = render(r)
                if obj is not None:
                    yield _sse(obj)
        for t in tail(last):
            yield t if isinstance(t, str) else _sse(t)

    def timings(self, last) -> dict:
        t = last.timings.to_dict() if last is not None and last.timings is not None else {}
        st = last.stats if last is not None else None
        if st is not None:
            t.update(draft_n=st.num_draft_tokens, draft_n_accepted=st.num_accepted_tokens,
                     mean_acceptance_length=st.mean_acceptance_length, speculative=self.spec_label)
        return t


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(server: Server, webui: bool = True, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="mtpllm", docs_url=None, redoc_url=None)
    if webui:  # the chat page at / (src/mtpllm/webui)
        from .webui import mount_webui
        mount_webui(app)
    if api_key:
        from .apikey import ApiKeyMiddleware
        app.add_middleware(ApiKeyMiddleware, key=api_key)
    eng = server.engine

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        return _error(400, str(exc))

    @app.exception_handler(MtpllmError)
    async def engine_error(_, exc: MtpllmError):
        return _error(400, str(exc))

    @app.exception_handler(404)
    async def not_found(request: Request, _):
        return _error(404, f"no such endpoint: {request.method} {request.url.path}", "not_found_error")

    @app.exception_handler(405)
    async def bad_method(request: Request, _):
        return _error(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": 0,
                                            "owned_by": "mtpllm"}]}

    @app.get("/props")
    async def props():
        return {"model_path": server.model_id, "total_slots": 1, "n_ctx": eng.n_ctx,
                "chat_template": eng.tokenizer.chat_template or "", "speculative": server.spec_label,
                "speculative_n_max": max_draft_length(server.spec),
                "default_generation_settings": {"n_ctx": eng.n_ctx, "temperature": server.defaults.temperature,
                                                "top_k": server.defaults.top_k, "top_p": server.defaults.top_p,
                                                "min_p": server.defaults.min_p}}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string")
        add_special = body.get("add_special", False)
        if not isinstance(add_special, bool):
            raise BadRequest("'add_special' must be true or false")
        return {"tokens": eng.tokenizer.encode(content, add_special=add_special)}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        return {"content": eng.tokenizer.decode(server.token_ids(body.get("tokens"), "tokens"))}

    def room(ids: list[int]) -> int:
        return max(eng.n_ctx - len(ids) - 1, 0)

    # ---------------------------------------------------------------- OpenAI
    async def openai(request: Request, chat: bool):
        body = await body_of(request)
        ids = server.chat_ids(body) if chat else server.prompt_ids(body.get("prompt"))
        eng._check_prompt(ids)  # too long for the context: MtpllmError, a 400
        params = server.params(body, "max_tokens", room(ids) if chat else 16)
        spec = request_spec(server.spec, body)
        trace = SpecTrace()  # the "mtpllm" object of each chunk: draft tokens, live statistics
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")
        so = body.get("stream_options") or {}
        include_usage = isinstance(so, dict) and so.get("include_usage") is True
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage(last):
            n = last.timings.predicted_n if last is not None else 0
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not stream:
            text, last = await run_in_threadpool(server.generate, ids, params, spec)
            choice = {"index": 0, "finish_reason": _finish(last)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice.update(text=text, logprobs=None)
            return {"id": rid, "object": kind, "created": created, "model": server.model_id, "choices": [choice],
                    "usage": usage(last), "timings": server.timings(last)}

        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": server.model_id}

        def render(r):
            trace.add(r)
            if not (r.text or r.finish_reason):
                return None
            fin = _finish(r) if r.finish_reason else None
            if chat:
                return {**head, "choices": [{"index": 0, "delta": {"content": r.text} if r.text else {},
                                             "finish_reason": fin}], "mtpllm": trace.field(r)}
            return {**head, "choices": [{"index": 0, "text": r.text, "logprobs": None, "finish_reason": fin}],
                    "mtpllm": trace.field(r)}

        def tail(last):
            usage_chunk = [{**head, "choices": [], "usage": usage(last), "timings": server.timings(last)}]
            return (usage_chunk if include_usage else []) + ["data: [DONE]\n\n"]
        first = ({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]},) if chat else ()
        return StreamingResponse(server.sse(ids, params, render, first, tail, spec), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai(request, chat=True)

    # ---------------------------------------------------------------- llama.cpp
    @app.post("/completion")
    async def completion(request: Request):
        body = await body_of(request)
        ids = server.prompt_ids(body.get("prompt"))
        eng._check_prompt(ids)  # too long for the context: MtpllmError, a 400
        params = server.params(body, "n_predict", room(ids))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")

        def final(text, last):
            return {"content": text, "stop": True, "model": server.model_id, "tokens_evaluated": len(ids),
                    "tokens_predicted": last.timings.predicted_n if last is not None else 0,
                    "stop_type": {"length": "limit", "context": "limit"}.get(last.finish_reason, "eos")
                    if last is not None else "eos", "timings": server.timings(last)}

        if not stream:
            text, last = await run_in_threadpool(server.generate, ids, params)
            return final(text, last)

        return StreamingResponse(server.sse(ids, params, lambda r: {"content": r.text, "stop": False} if r.text else None,
                                            tail=lambda last: [final("", last)]), media_type="text/event-stream")

    return app


def _finish(last) -> str:
    if last is None or last.finish_reason in (None, "stop"):
        return "stop"
    return "length"  # the token limit or the end of the context


def serve(server: Server, host: str, port: int, **app_options) -> None:
    import uvicorn
    uvicorn.run(create_app(server, **app_options), host=host, port=port, log_level="info")
