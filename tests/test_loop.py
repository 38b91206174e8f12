"""decoding/batch.py: the one batched step loop. Rows join a running batch between two steps and leave
it at once; each row computes what it computes alone (transformers' generate() for greedy rows), up
to float rounding of a padded batch."""

from __future__ import annotations

import pytest
import torch

from helpers import PROMPT_IDS

import lmhead_cli
from lmhead_cli.decoding.batch import Batch
from lmhead_cli.decoding.rows import Row
from lmhead_cli.decoding.stages import Knobs


class Sink:
    """Every event by key; `cancel` marks keys whose caller has gone."""

    def __init__(self):
        self.got: dict = {}
        self.cancel: set = set()

    def echo(self, key, echo):
        self.got.setdefault(key, []).append(("echo", echo.logprob[1:].tolist()))

    def token(self, key, t):
        self.got.setdefault(key, []).append(("token", t.id, t.text, t.logprob, t.top_ids))

    def finish(self, key, reason, tail):
        self.got.setdefault(key, []).append(("finish", reason, tail))

    def cancelled(self, key):
        return key in self.cancel


def alone(model, row: Row) -> list:
    sink = Sink()
    batch = Batch(model.loaded)
    batch.add(0, row)
    batch.run(sink)
    return sink.got[0]


def same(a: list, t: list) -> None:
    """The same events: tokens, texts, top ids and reasons exactly; log-probabilities up to rounding."""
    assert len(a) == len(t)
    for x, y in zip(a, t):
        assert x[0] == y[0]
        if x[0] == "token":
            assert (y[1], y[2], y[4]) == (x[1], x[2], x[4]) and y[3] == pytest.approx(x[3], abs=1e-5)
        elif x[0] == "echo":
            assert y[1] == pytest.approx(x[1], abs=1e-5)
        else:
            assert y == x


@pytest.fixture(scope="module")
def model(tiny):
    return lmhead_cli.load(str(tiny[0]), device="cpu")


ROWS = {
    "greedy": Row(tuple(PROMPT_IDS), max_tokens=14, top=2),
    "sampled": Row((40, 1101, 257), max_tokens=9, top=1, greedy=False, seed=5, knobs=Knobs(temperature=0.8, top_p=0.9)),
    "echo": Row(tuple(range(300, 340)), echo=True, max_tokens=3, top=3),
    "stop": Row(tuple(PROMPT_IDS[:2]), max_tokens=6, stop=(" ",), mode="processed", knobs=Knobs(top_k=40)),
    "long": Row(tuple(range(1000, 1700)), max_tokens=5, greedy=False, seed=9, knobs=Knobs(softcap=2.0)),
}


def test_rows_joining_and_leaving_a_running_batch_each_equal_their_answer_alone(model):
    batch, sink = Batch(model.loaded, prefill_chunk=128), Sink()
    batch.add("greedy", ROWS["greedy"])
    batch.add("sampled", ROWS["sampled"])
    batch.prefill(sink)
    for _ in range(3):
        batch.step(sink)
    assert [r.key for r in batch.live] == ["greedy", "sampled"]
    batch.add("echo", ROWS["echo"])  # joins after 3 steps: its prompt is longer than the others' so far
    batch.add("stop", ROWS["stop"])
    batch.add("long", ROWS["long"])  # 700 positions: read in chunks of 128, at most 256 per round
    rounds, seen = 0, set()
    while batch.queued or batch.live:
        batch.round(sink, budget=256)
        rounds += 1
        seen |= {r.key for r in batch.live}
        if rounds == 1:  # the long prompt is still being read while the others step
            assert batch.queued and batch.queued[0].ids == ROWS["long"].ids and "sampled" in seen
    assert set(sink.got) == set(ROWS) and {"greedy", "sampled", "echo", "long"} <= seen and rounds > 3
    for key, row in ROWS.items():
        same(alone(model, row), sink.got[key])


def test_a_greedy_row_that_joins_late_is_transformers_generate(model, tiny):
    want = tiny[1].generate(torch.tensor([PROMPT_IDS]), max_new_tokens=10, do_sample=False, pad_token_id=50256)
    batch, sink = Batch(model.loaded), Sink()
    batch.add("other", Row(tuple(range(500, 530)), max_tokens=30, greedy=False, seed=1))
    batch.prefill(sink)
    for _ in range(7):
        batch.step(sink)
    batch.add("late", Row(tuple(PROMPT_IDS), max_tokens=10))
    batch.run(sink)
    assert [e[1] for e in sink.got["late"] if e[0] == "token"] == want[0, len(PROMPT_IDS):].tolist()


