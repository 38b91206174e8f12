"""A job's results to OpenAI documents: whole (`collect`) or as server-sent events (`stream`).

The documents come from render/openai.py's builders, the same ones `--format openai` uses. A
choice of the completions endpoint holds, with `echo`, the prompt's text and its tokens (the first
with a null logprob, as OpenAI's legacy API and vLLM have it) before the generated ones.
"""

from __future__ import annotations

import asyncio
import time

from lmhead_cli.api.serving import Echo, Token
from lmhead_cli.render import dumps
from lmhead_cli.render import openai as doc
from lmhead_cli.serve.door import Disconnected
from lmhead_cli.serve.requests import Plan, RequestError
from lmhead_cli.serve.worker import Job


class Choice:
    """One choice as it is built: text, logprobs (legacy or chat), why it ended, tokens generated."""

    def __init__(self, index: int, plan: Plan, tokenizer):
        self.index, self.plan, self.tokenizer = index, plan, tokenizer
        self.prompt = plan.prompts[index // plan.n]
        self.text = ""
        self.finish: str | None = None
        self.generated = 0
        self.legacy = (doc.LegacyLogprobs(tokenizer, uncertainty=plan.uncertainty)
                       if plan.logprobs is not None and not plan.chat else None)
        self.chat: list[dict] | None = [] if plan.logprobs is not None and plan.chat else None

    def echo_text(self) -> str:
        """The prompt's text (with `echo`), decoded from its ids."""
        return self.tokenizer.decode(self.prompt)

    def add_echo(self, echo: Echo) -> None:
        """The prompt's tokens with their scores; position 0 has none."""
        ids = echo.top_ids.tolist() if echo.top_ids is not None else None
        lps = echo.top_logprobs.tolist() if echo.top_logprobs is not None else None
        spreads = echo.spread.tolist() if echo.spread is not None else None
        for i, (tid, lp) in enumerate(zip(self.prompt, echo.logprob.tolist())):
            if i == 0:
                self.legacy.add(tid, None)
            else:
                self.legacy.add(tid, lp, ids[i] if ids else (), lps[i] if lps else (),
                                spreads[i] if spreads else None)

    def add_token(self, token: Token) -> None:
        self.generated += 1
        self.text += token.text
        if self.legacy is not None:
            self.legacy.add(token.id, token.logprob, token.top_ids, token.top_logprobs, token.spread)
        if self.chat is not None:
            self.chat.append(doc.chat_token(self.tokenizer, token.id, token.logprob, token.top_ids, token.top_logprobs,
                                            token.spread))


def _error(event: tuple) -> RequestError:
    from lmhead_cli.errors import LmheadError

    e = event[1]
    if isinstance(e, LmheadError):
        return RequestError(500, str(e), type="server_error", code="model_error")
    return RequestError(500, f"the model failed: {type(e).__name__}", type="server_error", code="model_error")


async def _events(job: Job, request=None):
    """The job's events until every row has finished; Disconnected if the client goes first (watched
    here when `request` is given; a stream is cancelled by Starlette's own watch instead, and one
    reader of the connection at a time is what the ASGI server expects)."""
    left = job.choices
    watcher = asyncio.ensure_future(_disconnect(request) if request is not None else asyncio.Event().wait())
    try:
        while left:
            get = asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                job.cancel()
                raise Disconnected()
            event = get.result()
            if event[0] == "error":
                job.cancel()
                raise _error(event)
            if event[0] == "finish":
                left -= 1
            yield event
    finally:
        watcher.cancel()


async def unless_gone(request, work, cancel) -> object:
    """`work`'s result (a coroutine), unless the client disconnects first: then cancel() and Disconnected.
    The one cancel rule, for the page's work as for a completion's rows (`_events`): work no client
    waits for is dropped, queued or running."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            cancel()
            task.cancel()
            raise Disconnected()
        return task.result()
    finally:
        watcher.cancel()


async def _disconnect(request) -> None:
    """Returns when the client has disconnected (the body has been read, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(plan: Plan, choices: list[Choice]) -> dict:
    return doc.usage(sum(len(p) for p in plan.prompts), sum(c.generated for c in choices))


async def collect(job: Job, plan: Plan, tokenizer, request, model: str) -> dict:
    """The whole answer as one document."""
    choices = [Choice(i, plan, tokenizer) for i in range(plan.request.choices)]
    async for event in _events(job, request):
        kind, i = event[0], event[1]
        c = choices[i]
        if kind == "echo":
            c.add_echo(event[2])
        elif kind == "token":
            c.add_token(event[2])
        else:
            c.finish = event[2]
            c.text += event[3]
    created = int(time.time())
    if plan.chat:
        return doc.chat_completion(doc.new_id("chatcmpl"), created, model,
                                   [doc.chat_choice(c.index, c.text, c.finish, c.chat) for c in choices],
                                   _usage(plan, choices))
    out = []
    for c in choices:
        text = (c.echo_text() + c.text) if plan.echo else c.text
        out.append(doc.completion_choice(c.index, text, c.finish, c.legacy.doc() if c.legacy else None))
    return doc.completion(doc.new_id("cmpl"), created, model, out, _usage(plan, choices))


def sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else dumps(data)).encode() + b"\n\n"


async def stream(job: Job, plan: Plan, tokenizer, request, model: str):
    """The answer as server-sent events: one chunk per event, then `data: [DONE]`."""
    choices = [Choice(i, plan, tokenizer) for i in range(plan.request.choices)]
    cid, created = doc.new_id("chatcmpl" if plan.chat else "cmpl"), int(time.time())
    try:
        if plan.chat:
            yield sse(doc.chat_chunk(cid, created, model, [
                {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in choices]))
        elif plan.echo and plan.logprobs is None:  # the prompt's text alone; with logprobs it comes with its scores
            yield sse(doc.completion(cid, created, model, [doc.completion_choice(c.index, c.echo_text(), None, None)
                                                           for c in choices], None))
        async for event in _events(job):
            kind, i = event[0], event[1]
            c = choices[i]
            if kind == "echo":
                c.add_echo(event[2])
                chunk = doc.completion_choice(i, c.echo_text(), None, c.legacy.doc())
            elif kind == "token":
                since = len(c.legacy) if c.legacy else 0
                c.add_token(event[2])
                if plan.chat:
                    lp = None if c.chat is None else {"content": c.chat[-1:]}
                    chunk = {"index": i, "delta": {"content": event[2].text}, "logprobs": lp, "finish_reason": None}
                else:
                    chunk = doc.completion_choice(i, event[2].text, None, c.legacy.doc(since) if c.legacy else None)
            else:
                c.finish = event[2]
                chunk = ({"index": i, "delta": {"content": event[3]} if event[3] else {}, "logprobs": None,
                          "finish_reason": event[2]} if plan.chat
                         else doc.completion_choice(i, event[3], event[2], None))
            yield sse(doc.chat_chunk(cid, created, model, [chunk]) if plan.chat
                      else doc.completion(cid, created, model, [chunk], None))
        if plan.include_usage:
            use = _usage(plan, choices)
            yield sse(doc.chat_chunk(cid, created, model, [], use) if plan.chat
                      else doc.completion(cid, created, model, [], use))
    except RequestError as e:
        yield sse(doc.error(e.message, e.type, e.param, e.code))
    except (Disconnected, asyncio.CancelledError):
        job.cancel()
        raise
    finally:
        job.cancel()  # a no-op once every row has finished; stops the rest if the client has gone
    yield sse("[DONE]")
