"""The page's routes for `lmhead serve`: `/` (the page), `/page/page.css` and `/page/page.js` (from the
package), and the JSON routes the page calls, each a reading turned into a view document
(render/html.py). The serve app includes them with `app.include_router(router(model))`.

    GET  /api/info      the model's name, its context and the page's text limit
    POST /api/score     {"text"}                        -> render.html.score_view
    POST /api/inspect   {"prompt", "top_k", "targets"}  -> render.html.inspect_view
    POST /api/diff      {"a", "b", "top_k"}             -> render.html.diff_view

Errors come in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad value,
413 for a text over the limit, 500 for a model's failure (e.g. non-finite logits); the page shows the
message. The model runs one request at a time, in a worker thread, so the event loop never blocks.
This module imports FastAPI: only the server imports it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from lmhead_cli.errors import LmheadError, UsageError

MAX_TEXT_TOKENS = 20_000  # the page's scored text: 5,000 tokens render in well under a second
MAX_TEXT_CHARS = 20 * MAX_TEXT_TOKENS  # checked before encoding: a token is rarely over 20 characters
MAX_BODY_BYTES = 8 * 2**20  # a request body: the longest text JSON-escaped (6 bytes a character at worst) fits
MAX_TOP_K = 100
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class TooLong(UsageError):
    """A text over the page's limit (413)."""


def _error(status: int, message: str, kind: str, param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def _text(body: Any, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, str):
        raise UsageError(f"'{key}' must be a string")
    return value


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"'{key}' must be a whole number from {lo} to {hi} (got {value!r})")
    return value


def router(model, *, run: Callable[[Callable[[], Any]], Any] | None = None, dependencies=()):
    """The page's routes over one model (lmhead_cli.api.Model). `run(fn)`, if given, is an
    awaitable that runs fn() where the server runs its model work; by default fn runs in a worker
    thread, one at a time. `dependencies` (e.g. the server's API-key check) guard the JSON routes;
    the page's own files hold no data and are served to anyone."""
    from lmhead_cli.page import asset
    from lmhead_cli.render import html

    lock = threading.Lock()

    async def call(fn):
        if run is not None:
            return await run(fn)

        def locked():
            with lock:
                return fn()
        return await run_in_threadpool(locked)

    r = APIRouter()
    api = APIRouter(dependencies=list(dependencies))
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

    @r.get("/", include_in_schema=False)
    def index():
        return HTMLResponse(asset("index.html"), headers=headers)

    @r.get("/page/page.css", include_in_schema=False)
    def css():
        return Response(asset("page.css"), media_type="text/css; charset=utf-8", headers=headers)

    @r.get("/page/page.js", include_in_schema=False)
    def js():
        return Response(asset("page.js"), media_type="text/javascript; charset=utf-8", headers=headers)

    @api.get("/api/info")
    def info():
        from lmhead_cli.render import safe_text

        return {"model": safe_text(model.source), "random_weights": model.random_weights,
                "n_ctx": model.n_ctx, "max_text_tokens": MAX_TEXT_TOKENS}

    async def answer(request: Request, work: Callable[[dict], Any]):
        data = bytearray()
        async for part in request.stream():  # read no further than the limit
            data += part
            if len(data) > MAX_BODY_BYTES:
                return _error(413, f"the request body is over the page's limit of {MAX_BODY_BYTES:,} bytes",
                              "invalid_request_error")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        try:
            return await call(lambda: work(body))
        except TooLong as e:
            return _error(413, str(e), "invalid_request_error", "text")
        except UsageError as e:
            return _error(400, str(e), "invalid_request_error", getattr(e, "key", None))
        except LmheadError as e:
            return _error(500, str(e), "model_error")
        except MemoryError:
            return _error(500, "the model ran out of memory on this request", "model_error")
        except Exception as e:  # never a hang, never a traceback on the page: one line
            return _error(500, f"the model failed: {type(e).__name__}", "server_error")

    def do_score(body: dict) -> dict:
        from lmhead_cli.readings.score import check_text

        text = _text(body, "text")
        if len(text) > MAX_TEXT_CHARS:
            raise TooLong(f"the text is {len(text):,} characters; the page scores at most {MAX_TEXT_CHARS:,}")
        n = len(model.tokenizer.encode_long(check_text(text)))
        if n > MAX_TEXT_TOKENS:
            raise TooLong(f"the text is {n:,} tokens; the page scores at most {MAX_TEXT_TOKENS:,}")
        return html.score_view(model.score(text, alternatives=html.ALTERNATIVES).reading)

    def do_inspect(body: dict) -> dict:
        targets = body.get("targets", [])
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or len(targets) > MAX_TOP_K:
            raise UsageError(f"'targets' must be a list of at most {MAX_TOP_K} strings")
        return html.inspect_view(model.inspect(_text(body, "prompt"), _int(body, "top_k", 10, 1, MAX_TOP_K),
                                               targets).reading)

    def do_diff(body: dict) -> dict:
        return html.diff_view(model.diff(_text(body, "a"), _text(body, "b"),
                                         _int(body, "top_k", 10, 1, MAX_TOP_K)).reading)

    @api.post("/api/score")
    async def score(request: Request):
        return await answer(request, do_score)

    @api.post("/api/inspect")
    async def inspect(request: Request):
        return await answer(request, do_inspect)

    @api.post("/api/diff")
    async def diff(request: Request):
        return await answer(request, do_diff)

    r.include_router(api)
    return r
