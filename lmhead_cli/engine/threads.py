"""How many CPU threads torch runs on, and how they wait: chosen by measuring the work itself.

On an idle machine one thread per core makes lmhead's products faster. On a machine whose cores are
busy with other work the same threads can make them several times slower: every parallel region
waits for its slowest thread, and a thread the scheduler has parked for a slice holds up the rest.
Three things follow (figures in README, Performance):

* OpenMP's threads spin for about a millisecond before they sleep between parallel regions (SPIN),
  unless the user set a wait policy. A decoding step is a few hundred parallel regions a few
  microseconds apart: threads that sleep at once pay a wake-up in each (idle, 64 tokens on 2 cores:
  bfloat16 26.5 tok/s sleeping, 35.6 spinning; int8 35.3 and 55.5), while threads that spin without
  end take the core another process needs (beside one busy process: 1.5 tok/s). Beside a busy
  process the chooser below runs one thread, which waits for nobody.
* `ThreadChooser` times the first calls of repeated work (decoding steps, batches of a file, prompts
  in a session) with torch's thread count and with one thread, keeps the faster, and times both
  again when its speed halves, or after `recheck` calls (twice as many after each trial that kept
  the count: on a busy machine the call on the slower count can take many times longer).
  A one-shot forward (`inspect`, `lens`) has nothing to compare with and runs on torch's count.
* `--threads N` / LMHEAD_THREADS fix the count, and it is not timed.
* The count is set for the model's own calls only (engine/execution.py scopes it and restores the
  caller's after); OpenMP's wait is set only where the command line owns the process (`own_process`).
* The same trials choose the engine's product form where it offers several (engine/products.py:
  bfloat16 without the compiled kernels: gemv, gemm or blocked rows), which differs from CPU to CPU
  and between a quiet and a busy machine.

No torch import at module top: engine/execution.py's `own_process` must run before torch is first imported.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable, TypeVar

from lmhead_cli.errors import BadValue

T = TypeVar("T")
ENV = "LMHEAD_THREADS"
# OpenMP's wait between parallel regions unless the user set one: spin ~1 ms, then sleep. libgomp (torch's
# OpenMP on Linux) counts spins (~100,000 a millisecond); Intel's and LLVM's take milliseconds.
SPIN = {"GOMP_SPINCOUNT": "100000", "KMP_BLOCKTIME": "1"}
WAIT_SETTINGS = ("OMP_WAIT_POLICY", *SPIN)


# More threads than this is no machine's count; OpenMP asked for 99,999 fails to map their stacks
# and takes the process down with it.
MAX_THREADS = 1024


def check(threads: int | None) -> int | None:
    """A thread count as given by --threads or LMHEAD_THREADS: None (choose), or 1 to MAX_THREADS."""
    if threads is not None and threads < 1:
        raise BadValue("threads", f"must be at least 1 (got {threads})")
    if threads is not None and threads > MAX_THREADS:
        raise BadValue("threads", f"must be between 1 and {MAX_THREADS:,} (got {threads:,})")
    return threads


class ThreadChooser:
    """Keeps torch's thread count at whichever of (torch's count, 1) runs the work faster, and the
    engine's product form (`offer`: e.g. bfloat16 without the compiled kernels "gemv", "linear" or
    "blocked") at whichever of its forms does: every (count, form) pair is a setting, and the trials
    time them all.

    `run(fn, units)` runs fn and times it per unit of work (a token). The first call is a warm-up on
    one thread (first-call set-up is not what is compared); the next settings × trials calls
    alternate between the settings, and the fastest (best time per unit each) is kept. With forms, the trial times each
    form on one thread, then torch's count with the fastest of them: one call on more threads, not
    one per form. Then the median of the last 5 calls
    is watched against the median of the first 5 after the choice: when it is more than `slack` times
    slower, or after `recheck` calls, the trial runs again. A trial costs calls on slower settings,
    which on a busy machine can take many times longer, so a trial that keeps the same setting
    multiplies the calls until the next by how many times slower the slowest was (at least 2, up to
    `max_recheck` calls). With `fixed` (or one core, or a GPU) the thread count is not timed; forms
    still are, where the engine offers more than one.
    """

    WINDOW = 5

    def __init__(self, fixed: int | None = None, device_type: str = "cpu", trials: int = 1,
                 slack: float = 2.0, recheck: int = 64, max_recheck: int = 1024):
        import torch

        check(fixed)
        self.fixed = fixed
        self.count = fixed  # the count the model's calls run on (None: torch's, as the caller has it)
        most = torch.get_num_threads()
        self.candidates = [most, 1] if fixed is None and device_type == "cpu" and most > 1 else []
        self.trials, self.slack, self.recheck, self.max_recheck = trials, slack, recheck, max_recheck
        self.choices: list[int] = []  # the count each trial chose, in order
        self.forms: tuple[str, ...] = ()
        self.form_choices: list[str] = []  # the form each trial chose, in order (with forms)
        self._engine = None
        self._settings: list[tuple[int | None, str | None]] = [(n, None) for n in self.candidates]
        self._pending: list[tuple[int | None, str | None]] = []
        self._timed: dict[tuple[int | None, str | None], float] = {}
        self._window: deque[float] = deque(maxlen=self.WINDOW)
        self._reference: float | None = None
        self._interval, self._since = recheck, 0
        self._warm_up = 1 if self._settings else 0
        if self._settings:
            self._start_trial()

    def offer(self, engine) -> None:
        """Time the engine's product forms too (`engine.forms`, `use_form`), where it has more than one."""
        forms = tuple(engine.forms)
        if len(forms) < 2:
            return
        self.forms, self._engine = forms, engine
        # The forms on one thread first (on a busy machine a call on more threads can take many times
        # longer), then the other count with whichever form was fastest ("best", resolved when reached).
        counts = self.candidates or [None]
        first = 1 if 1 in counts else counts[0]
        self._settings = [(first, f) for f in forms] + [(n, "best") for n in counts if n != first]
        self._warm_up = 1  # with a fixed count too: a first call's set-up is not what the forms differ in
        self._start_trial()

    @property
    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    @property
    def deciding(self) -> bool:
        return bool(self._pending)

    def _start_trial(self) -> None:
        self._pending = self._settings * self.trials  # alternating: drift hits all alike
        self._timed = {}

    def _resolve(self, setting: tuple[int | None, str | None]) -> tuple[int | None, str | None]:
        """(n, "best"): the form timed fastest so far in this trial."""
        if setting[1] != "best":
            return setting
        return setting[0], min(self._timed, key=self._timed.get)[1]

    def _apply(self, setting: tuple[int | None, str | None]) -> None:

        n, form = setting
        if n is not None:
            self._set(n)
        if form is not None:
            self._engine.use_form(form)

    def _set(self, n: int) -> None:
        import torch

        self.count = n
        torch.set_num_threads(n)

    def _choose(self) -> None:
        best = min(self._timed, key=self._timed.get)
        self._apply(best)
        n, form = best
        previous = (self.choices[-1] if n is not None and self.choices else None,
                    self.form_choices[-1] if form is not None and self.form_choices else None)
        kept = bool(self.choices or self.form_choices) and previous == best
        if n is not None:
            self.choices.append(n)
        if form is not None:
            self.form_choices.append(form)
        # The slowest setting's call is what a trial costs: the more it lost by, the longer until the next.
        lost_by = max(self._timed.values()) / max(self._timed[best], 1e-12)
        self._interval = min(int(self._interval * max(2.0, lost_by)), self.max_recheck) if kept else self.recheck
        self._since, self._reference = 0, None
        self._window.clear()

    def run(self, fn: Callable[[], T], units: float = 1.0) -> T:
        """fn(), timed per unit when the setting is being chosen or watched."""
        if not self._settings:
            return fn()

        if self._warm_up:  # on one thread: on a busy machine the other count can take many times longer
            self._warm_up -= 1
            if self.candidates:
                self._set(1)
            return fn()

        if self._pending:
            self._pending[0] = self._resolve(self._pending[0])
            self._apply(self._pending[0])
        start = time.perf_counter()
        out = fn()
        per_unit = (time.perf_counter() - start) / max(units, 1e-9)
        if self._pending:
            setting = self._pending.pop(0)
            self._timed[setting] = min(self._timed.get(setting, math.inf), per_unit)
            if not self._pending:
                self._choose()
            return out
        self._since += 1
        self._window.append(per_unit)
        full = len(self._window) == self.WINDOW
        if self._reference is None:
            if full:
                self._reference = statistics.median(self._window)
        elif full and statistics.median(self._window) > self.slack * self._reference:
            self._start_trial()
        if self._since >= self._interval:
            self._start_trial()
        return out

    def settle(self, fn: Callable[[], object], units: float = 1.0) -> int:
        """Run fn as often as the trial needs to choose (nothing when fixed); the count chosen."""
        while self._pending:
            self.run(fn, units)
        return self.threads
