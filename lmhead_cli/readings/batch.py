"""`lmhead inspect --file`: many prompts, run in padded batches, each read exactly like `inspect`.

Rows are right-padded to the longest prompt of their batch, with an attention mask so no real
token attends to padding, and the head is applied at each row's own last real token only: a
(B, D) matrix, not (B, T, D). Lines are read lazily and handed over a batch at a time, in file
order (PromptLines, inspect_stream): memory is one batch, whatever the file's size. A batch that does not fit in memory is halved until it does.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from lmhead_cli.errors import BadValue, LmheadError, Param, UsageError
from lmhead_cli.head import check_finite, clamp_top_k, encode_targets
from lmhead_cli.inputs import MAX_LINE_BYTES, bounded_lines
from lmhead_cli.readings.inspect import Inspection, check_targets, encode_prompt, inspection_from_logits, shape_walk
from lmhead_cli.loading.sources import Loaded

STDIN = "-"
TRUNCATED_SHOWN = 5  # line numbers kept for the "longer than the context" warning


@dataclass(frozen=True)
class PromptLine:
    number: int  # 1-based line number in the file
    text: str


class PromptLines:
    """The non-empty lines of a prompt file (`-` for stdin), read lazily one at a time.

    Nothing is kept but the current line, and a line is read with a limit (MAX_LINE_BYTES), so a
    file of any size, /dev/zero included, costs at most one line of memory. A missing or
    unreadable file, a line over the limit or bytes that are not UTF-8 are UsageErrors naming the
    file and the line. `first()` reads up to the first prompt (before a model is loaded, so a bad
    file fails in an instant); `skipped_empty` counts the empty lines passed so far.
    """

    def __init__(self, name: str, max_bytes: int = MAX_LINE_BYTES):
        self.name, self.max_bytes = name, max_bytes
        self.label = "stdin" if name == STDIN else name
        self.skipped_empty = 0
        self._pending: PromptLine | None = None
        self._lines = bounded_lines(open_input(name, "prompt file"), self.label, max_bytes)

    def first(self) -> PromptLine:
        if self._pending is None:
            self._pending = self._next()
            if self._pending is None:
                raise UsageError(f"{self.label} holds no prompts (one prompt a line; empty lines are skipped)")
        return self._pending

    def __iter__(self):
        return self

    def __next__(self) -> PromptLine:
        line, self._pending = (self._pending, None) if self._pending is not None else (self._next(), None)
        if line is None:
            raise StopIteration
        return line

    def _next(self) -> PromptLine | None:
        for number, _, text in self._lines:
            if text.strip():
                return PromptLine(number, text)
            self.skipped_empty += 1
        return None


def open_input(name: str, what: str):
    """The binary stream behind a file option (`-`: stdin), opened now so that a bad path fails before
    any model loads; a missing or unreadable file, or a closed stdin, is a UsageError that names it as `what`.
    A named FIFO is refused without being opened (opening one waits for a writer, for ever when there is
    none); a pipe this process already holds (bash's `<(...)`: /dev/fd/N) is read, and so is a device
    (/dev/zero ends at the line limit)."""
    if name == STDIN:
        if sys.stdin is None or getattr(sys.stdin, "closed", False):
            raise UsageError(f"the {what} is stdin, and stdin is closed; pass a file or pipe it in")
        return getattr(sys.stdin, "buffer", sys.stdin)
    _refuse_fifo(name, what)
    try:
        return open(name, "rb")  # noqa: SIM115 - the caller reads and closes it
    except OSError as e:
        from lmhead_cli.inputs import unreadable

        raise unreadable(e, name, what) from None


def _refuse_fifo(name: str, what: str) -> None:
    import os
    import re
    import stat

    from lmhead_cli.inputs import special_kind

    try:
        mode = os.stat(name).st_mode
    except OSError:
        return  # missing or unreadable: open() says which
    if not stat.S_ISFIFO(mode) or re.fullmatch(r"/proc/(self|\d+)/fd/pipe:\[\d+\]", os.path.realpath(name)):
        return
    raise UsageError(f"{name} is {special_kind(mode)}, not a regular file; give a regular file, or give - and pipe "
                     f"the {what} in (a FIFO with no writer would wait for ever)")


@dataclass(frozen=True)
class PromptFile:
    name: str  # the path, or "-" for stdin
    prompts: list[str]  # the non-empty lines, in file order
    skipped_empty: int  # empty (or white-space only) lines left out


def read_prompts(name: str) -> PromptFile:
    """Every prompt of a file at once (for small files and tests; the CLI streams with PromptLines)."""
    lines = PromptLines(name)
    lines.first()
    prompts = [line.text for line in lines]
    return PromptFile(name=name, prompts=prompts, skipped_empty=lines.skipped_empty)


@dataclass(frozen=True)
class TargetWins:
    token: str
    best_of_targets: int  # prompts where this target was the most probable of the targets (first on ties)
    top1: int  # prompts where it was the most probable token of all


@dataclass
class BatchStats:
    """What a streamed run has done so far: counts only, nothing per prompt."""

    batch_size: int  # rows per forward pass, as asked
    targets: list[str]
    prompts: int = 0
    batches: int = 0  # forward passes actually run
    splits: int = 0  # batches halved because they did not fit in memory
    max_rows: int = 0  # the largest batch that ran
    truncated: int = 0  # prompts longer than the context
    truncated_lines: list[int] = field(default_factory=list)  # the first TRUNCATED_SHOWN of their line numbers
    best: list[int] = field(default_factory=list)  # per target: prompts where it was the best of the targets
    top1: list[int] = field(default_factory=list)  # per target: prompts where it was the top token

    @property
    def wins(self) -> list[TargetWins]:
        return [TargetWins(token=t, best_of_targets=b, top1=n) for t, b, n in zip(self.targets, self.best, self.top1)]

    @staticmethod
    def merged(every: list[BatchStats]) -> BatchStats:
        """The counts of several runs over parts of one file (torchrun's ranks, in rank order), as one."""
        out = BatchStats(every[0].batch_size, every[0].targets)
        for s in every:
            out.prompts, out.batches, out.splits = out.prompts + s.prompts, out.batches + s.batches, out.splits + s.splits
            out.max_rows, out.truncated = max(out.max_rows, s.max_rows), out.truncated + s.truncated
            out.truncated_lines = sorted(out.truncated_lines + s.truncated_lines)[:TRUNCATED_SHOWN]
            if s.best:
                out.best = [a + b for a, b in zip(out.best or [0] * len(s.best), s.best)]
                out.top1 = [a + b for a, b in zip(out.top1 or [0] * len(s.top1), s.top1)]
        return out

    def count(self, line: PromptLine, r: Inspection) -> None:
        self.prompts += 1
        if r.truncated:
            self.truncated += 1
            if len(self.truncated_lines) < TRUNCATED_SHOWN:
                self.truncated_lines.append(line.number)
        if r.targets:
            if not self.best:
                self.best, self.top1 = [0] * len(r.targets), [0] * len(r.targets)
            probs = [t.prob for t in r.targets]
            self.best[probs.index(max(probs))] += 1
            for j, t in enumerate(r.targets):
                self.top1[j] += t.rank == 1


@dataclass
class BatchRun:
    """A whole run kept in memory (`inspect_batch`, for the library and tests)."""

    prompts: list[str]
    results: list[Inspection]  # one per prompt, in file order
    batch_size: int
    batches: int
    splits: int
    max_rows: int
    wins: list[TargetWins]


@torch.inference_mode()
def batch_logits(loaded: Loaded, rows: list[list[int]]) -> torch.Tensor:
    """Logits (B, V) float32 at each row's last real token, for token-id rows of any lengths."""
    eng = loaded.engine
    lengths = torch.tensor([len(r) for r in rows], device=eng.device)  # (B,)
    B, T = len(rows), int(lengths.max())
    ids = torch.full((B, T), eng.eos_token_id or 0, dtype=torch.long, device=eng.device)  # (B, T)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, device=eng.device)
    mask = (torch.arange(T, device=eng.device)[None] < lengths[:, None]).long()  # (B, T), right padding
    logits = eng.last_logits(ids, attention_mask=mask, lengths=lengths)  # (B, V): each row's own last token
    check_finite(logits)
    return logits


def _out_of_memory(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


MAX_BATCH_SIZE = 1 << 16  # rows of one forward pass; beyond this no memory holds the batch's logits


def check_batch_size(batch_size: int) -> int:
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise BadValue("batch_size", f"must be between 1 and {MAX_BATCH_SIZE:,} (got {batch_size:,})")
    return batch_size


def inspect_stream(loaded: Loaded, lines: Iterable[PromptLine], top_k: int = 10, targets: list[str] | None = None,
                   batch_size: int = 32, stats: BatchStats | None = None,
                   run=batch_logits) -> Iterator[list[tuple[PromptLine, Inspection]]]:
    """`inspect` for every line, `batch_size` rows per forward pass: yields each batch's readings in
    file order as soon as it is computed, and keeps nothing once it is handed over (`stats` counts).

    `run(loaded, rows) -> (B, V)` is the forward (a parameter so tests can make memory run out).
    Memory: one batch of token ids (<= batch_size x n_ctx) and its (B, V) logits, whatever the file.
    batch_size in 1 to MAX_BATCH_SIZE is the API's check (api.checks.prompt_file), made before the model loads."""
    loaded.execution.bound_heap()  # each batch's (B, V) buffers go back to the OS, not into a growing heap (engine/heap.py)
    k = clamp_top_k(top_k, loaded.engine.vocab_size)
    targets = check_targets(targets)
    stats = stats if stats is not None else BatchStats(batch_size, targets)
    target_ids = encode_targets(loaded.tokenizer, targets)
    lines = iter(lines)
    while batch := list(itertools.islice(lines, batch_size)):
        encoded = [encode_prompt(loaded, line.text) for line in batch]  # [(ids, dropped)]
        logits: dict[int, torch.Tensor] = {}
        # Longest first: a batch halved for memory then splits into rows of like lengths.
        _forward(loaded, encoded, sorted(range(len(batch)), key=lambda i: -len(encoded[i][0])), logits, stats, run)
        readings = [(line, _inspection(loaded, *encoded[i], logits.pop(i), k, target_ids))
                    for i, line in enumerate(batch)]
        for line, r in readings:
            stats.count(line, r)
        yield readings


def _forward(loaded, encoded, indices: list[int], logits: dict, stats: BatchStats, run) -> None:
    """Logits for rows `indices` into `logits`, halving the rows while memory runs out."""
    try:
        rows = [encoded[i][0] for i in indices]
        z = loaded.execution.run(lambda: run(loaded, rows), sum(map(len, rows)))  # (B, V)
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError too
        if not _out_of_memory(e):
            raise
        if len(indices) == 1:
            device = loaded.engine.device.type
            advice = ("; ", Param("device"), " cpu may have more memory") if device != "cpu" else ()
            raise LmheadError(f"out of memory even for a single prompt of {len(encoded[indices[0]][0])} tokens "
                              f"on {device}", *advice) from None
        if loaded.engine.device.type == "cuda":
            torch.cuda.empty_cache()
        stats.splits += 1
        half = len(indices) // 2
        _forward(loaded, encoded, indices[:half], logits, stats, run)
        _forward(loaded, encoded, indices[half:], logits, stats, run)
        return
    stats.batches += 1
    stats.max_rows = max(stats.max_rows, len(indices))
    for i, row in zip(indices, z):
        logits[i] = row


def inspect_batch(loaded: Loaded, prompts: list[str], top_k: int = 10, targets: list[str] | None = None,
                  batch_size: int = 32, run=batch_logits) -> BatchRun:
    """`inspect_stream` over a list, every result kept: for the library and tests, not for big files."""
    stats = BatchStats(batch_size, check_targets(targets))
    lines = [PromptLine(n, p) for n, p in enumerate(prompts, 1)]
    results = [r for batch in inspect_stream(loaded, lines, top_k, targets, batch_size, stats, run) for _, r in batch]
    return BatchRun(prompts=list(prompts), results=results, batch_size=batch_size, batches=stats.batches,
                    splits=stats.splits, max_rows=stats.max_rows, wins=stats.wins)


def _inspection(loaded: Loaded, ids: list[int], dropped: int, logits: torch.Tensor, k: int,
                target_ids: list[tuple[str, list[int]]]) -> Inspection:
    """The `inspect` reading of one prompt. Shapes are the prompt's own, as a single run sees them,
    not the padded batch's, so each document equals a one-at-a-time run."""
    walk = shape_walk(len(ids), loaded.engine.embedding_weight.shape[1], logits.shape[-1])
    return inspection_from_logits(loaded, ids, dropped, logits, walk, k, target_ids)
