"""The FastAPI app: routes, errors in OpenAI's shape, the API key, the body limit.

    GET  /health                 {"status": "ok", ...}            (no key needed)
    GET  /v1/models              the one model served
    POST /v1/completions         text_completion: prompts scored (echo) and continued
    POST /v1/chat/completions    chat.completion
    POST /tokenize, /detokenize, GET /tokenizer_info   as lm-evaluation-harness's remote tokenizer probes them
    /                            the page (lmhead_cli/page/routes.py, issue 18)

A route reads like a CLI command: parse and check the body (serve/requests.py), queue the work
(serve/worker.py), build the answer (serve/answer.py with render/openai.py's builders).
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmhead_cli.errors import LmheadError, UsageError
from lmhead_cli.render import openai as doc
from lmhead_cli.serve import answer
from lmhead_cli.serve.requests import (Limits, ModelInfo, RequestError, bad, chat_plan, check_ids, completion_plan,
                                       messages)
from lmhead_cli.serve.worker import Busy, Job, Worker

RETRY_AFTER_S = 1


@dataclass
class Served:
    """What the app serves: the loaded model, its worker, and the settings."""

    model: object  # api.Model
    worker: Worker
    name: str
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    cors: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def info(self) -> ModelInfo:
        m = self.model
        return ModelInfo(name=self.name, vocab=m.vocab_size, n_ctx=m.n_ctx, eos=m.eos_token_id)

    @property
    def tokenizer(self):
        return self.model.tokenizer


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(doc.error(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 past `limit` bytes (read no further), 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise _too_large(limit)

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(data, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _too_large(limit: int) -> RequestError:
    return RequestError(413, f"the request body is over the server's limit of {limit:,} bytes (--max-body)",
                        code="request_too_large")


def _page(served: Served, dependencies) -> APIRouter | None:
    """The page's routes (lmhead_cli/page, issue 18), their model work on the model's thread and behind
    the API key; None where the page is not part of this build."""
    try:
        from lmhead_cli.page.routes import router
    except ImportError:
        return None
    return router(served.model, run=served.worker.call, dependencies=dependencies)


def build_app(served: Served, page: APIRouter | None = None) -> FastAPI:
    """The app for one served model; `page` (lmhead_cli/page's routes by default) is mounted at /."""
    app = FastAPI(title="lmhead", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served

    async def check_key(request: Request) -> None:
        if served.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), served.api_key.encode()):
            raise RequestError(401, "a missing or wrong API key: send Authorization: Bearer <key>", type="invalid_request_error",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestError)
    async def on_request_error(_request, e: RequestError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, e: StarletteHTTPException):
        message = f"no such path: {request.url.path}" if e.status_code == 404 else str(e.detail)
        return error_response(RequestError(e.status_code, message, code=str(e.status_code)))

    @app.exception_handler(UsageError)
    async def on_usage_error(_request, e: UsageError):
        return error_response(RequestError(400, str(e), param=getattr(e, "key", None), code="invalid_value"))

    @app.exception_handler(LmheadError)
    async def on_lmhead_error(_request, e: LmheadError):
        return error_response(RequestError(500, str(e), type="server_error", code="model_error"))

    @app.exception_handler(Exception)
    async def on_other(_request, e: Exception):
        return error_response(RequestError(500, f"internal error: {type(e).__name__}", type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.name, "queued": served.worker.queued,
                "running": served.worker.running, "batches": served.worker.batches,
                "generated": served.worker.generated}

    api = APIRouter(dependencies=[Depends(check_key)])

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "lmhead"}]}

    @api.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, served.limits.max_body)
        return await _answer(served, completion_plan(body, served.tokenizer, served.info, served.limits), request)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, served.limits.max_body)
        prompt = served.model.encode(served.model.chat_prompt(messages(body)))
        return await _answer(served, chat_plan(body, prompt, served.info, served.limits), request)

    @api.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request, served.limits.max_body)
        if "messages" in body:
            text = served.model.chat_prompt(messages(body))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise bad("prompt", "prompt must be a string")
        tokens = served.model.encode(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": served.info.n_ctx}

    @api.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request, served.limits.max_body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad("tokens", "tokens must be an array of token ids")
        if tokens:
            check_ids(tokens, served.info, "tokens", "tokens")
        return {"prompt": served.model.decode(tokens)}

    @api.get("/tokenizer_info")
    async def tokenizer_info():
        eos, bos = served.model.eos_token_id, served.model.bos_token_id
        text = served.tokenizer.token_text
        return {"tokenizer_class": "GPT2TokenizerFast" if served.tokenizer.byte_level else "PreTrainedTokenizerFast",
                "eos_token": None if eos is None else text(eos), "bos_token": None if bos is None else text(bos),
                "pad_token": None, "chat_template": served.model.chat_template, "model_max_length": served.info.n_ctx,
                "vocab_size": served.info.vocab}

    app.include_router(api)
    if page is None:
        page = _page(served, [Depends(check_key)])
    if page is not None:
        app.include_router(page)
    if served.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(served.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app



async def _answer(served: Served, plan, request: Request):
    import asyncio

    job = Job(plan.rows, asyncio.get_running_loop())
    try:
        served.worker.submit(job)
    except Busy:
        raise RequestError(503, f"the server's queue is full ({served.worker.max_queue:,} choices); retry shortly",
                           type="server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    if plan.stream:
        return StreamingResponse(answer.stream(job, plan, served.tokenizer, request, served.name),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return await answer.collect(job, plan, served.tokenizer, request, served.name)
    except answer.Disconnected:
        return JSONResponse(doc.error("the client disconnected", "invalid_request_error"), status_code=499)
