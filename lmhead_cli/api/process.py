"""The process a front end owns: what the `lmhead` command and `lmhead serve` may tune that a program
importing lmhead as a library never has tuned for it (engine/execution.py does the work)."""

from __future__ import annotations


def own_process() -> None:
    """For a front end that owns its process (the `lmhead` command), before anything imports torch:
    OpenMP's threads spin briefly between parallel regions and glibc's mmap threshold is pinned for
    long loops (engine/execution.py). A program that imports lmhead as a library never calls this."""
    from lmhead_cli.engine.execution import own_process as own

    own()


def hand_over() -> bool:
    """For a front end that owns its process and hands the model's work to another thread for good
    (`lmhead serve`, after loading): the calling thread's OpenMP helper threads are ended, so that the
    other thread's parallel regions keep their spin-wait (engine/execution.py release_thread_pool).
    Whether they were; nothing where own_process did not run."""
    from lmhead_cli.engine.execution import process_owned, release_thread_pool

    return process_owned() and release_thread_pool()
