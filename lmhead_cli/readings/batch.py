"""`lmhead inspect --file`: many prompts, run in padded batches, each read exactly like `inspect`.

Rows are right-padded to the longest prompt of their batch, with an attention mask so no real
token attends to padding, and the head is applied at each row's own last real token only: a
(B, D) matrix, not (B, T, D). Prompts are grouped by length (less padding) and the results put
back in file order. A batch that does not fit in memory is halved until it does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from lmhead_cli.errors import BadValue, LmheadError, UsageError
from lmhead_cli.head import check_finite, clamp_top_k, encode_targets
from lmhead_cli.readings.inspect import Inspection, check_targets, encode_prompt, inspection_from_logits, shape_walk
from lmhead_cli.loading.sources import Loaded

STDIN = "-"


@dataclass(frozen=True)
class PromptFile:
    name: str  # the path, or "-" for stdin
    prompts: list[str]  # the non-empty lines, in file order
    skipped_empty: int  # empty (or white-space only) lines left out


@dataclass(frozen=True)
class TargetWins:
    token: str
    best_of_targets: int  # prompts where this target was the most probable of the targets (first on ties)
    top1: int  # prompts where it was the most probable token of all


@dataclass
class BatchRun:
    prompts: list[str]
    results: list[Inspection]  # one per prompt, in file order
    batch_size: int  # rows per forward pass, as asked
    batches: int  # forward passes actually run
    splits: int  # batches halved because they did not fit in memory
    max_rows: int  # the largest batch that ran
    wins: list[TargetWins]


def open_input(name: str, what: str):
    """The binary stream behind a file option (`-`: stdin), opened now so that a bad path fails before
    any model loads; a missing or unreadable file is a UsageError that names it as `what`."""
    if name == STDIN:
        return sys.stdin.buffer
    try:
        return open(name, "rb")  # noqa: SIM115 - the caller reads and closes it
    except FileNotFoundError:
        raise UsageError(f"no such {what}: {name}") from None
    except IsADirectoryError:
        raise UsageError(f"{name} is a folder, not a {what}") from None
    except OSError as e:
        raise UsageError(f"cannot read the {what} {name}: {e.strerror or e}") from None


def read_prompts(name: str) -> PromptFile:
    """The prompts of a file (one a line; `-` reads stdin). Empty lines are skipped and counted.

    A missing, unreadable or non-UTF-8 file is a UsageError naming it."""
    label = "stdin" if name == STDIN else name
    stream = open_input(name, "prompt file")
    try:
        data = stream.read()
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UsageError(f"{label} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
                         "save it as UTF-8") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line opens no new one
    lines = [line.removesuffix("\r") for line in lines]
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError(f"{label} holds no prompts (one prompt a line; empty lines are skipped)")
    return PromptFile(name=name, prompts=prompts, skipped_empty=len(lines) - len(prompts))


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
    hidden = eng.body(ids, attention_mask=mask)  # (B, T, D)
    last = hidden[torch.arange(B, device=eng.device), lengths - 1]  # (B, D): each row's own last token
    logits = eng.head(last)  # (B, V)
    check_finite(logits)
    return logits.float()


def _out_of_memory(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def inspect_batch(loaded: Loaded, prompts: list[str], top_k: int = 10, targets: list[str] | None = None,
                  batch_size: int = 32, run=batch_logits) -> BatchRun:
    """`inspect` for every prompt, `batch_size` rows per forward pass; results in the prompts' order.

    `run(loaded, rows) -> (B, V)` is the forward (a parameter so tests can make memory run out)."""
    if batch_size < 1:
        raise BadValue("batch_size", f"must be at least 1 (got {batch_size})")
    k = clamp_top_k(top_k, loaded.engine.vocab_size)
    targets = check_targets(targets)
    target_ids = encode_targets(loaded.tokenizer, targets)
    encoded = [encode_prompt(loaded, p) for p in prompts]  # [(ids, dropped)]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i][0]), reverse=True)
    run_stats = BatchRun(prompts=list(prompts), results=[], batch_size=batch_size, batches=0, splits=0, max_rows=0, wins=[])
    logits: dict[int, torch.Tensor] = {}

    def forward(indices: list[int]) -> None:
        try:
            rows = [encoded[i][0] for i in indices]
            z = loaded.threads.run(lambda: run(loaded, rows), sum(map(len, rows)))  # (B, V)
        except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError too
            if not _out_of_memory(e):
                raise
            if len(indices) == 1:
                raise LmheadError(f"out of memory even for a single prompt of {len(encoded[indices[0]][0])} "
                                  "tokens; try the CPU or a shorter prompt") from None
            if loaded.engine.device.type == "cuda":
                torch.cuda.empty_cache()
            run_stats.splits += 1
            half = len(indices) // 2
            forward(indices[:half])
            forward(indices[half:])
            return
        run_stats.batches += 1
        run_stats.max_rows = max(run_stats.max_rows, len(indices))
        for i, row in zip(indices, z):
            logits[i] = row

    for start in range(0, len(order), batch_size):
        forward(order[start:start + batch_size])

    results = [_inspection(loaded, *encoded[i], logits[i], k, target_ids) for i in range(len(prompts))]
    run_stats.results = results
    run_stats.wins = _wins(results, targets)
    return run_stats


def _inspection(loaded: Loaded, ids: list[int], dropped: int, logits: torch.Tensor, k: int,
                target_ids: list[tuple[str, list[int]]]) -> Inspection:
    """The `inspect` reading of one prompt. Shapes are the prompt's own, as a single run sees them,
    not the padded batch's, so each document equals a one-at-a-time run."""
    walk = shape_walk(len(ids), loaded.engine.embedding_weight.shape[1], logits.shape[-1])
    return inspection_from_logits(loaded, ids, dropped, logits, walk, k, target_ids)


def _wins(results: list[Inspection], targets: list[str]) -> list[TargetWins]:
    best = [0] * len(targets)
    top1 = [0] * len(targets)
    for r in results:
        if not r.targets:
            continue
        probs = [t.prob for t in r.targets]
        best[probs.index(max(probs))] += 1
        for j, t in enumerate(r.targets):
            top1[j] += t.rank == 1
    return [TargetWins(token=t, best_of_targets=b, top1=n) for t, b, n in zip(targets, best, top1)]
