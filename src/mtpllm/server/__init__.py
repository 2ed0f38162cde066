"""HTTP server with OpenAI- and llama.cpp-compatible endpoints (`mtpllm serve`); see docs/server.md.

- `core.Server`: the model, the request defaults, and `Server.generate`, the one door to generation.
- `protocol`: request bodies -> validated engine inputs (4xx errors naming the field).
- `app`: the routes (`create_app`) and `serve` (uvicorn, graceful shutdown).
- `security`: API key, body-size limit, access log; `metrics`: Prometheus metrics.
"""
from .app import DEFAULT_MAX_BODY, create_app, serve
from .core import Server
from .protocol import ApiError, BadRequest

__all__ = ["Server", "create_app", "serve", "ApiError", "BadRequest", "DEFAULT_MAX_BODY"]
