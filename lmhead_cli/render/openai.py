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

import json
import sys
from collections.abc import Sequence

from lmhead_cli.render import dumps, json_text

DROPPED = -9999.0  # OpenAI's own stand-in for a log-probability too low to report; here log 0 (filtered out)


class Completion:
    """Write the document in order: `entry(...)` per token (or `rows(...)` per batch of them), then
    `end(...)`. Nothing is written before the first of them, so an error found before the first
    token leaves stdout empty rather than holding half a document."""

    def __init__(self, tokenizer, model: str, content: str, finish_reason: str):
        self.tokenizer = tokenizer
        self.head = {"object": "chat.completion", "model": model}
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
            text = dumps(self.tokenizer.token_text(token_id))
            data = json.dumps(list(self.tokenizer.token_bytes(token_id)), separators=(",", ":"))
            parts = self.known[token_id] = ('{"token":' + text + ',"logprob":', ',"bytes":' + data + "}")
        return parts[0] + json.dumps(logprob if logprob != float("-inf") else DROPPED) + parts[1]


def _dump(doc: dict) -> str:
    return json_text(doc, lines=True)
