"""ASGI middleware: the API key, the request-body limit and the access log (with the request metrics).

Plain ASGI (no BaseHTTPMiddleware): streaming responses pass through untouched and a client that
goes away is seen by the route.
"""
from __future__ import annotations

import hmac
import json
import sys
import time

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})  # answered without the API key (load balancers probe them)


async def send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = json.dumps(body).encode()
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": raw})


def error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` (or `X-Api-Key: KEY`) on every route but PUBLIC_PATHS; CORS
    preflight requests (OPTIONS) carry no credentials and pass to the CORS layer above."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS" \
                or scope["path"] == "/" or scope["path"].startswith("/webui/"):  # the chat page asks for the key itself
            return await self.app(scope, receive, send)
        given = b""
        for k, v in scope["headers"]:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                given = v[7:].strip()
            elif k == b"x-api-key" and not given:
                given = v.strip()
        if not hmac.compare_digest(given, self.key):  # constant time in the key's contents
            return await send_json(send, 401, error_body(401, "invalid or missing API key (send the header "
                                                         "'Authorization: Bearer KEY')", "authentication_error"),
                                   {"www-authenticate": "Bearer"})
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 to a body over `limit` bytes: at once from Content-Length, or as soon as a chunked
    body passes the limit (the route's read of the body then fails and the 413 is what is sent)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        msg = (f"the request body is larger than the limit of {self.limit} bytes "
               f"(the server's --max-body-bytes)")
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    return await send_json(send, 400, error_body(400, "invalid Content-Length header",
                                                                 "invalid_request_error"))
                if n > self.limit:
                    return await send_json(send, 413, error_body(413, msg, "request_too_large"),
                                           {"connection": "close"})
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            m = await receive()
            if m["type"] == "http.request":
                seen += len(m.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(msg)
            return m

        async def tracking_send(m):
            nonlocal started
            if m["type"] == "http.response.start":
                started = True
            await send(m)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:
            if not started:
                await send_json(send, 413, error_body(413, str(exc), "request_too_large"), {"connection": "close"})


class BodyTooLarge(Exception):
    pass


class AccessLogMiddleware:
    """One JSON line per request on stderr (method, path, status, duration, tokens, client) and the
    request metrics. The duration runs to the response's last byte, so a stream counts whole.
    Routes add their token counts to `scope["mtpllm.log"]`."""

    def __init__(self, app, metrics, stream=None, enabled: bool = True):
        self.app = app
        self.metrics = metrics
        self.stream = stream
        self.enabled = enabled

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        info: dict = {}
        scope["mtpllm.log"] = info
        status = 0

        async def logging_send(m):
            nonlocal status
            if m["type"] == "http.response.start":
                status = m["status"]
            await send(m)

        try:
            await self.app(scope, receive, logging_send)
        except BaseException:
            status = status or 500
            raise
        finally:
            dt = time.perf_counter() - t0
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or ("(unauthorized)" if status == 401 else "(other)")
            self.metrics.requests.labels(endpoint, str(status or 500)).inc()
            self.metrics.request_seconds.labels(endpoint).observe(dt)
            if self.enabled:
                client = scope.get("client")
                line = {"ts": round(time.time(), 3), "method": scope["method"], "path": scope["path"],
                        "status": status or 500, "duration_ms": round(dt * 1e3, 1),
                        "client": f"{client[0]}:{client[1]}" if client else None, **info}
                print(json.dumps(line, ensure_ascii=True), file=self.stream or sys.stderr, flush=True)
