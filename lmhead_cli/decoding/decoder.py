"""The decoder: decoding's one component with one entry. Requests in (checked Settings and prompts:
decoding/request.py), events out (each token with its record, each choice's finish).

The roles are vLLM v1's. The scheduler (`Decoder._admit` and `_turns`, here) turns requests into rows
and decides which rows join the running batch before each step, and which of them step; the batch
(decoding/batch.py) owns the step; a caller sees only `Request` and `Event`. `generate_many` (one call's prompts and choices), explore's
`:gen` (through it) and the server's worker are its callers: they submit requests and read events,
round after round, and never see a row, a batch or a step.

The scheduler is fair across requests. Before each step it admits waiting rows while the batch holds
fewer than `max_rows`, round-robin across the requests that wait (one row of each in turn), so a
request with many choices never holds a one-row request behind all of its rows. And a request with no
row running yet is admitted one row even when the batch is full, up to `SPARE` × `max_rows` rows: a
newcomer never waits for another request's rows to finish. Rows then take turns (`_turns`): while the
batch holds more than `max_rows` rows, each request steps at most its equal part of `max_rows` a
round, so a one-row request beside one of many steps every round, in steps of about half the rows,
and a request alone runs all of its rows every step. Admitted prompts are read before the step, at most
`budget` positions a round (a long prompt is read over several rounds while the running rows go on);
requests that arrive while a prompt is read (`arrivals`) are admitted and read in the same round while
the budget lasts, so a new request's first token never waits behind a step it did not need. Each
joined row hands out its first token at once, from its prompt's logits.

One thread drives a decoder; `arrivals` and `cancelled` are how other threads reach it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterator

from lmhead_cli.decoding.batch import Batch
from lmhead_cli.decoding.request import Event, Request

SPARE = 2  # rows a full batch may grow to, in multiples of max_rows, for requests with no row running
# Positions a lone plain greedy row runs in one engine call (Batch.step's `ahead`) where no request can
# join it (`decode`: one call's requests): its tokens then come AHEAD at a time.
AHEAD = 8


class Decoder:
    """Requests' rows, scheduled fairly into one running batch, a round (reads, then one step) at a time."""

    def __init__(self, loaded, *, max_rows: int | None = None, budget: int | None = None, chunk: int | None = None,
                 arrivals: Callable[[], list[tuple[object, Request]]] | None = None,
                 cancelled: Callable[[object], bool] | None = None, ahead: int = 1):
        """max_rows: rows the batch takes (None: every row at once, one call's choices); budget: prompt
        positions read per round (None: all); chunk: echo's head chunk; arrivals(): requests that came
        meanwhile, as (key, Request); cancelled(key): whether a request's caller has gone; ahead: positions
        a plain greedy row alone in the batch may run in one round (Batch.step), while the thread count
        is not being timed (its trials compare one step with one step)."""
        self.loaded, self.batch = loaded, Batch(loaded, chunk)
        self.max_rows, self.budget, self.ahead = max_rows, budget, ahead
        self.arrivals = arrivals or (lambda: [])
        self.gone = cancelled or (lambda key: False)
        self.queue: deque[list] = deque()  # [key, rows, next row] of each request with rows not admitted, in turn
        self.waiting = 0  # rows submitted, not yet admitted
        self.running: dict = {}  # key -> its rows admitted and not finished
        self.out: list[Event] = []
        self.searches: list[tuple] = []  # (key, prompt index, decoding.beams.BeamSearch) of beam requests
        self.prefill_s = self.step_s = 0.0  # seconds reading prompts and stepping (the server's /health)

    def submit(self, key, request: Request) -> None:
        """Queue a request's rows (one per choice); they are admitted at the next round. A beam request's
        prompts each start a search (a group of rows of its own) at the next round."""
        if request.settings.mode == "beam":
            from lmhead_cli.decoding.beams import BeamSearch

            s = request.settings
            for i, (ids, max_new) in enumerate(zip(request.prompts, request.max_tokens)):
                stop_at = None if s.ignore_eos else request.eos
                self.searches.append((key, i, BeamSearch(self.loaded, list(ids), s, max_new, stop_at)))
            return
        rows = request.rows()
        if rows:
            self.queue.append([key, rows, 0])
            self.waiting += len(rows)

    def __len__(self) -> int:
        """Rows waiting, being read or running (a beam search counts one)."""
        return self.waiting + len(self.batch) + len(self.searches)

    @property
    def rows(self) -> int:
        """Rows admitted: being read or running."""
        return len(self.batch)

    def events(self) -> Iterator[Event]:
        """Every event of the requests submitted (and arriving), round after round, until none is left."""
        self._take()
        while len(self):
            yield from self.round()
            self._take()

    def round(self) -> Iterator[Event]:
        """One round: waiting rows admitted and their prompts read (their first tokens out at once), then
        one step of the running rows whose turn it is (`_turns`). Events come as they are made."""
        self._take()
        admitted = self._admit()
        if admitted or self.batch.queued:
            start = time.perf_counter()
            self._read(admitted)
            self.prefill_s += time.perf_counter() - start
            yield from self._drain()
        if self.batch.live:
            start = time.perf_counter()
            batch, turn, execution = self.batch, self._turns(), self.loaded.execution
            ahead = self.ahead if execution.settled else 1
            execution.run(lambda: batch.step(self, turn, ahead), units=lambda ran: max(ran, 1))
            self.step_s += time.perf_counter() - start
            for key in [k for k in self.running if self.gone(k)]:  # their rows left at this step
                del self.running[key]
            yield from self._drain()
        if self.searches:
            yield from self._search()

    def _search(self) -> Iterator[Event]:
        """One step of each beam search (the first: its prompt read, untimed), a finish for each that ends."""
        going = []
        for key, i, search in self.searches:
            if self.gone(key):
                continue
            start = time.perf_counter()
            if not search.started:
                with self.loaded.execution.scope():
                    search.start()
                self.prefill_s += time.perf_counter() - start
            else:
                self.loaded.execution.run(search.step, units=max(len(search.rows), 1))
                self.step_s += time.perf_counter() - start
            if search.done:
                yield Event(key, i, "finish", reason=search.stop, search=search)
            else:
                going.append((key, i, search))
        self.searches = going

    def drop(self) -> list:
        """After a round that failed: every request in flight or waiting (their keys), all dropped."""
        keys = list(dict.fromkeys([k for k in self.running] + [e[0] for e in self.queue] + [k for k, _, _ in self.searches]))
        self.batch = Batch(self.loaded, self.batch.chunk)
        self.queue.clear()
        self.searches = []
        self.running.clear()
        self.waiting, self.out = 0, []
        return keys

    # ---- the scheduler ----------------------------------------------------------------------------

    def _take(self) -> None:
        for key, request in self.arrivals():
            self.submit(key, request)

    def _admit(self) -> list[tuple[object, int, object]]:
        """Waiting rows that join now, round-robin across requests: while the batch has fewer than
        max_rows, and one row of a request with none running up to SPARE × max_rows."""
        admitted = []
        rows = len(self.batch)
        moved = True
        while self.queue and moved:
            moved = False
            for _ in range(len(self.queue)):
                entry = self.queue.popleft()
                key, reqrows, i = entry
                if self.gone(key):
                    self.waiting -= len(reqrows) - i
                    continue
                if self.max_rows is not None and not (
                        rows < self.max_rows or (not self.running.get(key) and rows < SPARE * self.max_rows)):
                    self.queue.append(entry)
                    continue
                admitted.append((key, i, reqrows[i]))
                self.running[key] = self.running.get(key, 0) + 1
                self.waiting -= 1
                rows += 1
                moved = True
                if i + 1 < len(reqrows):
                    entry[2] = i + 1
                    self.queue.append(entry)
        return admitted

    def _turns(self) -> set | None:
        """The keys of the rows that step this round (None: every row). While the batch holds more than
        max_rows rows, each request steps at most its equal part of max_rows (max_rows // requests, at
        least one row): a request of one row steps every round beside one of many, in rounds that cost
        about half of a full one (measured on random:gpt2, a 32-token request beside 16 sampled choices:
        2.5-2.7x its time alone where every row stepping gave 4.6-5.4x). A request's latest rows step
        first, so the rows that wait are its earliest and the rows that step lie together in the cache
        (one run, a compiled step's call: Engine.step_rows)."""
        live = self.batch.live
        if self.max_rows is None or len(live) <= self.max_rows:
            return None
        rows: dict = {}
        for r in reversed(live):  # each request's rows, its latest first; requests by their latest row, last first
            rows.setdefault(r.key[0], []).append(r.key)
        share = max(self.max_rows // len(rows), 1)  # each request's equal part of a round's rows
        return {k for keys in rows.values() for k in keys[:share]}

    def _read(self, admitted: list) -> None:
        """The admitted rows join the batch, their prompts read before the step: with them the rows of
        requests that arrive meanwhile, while the round's `budget` positions last."""
        left = self.budget
        with self.loaded.execution.scope():  # untimed: the thread count is chosen on the steps
            while True:
                now = time.perf_counter()
                for key, i, row in admitted:
                    self.out.append(Event(key, i, "admit", at=now))
                    self.batch.add((key, i), row)
                if not self.batch.queued:
                    break
                read = self.batch.prefill(self, left)
                if left is not None:
                    left -= read
                    if left <= 0:
                        break
                self._take()
                admitted = self._admit()
                if not admitted:
                    break

    def _drain(self) -> Iterator[Event]:
        out, self.out = self.out, []
        yield from out

    # ---- decoding.rows.Sink: the batch's results as events -----------------------------------------

    def echo(self, key, echo) -> None:
        self.out.append(Event(key[0], key[1], "echo", echo=echo))

    def token(self, key, token) -> None:
        self.out.append(Event(key[0], key[1], "token", token=token))

    def finish(self, key, reason: str, tail: str) -> None:
        left = self.running.get(key[0], 0) - 1
        if left > 0:
            self.running[key[0]] = left
        else:
            self.running.pop(key[0], None)
        self.out.append(Event(key[0], key[1], "finish", reason=reason, tail=tail))

    def cancelled(self, key) -> bool:
        return self.gone(key[0])


def decode(loaded, requests: list[Request]) -> Iterator[Event]:
    """Every event of `requests` (keys 0 … len - 1), all rows at once: one call's prompts and choices (no
    other request can join, so a lone greedy row runs AHEAD positions a round)."""
    decoder = Decoder(loaded, ahead=AHEAD)
    for key, request in enumerate(requests):
        decoder.submit(key, request)
    return decoder.events()
