"""The Model methods a server needs (lmhead serve): batches of completions, chat prompts, tokens.

`Model` takes these from the `Serving` mixin, so that the API stays the one door a front end goes
through: serve/ calls these methods and never a reading or an engine directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmhead_cli.api.checks import kinds
from lmhead_cli.decoding.settings import Settings, from_openai  # noqa: F401 - torch-free: the server's one conversion


class Serving:
    """Mixed into api.Model (which provides `self.loaded`)."""

    def complete(self, rows: Sequence, sink, chunk: int | None = None) -> None:
        """Run decoding.rows.Row's together, results to `sink` (decoding.rows.Sink, rows keyed 0 … len - 1)
        as they are made: each prompt prefilled once (echo scored in head chunks of `chunk` positions),
        then one forward per step for every row that generates. torch's thread count is chosen by timing."""
        from lmhead_cli.decoding.batch import run

        rows = list(rows)
        self.loaded.execution.run(lambda: run(self.loaded, rows, sink, chunk),
                                units=sum(len(r.ids) + r.max_tokens for r in rows))

    def decoding_batch(self, chunk: int | None = None):
        """An empty running batch (decoding.batch.Batch): `add(key, row)` queues a Row; `prefill` and `step` run it."""
        from lmhead_cli.decoding.batch import Batch

        return Batch(self.loaded, chunk)

    def prefill(self, batch, sink, budget: int | None = None) -> int:
        """A running batch's queued prompts read (at most `budget` positions) and joined, each joined row's
        first token handed to `sink` at once. Returns the positions read. On the model's thread count,
        untimed: the count is chosen on the steps, which a prompt's read would make look slow."""
        with self.loaded.execution.scope():
            return batch.prefill(sink, budget)

    def step(self, batch, sink) -> int:
        """One decoding step for every running row (timed per row for the thread count). Returns the rows
        that stepped."""
        return self.loaded.execution.run(lambda: batch.step(sink), units=max(len(batch.live), 1))

    @property
    def eos_token_id(self) -> int | None:
        return self.loaded.engine.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        bos = self.loaded.config.get("bos_token_id", self.eos_token_id)
        return bos[0] if isinstance(bos, list) else bos

    @property
    def chat_template(self) -> str:
        """The checkpoint's own chat template, or the plain one (loading/chat.py); read once."""
        from lmhead_cli.loading import chat

        if getattr(self, "_chat_template", None) is None:
            self._chat_template = chat.own_template(self.loaded.path) or chat.PLAIN_TEMPLATE
        return self._chat_template

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text for chat `messages` ([{"role", "content"}]) through the chat template."""
        from lmhead_cli.loading import chat

        text = self.tokenizer.token_text
        eos = "" if self.eos_token_id is None else text(self.eos_token_id)
        bos = "" if self.bos_token_id is None else text(self.bos_token_id)
        return chat.render(self.chat_template, messages, bos_token=bos, eos_token=eos)

    @kinds(n_tokens=int, bos=bool, stride=int)
    def scored_positions(self, n_tokens: int, *, bos: bool = False, stride: int | None = None) -> list[range]:
        """Which of a text's n_tokens positions `score` gives a logprob (the rest have nothing before them
        in their window): ranges of text positions, in order."""
        from lmhead_cli.readings.score import windows

        n_ctx = self.n_ctx
        return [range(w.first - bos, w.end - bos)
                for w in windows(n_tokens + bos, n_ctx, n_ctx // 2 if stride is None else stride)]

    @property
    def chars_per_token(self) -> int | None:
        """The most characters one token can stand for, or None where no bound is known: GPT-2's
        byte-level BPE without a normalizer (a token is at most `max_token_bytes` bytes, a character at
        least one), so a text of more than n × this many characters cannot fit n tokens."""
        from tokenizers import pre_tokenizers

        tok = self.tokenizer
        inner = getattr(tok, "tok", None)
        if inner is None or inner.normalizer is not None or not isinstance(inner.pre_tokenizer, pre_tokenizers.ByteLevel):
            return None
        return tok.max_token_bytes

    @kinds(text=str)
    def encode(self, text: str) -> list[int]:
        """A text's token ids (any length; long texts are encoded in pieces, with the same ids)."""
        return list(self.tokenizer.encode_long(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


def __getattr__(name: str):
    # The server's row and result types (decoding/rows.py), reached through the API (serve/ imports nothing
    # from decoding/: tests/test_imports.py), imported with torch only when asked for.
    if name in ("Row", "Echo", "Token", "Sink"):
        from lmhead_cli.decoding import rows

        return getattr(rows, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
