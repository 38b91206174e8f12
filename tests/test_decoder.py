"""decoding/decoder.py: decoding's one entry. Requests in, events out; its scheduler admits rows fairly
across requests and reads arriving prompts before the step. The rows of several requests each give
what they give alone (the batch's own tests: test_loop.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from helpers import PROMPT_IDS

import lmhead_cli
from lmhead_cli.decoding.decoder import SPARE, Decoder
from lmhead_cli.decoding.request import Request
from lmhead_cli.decoding.settings import make


def events(decoder: Decoder) -> dict:
    got: dict = {}
    for e in decoder.events():
        if e.kind == "echo":
            got.setdefault((e.key, e.index), []).append(("echo", e.echo.logprob[1:].tolist(), e.echo.top_ids[1:].tolist()))
        elif e.kind == "token":
            got.setdefault((e.key, e.index), []).append(("token", e.token.id, e.token.text, e.token.logprob,
                                                         e.token.top_ids))
        elif e.kind == "finish":
            got.setdefault((e.key, e.index), []).append(("finish", e.reason, e.tail))
    return got


REQUESTS = {
    "echo": Request.of(make(greedy=True, top_logprobs=2), [PROMPT_IDS], 3, echo=True),
    "sampled": Request.of(make(seed=5, n=2, top_logprobs=1, temperature=0.8, top_p=0.9), [(40, 1101, 257)], 9),
    "score": Request.of(make(greedy=True, top_logprobs=3), [tuple(range(300, 340))], 0, echo=True),
    "stop": Request.of(make(greedy=True, stop=[" "], logprobs="processed", top_k=40), [PROMPT_IDS[:2]], 6),
    "two prompts": Request.of(make(seed=9), [(464,), (40, 1101)], [12, 4]),
}


def test_the_rows_of_several_requests_each_give_what_they_give_alone(tiny):
    """Requests submitted together (one prompt echoed, n choices drawn with seed + j, a prompt only scored,
    a stop string, two prompts), on a decoder of 3 rows a step: each choice's events are those it has alone."""
    import pytest as _pytest

    model = lmhead_cli.load(str(tiny[0]), device="cpu")
    together = Decoder(model.loaded, max_rows=3)
    for key, request in REQUESTS.items():
        together.submit(key, request)
    got = events(together)
    assert sorted(got) == sorted((k, i) for k, r in REQUESTS.items() for i in range(r.choices))
    for key, request in REQUESTS.items():
        alone = Decoder(model.loaded)
        alone.submit(key, request)
        for (k, i), want in events(alone).items():
            for a, t in zip(want, got[(k, i)], strict=True):
                assert t[0] == a[0]
                if a[0] == "echo":
                    assert t[2] == a[2] and t[1] == _pytest.approx(a[1], abs=1e-5)
                elif a[0] == "token":
                    assert (t[1], t[2], t[4]) == (a[1], a[2], a[4]) and t[3] == _pytest.approx(a[3], abs=1e-5)
                else:
                    assert t == a


@pytest.mark.parametrize("n", [8, 24])
def test_a_one_row_request_beside_many_steps_every_round_and_rounds_hold_max_rows(tiny, n):
    """A request of n choices fills the 4 rows a round takes (max_rows); a one-row request that comes
    after joins at once (beyond them) and then steps every round, in rounds that run at most 4 rows
    through the engine whatever n is (the n-choice request's half of them, 2, beside its one): its cost
    per token is 3 rows', not 4 + 1 (or more, with more newcomers). Every choice gives what it gives alone, the rows that waited too (their empty cache
    columns dropped when their cache is rebuilt: compact_cache). Mutant: every row steps every round
    (the engine runs 5 rows a round while the one-row request runs)."""
    model = lmhead_cli.load(str(tiny[0]), device="cpu")
    eng = model.loaded.engine
    ran: list[int] = []
    compacted: list[int] = []
    step_logits, compact = eng.step_logits, eng.compact_cache
    eng.step_logits = lambda ids, *a, **kw: (ran.append(ids.shape[0]), step_logits(ids, *a, **kw))[1]
    eng.compact_cache = lambda cache, keep, n: (compacted.append(keep.shape[0]), compact(cache, keep, n))[1]
    many = Request.of(make(seed=3, n=n, temperature=0.8, top_logprobs=1), [PROMPT_IDS], 12)
    one = Request.of(make(greedy=True, top_logprobs=2), [(40, 1101)], 6)
    d = Decoder(model.loaded, max_rows=4)
    d.submit("many", many)
    got: dict = {}
    rounds: list[tuple[int, bool]] = []  # per round: rows the engine ran, whether "one" had a token
    for r in range(200):
        if r == 1:
            d.submit("one", one)
        ran.clear()
        evs = list(d.round())
        for e in evs:
            if e.kind == "token":
                got.setdefault((e.key, e.index), []).append((e.token.id, e.token.logprob, e.token.top_ids))
        rounds.append((sum(ran), any(e.key == "one" and e.kind == "token" for e in evs)))
        if not len(d):
            break
    del eng.step_logits, eng.compact_cache
    assert compacted
    with_one = [i for i, (_, token) in enumerate(rounds) if token]
    assert with_one == list(range(1, 7))  # its first token at its read, then one a round: 6 rounds
    assert all(rows <= 3 for rows, _ in rounds[1:7])
    for key, request in (("many", many), ("one", one)):
        alone = Decoder(model.loaded)
        alone.submit(key, request)
        want: dict = {}
        for e in alone.events():
            if e.kind == "token":
                want.setdefault((e.key, e.index), []).append((e.token.id, e.token.logprob, e.token.top_ids))
        for k, tokens in want.items():
            assert [(i, t) for i, _, t in got[k]] == [(i, t) for i, _, t in tokens]
            assert [lp for _, lp, _ in got[k]] == pytest.approx([lp for _, lp, _ in tokens], abs=1e-5)


