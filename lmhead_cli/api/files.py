"""The one `--file` pipeline, for every command that takes a file of inputs (inspect, score), alone or
under torchrun (distributed.py: each rank computes its share, rank 0 writes everything in order), and
score's use of it (score_file)."""

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


def score_file(file: str, load: Callable[[str], object], write: Callable[[object, Iterator, object, int | None], None],
               *, bos: bool = False, stride: int | None = None, chunk: int | None = None,
               device: str = "auto") -> None:
    """`score --file`: each line of `file` (`-`: stdin) scored as its own text, streamed, through run_file
    (under torchrun each rank scores every N-th group of SCORE_LINES_PER_ROUND lines).

    On the writing rank, `write(model, items, corpus, size)` gets the lazy readings.score.FileItem
    stream, in file order, and the readings.score.Corpus whose totals (every rank's) are complete once
    `items` is exhausted; `size` is the file's size in bytes (None for stdin)."""
    import collections
    import os
    import sys

    from lmhead_cli.readings.batch import open_input
    from lmhead_cli.readings.score import Corpus, read_lines

    def work(model, stream, ranks) -> None:
        corpus = Corpus()
        model.check_score(stride=stride, chunk=chunk)
        items = ranks.spread(read_lines(stream, file), SCORE_LINES_PER_ROUND,
                             lambda lines: model.score_lines(lines, corpus, bos=bos, stride=stride, chunk=chunk))

        def totalled():  # every rank's items, then every rank's counts in `corpus`, for the summary
            yield from items
            for name, value in vars(Corpus.merged(ranks.gather(corpus))).items():
                setattr(corpus, name, value)

        if ranks.writer:
            size = os.fstat(stream.fileno()).st_size if stream is not sys.stdin.buffer else None
            write(model, totalled(), corpus, size)
        else:
            collections.deque(totalled(), maxlen=0)  # compute and hand over; rank 0 writes

    def close(stream) -> None:
        if stream is not sys.stdin.buffer:
            stream.close()

    run_file(file, "texts", lambda: open_input(file, "text file"), load, work, close, device=device)