def test_a_cancelled_row_leaves_at_the_next_step_and_the_others_go_on(model):
    batch, sink = Batch(model.loaded), Sink()
    batch.add("a", ROWS["greedy"])
    batch.add("b", ROWS["sampled"])
    batch.prefill(sink)
    batch.step(sink)
    sink.cancel.add("a")
    assert batch.step(sink) == 1 and [r.key for r in batch.live] == ["b"]
    assert len([e for e in sink.got["a"] if e[0] == "token"]) == 1 and not any(e[0] == "finish" for e in sink.got["a"])
    batch.run(sink)
    same(alone(model, ROWS["sampled"]), sink.got["b"])


def test_choices_of_one_prompt_share_one_prefill(model):
    """n rows with the same prompt: the prompt runs through the body once; seed s draws as it does alone."""
    calls = []
    body = model.loaded.engine.body
    model.loaded.engine.body = lambda ids, cache=None, mask=None: calls.append(tuple(ids.shape)) or body(ids, cache, mask)
    try:
        batch, sink = Batch(model.loaded), Sink()
        for j in range(4):
            batch.add(j, Row(tuple(PROMPT_IDS), max_tokens=3, greedy=False, seed=100 + j))
        batch.run(sink)
    finally:
        del model.loaded.engine.body  # the class's again: an instance's own body would keep the compiled step off
    assert calls.count((1, len(PROMPT_IDS))) == 1 and calls[1:] == [(4, 1), (4, 1)]
    for j in range(4):
        same(alone(model, Row(tuple(PROMPT_IDS), max_tokens=3, greedy=False, seed=100 + j)), sink.got[j])


def test_a_row_at_the_end_of_the_context_leaves_room_for_the_others(model):
    """A long row and a short one with many tokens to go: the padding the long row needed is dropped when
    the cache is full, so the short row runs to its own end within the context."""
    n_ctx = model.n_ctx
    long = Row(tuple(range(2000, 2000 + n_ctx - 10)), max_tokens=10)
    short = Row(tuple(PROMPT_IDS), max_tokens=60)
    batch, sink = Batch(model.loaded), Sink()
    batch.add("long", long)
    batch.add("short", short)
    batch.run(sink)
    same(alone(model, long), sink.got["long"])
    same(alone(model, short), sink.got["short"])


def test_a_row_regrouped_twice_goes_on_as_two_copies_of_itself(model):
    """Batch.regroup([0, 0]) (beam search's survivors) copies a row with its cache, generator and text:
    after two steps alone, the two copies draw the same tokens and show the same text as the row does
    alone. Mutants: the copies share one generator (the second draws the next number) or one text."""
    row = Row((40, 1101, 257), max_tokens=6, greedy=False, seed=3, knobs=Knobs(temperature=1.5))
    want = alone(model, row)
    sink = Sink()
    batch = Batch(model.loaded)
    batch.add(0, row)
    batch.round(sink)
    batch.step(sink)
    batch.regroup([0, 0])
    assert len(batch.live) == 2 and batch.live[0] is not batch.live[1]
    batch.run(sink)
    tokens = [e for e in sink.got[0] if e[0] == "token"]
    assert [e[1] for e in tokens[:2]] == [e[1] for e in want[:2]]
    first, second = tokens[2::2], tokens[3::2]  # both copies carry key 0: their events interleave
    assert [e[1] for e in first] == [e[1] for e in second] == [e[1] for e in want[2:] if e[0] == "token"]
    assert [e[2] for e in first] == [e[2] for e in second] == [e[2] for e in want[2:] if e[0] == "token"]


