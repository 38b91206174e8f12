"""What a decoding batch computes and hands out: a `Row` (one choice: a prompt, what to score, how to
continue it), the results (`Echo`: a prompt's scores; `Token`: one generated token with its record)
and the `Sink` they go to, row by row. `Live` is a row while it generates (its generator, its text).

Shapes: T prompt positions, K top tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from lmhead_cli.decoding.grammar import Grammar, Matcher
from lmhead_cli.decoding.record import Step
from lmhead_cli.decoding.stages import Knobs
from lmhead_cli.decoding.text import Text
from lmhead_cli.head import check_finite

MODES = ("raw", "processed")


@dataclass(frozen=True)
class Row:
    """One choice to compute: a prompt, what to score and how to continue it."""

    ids: tuple[int, ...]  # the prompt, at least one token, all in the vocabulary
    echo: bool = False  # score the prompt's own tokens (the first has nothing before it)
    max_tokens: int = 0  # tokens to generate at most (the prompt plus max_tokens - 1 fit the context)
    top: int = 0  # the most probable tokens to report per position, 0..V
    mode: str = "raw"  # the distribution logprobs and `top` come from: raw or processed
    knobs: Knobs = field(default_factory=Knobs)  # the stages (soft-cap, temperature, top-k, top-p, min-p, ...)
    greedy: bool = True  # the most probable token each step; else drawn with `seed`
    seed: int = 0
    stop: tuple[str, ...] = ()  # text that ends the row (not included in its text)
    eos: int | None = None  # the token that ends the row (not text), None to run to max_tokens
    alternatives: int = 0  # the K most probable (processed) tokens kept in each Step (--show-steps)
    uncertainty: bool = False  # also each position's entropy, varentropy and margin (raw or processed, as `mode`)
    grammar: Grammar | None = None  # what the text must follow (decoding/grammar.py): a mask each step


@dataclass(frozen=True)
class Echo:
    """A prompt's scores: position i holds token i's log p given tokens < i; position 0 is unscored."""

    logprob: torch.Tensor  # (T,) float32, NaN at 0
    top_ids: torch.Tensor | None  # (T, K) int64 (row 0 unused), or None when K = 0
    top_logprobs: torch.Tensor | None  # (T, K) float32
    spread: torch.Tensor | None = None  # (T, 3) float32 entropy, varentropy, margin (NaN at 0), when asked


@dataclass(frozen=True)
class Token:
    """One generated token: its log p, the top K at its step, and the text that it made safe to show."""

    id: int
    logprob: float  # under the row's mode
    top_ids: list[int]
    top_logprobs: list[float]
    text: str  # new text shown with this token: held back while it may still start a stop string
    step: Step | None = None  # the whole record: raw and processed figures, rank, entropy, alternatives
    spread: tuple[float, float, float] | None = None  # entropy, varentropy, margin of its step, when asked


class Sink(Protocol):
    """Where a batch's results go, row by row (rows named by the caller's key), in order: echo, tokens, finish."""

    def echo(self, key, echo: Echo) -> None: ...

    def token(self, key, token: Token) -> None: ...

    def finish(self, key, reason: str, tail: str) -> None:
        """reason: "eos", "stop" (a stop string) or "length"; tail: the text still held back."""

    def cancelled(self, key) -> bool: ...


def check_mode(mode: str) -> str:
    from lmhead_cli.errors import BadValue

    if mode not in MODES:
        raise BadValue("logprobs_mode", f"must be raw or processed (got {mode!r})")
    return mode


def check_finite_rows(logits: torch.Tensor) -> None:
    """NonFiniteLogits for a NaN or infinite logit, checked through each row's max (O(N), not O(N·V))."""
    if not bool(torch.isfinite(logits.amax(-1)).all() & torch.isfinite(logits.amin(-1)).all()):
        check_finite(logits)


class Quiet:
    """A Sink that keeps nothing (beam search's prefill: its rows choose nothing there)."""

    def echo(self, key, echo: Echo) -> None:
        pass

    def token(self, key, token: Token) -> None:
        pass

    def finish(self, key, reason: str, tail: str) -> None:
        pass

    def cancelled(self, key) -> bool:
        return False


class Live:
    """One row while it generates: its key, generator, text, count and place in its grammar."""

    __slots__ = ("key", "row", "pipeline", "generator", "text", "count", "length", "pending", "matcher")

    def __init__(self, key, row: Row, tokenizer, device, vocab: int):
        self.key, self.row = key, row
        self.pipeline = row.knobs.pipeline(grammar=row.grammar is not None)
        # the row's own place in its grammar (None: no grammar, nothing to pay)
        self.matcher = None if row.grammar is None else Matcher(row.grammar, tokenizer, vocab, row.eos)
        self.generator = None if row.greedy else torch.Generator(device=device).manual_seed(row.seed)
        self.text = Text(tokenizer, row.stop)
        self.count = 0
        self.length = len(row.ids)  # positions in the cache (the prompt, then each token run)
        self.pending: int | None = None  # a token chosen (and handed to the sink) not yet run: its first

    def copy(self) -> Live:
        """The same row, with a generator and text of its own in the same state (a beam kept twice)."""
        twin = object.__new__(Live)
        for name in self.__slots__:
            setattr(twin, name, getattr(self, name))
        if self.generator is not None:
            twin.generator = torch.Generator(device=self.generator.device).set_state(self.generator.get_state())
        twin.text = self.text.copy()
        if self.matcher is not None:
            twin.matcher = self.matcher.copy()
        return twin
