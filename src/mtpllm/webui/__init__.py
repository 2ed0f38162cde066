"""The chat page that `mtpllm serve` serves at `/` (turned off with `--no-webui`).

Plain files from `static/`: the page, its own JavaScript modules and the pinned browser libraries
in `static/vendor/` (markdown, sanitizing, highlighting; see vendor/README.md). Nothing is built or
fetched at run time. Every file is sent with a strict Content-Security-Policy: scripts only from
this server (no inline script), no plugins, no frames, requests only back to this server, so text
that a model writes cannot run script in the page even if it got past the sanitizer.
"""
from __future__ import annotations

import mimetypes
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # revalidate (ETag): an upgraded package serves its new files at once
}

# module scripts need a JavaScript MIME type, whatever the system's MIME table says
for _ext in (".js", ".mjs"):
    mimetypes.add_type("text/javascript", _ext)


class _Static(StaticFiles):
    def file_response(self, *args, **kwargs):
        resp = super().file_response(*args, **kwargs)
        resp.headers.update(HEADERS)
        return resp


def mount_webui(app: FastAPI) -> None:
    """Serve the chat page at `/` and its files under `/webui/` on `app`."""

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)

    app.mount("/webui", _Static(directory=STATIC), name="webui")
