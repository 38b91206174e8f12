"""One model, many requests: a queue of rows and the one thread that runs them, a step at a time.

Every request becomes a `Job` of rows (one per choice). The model's thread keeps one running batch
(decoding/batch.py through Model.decoding_batch) and, between two decoding steps, admits queued rows
into it while it has fewer than `max_rows`: round-robin across the jobs that wait (one row of each in
turn), so a request with many choices never holds a one-row request behind all of its rows. An
admitted prompt is prefilled alone, at most `max_tokens` prompt positions per round between two
steps (a long prompt is read over several rounds while the running rows go on); its rows then join
the batch, and each hands out its first token at once, from its prompt's logits. Prefills come
before the step (as vLLM's scheduler and llama.cpp's server slots have it): rows that arrive while a
prompt is being read are admitted and read in the same round, before the running rows step, while
the round's `max_tokens` positions last, so a new request's first token never waits behind a step
it did not need. A row that finishes, or whose client has gone (a cancelled job), leaves at the next
step.

`Timing` keeps the seconds of the rounds (prefill and step), and each request's wait in the queue
and to its first token (/health shows them): what a time to first token is made of.

The queue holds at most `max_queue` rows: a request that would go past it is refused at once
(`Busy`, the server's 503 with Retry-After), never queued. Results go back to the request's own
asyncio queue on the server's event loop. Other work (Worker.call: the page's readings) runs on the
same thread between two steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from lmhead_cli.api.serving import Echo, Row, Token


class Busy(Exception):
    """The queue is full."""


class Job:
    """One request's rows, and the channel their results come back on: ("echo", i, Echo),
    ("token", i, Token), ("finish", i, reason, tail) per row i, or ("error", exception)."""

    def __init__(self, rows: list[Row], loop: asyncio.AbstractEventLoop):
        self.rows = rows
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.submitted: float | None = None  # time.perf_counter() when queued, when its first row was
        self.admitted: float | None = None  # admitted, and when its first token came
        self.first: float | None = None

    def put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: the server is stopping
            self.cancelled = True

    def cancel(self) -> None:
        self.cancelled = True


class _Sink:
    """decoding.rows.Sink for the running batch: a row's key is (job, i), row i of the job."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def echo(self, key, echo: Echo) -> None:
        key[0].put(("echo", key[1], echo))

    def token(self, key, token: Token) -> None:
        self.worker.generated += 1
        job = key[0]
        if job.first is None:
            job.first = time.perf_counter()
            self.worker.timing.first_token(job)
        job.put(("token", key[1], token))

    def finish(self, key, reason: str, tail: str) -> None:
        key[0].put(("finish", key[1], "stop" if reason == "eos" else reason, tail))

    def cancelled(self, key) -> bool:
        return key[0].cancelled


class Timing:
    """Where the model's thread spends its time, and what a request waits, as running sums (/health):
    rounds, seconds reading prompts (`prefill_s`) and stepping (`step_s`); requests that have had a
    first token (`firsts`), their seconds in the queue until their first row was admitted (`queue_s`)
    and until their first token (`first_token_s`). Differences of two readings give a stretch's means."""

    def __init__(self):
        self.rounds = 0
        self.prefill_s = self.step_s = 0.0
        self.firsts = 0
        self.queue_s = self.first_token_s = 0.0

    def first_token(self, job: Job) -> None:
        self.firsts += 1
        self.queue_s += (job.admitted or job.first) - job.submitted
        self.first_token_s += job.first - job.submitted

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "prefill_s": round(self.prefill_s, 6), "step_s": round(self.step_s, 6),
                "firsts": self.firsts, "queue_s": round(self.queue_s, 6),
                "first_token_s": round(self.first_token_s, 6)}


