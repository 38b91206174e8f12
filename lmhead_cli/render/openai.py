"""`--format openai`: a run as one OpenAI chat completion object, written a token at a time.

    {"object": "chat.completion", "model", "choices": [{"index": 0, "message": {"role": "assistant",
     "content"}, "finish_reason", "logprobs": {"content": [{"token", "logprob", "bytes",
     "top_logprobs": [{"token", "logprob", "bytes"}]}]}}], "usage": {"prompt_tokens",
     "completion_tokens", "total_tokens"}}

Each token entry goes out on its own line as soon as it is known, so --top-logprobs up to V never
builds the document in memory. `bytes` are the token's own bytes (GPT-2's byte-level tokens map to
bytes exactly), so a token that is half a character keeps them.
"""

from __future__ import annotations

import codecs
import json
import math
import sys
import time
from collections.abc import Sequence

from lmhead_cli.render import dumps, json_text

DROPPED = -9999.0  # OpenAI's own stand-in for a log-probability too low to report; here log 0 (filtered out)


class Completion:
    """Write the document in order: `entry(...)` per token (or `rows(...)` per batch of them), then
    `end(...)`. Nothing is written before the first of them, so an error found before the first
    token leaves stdout empty rather than holding half a document."""

    def __init__(self, tokenizer, model: str, content: str, finish_reason: str):
        self.tokenizer = tokenizer
        self.head = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model}
        self.choice = {"index": 0, "message": {"role": "assistant", "content": content},
                       "finish_reason": finish_reason}
        self.known: dict[int, tuple[str, str]] = {}  # id -> JSON around its logprob: at most V of them
        self.count = 0
        self.begun = False

    def _begin(self) -> None:
        # {head, "choices": [{choice, "logprobs": {"content": [entries]}}], "usage": {...}}: the dicts are
        # opened by dropping their closing brace, and closed by `end`
        if not self.begun:
            sys.stdout.write(_dump(self.head)[:-1] + ',"choices":[' + _dump(self.choice)[:-1]
                             + ',"logprobs":{"content":[')
            self.begun = True

    def entry(self, token_id: int, logprob: float, top_ids: Sequence[int] = (), top_logprobs: Sequence[float] = ()):
        """One token: its logprob and its top_logprobs (ids and log p, best first)."""
        self._begin()
        top = ",".join(map(self._token, top_ids, top_logprobs))
        sys.stdout.write(("," if self.count else "") + "\n" + self._token(token_id, logprob)[:-1]
                         + ',"top_logprobs":[' + top + "]}")
        self.count += 1

    def rows(self, ids, logprobs, top_ids=None, top_logprobs=None) -> None:
        """Several tokens at once: ids (n,), logprobs (n,), top_ids and top_logprobs (n, K) or None."""
        for i, (token_id, logprob) in enumerate(zip(ids.tolist(), logprobs.tolist())):
            # one row's top tokens as Python numbers at a time: K of them, not n × K
            top = (top_ids[i].tolist(), top_logprobs[i].tolist()) if top_ids is not None else ()
            self.entry(token_id, logprob, *top)

    def end(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._begin()
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        sys.stdout.write("\n]}}]," + _dump({"usage": usage})[1:] + "\n")
        sys.stdout.flush()

    def _token(self, token_id: int, logprob: float) -> str:
        """{"token", "logprob", "bytes"} as JSON text; each token's text and bytes encoded once per run."""
        parts = self.known.get(token_id)
        if parts is None:
            fields = token_fields(self.tokenizer, token_id)
            text = dumps(fields["token"])
            data = json.dumps(fields["bytes"], separators=(",", ":"))
            parts = self.known[token_id] = ('{"token":' + text + ',"logprob":', ',"bytes":' + data + "}")
        return parts[0] + json.dumps(logprob_value(logprob)) + parts[1]


def _dump(doc: dict) -> str:
    return json_text(doc, lines=True)


# ---- documents as dicts: the server's responses (`lmhead serve`), one builder per shape -----------
# Each returns plain JSON-ready data that validates with the `openai` package's types (Completion,
# ChatCompletion, ChatCompletionChunk), except where OpenAI's own legacy API puts a null the types do
# not declare: echo's first position, which has nothing before it to be scored from.

def new_id(prefix: str) -> str:
    """A response id as OpenAI spells them: "cmpl-…", "chatcmpl-…"."""
    import uuid

    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


SPREAD = ("entropy", "varentropy", "margin")  # lmhead's `uncertainty` fields, in nats, nats² and nats


def spread_values(spread) -> list[float | None]:
    """A position's (entropy, varentropy, margin) as JSON holds them: a value that is not finite (the
    margin where one token alone was possible) is null."""
    return [v if v is not None and math.isfinite(v) else None for v in spread]


def logprob_value(lp: float) -> float:
    """A log-probability as JSON can hold it: log 0 (a token the filters dropped) is OpenAI's -9999.0."""
    return lp if lp != float("-inf") else DROPPED


class LegacyLogprobs:
    """The completions endpoint's logprobs, built a position at a time: tokens, token_logprobs,
    top_logprobs (a dict keyed by token text, as OpenAI's legacy API has it) and text_offset, plus
    lmhead's `top_ids`: the same entries as [id, logprob] pairs, best first, so that two ids that
    decode to the same text are never merged. The chosen token is always among them. With `uncertainty`,
    lmhead's lists `entropy`, `varentropy` and `margin` too: each position's distribution's (null where
    unscored)."""

    def __init__(self, tokenizer, start: int = 0, uncertainty: bool = False):
        self.tokenizer = tokenizer
        self.spread: dict[str, list] | None = {k: [] for k in SPREAD} if uncertainty else None
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.top_ids: list[list | None] = []
        self.text_offset: list[int] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._length = start  # characters of text before the next token

    def add(self, token_id: int, logprob: float | None, top_ids: Sequence[int] = (),
            top_logprobs: Sequence[float] = (), spread: Sequence[float] | None = None) -> None:
        """One position: its token, its log p (None: unscored, echo's first), its top tokens and, with
        `uncertainty`, its (entropy, varentropy, margin)."""
        text = self.tokenizer.token_text
        if self.spread is not None:
            values = spread_values(spread) if logprob is not None and spread is not None else [None] * 3
            for k, v in zip(SPREAD, values):
                self.spread[k].append(v)
        self.tokens.append(text(token_id))
        self.text_offset.append(self._length)
        self._length += len(self._decoder.decode(self.tokenizer.token_bytes(token_id)))
        if logprob is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            self.top_ids.append(None)
            return
        pairs = [[i, logprob_value(lp)] for i, lp in zip(top_ids, top_logprobs)]
        if token_id not in top_ids:
            pairs.append([token_id, logprob_value(logprob)])
        top: dict[str, float] = {}
        for i, lp in pairs:
            top.setdefault(text(i), lp)  # the better of two ids with the same text keeps the key
        self.token_logprobs.append(logprob_value(logprob))
        self.top_logprobs.append(top)
        self.top_ids.append(pairs)

    def doc(self, since: int = 0) -> dict:
        """The positions from `since` on (a stream sends each piece's own)."""
        return {"tokens": self.tokens[since:], "token_logprobs": self.token_logprobs[since:],
                "top_logprobs": self.top_logprobs[since:], "text_offset": self.text_offset[since:],
                "top_ids": self.top_ids[since:],
                **({k: v[since:] for k, v in self.spread.items()} if self.spread is not None else {})}

    def __len__(self) -> int:
        return len(self.tokens)

    def drain(self) -> dict:
        """The positions added since the last drain, as doc() gives them; the next offsets go on from them."""
        out = self.doc()
        self.tokens, self.token_logprobs, self.top_logprobs, self.top_ids, self.text_offset = [], [], [], [], []
        if self.spread is not None:
            self.spread = {k: [] for k in SPREAD}
        return out


class EchoCompletion:
    """`score --format openai`: the text as a `text_completion` that echoes it with max_tokens 0, its
    logprobs in the legacy shape built by LegacyLogprobs (the server's builder), as `lmhead serve`
    answers {"prompt": text, "echo": true, "max_tokens": 0, "logprobs": K}. A token that has nothing
    before it in its window (the first, unless --bos) has null, as echo's first token does.

    Scored rows come a chunk at a time (`rows`, score_text's on_rows); each chunk's columns go to
    temporary files at once, so memory stays one chunk whatever the text's length, and nothing is
    written to stdout before `end`: an error half-way leaves it empty."""

    COLUMNS = ("tokens", "token_logprobs", "top_logprobs", "text_offset", "top_ids")

    def __init__(self, tokenizer, model: str, text: str, ids: Sequence[int], scored: Sequence[range], bos: bool):
        import tempfile

        self.tokenizer, self.model, self.text, self.ids, self.bos = tokenizer, model, text, ids, bos
        self.scored = [p for r in scored for p in (r.start, r.stop)]  # text positions [a, b) scored, in order
        self.logprobs = LegacyLogprobs(tokenizer)
        self.spools = {c: tempfile.TemporaryFile("w+", encoding="utf-8") for c in self.COLUMNS}
        self.count = 0  # positions written
        self.pos = 0  # the next text position

    def _next_scored(self) -> int:
        """The text position of the next scored token, writing null for unscored ones before it."""
        while self.scored and self.pos >= self.scored[1]:
            del self.scored[:2]
        start = max(self.pos, self.scored[0]) if self.scored else len(self.ids)
        while self.pos < start:
            self.logprobs.add(int(self.ids[self.pos]), None)
            self.pos += 1
        return start

    def rows(self, ids, logprobs, top_ids=None, top_logprobs=None) -> None:
        """Scored tokens in text order: ids (n,), logprobs (n,), top_ids and top_logprobs (n, K) or None."""
        for i, (token_id, lp) in enumerate(zip(ids.tolist(), logprobs.tolist())):
            self._next_scored()
            top = (top_ids[i].tolist(), top_logprobs[i].tolist()) if top_ids is not None else ((), ())
            self.logprobs.add(token_id, lp, *top)
            self.pos += 1
        self._flush()

    def _flush(self) -> None:
        cols = self.logprobs.drain()
        n = len(cols["tokens"])
        for c in self.COLUMNS:
            if n:
                self.spools[c].write(("," if self.count else "") + dumps(cols[c], separators=(",", ":"))[1:-1])
        self.count += n

    def end(self, prompt_tokens: int) -> None:
        self.scored = []
        self._next_scored()  # trailing unscored tokens, if any
        self._flush()
        head = completion(new_id("cmpl"), int(time.time()), self.model,
                          [completion_choice(0, self.text, "length", {"": None})], usage(prompt_tokens, 0))
        before, after = _dump(head).rsplit('{"":null}', 1)
        sys.stdout.write(before + "{")
        for i, c in enumerate(self.COLUMNS):
            spool = self.spools[c]
            spool.seek(0)
            sys.stdout.write(("," if i else "") + json.dumps(c) + ":[")
            while piece := spool.read(1 << 20):
                sys.stdout.write(piece)
            sys.stdout.write("]")
            spool.close()
        sys.stdout.write("}" + after + "\n")
        sys.stdout.flush()


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(id: str, created: int, model: str, choices: list[dict], use: dict | None) -> dict:
    """A `text_completion` (also each chunk of a stream, which has the same shape)."""
    doc = {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        doc["usage"] = use
    return doc


def token_fields(tokenizer, token_id: int) -> dict:
    """A token as the chat shape names it: its text and its own bytes (a piece of a character keeps them)."""
    return {"token": tokenizer.token_text(token_id), "bytes": list(tokenizer.token_bytes(token_id))}


def chat_token(tokenizer, token_id: int, logprob: float, top_ids: Sequence[int] = (),
               top_logprobs: Sequence[float] = (), spread: Sequence[float] | None = None) -> dict:
    """One entry of a chat completion's logprobs.content: token, logprob, bytes, top_logprobs, and with
    `spread` lmhead's entropy, varentropy and margin of the step."""
    def one(i: int, lp: float) -> dict:
        fields = token_fields(tokenizer, i)
        return {"token": fields["token"], "logprob": logprob_value(lp), "bytes": fields["bytes"]}

    entry = {**one(token_id, logprob), "top_logprobs": [one(i, lp) for i, lp in zip(top_ids, top_logprobs)]}
    return entry | (dict(zip(SPREAD, spread_values(spread))) if spread is not None else {})


def chat_choice(index: int, content: str, finish_reason: str, logprobs: list[dict] | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": content},
            "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish_reason}


def chat_completion(id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def chat_chunk(id: str, created: int, model: str, choices: list[dict], use: dict | None = None) -> dict:
    """A `chat.completion.chunk`: choices hold {"index", "delta", "logprobs", "finish_reason"}."""
    doc = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        doc["usage"] = use
    return doc


def error(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
