"""The page's routes for `lmhead serve`: `/` (the page), `/page/page.css` and `/page/page.js` (the files
of lmhead_cli/page/, shipped in the package), and the JSON routes the page calls, each a Model method's result turned into a view
document (render/html.py). serve/app.py includes them with `app.include_router(router(model, ...))`.

    GET  /api/info      the model's name (a local folder's last part, never its path), its context and
                        the page's text limit
    POST /api/score     {"text"}                        -> render.html.score_view
    POST /api/inspect   {"prompt", "top_k", "targets"}  -> render.html.inspect_view
    POST /api/diff      {"a", "b", "top_k"}             -> render.html.diff_view
    POST /api/calibrate {"text"}                        -> render.calibrate.calibration_view (the
                        reliability diagrams of `calibrate --html`, over the same text as /api/score)

They go through the server's door (serve/door.py): the same content-type, size (--max-body), depth and
text checks, the bodies as pydantic models, errors in OpenAI's shape ({"error": {"message", "type",
"param", "code"}}: 400 for a bad value, 413 for a text over the limit, 500 for a model's failure, such
as non-finite logits), and the one JSON encoder. The work waits in the server's one queue (`run`:
Worker.call, bounded by --max-queue) and is dropped when its client disconnects, queued or running
(score stops at its next chunk). This module imports FastAPI: only the server imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from lmhead_cli.errors import LmheadError
from lmhead_cli.serve import door
from lmhead_cli.serve.door import model_name
from lmhead_cli.serve.answer import unless_gone
from lmhead_cli.serve.requests import Body, RequestError, shaped

MAX_TEXT_TOKENS = 20_000  # the page's scored text: 5,000 tokens render in well under a second
MAX_TEXT_CHARS = 20 * MAX_TEXT_TOKENS  # checked before encoding: a token is rarely over 20 characters
MAX_BODY_BYTES = 8 * 2**20  # a request body: the longest text JSON-escaped (6 bytes a character at worst) fits
MAX_TOP_K = 100
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

TopK = Annotated[int, Field(ge=1, le=MAX_TOP_K)]


class ScoreRequest(Body):
    """POST /api/score."""

    text: str


class CalibrateRequest(Body):
    """POST /api/calibrate."""

    text: str


class InspectRequest(Body):
    """POST /api/inspect."""

    prompt: str
    top_k: TopK = 10
    targets: Annotated[list[str], Field(max_length=MAX_TOP_K),
                       shaped(f"targets must be an array of at most {MAX_TOP_K} strings")] = []


class DiffRequest(Body):
    """POST /api/diff."""

    a: str
    b: str
    top_k: TopK = 10


class Cancelled(LmheadError):
    """The page's client went away: its work stops."""


def too_long(message: str) -> RequestError:
    return RequestError(413, message, param="text", code="text_too_long")


def router(model, *, run: Callable[[Callable[[], Any]], Any] | None = None, dependencies=(),
           max_body: int = MAX_BODY_BYTES, name: str | None = None, pause: Callable[[], None] | None = None):
    """The page's routes over one model (lmhead_cli.api.Model). `run(fn)`, if given, is an awaitable
    that runs fn() where the server runs its model work (Worker.call); by default fn runs in a worker
    thread, one at a time. `dependencies` (e.g. the server's API-key check) guard the JSON routes;
    the page's own files hold no data and are served to anyone. `name` is the name /api/info shows
    (by default the source's, a local folder's last part). `pause()`, if given, runs at the end of each
    piece of a reading (a chunk of score's, a pass of calibrate's fit): where `run` runs the work
    (Worker.interlude), the other requests take their share of the model there."""
    from lmhead_cli.page import asset
    from lmhead_cli.render import html
    from lmhead_cli.render.calibrate import calibration_view

    lock = threading.Lock()
    shown = name or model_name(model.source)

    async def call(fn):
        if run is not None:
            return await run(fn)

        def locked():
            with lock:
                return fn()
        return await run_in_threadpool(locked)

    async def work(request: Request, fn: Callable[[Callable[[], None]], Any]):
        """fn(check) on the model's thread unless the client has gone; `check()` raises once it has."""
        gone = threading.Event()

        def check() -> None:
            if gone.is_set():
                raise Cancelled("the client disconnected")
            if pause is not None:
                pause()

        def task():
            check()
            return fn(check)

        return await unless_gone(request, call(task), gone.set)

    route = door.route_class(max_body)
    r = APIRouter(route_class=route, default_response_class=door.Answer)
    api = APIRouter(dependencies=list(dependencies), route_class=route, default_response_class=door.Answer)
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
        return {"model": shown, "random_weights": model.random_weights, "n_ctx": model.n_ctx,
                "max_text_tokens": MAX_TEXT_TOKENS}

    def check_text(text: str) -> None:
        """The page's text limits (score and calibrate read the same text)."""
        if len(text) > MAX_TEXT_CHARS:
            raise too_long(f"the text is {len(text):,} characters; the page scores at most {MAX_TEXT_CHARS:,}")
        model.check_score(text)
        n = len(model.encode(text))
        if n > MAX_TEXT_TOKENS:
            raise too_long(f"the text is {n:,} tokens; the page scores at most {MAX_TEXT_TOKENS:,}")

    def do_score(text: str, check) -> dict:
        check_text(text)
        result = model.score(text, alternatives=html.ALTERNATIVES, progress=lambda done, total: check())
        return html.score_view(result.reading)

    def do_calibrate(text: str, check) -> dict:
        check_text(text)
        return calibration_view(model.calibrate(text, progress=lambda done, total: check()).reading)

    @api.post("/api/score")
    async def score(body: ScoreRequest, request: Request):
        return await work(request, lambda check: do_score(body.text, check))

    @api.post("/api/calibrate")
    async def calibrate(body: CalibrateRequest, request: Request):
        return await work(request, lambda check: do_calibrate(body.text, check))

    @api.post("/api/inspect")
    async def inspect(body: InspectRequest, request: Request):
        return await work(request, lambda check: html.inspect_view(
            model.inspect(body.prompt, body.top_k, body.targets).reading))

    @api.post("/api/diff")
    async def diff(body: DiffRequest, request: Request):
        return await work(request, lambda check: html.diff_view(model.diff(body.a, body.b, body.top_k).reading))

    r.include_router(api)
    return r