class Worker:
    """The model's thread, its queue and its running batch."""

    def __init__(self, model, *, max_rows: int = 16, max_tokens: int = 4096, max_queue: int = 1024):
        self.model = model  # api.Model
        self.n_ctx = model.n_ctx
        self.max_rows, self.max_tokens, self.max_queue = max_rows, max_tokens, max_queue
        self.jobs: deque[list] = deque()  # [job, next row] of each job with rows not yet admitted, in turn
        self.waiting = 0  # rows queued, not yet admitted
        self.calls: deque = deque()  # other work for the model's thread (Worker.call)
        self.cond = threading.Condition()
        self.batches = 0  # decoding rounds run (admission and one step), and tokens generated (/health)
        self.generated = 0
        self.running = 0  # rows in the running batch
        self.stopping = False
        self.busy = False  # the model's thread is running a batch or a call
        self.timing = Timing()
        self.thread = threading.Thread(target=self._loop, name="lmhead-model", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue the job's rows, or raise Busy when they would not all fit."""
        with self.cond:
            if self.waiting + len(self.calls) + len(job.rows) > self.max_queue:
                raise Busy()
            if job.rows:
                job.submitted = time.perf_counter()
                self.jobs.append([job, 0])
                self.waiting += len(job.rows)
            self.cond.notify()

    async def call(self, fn):
        """fn() on the model's thread, between two steps (the page's readings); its result or its exception.
        It waits in the same queue as the rows, and counts against max_queue (Busy past it)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(ok: bool, value) -> None:
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        def task() -> None:
            try:
                value, ok = fn(), True
            except Exception as e:  # noqa: BLE001 - handed to the caller
                value, ok = e, False
            loop.call_soon_threadsafe(done, ok, value)

        with self.cond:
            if self.waiting + len(self.calls) >= self.max_queue:
                raise Busy()
            self.calls.append(task)
            self.cond.notify()
        return await future

    @property
    def queued(self) -> int:
        """Rows waiting to be admitted, and calls waiting to run."""
        return self.waiting + len(self.calls)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def _admit(self, free: int, wait: bool = True) -> tuple[list, list]:
        """Up to `free` queued rows, one per job in turn (round-robin), and the next call waiting; with
        `wait`, waits while there is nothing to do and no row runs (without, no call is taken)."""
        with self.cond:
            while wait and not self.jobs and not self.calls and not self.stopping and not self.running:
                self.cond.wait()
            # one call a round: the others stay in the queue, counted against max_queue until they start
            calls = [self.calls.popleft()] if self.calls and wait else []
            rows = []
            now = time.perf_counter()
            while self.jobs and len(rows) < free:
                entry = self.jobs.popleft()
                job, i = entry
                if job.cancelled:
                    self.waiting -= len(job.rows) - i
                    continue
                rows.append((job, i))
                if job.admitted is None:
                    job.admitted = now
                self.waiting -= 1
                if i + 1 < len(job.rows):
                    entry[1] = i + 1
                    self.jobs.append(entry)
            return rows, calls

    def _prefill(self, batch, sink, admitted: list) -> None:
        """The admitted rows join the batch, their prompts read before the step: with them any rows
        that arrive meanwhile, while the round's `max_tokens` positions last and the batch has room."""
        budget = self.max_tokens
        start = time.perf_counter()
        while True:
            for job, i in admitted:
                batch.add((job, i), job.rows[i])
            if not batch.queued:
                break
            budget -= self.model.prefill(batch, sink, budget)
            if budget <= 0:
                break
            admitted, _ = self._admit(self.max_rows - len(batch), wait=False)
            if not admitted:
                break
        self.timing.prefill_s += time.perf_counter() - start

    def _loop(self) -> None:
        batch, sink = None, _Sink(self)
        while not self.stopping:
            self.busy = False
            admitted, calls = self._admit(self.max_rows - (len(batch) if batch is not None else 0))
            self.busy = True  # /health shows it: work no client waits for must not keep it so
            for call in calls:
                call()
            if batch is None and (admitted or self.running):
                batch = self.model.decoding_batch()
            if batch is None or not (admitted or len(batch)):
                continue
            try:
                if admitted or batch.queued:
                    self._prefill(batch, sink, admitted)
                if len(batch.live):
                    start = time.perf_counter()
                    self.model.step(batch, sink)
                    self.timing.step_s += time.perf_counter() - start
            except Exception as e:  # noqa: BLE001 - every job in the batch hears of it, the thread goes on
                for job in {id(job): job for job, _ in batch.keys()}.values():
                    job.put(("error", e))
                batch = None
            self.running = len(batch) if batch is not None else 0
            self.batches += 1
            self.timing.rounds += 1
