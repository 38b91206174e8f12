"""The one `--file` pipeline, for every command that takes a file of inputs (inspect, score), alone or
under torchrun (distributed.py: each rank computes its share, rank 0 writes everything in order),
inspect's and score's use of it (inspect_file, score_file), and a file read as one text (read_text_file)."""

from __future__ import annotations

from typing import Callable, Iterator, TypeVar

from lmhead_cli.errors import Param, UsageError

Opened = TypeVar("Opened")

SCORE_LINES_PER_ROUND = 8  # under torchrun: the lines each rank scores before the ranks hand over


def run_file(file: str, noun: str, open_input: Callable[[], Opened], load: Callable[[str], object],
             work: Callable[[object, Opened, object], None], close: Callable[[Opened], None] = lambda opened: None,
             device: str = "auto") -> None:
    """Run `work(model, opened, ranks)` over the file `file` (`-`: stdin):

    1. under torchrun, stdin is refused (every rank reads the file itself; `noun` names what it holds);
    2. `open_input()` opens the file before any model loads, so a bad path or an empty file fails at once;
    3. `load(device)` loads the model on this rank's device (`device` as asked, or cuda:LOCAL_RANK);
    4. `work` reads its share (ranks.share / ranks.spread), rank 0 writing (ranks.writer);
    5. `close(opened)` and the process group is left, whatever happened.
    """
    from lmhead_cli.distributed import Ranks
    from lmhead_cli.readings.batch import STDIN

    ranks = Ranks.from_env()
    if ranks.world > 1 and file == STDIN:
        raise UsageError(f"under torchrun every rank reads the {noun} itself: give ", Param("file"),
                         " a file, not - (stdin)")
    opened = open_input()
    try:
        work(load(ranks.start(device)), opened, ranks)
    finally:
        close(opened)
        ranks.finish()


def _totalled(results, mine: list, into, merged: Callable[[list], object], ranks) -> Iterator:
    """`results` yielded through, then `into` given every rank's totals: `merged` of the gathered
    `mine[0].totals` (the Model's LineResults, made once the first result is asked for)."""
    yield from results
    for name, value in vars(merged(ranks.gather(mine[0].totals))).items():
        setattr(into, name, value)


def _drain(items: Iterator) -> None:
    """Compute and hand over without writing (every rank but rank 0)."""
    import collections

    collections.deque(items, maxlen=0)


def inspect_file(file: str, load: Callable[[str], object], write: Callable[[object, Iterator, object, object], None],
                 *, top_k: int = 10, targets=(), batch_size: int = 32, device: str = "auto") -> None:
    """`inspect --file`: every non-empty line of `file` (`-`: stdin) inspected, `batch_size` a forward
    pass, streamed, through run_file (under torchrun each rank inspects every N-th batch).

    On the writing rank, `write(model, batches, stats, lines)` gets the lazy stream of batches, each
    [(readings.batch.PromptLine, InspectResult)] in file order; the readings.batch.BatchStats whose
    counts (every rank's) are complete once `batches` is exhausted; and the readings.batch.PromptLines
    read (its `skipped_empty`)."""
    from lmhead_cli.api import checks
    from lmhead_cli.readings.batch import BatchStats, PromptLines

    targets = checks.prompt_file(top_k, batch_size, targets)

    def open_lines() -> PromptLines:
        lines = PromptLines(file)
        lines.first()  # before the load: a missing, empty or undecodable file fails in an instant
        return lines

    def work(model, lines, ranks) -> None:
        mine = [model.inspect_lines(ranks.share(lines, batch_size), top_k, targets, batch_size)]
        stats = BatchStats(batch_size, targets)
        batches = _totalled(ranks.merge(mine[0]), mine, stats, BatchStats.merged, ranks)
        if ranks.writer:
            write(model, batches, stats, lines)
        else:
            _drain(batches)

    run_file(file, "prompts", open_lines, load, work, device=device)


def read_text_file(file: str, what: str = "text file") -> str:
    """The whole of `file` (`-`: stdin) as one text (inputs.read_text's limits and checks)."""
    import sys

    from lmhead_cli.inputs import read_text
    from lmhead_cli.readings.batch import open_input

    stream = open_input(file, what)
    try:
        return read_text(f"the {what} {file}", stream=stream)
    finally:
        if stream is not sys.stdin.buffer and stream is not sys.stdin:
            stream.close()


def score_file(file: str, load: Callable[[str], object], write: Callable[[object, Iterator, object, int | None], None],
               *, bos: bool | None = None, stride: int | None = None, chunk: int | None = None,
               device: str = "auto") -> None:
    """`score --file`: each line of `file` (`-`: stdin) scored as its own text, streamed, through run_file
    (under torchrun each rank scores every N-th group of SCORE_LINES_PER_ROUND lines).

    On the writing rank, `write(model, items, corpus, size)` gets the lazy readings.score.FileItem
    stream, in file order, and the readings.score.Corpus whose totals (every rank's) are complete once
    `items` is exhausted; `size` is the file's size in bytes (None for stdin)."""
    import os
    import sys

    from lmhead_cli.readings.batch import open_input
    from lmhead_cli.readings.score import Corpus, read_lines

    def work(model, stream, ranks) -> None:
        model.check_score(stride=stride, chunk=chunk)
        mine: list = []  # this rank's LineResults, made when spread starts

        def score(lines):
            mine.append(model.score_lines(lines, bos=bos, stride=stride, chunk=chunk))
            return mine[0]

        corpus = Corpus()
        items = _totalled(ranks.spread(read_lines(stream, file), SCORE_LINES_PER_ROUND, score), mine, corpus,
                          Corpus.merged, ranks)
        if ranks.writer:
            size = os.fstat(stream.fileno()).st_size if stream is not sys.stdin.buffer else None
            write(model, items, corpus, size)
        else:
            _drain(items)

    def close(stream) -> None:
        if stream is not sys.stdin.buffer:
            stream.close()

    run_file(file, "texts", lambda: open_input(file, "text file"), load, work, close, device=device)
