"""How a loaded model's work runs: the engine's one execution boundary.

`Execution` owns the four things that decide speed and memory besides the weights themselves, so that
readings/, decoding/ and head.py ask it and never reach them:

* the thread count (engine/threads.py's `ThreadChooser`: fixed by --threads, or chosen by timing);
* the product forms the engine offers (engine/products.py: which one runs is timed with the counts);
* the compiled kernels (engine/kernels.py: the extension module `pip install` built, or torch's
  products where there is none);
* the memory policy (engine/heap.py: glibc's mmap threshold pinned, for long loops over chunks).

It leaves the host process as it found it. Every call that runs work (`run`, `settle`, `scope`)
sets torch's thread count it chose and restores the caller's after, and nothing here writes
os.environ or the allocator's settings, unless the process is the command line's own: `own_process()`
(called by `lmhead`'s entry point before torch is imported) lets OpenMP's threads spin ~1 ms between
parallel regions (engine/threads.py, SPIN) and pins the mmap threshold (`bound_heap`) for the
process. A program that imports lmhead (a notebook, an evaluation harness) keeps its own settings:
its torch work is not slowed or changed, and lmhead's runs on OpenMP's default wait (documented in
docs/performance.md, with what that costs).

No torch import at module top: `own_process` runs before torch is first imported.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

from lmhead_cli.engine.threads import SPIN, WAIT_SETTINGS, ThreadChooser

T = TypeVar("T")
_owned: list[bool] = []  # True once the command line has said it owns this process


def own_process() -> None:
    """The command line owns its process: OpenMP's threads spin briefly between regions (unless the
    user set a wait policy; read once, when torch is imported, so this must run before that), and
    the memory policy applies process-wide. A library caller never calls this."""
    if not any(name in os.environ for name in WAIT_SETTINGS):
        os.environ.update(SPIN)
    _owned.append(True)


def process_owned() -> bool:
    return bool(_owned)


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP helper threads, where the command line hands the model's work to
    another thread for good (`lmhead serve`'s model thread) and this one runs no more parallel work.
    libgomp counts the helper threads of every thread's pool, and once they outnumber the cores it cuts
    every waiting thread's spin to a few hundred iterations: the model thread's parallel regions (some
    sixty a step) then each paid a sleep and a wake-up. Measured on a 2-core AVX2 machine: a float32
    step took 28.7 ms on a second thread against 20.3 ms on the first, and 22.4 ms once the first
    thread's pool was ended; `lmhead serve` gave one client 28.8 tok/s where `lmhead greedy` ran at 45.
    Through the compiled kernels' module (OpenMP 5's omp_pause_resource_all, in the runtime torch runs
    on); False where they did not load or could not. The pool is made again if this thread runs
    parallel work later, so nothing breaks, only the speed comes back."""
    from lmhead_cli.engine import kernels

    k = kernels.load()
    return k is not None and k.release_thread_pool()


class Execution:
    """One loaded model's way of running: its thread count (fixed, or chosen by timing repeated work),
    its engine's product forms, the compiled kernels, the memory policy. Work runs through `run`
    (timed: decoding steps, batches, prompts in a session) or inside `scope()` (one-shot readings)."""

    def __init__(self, threads: int | None = None, device_type: str = "cpu"):
        self.device_type = device_type
        self.chooser = ThreadChooser(threads, device_type)
        self.engine = None  # the engine offered (`offer`): it says what its products run on

    # ---- threads and forms ----------------------------------------------------------------------
    def offer(self, engine) -> None:
        """Time the engine's product forms with the thread counts, where it offers more than one."""
        self.engine = engine
        self.chooser.offer(engine)

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Inside: torch runs on this model's thread count (fixed, or the chooser's latest). After: the
        caller's count again, whatever happened inside."""
        import torch

        before = torch.get_num_threads()
        try:
            if self.chooser.count is not None and self.chooser.count != before:
                torch.set_num_threads(self.chooser.count)
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def run(self, fn: Callable[[], T], units: float | Callable[[T], float] = 1.0) -> T:
        """fn() in this model's scope, timed per unit (a token) while the thread count and the product
        form are being chosen or watched (engine/threads.py). `units`: a number, or a function of fn's
        result that counts them (a decoding round that ran several positions)."""
        with self.scope():
            return self.chooser.run(fn, units)

    @property
    def settled(self) -> bool:
        """Whether no trial of thread counts or forms is under way or due at the next call: calls are only
        watched, so a call may hold more work than the one before (ThreadChooser.settled)."""
        return self.chooser.settled

    def settle(self, fn: Callable[[], object], units: float = 1.0) -> int:
        """Run fn as often as the trial needs to choose (nothing when the count is fixed); the count chosen."""
        with self.scope():
            return self.chooser.settle(fn, units)

    def iterate(self, items: Iterable[T]) -> Iterator[T]:
        """`items` (a lazy reading: a generator over a file's lines), each item made inside the scope."""
        it = iter(items)
        while True:
            with self.scope():
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    @property
    def threads(self) -> int:
        """The thread count this model's work runs on (torch's count when none was fixed or chosen)."""
        import torch

        return self.chooser.count or torch.get_num_threads()

    # ---- compiled kernels -----------------------------------------------------------------------
    @property
    def kernels(self):
        """engine.kernels.Kernels on the CPU where the extension module loads; None otherwise."""
        if self.device_type != "cpu":
            return None
        from lmhead_cli.engine import kernels

        return kernels.load()

    @property
    def products(self) -> str:
        """Which products run, for the places that report speed, as the engine says (Engine.runs_on):
        "compiled kernels (VARIANT)" or "torch's products" (on the CPU without the kernels, or on another
        device), or per weight type where they differ (a GGUF Llama's blocks)."""
        k = self.kernels
        if self.engine is not None:
            return self.engine.runs_on(k)
        return f"compiled kernels ({k.variant})" if k is not None else "torch's products"

    def kernels_notice(self, weights: str) -> str | None:
        """One line, once per process, when `weights` run on the CPU without the compiled kernels
        (engine/kernels.py `fallback_notice`); None otherwise."""
        if self.device_type != "cpu":
            return None
        from lmhead_cli.engine import kernels

        return kernels.fallback_notice(weights)

    def row_kernel(self) -> Callable | None:
        """head.score_rows's compiled kernel ((z, ids) -> its seven figures and the count of rows not finite), or None for torch's."""
        k = self.kernels
        return k.score_rows if k is not None else None

    # ---- memory ---------------------------------------------------------------------------------
    def bound_heap(self) -> None:
        """Before a long loop over same-sized buffers (score's chunks, a file's batches): glibc's mmap
        threshold pinned, so freed buffers go back to the OS (engine/heap.py). A process setting, so
        only where the command line owns the process; a library caller's allocator is left alone."""
        if process_owned():
            from lmhead_cli.engine.heap import fix_mmap_threshold

            fix_mmap_threshold()