def test_a_joining_row_hands_out_its_first_token_from_its_prompt_before_any_step(model, tiny):
    """The first token comes with the prefill (from the prompt's logits), while the running row waits for the
    step; the step then runs that token with the others, and every row still equals its answer alone."""
    want = tiny[1].generate(torch.tensor([PROMPT_IDS]), max_new_tokens=4, do_sample=False, pad_token_id=50256)
    batch, sink = Batch(model.loaded), Sink()
    batch.add("running", ROWS["sampled"])
    batch.prefill(sink)
    assert [e[0] for e in sink.got["running"]] == ["token"]  # its first token, before any step
    batch.step(sink)
    before = len(sink.got["running"])
    forwards = []
    last_logits = model.loaded.engine.last_logits
    model.loaded.engine.last_logits = lambda *a: forwards.append(1) or last_logits(*a)
    try:
        batch.add("late", Row(tuple(PROMPT_IDS), max_tokens=4))
        read = batch.prefill(sink)
    finally:
        del model.loaded.engine.last_logits
    assert read == len(PROMPT_IDS) and forwards == []  # no step ran
    assert [e[:2] for e in sink.got["late"]] == [("token", want[0, len(PROMPT_IDS)].item())]
    assert len(sink.got["running"]) == before  # the running row got nothing from the prefill
    assert batch.step(sink) == 2 and len(sink.got["late"]) == 1  # the step ran the late row's first token
    batch.run(sink)
    assert [e[1] for e in sink.got["late"] if e[0] == "token"] == want[0, len(PROMPT_IDS):].tolist()
    same(alone(model, ROWS["sampled"]), sink.got["running"])


def test_a_row_that_ends_with_its_first_token_leaves_at_the_prefill(model):
    batch, sink = Batch(model.loaded), Sink()
    batch.add("running", ROWS["greedy"])
    batch.prefill(sink)
    batch.add("one", Row(tuple(PROMPT_IDS), max_tokens=1, top=2))
    batch.prefill(sink)
    assert [e[0] for e in sink.got["one"]] == ["token", "finish"] and [r.key for r in batch.live] == ["running"]
    batch.run(sink)
    same(alone(model, Row(tuple(PROMPT_IDS), max_tokens=1, top=2)), sink.got["one"])
    same(alone(model, ROWS["greedy"]), sink.got["running"])


def test_prompts_waiting_together_are_read_in_one_pass_and_each_row_equals_its_answer_alone(model, monkeypatch):
    """Prompts queued before a prefill (a server's clients arriving at once) go through the body in one
    left-padded pass, not one pass each; every row still computes what it computes alone, joining an
    empty batch or a running one, with a prompt's n choices, a sampled row and a cancelled row among
    them. Mutants: positions counted from the padding, or the cache not right-aligned, change tokens."""
    passes = []
    body = type(model.loaded.engine).body  # patched on the class: set on the instance, undo would leave it there
    monkeypatch.setattr(type(model.loaded.engine), "body",
                        lambda self, ids, *a, **k: passes.append(tuple(ids.shape)) or body(self, ids, *a, **k))
    rows = {"greedy": ROWS["greedy"], "sampled": ROWS["sampled"], "stop": ROWS["stop"],
            "short": Row((464,), max_tokens=5), "gone": Row((11, 12, 13, 14), max_tokens=4)}
    choices = [Row((40, 1101, 257, 1110), max_tokens=4, greedy=False, seed=20 + j) for j in range(2)]
    batch, sink = Batch(model.loaded), Sink()
    for key, row in rows.items():
        batch.add(key, row)
    for j, row in enumerate(choices):
        batch.add(("n", j), row)  # the same prompt: one _Prefill with two rows
    sink.cancel.add("gone")
    batch.prefill(sink)
    longest = max(len(r.ids) for key, r in rows.items() if key != "gone")
    assert passes[0] == (5, longest) and len(passes) == 1  # 5 prompts (the cancelled one dropped) in one pass
    keys = [r.key for r in batch.live]  # in queue order ("stop" may end with its first token)
    assert [k for k in keys if k != "stop"] == ["greedy", "sampled", "short", ("n", 0), ("n", 1)]
    for _ in range(2):
        batch.step(sink)
    late = {"late1": Row(tuple(range(600, 610)), max_tokens=6), "late2": Row(tuple(PROMPT_IDS), max_tokens=3, top=2)}
    for key, row in late.items():  # two more arrive together while the others run: one more pass, then joined
        batch.add(key, row)
    passes.clear()
    batch.prefill(sink)
    assert passes[0] == (2, 10)
    batch.run(sink)
    assert "gone" not in sink.got
    for key, row in {**rows, **late}.items():
        if key != "gone":
            same(alone(model, row), sink.got[key])
    for j, row in enumerate(choices):
        same(alone(model, row), sink.got[("n", j)])


class StepSink(Sink):
    """Sink with each token's whole record (Step's figures) too."""

    def token(self, key, t):
        s = t.step
        self.got.setdefault(key, []).append(("token", t.id, t.text, t.logprob, t.top_ids,
                                             (s.logit, s.entropy, s.rank, s.raw_logprob, s.raw_entropy, s.removed_mass)))


