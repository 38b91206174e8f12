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
  again when its speed halves, when the calls on more threads lose their cores (their CPU time falls
  short of wall time × threads: another process took one), or after `recheck` calls (twice as many
  after each trial that kept the count: on a busy machine the call on the slower count can take many
  times longer). More threads that keep their cores are not timed again on that schedule: on a quiet
  machine nothing has changed, and each trial costs a call on one thread (idle, a Q4_K_M step of
  TinyLlama's sizes took 35 ms there against 20 on two: the three such calls of a 128-token run, the
  warm-up, the trial and the schedule's, were 2% of it; now the trial's alone). Where the
  two counts come out close (within CLEAR), as they do beside a busy process, one call each says
  little (a call on two threads there took from 1x to 1.5x the time of the next): the trial times
  each count twice more and compares medians, and where the calls on more threads lacked their cores
  (the median below SHARED: another process holds one), more threads are kept only when faster by
  MARGIN, since one thread keeps its speed whatever the other core does and a wrong two-thread choice
  does not (measured beside a spin loop: the chooser's two threads 20.3 tok/s in a run where
  `--threads 1` gave 27.3). Where they had their cores, the faster is kept: at times this host's two
  cores read memory barely faster than one (GPT-2 in bfloat16, fresh processes, nothing else running:
  8.3-9.7 ms a step on two threads, 9.2-12.7 on one, every call on two with 0.82-1.2 of its cores), and
  MARGIN then kept one thread in 3 of 6 runs: 95-98 tok/s where two threads gave 104-107.
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


