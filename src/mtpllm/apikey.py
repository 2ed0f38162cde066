"""`mtpllm serve --api-key KEY`: every endpoint but the health check and the chat page's own files
needs `Authorization: Bearer KEY` (as llama.cpp's server and OpenAI clients send it).

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware) so streamed answers pass through
untouched and a client that goes away still stops its generation.
"""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

PUBLIC = {"/", "/health"}  # the page itself asks for the key when an API call answers 401
PUBLIC_PREFIXES = ("/webui/",)


class ApiKeyMiddleware:
    def __init__(self, app, key: str):
        if not key:
            raise ValueError("the API key is empty")
        self.app = app
        self.key = key.encode()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if (scope.get("method") == "OPTIONS" or path in PUBLIC or path.startswith(PUBLIC_PREFIXES)
                or self._authorized(scope)):
            return await self.app(scope, receive, send)
        resp = JSONResponse({"error": {"message": "invalid or missing API key: send the header "
                                                  "'Authorization: Bearer KEY'",
                                       "type": "authentication_error", "code": 401}},
                            status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)