def run_ahead(loaded, row: Row, ahead: int, runs: list | None = None) -> list:
    """One row alone, stepped with `ahead`: its events (StepSink's); `runs`, the positions of each
    Engine.greedy_run call that ran some."""
    eng, sink = loaded.engine, StepSink()
    real = eng.greedy_run

    def counted(*args):
        out = real(*args)
        if out is not None and runs is not None:
            runs.append(out.top_ids.shape[0])
        return out

    eng.greedy_run = counted
    try:
        batch = Batch(loaded)
        batch.add(0, row)
        while batch.queued or batch.live:
            if batch.queued:
                batch.prefill(sink)
            batch.step(sink, ahead=ahead)
    finally:
        del eng.greedy_run
    return sink.got[0]


def test_a_lone_greedy_row_run_ahead_hands_out_what_one_step_at_a_time_does(model, tiny):
    """Batch.step with `ahead`: a lone plain greedy row runs up to that many positions in one engine call
    (Engine.greedy_run) and hands their tokens out in order, each with its record, text and finish
    exactly as one step a call makes them: whatever max_tokens leaves of a run, a stop string met in
    the middle of one (the rest dropped), end-of-text where the run stops itself. The tokens are
    transformers' generate(). Mutants: the last position's record handed out twice or not at all, runs
    that pass max_tokens, the stop string missed, tokens after end-of-text."""
    from lmhead_cli.engine import kernels

    compiled = kernels.load() is not None
    base = Row(tuple(PROMPT_IDS), max_tokens=30)
    one = run_ahead(model.loaded, base, 1)
    ids = [e[1] for e in one if e[0] == "token"]
    want = tiny[1].generate(torch.tensor([PROMPT_IDS]), max_new_tokens=30, do_sample=False, pad_token_id=50256)
    assert ids == want[0, len(PROMPT_IDS):].tolist()
    later = next(i for i in range(9, len(ids)) if ids[i] not in ids[:i])  # a token first met in a later run
    texts = [e[2] for e in one if e[0] == "token"]
    rows = [Row(tuple(PROMPT_IDS), max_tokens=k) for k in (1, 2, 3, 9, 17, 30)]
    rows += [Row(tuple(PROMPT_IDS), max_tokens=30, stop=(model.loaded.tokenizer.token_text(ids[later]),)),
             Row(tuple(PROMPT_IDS), max_tokens=30, stop=(texts[1] + texts[2],)),
             Row(tuple(PROMPT_IDS), max_tokens=30, eos=ids[later])]
    for row in rows:
        runs = []
        got = run_ahead(model.loaded, row, 8, runs)
        assert got == run_ahead(model.loaded, row, 1), row
        assert got[-1][0] == "finish"
        if compiled and row.max_tokens > 2:
            assert runs and max(runs) <= 8 and sum(runs) <= row.max_tokens - 1  # the positions its tokens need, or fewer
    assert run_ahead(model.loaded, rows[-1], 8)[-1][1] == "eos"


def test_a_logit_that_is_not_finite_in_a_run_ahead_fails_where_one_step_at_a_time_does(tmp_path):
    """A position whose embedding is NaN makes that step's logits NaN: run ahead, the run stops there
    (its record spoilt) and the next step reports NonFiniteLogits, after the same tokens as one step a
    call."""
    from helpers import build_checkpoint

    from lmhead_cli.errors import NonFiniteLogits

    model = build_checkpoint(tmp_path)
    with torch.no_grad():
        model.transformer.wpe.weight[len(PROMPT_IDS) + 5] = float("nan")
    model.save_pretrained(tmp_path)
    from lmhead_cli.engine import kernels

    loaded = lmhead_cli.load(str(tmp_path), device="cpu").loaded
    runs, real = [], loaded.engine.greedy_run
    loaded.engine.greedy_run = lambda *a: runs.append(real(*a)) or runs[-1]
    outs = []
    for ahead in (1, 8):
        sink = StepSink()
        batch = Batch(loaded)
        batch.add(0, Row(tuple(PROMPT_IDS), max_tokens=20))
        batch.prefill(sink)
        with pytest.raises(NonFiniteLogits):
            while batch.live:
                batch.step(sink, ahead=ahead)
        outs.append(sink.got[0])
    assert outs[0] == outs[1] and len(outs[0]) == 6
    if kernels.load() is not None:  # one run, stopped at the sixth position: its record spoilt
        assert len(runs) == 1 and runs[0].top_ids.tolist()[5:] == [-1]
