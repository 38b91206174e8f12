"""Completions in a batch: many prompts scored (echo) and continued together, one forward per batch.

This is what the server (`lmhead serve`) runs; a caller builds one `Row` per choice and hands a
`Sink` that receives the results as they are made. For the whole batch:

* **Prefill once.** The prompts are left-padded to the longest, with an attention mask, and go
  through the body in one forward (B, T). Positions come from the mask, so each row reads exactly
  as it would alone, up to float rounding.
* **Echo in chunks.** A row with `echo` has every prompt position after the first scored: the log
  probability of the token that follows and, when asked, the `top` most probable. The head runs on
  at most `chunk` positions of one row at a time, so no (T, V) tensor exists beyond a (chunk, V)
  one, and only `top` values per position leave it.
* **Decode together.** Rows that continue draw their first token from the prefill's last position,
  then run one position per step through the KV cache, all rows in one forward. Each row has its
  own stages (decoding.stages), greedy choice or its own seeded generator, stop strings and
  end-of-text; a row that finishes, or that its caller cancels, leaves the batch
  (`reorder_cache`), so the others go on without it.

Each generated token's log-probability is under the `raw` distribution (softmax of the logits) or
the `processed` one (after the row's stages: what it was drawn from), as the row asks
(`logprobs_mode`); the echo positions use the same choice, and so do the entropy, varentropy and margin
of each position's distribution, reported when a row asks for its `uncertainty`. Shapes: B rows, T positions, D width,
V vocabulary, K top tokens.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lmhead_cli.decoding import stages
from lmhead_cli.decoding.generate import _top
from lmhead_cli.decoding.stages import Knobs
from lmhead_cli.head import check_finite, entropy, log_softmax, margin, varentropy
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.readings.score import default_chunk

MODES = ("raw", "processed")


@dataclass(frozen=True)
class Row:
    """One choice to compute: a prompt, what to score and how to continue it."""

    ids: tuple[int, ...]  # the prompt, at least one token, all in the vocabulary
    echo: bool = False  # score the prompt's own tokens (the first has nothing before it)
    max_tokens: int = 0  # tokens to generate at most
    top: int = 0  # the most probable tokens to report per position, 0..V
    mode: str = "raw"  # the distribution logprobs come from: raw or processed
    knobs: Knobs = field(default_factory=Knobs)  # the stages (soft-cap, temperature, top-k, top-p, min-p)
    greedy: bool = True  # the most probable token each step; else drawn with `seed`
    seed: int = 0
    stop: tuple[str, ...] = ()  # text that ends the row (not included in its text)
    eos: int | None = None  # the token that ends the row (not text), None to run to max_tokens
    uncertainty: bool = False  # also each position's entropy, varentropy and margin (raw or processed, as `mode`)


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
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    text: str  # new text shown with this token: held back while it may still start a stop string
    spread: tuple[float, float, float] | None = None  # entropy, varentropy, margin of its step, when asked


class Sink(Protocol):
    """Where a batch's results go, row by row, in order: echo, tokens, finish."""

    def echo(self, row: int, echo: Echo) -> None: ...

    def token(self, row: int, token: Token) -> None: ...

    def finish(self, row: int, reason: str, tail: str) -> None:
        """reason: "stop" (end-of-text or a stop string) or "length"; tail: the text still held back."""

    def cancelled(self, row: int) -> bool: ...


def check_mode(mode: str) -> str:
    from lmhead_cli.errors import BadValue

    if mode not in MODES:
        raise BadValue("logprobs_mode", f"must be raw or processed (got {mode!r})")
    return mode


