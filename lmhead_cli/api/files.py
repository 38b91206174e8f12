"""The one `--file` pipeline, for every command that takes a file of inputs (inspect, score), alone or
under torchrun (distributed.py: each rank computes its share, rank 0 writes everything in order)."""

from __future__ import annotations

from typing import Callable, TypeVar

from lmhead_cli.errors import Param, UsageError

Opened = TypeVar("Opened")


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
