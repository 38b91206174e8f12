"""One model, many requests: a queue of requests and the one thread that runs the model's decoder.

Every request becomes a `Job` (its api.serving.Request: prompts × n choices). The model's thread owns
the model's decoder (api.serving's Model.decoder, decoding/decoder.py): the decoder's scheduler admits
the jobs' rows fairly (round-robin across requests, and one row at once for a request with none
running), reads their prompts (at most `max_tokens` positions a round) and steps the running rows, and
the worker hands each event back to its job. Jobs that arrive while a prompt is read reach the decoder
between two reads (`_arrivals`). A job whose client has gone (`Job.cancel`) leaves at the next step.

`Timing` keeps the seconds of the rounds (prefill and step), and each request's wait in the queue
and to its first token (/health shows them): what a time to first token is made of.

The queue holds at most `max_queue` rows: a request that would go past it is refused at once
(`Busy`, the server's 503 with Retry-After), never queued. Results go back to the request's own
asyncio queue on the server's event loop. Other work (Worker.call: the page's readings) runs on the
same thread between two rounds, and gives the rows their share while it runs: at each of its pieces
(a chunk of a score, a pass of a fit) it calls `interlude`, which runs rounds for as long as its last
piece took, so a one-token completion waits one piece of a page's reading, not the whole of it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque


class Busy(Exception):
    """The queue is full."""


class Job:
    """One request, and the channel its results come back on: ("echo", i, Echo), ("token", i, Token),
    ("finish", i, reason, tail) per choice i, or ("error", exception)."""

    def __init__(self, request, loop: asyncio.AbstractEventLoop):
        self.request = request  # api.serving.Request
        self.choices = request.choices
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
    """The model's thread, its queue and its decoder."""

    def __init__(self, model, *, max_rows: int = 16, max_tokens: int = 4096, max_queue: int = 1024):
        self.model = model  # api.Model
        self.n_ctx = model.n_ctx
        self.max_rows, self.max_tokens, self.max_queue = max_rows, max_tokens, max_queue
        self.inbox: deque[Job] = deque()  # jobs not yet handed to the decoder
        self.arriving = 0  # their rows
        self.decoder = None  # the model thread's, made there
        self.calls: deque = deque()  # other work for the model's thread (Worker.call)
        self.cond = threading.Condition()
        self.batches = 0  # decoding rounds run (admission, reads and one step), and tokens generated (/health)
        self.generated = 0
        self.running = 0  # rows being read or running
        self.stopping = False
        self.busy = False  # the model's thread is running a round or a call
        self.timing = Timing()
        self.piece = 0.0  # time.perf_counter() when a call's current piece began (interlude)
        self.thread = threading.Thread(target=self._loop, name="lmhead-model", daemon=True)
        self.thread.start()

    @property
    def waiting(self) -> int:
        """Rows queued, not yet admitted (read from any thread: a count, not a promise)."""
        return self.arriving + (self.decoder.waiting if self.decoder is not None else 0)

    def submit(self, job: Job) -> None:
        """Queue the job's rows, or raise Busy when they would not all fit."""
        with self.cond:
            if self.waiting + len(self.calls) + job.choices > self.max_queue:
                raise Busy()
            if job.choices:
                job.submitted = time.perf_counter()
                self.inbox.append(job)
                self.arriving += job.choices
            self.cond.notify()

    async def call(self, fn):
        """fn() on the model's thread, between two rounds (the page's readings); its result or its exception.
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

    def _arrivals(self) -> list:
        """The jobs queued since the last look, for the decoder: (job, its request)."""
        with self.cond:
            jobs = list(self.inbox)
            self.inbox.clear()
            self.arriving = 0
        return [(job, job.request) for job in jobs]

    def _wait(self) -> list:
        """Waits while there is nothing to do; the next call waiting (one a round: the others stay in
        the queue, counted against max_queue until they start)."""
        with self.cond:
            while not self.inbox and not self.calls and not self.stopping and not (self.decoder and len(self.decoder)):
                self.cond.wait()
            return [self.calls.popleft()] if self.calls else []

    def _event(self, event) -> None:
        """A decoder's event to its job."""
        job = event.key
        if event.kind == "token":
            self.generated += 1
            if job.first is None:
                job.first = time.perf_counter()
                self.timing.first_token(job)
            job.put(("token", event.index, event.token))
        elif event.kind == "finish":
            job.put(("finish", event.index, "stop" if event.reason == "eos" else event.reason, event.tail))
        elif event.kind == "echo":
            job.put(("echo", event.index, event.echo))
        elif event.kind == "admit" and job.admitted is None:
            job.admitted = event.at

    def interlude(self) -> None:
        """Called by a call (the page's reading) at the end of each of its pieces, on the model's thread:
        the rows that wait or run get rounds for as long as that piece took (a fair share: half the
        model's time each while both have work), then the call goes on. Elsewhere, nothing."""
        if threading.current_thread() is not self.thread:
            return
        now = time.perf_counter()
        until = now + (now - self.piece)
        while self._has_rows() and time.perf_counter() < until and not self.stopping:
            self._round()
        self.piece = time.perf_counter()

    def _has_rows(self) -> bool:
        return bool((self.decoder is not None and len(self.decoder)) or self.inbox)

    def _loop(self) -> None:
        while not self.stopping:
            self.busy = False
            calls = self._wait()
            self.busy = True  # /health shows it: work no client waits for must not keep it so
            for call in calls:
                self.piece = time.perf_counter()
                call()
            if self._has_rows():
                self._round()

    def _round(self) -> None:
        """One decoder round: arrivals admitted, prompts read, one step; its events to their jobs."""
        if self.decoder is None:
            self.decoder = self.model.decoder(max_rows=self.max_rows, budget=self.max_tokens,
                                              arrivals=self._arrivals, cancelled=lambda job: job.cancelled)
        try:
            for event in self.decoder.round():
                self._event(event)
        except Exception as e:  # noqa: BLE001 - every job in flight hears of it, the thread goes on
            for job in self.decoder.drop():
                job.put(("error", e))
        self.running = self.decoder.rows
        self.timing.prefill_s, self.timing.step_s = self.decoder.prefill_s, self.decoder.step_s
        self.batches += 1
        self.timing.rounds += 1