# A trial whose counts came out within CLEAR of each other, or whose calls on more threads got less than
# SHARED of their cores' time (another process held a core), times each setting twice more (ROUNDS in
# all); torch's count is kept over one thread only when faster by MARGIN where its calls lacked their cores
# (their median share under SHARED); and the count kept is timed
# again once its calls run slower than REJECTED times the count it beat.
CLEAR = 1.3
SHARED = 0.8
ROUNDS = 3
MARGIN = 1.15
REJECTED = 1.25

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
    the count of the trial's first call (first-call set-up is not what is compared; beside a busy
    process a Q4_K_M step took 41 ms there on two threads against 35 on one); the next settings ×
    trials calls
    alternate between the settings, then, where one thread and torch's count came out within CLEAR
    of each other or the calls on more threads had less than SHARED of their cores' CPU time,
    settings × more up to ROUNDS in all; the fastest by its median time per unit is kept, torch's
    count, where the median call on it had less than SHARED of its cores, only when faster than one
    thread by MARGIN. With forms, the trial times each
    form on one thread, then torch's count with the fastest of them: one call on more threads, not
    one per form. Then the median of the last 5 calls
    is watched against the median of the first 5 after the choice: when it is more than `slack` times
    slower, or more than REJECTED times the time of the count the trial did not keep, or the median
    call on more threads had less than SHARED of its cores, or after `recheck` calls unless each of
    the last 5 calls on more threads had its cores, the trial runs again. A trial costs calls on
    slower settings,
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
        self._timed: dict[tuple[int | None, str | None], list[float]] = {}  # each setting's times per unit
        self._rounds = 0  # the rounds of the trial under way queued so far
        self._shares: list[float] = []  # this trial's calls on more threads: CPU time / (wall time × threads)
        self._rejected: float | None = None  # the fastest time per unit of a count the last trial did not keep
        self._had_cores = True  # whether the last trial's calls on more threads had their cores (SHARED)
        self._window: deque[float] = deque(maxlen=self.WINDOW)
        self._window_shares: deque[float] = deque(maxlen=self.WINDOW)  # the watched calls' CPU / (wall × threads)
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

    @property
    def settled(self) -> bool:
        """Whether the next call is only watched: no trial to run, its warm-up included (a trial compares
        calls of the same work, one against one)."""
        return not self._pending

    def _start_trial(self) -> None:
        self._pending = self._settings * self.trials  # alternating: drift hits all alike
        self._rounds = self.trials
        self._timed, self._shares = {}, []

    def _scores(self) -> dict[tuple[int | None, str | None], float]:
        """Each setting timed in this trial: its median time per unit."""
        return {setting: statistics.median(times) for setting, times in self._timed.items()}

    def _resolve(self, setting: tuple[int | None, str | None]) -> tuple[int | None, str | None]:
        """(n, "best"): the form timed fastest so far in this trial."""
        if setting[1] != "best":
            return setting
        scores = self._scores()
        return setting[0], min(scores, key=scores.get)[1]

    def _counts_best(self, scores) -> tuple[tuple | None, tuple | None]:
        """The fastest setting on one thread and the fastest on more (None where the trial has none)."""
        one = [s for s in scores if s[0] == 1]
        more = [s for s in scores if s[0] is not None and s[0] > 1]
        return (min(one, key=scores.get) if one else None), (min(more, key=scores.get) if more else None)

    def _best(self) -> tuple[int | None, str | None]:
        """The setting to keep: the fastest (one thread on a tie), except that more threads whose calls
        lacked their cores (the median share under SHARED: another process holds one) must beat one
        thread by MARGIN."""
        scores = self._scores()
        best = min(scores, key=scores.get)
        one, more = self._counts_best(scores)
        margin = MARGIN if self._lacked_cores() else 1.0
        if best == more and one is not None and scores[one] <= margin * scores[more]:
            return one
        return best

    def _lacked_cores(self) -> bool:
        """Whether this trial's median call on more threads had less than SHARED of its cores (another
        process holds one): False where it timed none."""
        return bool(self._shares) and statistics.median(self._shares) < SHARED

    def _close(self) -> bool:
        """Whether one thread and torch's count came out within CLEAR of each other, or the calls on
        more threads did not have their cores (SHARED): one call each does not settle it."""
        scores = self._scores()
        one, more = self._counts_best(scores)
        if one is None or more is None:
            return False
        fast, slow = sorted((scores[one], scores[more]))
        return slow < CLEAR * fast or min(self._shares, default=1.0) < SHARED

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
        best = self._best()
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
        scores = self._scores()
        lost_by = max(scores.values()) / max(scores[best], 1e-12)
        self._interval = min(int(self._interval * max(2.0, lost_by)), self.max_recheck) if kept else self.recheck
        self._since, self._reference = 0, None
        self._window.clear()
        self._window_shares.clear()
        one, more = self._counts_best(scores)
        other = more if best[0] == 1 else one
        self._rejected = scores[other] if n is not None and other is not None and other[0] != n else None
        # whether the trial's calls on more threads had their cores: only then is losing them a change
        self._had_cores = not self._lacked_cores()

    def run(self, fn: Callable[[], T], units: float | Callable[[T], float] = 1.0) -> T:
        """fn(), timed per unit when the setting is being chosen or watched; `units` a number, or a function
        of fn's result."""
        if not self._settings:
            return fn()

        if self._warm_up:  # on the trial's first setting's count: the first timed call does not switch
            self._warm_up -= 1
            if self.candidates and self._pending and self._pending[0][0] is not None:
                self._set(self._pending[0][0])
            return fn()

        if self._pending:
            self._pending[0] = self._resolve(self._pending[0])
            self._apply(self._pending[0])
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        per_unit = wall / max(units(out) if callable(units) else units, 1e-9)
        if self._pending:
            setting = self._pending.pop(0)
            self._timed.setdefault(setting, []).append(per_unit)
            if setting[0] is not None and setting[0] > 1 and wall > 0:
                self._shares.append(cpu / (wall * setting[0]))
            if not self._pending and self._rounds < ROUNDS and self._close():
                self._pending = list(self._settings) * (ROUNDS - self._rounds)  # too close to call on one each
                self._rounds = ROUNDS
            if not self._pending:
                self._choose()
            return out
        self._since += 1
        self._window.append(per_unit)
        n = self.count or 1
        if n > 1 and wall > 0:
            self._window_shares.append(cpu / (wall * n))
        full = len(self._window) == self.WINDOW
        if full:
            now = statistics.median(self._window)
            if self._reference is None:
                self._reference = now
            # `slack` times its own first calls, REJECTED times the count it beat, or calls on more threads
            # without the cores they had in the trial (another process took one): the machine changed
            if (now > self.slack * self._reference or (self._rejected is not None and now > REJECTED * self._rejected)
                    or (self._had_cores and len(self._window_shares) == self.WINDOW
                        and statistics.median(self._window_shares) < SHARED)):
                self._start_trial()
                return out
        if self._since >= self._interval and not self._cores_held():
            self._start_trial()
        return out

    def _cores_held(self) -> bool:
        """Whether the kept count is more than one thread and each of its last calls (up to WINDOW) had its
        cores (SHARED of them or more): nothing took a core, so the trial that chose this count needs no
        repeat on a schedule (a change shows in the shares, or as a slowdown)."""
        return bool(self._window_shares) and min(self._window_shares) >= SHARED

    def settle(self, fn: Callable[[], object], units: float = 1.0) -> int:
        """Run fn as often as the trial needs to choose (nothing when fixed); the count chosen."""
        while self._pending:
            self.run(fn, units)
        return self.threads
