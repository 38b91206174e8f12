"""One model, many requests: a queue of rows and the one thread that runs them in batches.

Every request becomes a `Job` of rows (one per choice) queued in arrival order. The model's
thread takes the first queued row and then, in queue order, every other that fits one batch (at
most `max_rows` rows, at most `max_tokens` padded prompt tokens, padding at most a quarter more than
the real tokens, and the longest prompt plus the largest max_tokens within the context) and
runs them with Model.complete (readings/completion.py): one forward for the batch's prompts, then one per step for
the rows that generate. A batch runs to its end; rows queued meanwhile go in the next one.

The queue holds at most `max_queue` rows: a request that would go past it is refused at once
(`Busy`, the server's 503 with Retry-After), never queued. A job whose client has gone is
cancelled: its queued rows are skipped and its running rows leave their batch at the next step.
Results go back to the request's own asyncio queue on the server's event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from lmhead_cli.api.serving import Echo, Row, Token


# A batch's padded prompt tokens stay within this many times its real ones: on a CPU a padded position
# costs as much as a real one, and prompts of mixed lengths padded to the longest waste work.
PADDING = 1.25


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

    def put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: the server is stopping
            self.cancelled = True

    def cancel(self) -> None:
        self.cancelled = True


class _BatchSink:
    """readings.completion's Sink for a batch: batch row b is row i of job j."""

    def __init__(self, batch: list[tuple[Job, int]], worker: Worker):
        self.batch, self.worker = batch, worker

    def echo(self, b: int, echo: Echo) -> None:
        job, i = self.batch[b]
        job.put(("echo", i, echo))

    def token(self, b: int, token: Token) -> None:
        job, i = self.batch[b]
        self.worker.generated += 1
        job.put(("token", i, token))

    def finish(self, b: int, reason: str, tail: str) -> None:
        job, i = self.batch[b]
        job.put(("finish", i, reason, tail))

    def cancelled(self, b: int) -> bool:
        return self.batch[b][0].cancelled


class Worker:
    """The model's thread and its queue."""

    def __init__(self, model, *, max_rows: int = 16, max_tokens: int = 4096, max_queue: int = 1024):
        self.model = model  # api.Model
        self.n_ctx = model.n_ctx
        self.max_rows, self.max_tokens, self.max_queue = max_rows, max_tokens, max_queue
        self.pending: deque[tuple[Job, int]] = deque()
        self.calls: deque = deque()  # other work for the model's thread (Worker.call)
        self.cond = threading.Condition()
        self.batches = 0  # how many batches have run, and tokens generated (/health shows both)
        self.generated = 0
        self.stopping = False
        self.busy = False  # the model's thread is running a batch or a call
        self.thread = threading.Thread(target=self._loop, name="lmhead-model", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue the job's rows, or raise Busy when they would not all fit."""
        with self.cond:
            if len(self.pending) + len(self.calls) + len(job.rows) > self.max_queue:
                raise Busy()
            self.pending.extend((job, i) for i in range(len(job.rows)))
            self.cond.notify()

    async def call(self, fn):
        """fn() on the model's thread, between batches (the page's readings); its result or its exception.
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
            if len(self.pending) + len(self.calls) >= self.max_queue:
                raise Busy()
            self.calls.append(task)
            self.cond.notify()
        return await future

    @property
    def queued(self) -> int:
        return len(self.pending) + len(self.calls)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def _take(self):
        """The next batch: queued rows in order, while they fit (the first always does); or a call."""
        with self.cond:
            while not self.pending and not self.calls and not self.stopping:
                self.cond.wait()
            if self.calls:
                return self.calls.popleft()
            batch: list[tuple[Job, int]] = []
            longest = steps = real = 0
            kept: deque[tuple[Job, int]] = deque()  # rows passed over, back to the queue in order
            while self.pending:
                job, i = self.pending.popleft()
                if job.cancelled:
                    continue
                row = job.rows[i]
                t, s = max(longest, len(row.ids)), max(steps, row.max_tokens)
                if batch and (len(batch) >= self.max_rows or t * (len(batch) + 1) > self.max_tokens
                              or t + s > self.n_ctx or t * (len(batch) + 1) > PADDING * (real + len(row.ids))):
                    kept.append((job, i))  # a later row may fit (a prompt of another length)
                    continue
                batch.append((job, i))
                longest, steps, real = t, s, real + len(row.ids)
            self.pending = kept
            return batch

    def _loop(self) -> None:
        while not self.stopping:
            self.busy = False
            batch = self._take()
            self.busy = True  # /health shows it: work no client waits for must not keep it so
            if callable(batch):
                batch()
                continue
            if not batch:
                continue
            try:
                self.model.complete([job.rows[i] for job, i in batch], _BatchSink(batch, self))
            except Exception as e:  # noqa: BLE001 - every job of the batch hears of it, the thread goes on
                for job in {id(job): job for job, _ in batch}.values():
                    job.put(("error", e))
            self.batches += 1