def test_turns_go_one_row_of_each_request_in_turn_and_the_rows_that_step_lie_together():
    """While the batch holds more than max_rows rows, each request steps at most its equal part of
    max_rows a round (at least one row), its latest rows first, so the rows that wait are the earliest
    ones (the rows that step are one run of the cache); with more requests than max_rows, one row of each."""
    d = Decoder(STUB, max_rows=4)
    row = lambda key, i: SimpleNamespace(key=(key, i))  # noqa: E731
    d.batch = SimpleNamespace(live=[row("a", i) for i in range(6)] + [row("b", 0), row("c", 0)])
    assert d._turns() == {("a", 5), ("b", 0), ("c", 0)}
    d.batch.live = [row("a", i) for i in range(3)] + [row("b", i) for i in range(3)]
    assert d._turns() == {("a", 1), ("a", 2), ("b", 1), ("b", 2)}
    d.batch.live = [row("a", i) for i in range(4)] + [row("b", 0)]
    assert d._turns() == {("a", 2), ("a", 3), ("b", 0)}  # a one-row request beside 4: 2 + 1 rows a round
    d.batch.live = [row(k, 0) for k in "abcdef"]
    assert d._turns() is None or len(d._turns()) == 6  # more requests than max_rows: each steps
    d.batch.live = d.batch.live[:4]
    assert d._turns() is None  # no more rows than max_rows: every row


# ---- the scheduler, on a batch that logs what it is asked to do -------------------------------------

class _Batch:
    """A batch for the scheduler's tests: `prefill` reads every queued row (one position each; the first
    read waits for `gate` when one is given), `step` ends every running row."""

    def __init__(self, log: list, gate: threading.Event | None = None, entered: threading.Event | None = None):
        self.log, self.gate, self.entered = log, gate, entered
        self.queued, self.live, self.chunk = [], [], None

    def add(self, key, row):
        self.queued = self.queued + [(key, row)]

    def __len__(self):
        return len(self.queued) + len(self.live)

    def prefill(self, sink, budget=None):
        read, self.queued = self.queued, []
        self.log.append(("prefill", [row for _, row in read]))
        if self.entered is not None and not self.entered.is_set():
            self.entered.set()
            self.gate.wait(10)
        self.live = self.live + [SimpleNamespace(key=key, row=row) for key, row in read]
        for key, _ in read:
            sink.token(key, None)
        return len(read)

    def step(self, sink, turn=None, ahead=1):
        self.log.append(("step", [r.row for r in self.live]))
        for r in self.live:
            sink.finish(r.key, "length", "")
        self.live = []
        return 1


class _Request:
    """A request of rows named by strings."""

    settings = SimpleNamespace(mode="sample")

    def __init__(self, *names):
        self.names = list(names)
        self.choices = len(names)

    def rows(self):
        return self.names


STUB = SimpleNamespace(execution=SimpleNamespace(scope=contextlib.nullcontext, run=lambda f, units=1: f(),
                                                 row_kernel=lambda: None, settled=True),
                       engine=SimpleNamespace(vocab_size=8))


def _decoder(log, **kw) -> Decoder:
    d = Decoder(STUB, **kw)
    d.batch = _Batch(log)
    return d