def padded(rows: list[Row], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to the longest: ids (B, T) and the attention mask (B, T), 1 = real."""
    T = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r.ids):] = torch.tensor(r.ids, dtype=torch.long)
        mask[b, T - len(r.ids):] = 1
    return ids.to(device), mask.to(device)


def _distributions(logits: torch.Tensor, row: Row, pipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, processed) log-probabilities of logits (N, V); the same tensor twice with no stage on."""
    check_finite_rows(logits)
    raw = log_softmax(logits)
    return raw, (log_softmax(stages.process(logits, pipeline)) if pipeline else raw)


def spread(logprobs: torch.Tensor) -> torch.Tensor:
    """(N, V) log-probabilities -> (N, 3) float32: entropy (nats), varentropy (nats²) and margin (nats,
    inf with one possible token) of each row: head.py's, once."""
    h = entropy(logprobs)
    return torch.stack([h, varentropy(logprobs, h), margin(logprobs)], dim=-1)


def check_finite_rows(logits: torch.Tensor) -> None:
    """NonFiniteLogits for a NaN or infinite logit, checked through each row's max (O(N), not O(N·V))."""
    if not bool(torch.isfinite(logits.amax(-1)).all() & torch.isfinite(logits.amin(-1)).all()):
        check_finite(logits)


def echo_scores(eng, hidden: torch.Tensor, row: Row, chunk: int) -> Echo:
    """Score the prompt of `row` from its hidden states (T, D) (its own positions, no padding)."""
    T = len(row.ids)
    targets = torch.tensor(row.ids[1:], dtype=torch.long, device=hidden.device)  # (T - 1,)
    pipeline = row.knobs.pipeline() if row.mode == "processed" else []
    logprob = torch.full((T,), math.nan)
    K = min(row.top, eng.vocab_size)
    top_ids = torch.zeros((T, K), dtype=torch.long) if K else None
    top_lps = torch.zeros((T, K)) if K else None
    spreads = torch.full((T, 3), math.nan) if row.uncertainty else None
    for c in range(0, T - 1, chunk):
        z = eng.head(hidden[c:min(c + chunk, T - 1)]).float()  # (n, V), dropped at the end of the step
        raw, used = _distributions(z, row, pipeline)
        sel = used if row.mode == "processed" else raw
        n = z.shape[0]
        logprob[c + 1:c + 1 + n] = sel.gather(-1, targets[c:c + n, None])[:, 0].cpu()
        if K:
            ids, lps = _top(raw, used, row.mode, K)
            top_ids[c + 1:c + 1 + n], top_lps[c + 1:c + 1 + n] = ids, lps
        if spreads is not None:
            spreads[c + 1:c + 1 + n] = spread(sel).cpu()
        del z, raw, used, sel
    return Echo(logprob, top_ids, top_lps, spreads)


class _Running:
    """One row while it generates: its generator, text so far and what has been shown of it."""

    def __init__(self, index: int, row: Row, tokenizer, device):
        self.index, self.row, self.tokenizer = index, row, tokenizer
        self.pipeline = row.knobs.pipeline()
        self.generator = None if row.greedy else torch.Generator(device=device).manual_seed(row.seed)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.shown, self.count = "", 0, 0
        self.hold = max((len(s) for s in row.stop), default=1) - 1  # a stop string may still be forming

    def choose(self, logits: torch.Tensor) -> tuple[Token, str | None]:
        """Choose from logits (1, V); returns the token and why the row ends here (None: it goes on)."""
        row = self.row
        raw, used = _distributions(logits, row, self.pipeline)
        chosen = stages.choose(used, row.greedy, self.generator)  # (1,)
        tid = int(chosen[0])
        lp = float((used if row.mode == "processed" else raw)[0, tid])
        top = _top(raw, used, row.mode, min(row.top, raw.shape[-1]))
        self.count += 1
        reason = None
        if tid == row.eos:
            reason = "stop"
        else:
            before = len(self.text)
            self.text += self.decoder.decode(self.tokenizer.token_bytes(tid))
            cut = self._stop_at(before)
            if cut is not None:
                self.text, reason = self.text[:cut], "stop"
        if reason is None and self.count >= row.max_tokens:
            reason = "length"
        if reason is None:
            safe = len(self.text) - self.hold if row.stop else len(self.text)
        else:
            if reason == "length" or tid == row.eos:
                self.text += self.decoder.decode(b"", final=True)
            safe = len(self.text)
        piece = self.text[self.shown:max(safe, self.shown)]
        self.shown += len(piece)
        ids, lps = (top[0][0].tolist(), top[1][0].tolist()) if top else ([], [])
        sp = tuple(spread(used if row.mode == "processed" else raw)[0].tolist()) if row.uncertainty else None
        return Token(tid, lp, ids, lps, piece, sp), reason

    def _stop_at(self, before: int) -> int | None:
        """Where the first stop string now in the text begins, looking only where a new one can be."""
        found = [i for s in self.row.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        return min(found) if found else None


@torch.inference_mode()
def run(loaded: Loaded, rows: list[Row], sink: Sink, chunk: int | None = None) -> None:
    """Compute a batch of rows, handing results to `sink` as they are made (see the module's notes).

    The caller has checked each row (ids in the vocabulary, prompt + max_tokens within the context,
    top <= V) and that the batch's longest prompt plus its largest max_tokens fits the context."""
    eng = loaded.engine
    chunk = chunk or default_chunk(eng.vocab_size)
    pad = eng.eos_token_id or 0
    ids, mask = padded(rows, pad, eng.device)  # (B, T)
    B, T = ids.shape
    steps = max(r.max_tokens for r in rows)
    cache = eng.new_cache(B, T + steps) if steps > 1 else None
    hidden = eng.body(ids, cache, mask)  # (B, T, D)
    for b, row in enumerate(rows):
        if row.echo and not sink.cancelled(b):
            sink.echo(b, echo_scores(eng, hidden[b, T - len(row.ids):], row, chunk))
    live = [_Running(b, r, loaded.tokenizer, eng.device) for b, r in enumerate(rows)
            if r.max_tokens > 0 and not sink.cancelled(b)]
    for b, r in enumerate(rows):
        if r.max_tokens == 0 and not sink.cancelled(b):
            sink.finish(b, "length", "")
    if not live:
        return
    at = [r.index for r in live]  # the batch row of each live row (the cache still holds all B)
    logits = eng.head(hidden[at, -1]).float()  # (R, V) each row's next token
    del hidden
    if cache is not None and len(at) < B:  # rows that only score leave the cache
        cache = eng.reorder_cache(cache, torch.tensor(at, device=eng.device))
    mask = mask[at]
    while True:
        keep, last = [], []
        for i, r in enumerate(live):
            if sink.cancelled(r.index):
                continue
            token, reason = r.choose(logits[i:i + 1])
            sink.token(r.index, token)
            if reason is None:
                keep.append(i)
                last.append(token.id)
            else:
                sink.finish(r.index, reason, r.text[r.shown:])
        if not keep:
            return
        if len(keep) < len(live):
            rows_kept = torch.tensor(keep, device=eng.device)
            cache = eng.reorder_cache(cache, rows_kept)
            mask = mask[rows_kept]
            live = [live[i] for i in keep]
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)  # (R, T + step)
        x = torch.tensor([[t] for t in last], device=eng.device)  # (R, 1)
        logits = eng.head(eng.body(x, cache, mask)[:, -1]).float()  # (R, V)
