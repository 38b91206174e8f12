"""The FastAPI app: routes, errors in OpenAI's shape, the API key, the memory budget.

    GET  /health                 {"status": "ok", ...}            (no key needed)
    GET  /v1/models              the one model served
    POST /v1/completions         text_completion: prompts scored (echo) and continued
    POST /v1/chat/completions    chat.completion
    POST /tokenize, /detokenize, GET /tokenizer_info   as lm-evaluation-harness's remote tokenizer probes them
    GET  /openapi.json           the request models (serve/requests.py), extension fields included
    /                            the page (serve/page.py; its files in lmhead_cli/page/)

A route reads like a CLI command: its body comes through the door (serve/door.py: Host, content type,
size, depth) as a pydantic model (serve/requests.py), is converted once to the decoder's Request, queued
(serve/worker.py), and answered (serve/answer.py with render/openai.py's builders). Prompts are
tokenized off the event loop, after a refusal of any text whose characters alone cannot fit.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmhead_cli.serve import answer, door
from lmhead_cli.serve.requests import (ChatRequest, CompletionRequest, DetokenizeRequest, Limits, ModelInfo,
                                       RequestError, TokenizeRequest, check_chars, check_ids)
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
    host: str = "127.0.0.1"  # the address bound: its name is one the Host check accepts
    allow_hosts: tuple[str, ...] = ()  # more names the Host check accepts ("*": any)
    created: int = field(default_factory=lambda: int(time.time()))
    entries: int = 0  # logprob entries in the answers being built now (the memory budget, limits.max_entries)

    def __post_init__(self):
        m = self.model
        self.info = ModelInfo(name=self.name, vocab=m.vocab_size, n_ctx=m.n_ctx, eos=m.eos_token_id,
                              chars_per_token=m.chars_per_token)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def reserve(self, entries: int) -> None:
        """Count an answer's logprob entries against the server-wide budget, or 503 when the answers being
        built already hold so many that this one would go past it (alone it fits: --max-entries is checked
        per request first)."""
        if entries and self.entries and self.entries + entries > self.limits.max_entries:
            raise RequestError(503, f"the server is building answers of {self.entries:,} logprob entries; this one "
                                    f"adds {entries:,}, past its budget of {self.limits.max_entries:,} "
                                    "(--max-entries); retry shortly", type="server_error", code="overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        self.entries += entries

    def release(self, entries: int) -> None:
        self.entries -= entries

    async def encode(self, texts: list[str], room: int, param: str) -> list[list[int]]:
        """Texts to ids on a worker thread, never on the event loop; refused first when their characters
        alone cannot fit `room` tokens."""
        check_chars(texts, room, self.info, param)
        # a completion reads its prompt after BOS where the model's tokenizer puts one (Model.prompt_ids)
        return await run_in_threadpool(lambda: [self.model.prompt_ids(t) for t in texts])

    async def chat_prompt(self, messages: list[dict], room: int) -> list[int]:
        check_chars(["".join(m["content"] for m in messages)], room, self.info, "messages", "the messages")
        return await run_in_threadpool(lambda: self.model.encode(self.model.chat_prompt(messages)))


def _page(served: Served, dependencies) -> APIRouter:
    """The page's routes (serve/page.py), their model work in the worker's queue and behind the API key."""
    from lmhead_cli.serve.page import router

    return router(served.model, run=served.worker.call, dependencies=dependencies, max_body=served.limits.max_body,
                  name=served.name, pause=served.worker.interlude)


def build_app(served: Served, page: APIRouter | None = None) -> FastAPI:
    """The app for one served model; `page` (serve/page.py's routes by default) is mounted at /."""
    app = FastAPI(title="lmhead", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  default_response_class=door.Answer)
    app.state.served = served
    route = door.route_class(served.limits.max_body)

    async def check_key(request: Request) -> None:
        if served.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or not hmac.compare_digest(token.encode("latin-1", "replace"),
                                                                             served.api_key.encode()):
            raise RequestError(401, "a missing or wrong API key: send Authorization: Bearer <key>", type="invalid_request_error",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestError)
    async def on_request_error(_request, e: RequestError):
        return door.error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, e: StarletteHTTPException):
        message = f"no such path: {request.url.path}" if e.status_code == 404 else str(e.detail)
        return door.error_response(RequestError(e.status_code, message, code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def on_other(request, e: Exception):
        return door.error_response(door.as_request_error(e))

    open_routes = APIRouter(route_class=route, default_response_class=door.Answer)

    @open_routes.get("/health")
    async def health():
        return {"status": "ok", "model": served.name, "queued": served.worker.queued, "busy": served.worker.busy,
                "running": served.worker.running, "batches": served.worker.batches,
                "generated": served.worker.generated, "timing": served.worker.timing.as_dict()}

    api = APIRouter(dependencies=[Depends(check_key)], route_class=route, default_response_class=door.Answer)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "lmhead"}]}

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        texts = body.texts
        prompts = body.ids if texts is None else await served.encode(texts, served.info.n_ctx - body.max_tokens,
                                                                     "prompt")
        return await _answer(served, await run_in_threadpool(body.plan, prompts, served.info, served.limits), request)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        room = served.info.n_ctx - (body.max_tokens or body.max_completion_tokens or 1)
        prompt = await served.chat_prompt(body.message_list, room)
        return await _answer(served, await run_in_threadpool(body.plan, prompt, served.info, served.limits), request)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        body.check()
        if body.messages is not None:  # the chat template writes its own BOS where it wants one
            text = await run_in_threadpool(served.model.chat_prompt, body.message_list)
            tokens = await run_in_threadpool(served.model.encode, text)
        else:  # add_special_tokens (vLLM's, default true): the ids a completion of the prompt reads
            encode = served.model.prompt_ids if body.add_special_tokens else served.model.encode
            tokens = await run_in_threadpool(encode, body.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": served.info.n_ctx}

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.tokens:
            check_ids(body.tokens, served.info, "tokens", "tokens")
        return {"prompt": await run_in_threadpool(served.model.decode, body.tokens)}

    @api.get("/tokenizer_info")
    async def tokenizer_info():
        eos, bos = served.model.eos_token_id, served.model.bos_token_id
        text = served.tokenizer.token_text
        return {"tokenizer_class": "GPT2TokenizerFast" if served.tokenizer.byte_level else "PreTrainedTokenizerFast",
                "eos_token": None if eos is None else text(eos), "bos_token": None if bos is None else text(bos),
                "pad_token": None, "chat_template": served.model.chat_template, "model_max_length": served.info.n_ctx,
                "vocab_size": served.info.vocab}

    app.include_router(open_routes)
    app.include_router(api)
    app.include_router(page if page is not None else _page(served, [Depends(check_key)]))
    if served.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(served.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(door.Head)
    app.add_middleware(door.HostCheck, bound=served.host, allowed=served.allow_hosts)
    return app


async def _answer(served: Served, plan, request: Request):
    """Queue the plan's request and answer: a document, or server-sent events. Its logprob entries count
    against the server's budget until the document is written (or the stream ends)."""
    import asyncio

    grammar = plan.request.settings.grammar
    if grammar is not None:  # compiled for the model's tokenizer off the event loop, before its rows queue
        await run_in_threadpool(served.model.prepare_grammar, grammar)
    served.reserve(plan.entries)
    streaming = False
    try:
        job = Job(plan.request, asyncio.get_running_loop())
        try:
            served.worker.submit(job)
        except Busy:
            raise RequestError(503, f"the server's queue is full ({served.worker.max_queue:,} choices); retry shortly",
                               type="server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        if plan.stream:
            events = answer.stream(job, plan, served.tokenizer, request, served.name)
            streaming = True
            return StreamingResponse(_released(events, served, plan.entries), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return door.Answer(await answer.collect(job, plan, served.tokenizer, request, served.name))
    finally:
        if not streaming:
            served.release(plan.entries)


async def _released(events, served: Served, entries: int):
    try:
        async for event in events:
            yield event
    finally:
        served.release(entries)