def test_a_request_with_no_row_running_joins_a_full_batch_at_once():
    """Two rows a step: a request of 8 choices fills both; a 1-row request that comes next joins at the
    next round, beyond the two (SPARE), where the 8's other rows wait for free rows, one of each request
    in turn. Mutant: admission only below max_rows (the 1-row request waits for the 8 to finish)."""
    log: list = []
    d = _decoder(log, max_rows=2)
    d.batch.step = lambda sink, turn=None, ahead=1: None  # nothing ends: rows stay running
    d.submit("many", _Request(*[f"m{i}" for i in range(8)]))
    list(d.round())
    assert log == [("prefill", ["m0", "m1"])] and d.waiting == 6
    d.submit("one", _Request("o"))
    d.submit("two", _Request("t0", "t1"))
    list(d.round())
    # each newcomer gets one row beyond the full batch; its second row waits like the 8's
    assert log[-1] == ("prefill", ["o", "t0"]) and d.rows == 4 <= SPARE * 2 and d.waiting == 7


def test_rows_beyond_max_rows_are_bounded():
    log: list = []
    d = _decoder(log, max_rows=1)
    d.batch.step = lambda sink, turn=None, ahead=1: None
    for k in range(5):
        d.submit(k, _Request(f"r{k}"))
    list(d.round())
    assert d.rows == SPARE * 1 and d.waiting == 3  # one over max_rows at most, whoever waits


@pytest.mark.parametrize("budget, calls", [
    (4096, [("prefill", ["a"]), ("prefill", ["b"]), ("step", ["a", "b"])]),
    (1, [("prefill", ["a"]), ("step", ["a"]), ("prefill", ["b"]), ("step", ["b"])])])
def test_a_prompt_that_arrives_while_one_is_read_is_read_before_the_step(budget, calls):
    """Prefill before the step: a request that arrives while another's prompt is read is read in the same
    round, before the running rows step, while the round's prompt positions (budget) last; past them the
    step comes first."""
    log: list = []
    arriving = [[], [("b", _Request("b"))]]
    d = Decoder(STUB, max_rows=16, budget=budget, arrivals=lambda: arriving.pop(0) if arriving else [])
    d.batch = _Batch(log)
    d.submit("a", _Request("a"))
    for _ in range(3):
        list(d.round())
    assert log == calls


def test_the_worker_clock_counts_the_wait_and_the_first_token():
    """serve/worker.py on the decoder: a request queued while another's prompt is read waits in the queue
    through that read, and each first token comes after its wait; a request's read counts after its
    admission (Event.at), not in its wait."""
    from lmhead_cli.serve.worker import Job, Worker

    log: list = []
    entered, gate = threading.Event(), threading.Event()

    class Model:
        n_ctx = 16

        def decoder(self, **kw):
            d = Decoder(STUB, **kw)
            d.batch = _Batch(log, gate, entered)
            return d

    loop = asyncio.new_event_loop()
    worker = Worker(Model())
    try:
        worker.submit(Job(_Request("a"), loop))
        assert entered.wait(10)
        worker.submit(Job(_Request("b"), loop))  # queued while a's prompt is read
        time.sleep(0.2)
        gate.set()
        deadline = time.monotonic() + 10
        while worker.timing.firsts < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        t = worker.timing
        assert log[:2] == [("prefill", ["a"]), ("prefill", ["b"])] and log[2][0] == "step"
        assert t.firsts == 2 and 0.2 <= t.queue_s <= t.first_token_s
        assert t.queue_s <= t.first_token_s - 0.2  # a's read (0.2 s) was after its admission, not in the queue
        assert t.prefill_s >= 0.2 and t.step_s >= 0
    finally:
        worker.stop()
        loop.close()


@pytest.mark.parametrize("settled", [True, False])
def test_a_decoder_runs_ahead_only_where_no_request_can_join_and_the_threads_are_chosen(tiny, settled, monkeypatch):
    """`decode` (one call's requests: no other can arrive) lets a lone greedy row run AHEAD positions a
    round; the decoder the server drives (arrivals, cancellations) steps one position a round, so a
    request that arrives joins at the next step; and no round runs ahead while the thread count's trial
    is under way (not `settled`: a trial compares one step with one step). Mutants: AHEAD ignored; a
    run ahead for the server; during a trial."""
    from dataclasses import replace

    from lmhead_cli.decoding import decoder as decoding

    model = lmhead_cli.load(str(tiny[0]), device="cpu")
    loaded = replace(model.loaded, execution=SimpleNamespace(run=lambda f, units=1: f(), settled=settled,
                                                             row_kernel=lambda: None))
    made = []
    monkeypatch.setattr(decoding, "Decoder", lambda *a, **k: made.append(Decoder(*a, **k)) or made[-1])
    decoding.decode(loaded, [])
    monkeypatch.setattr(model, "loaded", loaded)
    server = model.decoder(max_rows=4, arrivals=lambda: [], cancelled=lambda key: False)
    for d, want in ((made[0], decoding.AHEAD if settled else 1), (server, 1)):
        asked = []
        d.batch = _Batch([])
        d.batch.step = lambda sink, turn=None, ahead=1: asked.append(ahead) or 0
        d.batch.live = [SimpleNamespace(key=(0, 0))]
        list(d.round())
        assert asked == [want]
