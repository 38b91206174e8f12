"""The CPU thread count: fixed by --threads / LMHEAD_THREADS, otherwise chosen by timing the work
(engine/threads.py), and OpenMP's wait policy. The timings here come from a fake clock."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import cli

from lmhead_cli.engine import threads
from lmhead_cli.engine.threads import ThreadChooser


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def clock(monkeypatch, durations, share=1.0):
    """perf_counter returning start/end pairs so that the i-th timed call lasts durations[i], and
    process_time so that each call had `share` of its threads' time (1.0: every core its own; a list:
    the i-th call's)."""
    ticks, now = [], 0.0
    for d in durations:
        ticks += [now, now + d]
        now += d + 1
    it = iter(ticks)
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(it))
    cpu, calls = [0.0], iter(range(2 * len(durations)))

    def process_time():
        i = next(calls)
        if i % 2:  # the end of call i // 2
            cpu[0] += durations[i // 2] * torch.get_num_threads() * (share[i // 2] if isinstance(share, list) else share)
        return cpu[0]
    monkeypatch.setattr(threads.time, "process_time", process_time)


def counts_seen(chooser, n):
    """Run n units through the chooser; the thread count each ran on."""
    seen = []
    for _ in range(n):
        chooser.run(lambda: seen.append(torch.get_num_threads()))
    return seen


def test_warm_up_then_trial_keeps_the_faster(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    chooser = ThreadChooser(trials=2)
    assert chooser.candidates == [2, 1] and chooser.deciding
    # after the untimed warm-up (on the trial's first count, so its first call does not switch): 2 threads
    # 5 s a call, 1 thread 1 s
    clock(monkeypatch, [5, 1, 5, 1, 1, 1])
    assert counts_seen(chooser, 7) == [2, 2, 1, 2, 1, 1, 1]
    assert chooser.choices == [1] and torch.get_num_threads() == 1 and not chooser.deciding


def test_a_tie_is_timed_twice_more_and_keeps_one_thread(monkeypatch, restore_threads):
    """Within CLEAR after one call each: two more each, alternating; a tie keeps one thread (more
    threads must win by MARGIN)."""
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    clock(monkeypatch, [1, 1] * 3 + [1])  # the last: the kept count, watched
    assert counts_seen(chooser, 8) == [2, 2, 1, 2, 1, 2, 1, 1]
    assert chooser.choices == [1] and torch.get_num_threads() == 1


def test_a_clear_first_round_decides_at_once(monkeypatch, restore_threads):
    """Two threads 1.5x faster after one call each (an idle machine): no more calls on one thread."""
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    clock(monkeypatch, [2, 3, 2])
    assert counts_seen(chooser, 4) == [2, 2, 1, 2] and chooser.choices == [2]


@pytest.mark.parametrize("two, one, share, kept", [
    # two threads 1.1x faster with their cores (this host at times, nothing else running): kept
    ([1.0, 1.0, 1.0], [1.1, 1.1, 1.1], 1.0, 2),
    # the same without their cores (another process holds one): under MARGIN, one thread kept
    ([1.0, 1.0, 1.0], [1.1, 1.1, 1.1], 0.7, 1),
    ([1.0, 1.0, 1.0], [1.3, 1.3, 1.3], 0.7, 2),  # 1.3x: over MARGIN, two threads kept
    # a lucky first call on two threads, 2x faster, but without its cores (a busy machine): the medians decide
    ([0.6, 1.4, 1.4], [1.2, 1.2, 1.2], 0.6, 1),
])
def test_close_counts_are_decided_by_medians_and_the_margin(monkeypatch, restore_threads, two, one, share, kept):
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    clock(monkeypatch, [t for pair in zip(two, one) for t in pair] + [1], share)
    seen = counts_seen(chooser, 1 + 6 + 1)
    assert seen[1:7] == [2, 1] * 3 and chooser.choices == [kept] and seen[7] == kept


def test_a_slowdown_starts_a_new_trial(monkeypatch, restore_threads):
    """Chosen, then 5 calls at 1 s (the reference); once the median of the last 5 is over 2 s (the
    third call at 3 s), both counts are timed again."""
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    clock(monkeypatch, [1, 4] + [1] * 5 + [3] * 3 + [9, 2])
    seen = counts_seen(chooser, 13)
    assert seen[:11] == [2, 2, 1] + [2] * 8
    assert seen[11:] == [2, 1] and chooser.choices == [2, 1]


def test_a_kept_count_waits_longer_for_the_next_trial(monkeypatch, restore_threads):
    """recheck 3: a trial that keeps 1 thread, 2 threads 2× slower, doubles it to 6; one where 2 threads
    were 5× slower multiplies it by 5 (30); a trial that changes the count goes back to 3, and two threads
    that keep their cores are not timed again on a schedule (below)."""
    torch.set_num_threads(2)
    chooser = ThreadChooser(recheck=3)
    clock(monkeypatch, [2, 1] + [1] * 3 + [2, 1] + [1] * 6 + [5, 1] + [1] * 30 + [1, 2] + [1] * 5)
    seen = counts_seen(chooser, 1 + 2 + 3 + 2 + 6 + 2 + 30 + 2 + 5)
    assert seen == [2] + [2, 1] + [1] * 3 + [2, 1] + [1] * 6 + [2, 1] + [1] * 30 + [2, 1] + [2] * 5
    assert chooser.choices == [1, 1, 1, 2]


def test_more_threads_that_keep_their_cores_are_not_timed_again_on_a_schedule(monkeypatch, restore_threads):
    """Two threads kept, every call with its cores (a quiet machine): no trial on one thread however many
    calls follow (each costs a slow call: three of a 128-token run were 2% of it). A call with less than
    SHARED of its cores (another process took one) lets the schedule run again: past `recheck` calls,
    both counts are timed at once."""
    torch.set_num_threads(2)
    chooser = ThreadChooser(recheck=3)
    clock(monkeypatch, [1, 2] + [1] * 20 + [1] + [2, 1], share=[1.0] * 22 + [0.6] + [1.0] * 2)
    seen = counts_seen(chooser, 1 + 2 + 20 + 1 + 2)
    assert seen == [2] + [2, 1] + [2] * 20 + [2] + [2, 1]
    assert chooser.choices == [2, 1]


def test_more_threads_that_lose_their_cores_are_timed_again(monkeypatch, restore_threads):
    """Before the schedule's next trial: once the median of the last 5 calls had less than SHARED of their
    cores, both counts are timed again (the speed alone may not show it: beside a busy process a call
    on two threads took 1x to 1.5x the time of the next)."""
    torch.set_num_threads(2)
    chooser = ThreadChooser(recheck=64)
    clock(monkeypatch, [1, 2] + [1] * 5 + [1] * 3 + [2, 1], share=[1.0] * 7 + [0.6] * 3 + [1.0] * 2)
    seen = counts_seen(chooser, 1 + 2 + 5 + 3 + 2)
    assert seen == [2] + [2, 1] + [2] * 5 + [2] * 3 + [2, 1]
    assert chooser.choices == [2, 1]


def test_more_threads_kept_beside_another_process_are_not_timed_again_for_it(monkeypatch, restore_threads):
    """Two threads kept although their calls lacked their cores in the trial (twice as fast as one
    beside a busy process): calls that go on lacking them are no change, and start no trial before
    the schedule's (a trial every 5 calls would cost a call on one thread each time)."""
    torch.set_num_threads(2)
    chooser = ThreadChooser(recheck=12)
    clock(monkeypatch, [1, 2] * 3 + [1] * 12 + [1, 2] * 3, share=0.6)
    seen = counts_seen(chooser, 1 + 6 + 12 + 6)
    assert seen == [2] + [2, 1] * 3 + [2] * 12 + [2, 1] * 3
    assert chooser.choices == [2, 2]


def test_a_count_slower_than_the_one_it_beat_is_timed_again(monkeypatch, restore_threads):
    """Two threads kept at 1 s against one thread's 2 s; then the machine changes and two threads take
    3 s a call from the start (their own reference too, so the slack never fires): once the median of 5
    is past REJECTED × 2 s, both counts are timed again, and one thread (now 2 s) wins."""
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    clock(monkeypatch, [1, 2] + [3] * 5 + [3, 1.5] + [2])
    seen = counts_seen(chooser, 1 + 2 + 5 + 2 + 1)
    assert seen[:8] == [2, 2, 1] + [2] * 5
    assert seen[8:] == [2, 1, 1] and chooser.choices == [2, 1]


def test_units_normalise_the_work(monkeypatch, restore_threads):
    """Per unit: a 10-unit call of 5 s (0.5 s a unit) beats a 1-unit call of 1 s."""
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    chooser.run(lambda: None)  # the warm-up
    clock(monkeypatch, [5, 1])
    for units in (10, 1):
        chooser.run(lambda: None, units)
    assert chooser.choices == [2]


def test_units_counted_from_the_call_s_result_normalise_it_too(monkeypatch, restore_threads):
    """`units` as a function of the call's result (a decoding round that ran several positions): a call
    that returns 10 and took 5 s is 0.5 s a unit, and beats a 1-unit call of 1 s."""
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    chooser.run(lambda: None)  # the warm-up
    clock(monkeypatch, [5, 1])
    for ran in (10, 1):
        assert chooser.run(lambda: ran, lambda out: out) == ran
    assert chooser.choices == [2]


def test_settled_while_calls_are_only_watched(monkeypatch, restore_threads):
    """`settled` (a decoder may put several positions in a call): not during the warm-up or a trial, nor
    when the next call starts one; yes while calls are watched."""
    torch.set_num_threads(2)
    chooser = ThreadChooser()
    clock(monkeypatch, [1, 4] + [1] * 5 + [3] * 3 + [9, 2])
    states = []
    for _ in range(13):
        states.append(chooser.settled)
        chooser.run(lambda: None)
    # warm-up, the trial's two calls, then watched until the slowdown (the tenth call) starts a trial
    assert states == [False, False, False] + [True] * 8 + [False, False]
    assert ThreadChooser(fixed=1).settled


def test_fixed_count_is_set_inside_the_model_s_calls_only_and_nothing_is_timed(monkeypatch, restore_threads):
    from lmhead_cli.engine.execution import Execution

    monkeypatch.setattr(threads.time, "perf_counter", lambda: pytest.fail("timed although fixed"))
    torch.set_num_threads(2)
    ex = Execution(threads=1)
    assert torch.get_num_threads() == 2 and ex.chooser.candidates == []
    assert ex.run(lambda: torch.get_num_threads()) == 1 and torch.get_num_threads() == 2
    assert ex.settle(lambda: None) == 1 and torch.get_num_threads() == 2
    with pytest.raises(ZeroDivisionError):  # restored however the call ends
        with ex.scope():
            assert torch.get_num_threads() == 1
            1 / 0
    assert torch.get_num_threads() == 2
    assert list(ex.iterate(torch.get_num_threads() for _ in range(2))) == [1, 1] and torch.get_num_threads() == 2


def test_gpu_work_is_not_timed(restore_threads):
    torch.set_num_threads(2)
    assert ThreadChooser(device_type="cuda").candidates == []


@pytest.mark.parametrize("user", [None, ("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0"),
                                  ("KMP_BLOCKTIME", "200")])
def test_the_command_line_s_threads_spin_a_millisecond_unless_the_user_set_how_they_wait(monkeypatch, user):
    from lmhead_cli.engine import execution

    for name in threads.WAIT_SETTINGS:
        monkeypatch.setenv(name, "")  # recorded as it was, so own_process's writes are undone after the test
        monkeypatch.delenv(name)
    if user:
        monkeypatch.setenv(*user)
    monkeypatch.setattr(execution, "_owned", [])
    execution.own_process()
    assert execution.process_owned()
    wait = {name: os.environ.get(name) for name in threads.WAIT_SETTINGS}
    if user is None:
        assert wait == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "100000", "KMP_BLOCKTIME": "1"}
    else:
        assert wait == {name: user[1] if name == user[0] else None for name in threads.WAIT_SETTINGS}


@pytest.mark.slow
def test_the_command_sets_the_spin_before_torch_is_imported(tiny):
    """OpenMP reads its wait settings once, when torch's import starts it: `lmhead`'s entry point sets
    them first (the process is the command's own)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_SETTINGS}
    code = ("import os, sys, lmhead_cli.cli as cli\n"
            "assert 'torch' not in sys.modules\n"
            "sys.argv = ['lmhead', 'inspect', '--model', " + repr(str(tiny[0])) + ", '--json', 'The keys']\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.split()[-2:] == ["100000", "True"]


@pytest.mark.slow
def test_the_api_leaves_the_host_process_as_it_found_it(tiny):
    """In a fresh interpreter: load() (a chosen and a fixed thread count, float32 and int8) plus score,
    generate, inspect, lens and a file of prompts leave os.environ, torch's thread count and glibc's
    mmap threshold (never pinned: engine/heap.py not even called) as they were."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_SETTINGS}
    code = f"""
import os, sys, torch
torch.set_num_threads(2)
env, n = dict(os.environ), torch.get_num_threads()
import lmhead_cli
from lmhead_cli.engine import heap
for kw in ({{}}, {{"threads": 1}}, {{"dtype": "int8"}}):
    m = lmhead_cli.load({str(tiny[0])!r}, announce=lambda line: None, **kw)
    assert torch.get_num_threads() == n
    m.score("The keys on the table are on the floor, and the door is open.")
    m.generate("The keys", max_new_tokens=12, greedy=True)
    m.generate("The keys", max_new_tokens=6, seed=1)
    m.inspect("The keys on the table")
    m.lens("The keys on the table")
    list(m.inspect_lines(["The keys", "A door"], batch_size=1))
    assert torch.get_num_threads() == n, torch.get_num_threads()
print(dict(os.environ) == env, torch.get_num_threads() == n, heap.fix_mmap_threshold.cache_info().currsize)
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True", "0"]



@pytest.mark.parametrize("args", [["inspect", "x"], ["greedy", "x"], ["lens", "x"], ["tie"], ["explore"]])
def test_every_model_command_refuses_zero_threads_before_loading(args):
    got = cli(*args, "--threads", "0", "--model", "random:no-such-model", input="")
    assert got.exit_code == 2
    assert "--threads must be at least 1 (got 0)" in got.stderr


def test_lmhead_threads_sets_the_count(tiny, monkeypatch, restore_threads):
    torch.set_num_threads(2)
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    monkeypatch.setenv("LMHEAD_THREADS", "1")
    got = cli("greedy", "The keys", "-n", "3", "--model", str(tiny[0]), "--json")
    assert got.exit_code == 0, got.output
    # 1 for each of the model's calls (the load, the generation), the caller's 2 after each: never a trial
    assert calls and calls[::2] == [1] * (len(calls) // 2) and calls[1::2] == [2] * (len(calls) // 2)
    assert torch.get_num_threads() == 2


class FormsEngine:
    """An engine's product-form hooks, recording what the chooser asks for."""

    forms = ("gemv", "linear")

    def __init__(self):
        self.form = "gemv"

    def use_form(self, form):
        self.form = form


def test_offered_forms_are_timed_on_one_thread_then_the_count_with_the_fastest(monkeypatch, restore_threads):
    """A warm-up call on one thread, then each form on one thread, then torch's count with the faster
    form; 1 thread with "linear" is fastest here, so it stays; the next trial times every setting again."""
    torch.set_num_threads(2)
    eng = FormsEngine()
    chooser = ThreadChooser(recheck=2)
    chooser.offer(eng)
    seen = []
    # (1, gemv), (1, linear), (2, linear); 2 watched; (1, gemv), (1, linear), (2, linear)
    clock(monkeypatch, [3, 1, 2, 1, 1, 2, 1, 2])
    run = lambda n: [chooser.run(lambda: seen.append((torch.get_num_threads(), eng.form))) for _ in range(n)]  # noqa: E731
    run(1 + 3)
    assert seen == [(1, "gemv")] * 2 + [(1, "linear"), (2, "linear")]
    assert chooser.choices == [1] and chooser.form_choices == ["linear"] and eng.form == "linear"
    run(2 + 3)
    assert seen[4:6] == [(1, "linear")] * 2  # recheck 2: then a trial of every setting
    assert seen[6:] == [(1, "gemv"), (1, "linear"), (2, "linear")]
    assert chooser.choices == [1, 1] and chooser.form_choices == ["linear", "linear"]


def test_forms_are_timed_even_with_a_fixed_count(monkeypatch, restore_threads):
    from lmhead_cli.engine.execution import Execution

    torch.set_num_threads(2)
    eng = FormsEngine()
    ex = Execution(threads=1)
    ex.offer(eng)
    clock(monkeypatch, [1, 3, 1])  # (1, gemv), (1, linear), then the chosen one watched
    seen = []
    for _ in range(1 + 2 + 1):
        ex.run(lambda: seen.append((torch.get_num_threads(), eng.form)))
    assert seen == [(1, "gemv")] * 2 + [(1, "linear"), (1, "gemv")]
    assert ex.chooser.choices == [] and ex.chooser.form_choices == ["gemv"] and torch.get_num_threads() == 2


# ---- the same numbers at any thread count ------------------------------------------------------------

TIMING = {"elapsed_s", "first_token_s", "tokens_per_second", "decode_tokens_per_second"}
PROMPT = "The keys on the table"
SAME_AT_ANY_COUNT = {
    "lens": ["lens", PROMPT],  # entropies and KL over 50,257 logits; the position map's head over 5 rows
    "inspect": ["inspect", PROMPT],
    "generate": ["generate", PROMPT, "--seed", "5", "--max-new-tokens", "8"],  # each step's record
    "score-6": ["score", "The keys on the table are"],  # 6 positions: MKL split 5-11 rows by the count
    "score-10": ["score", "A cat sat on the mat and it was warm"],
    "score-long": ["score", " ".join(["The keys on the table are where we left them."] * 12)],
}


def _without_timing(doc):
    if isinstance(doc, dict):
        return {k: _without_timing(v) for k, v in doc.items() if k not in TIMING}
    if isinstance(doc, list):
        return [_without_timing(v) for v in doc]
    return doc


@pytest.mark.parametrize("name", SAME_AT_ANY_COUNT)
def test_the_json_is_the_same_at_one_and_two_threads(tiny, restore_threads, name):
    """docs/python-api.md's promise: --json is bit for bit the same for --threads 1 and 2 (timings aside).
    Before: the sums over the vocabulary (entropy, KL, log-sum-exp, removed mass) were split among
    torch's threads, and a short text's head ran MKL's GEMM, whose last bits follow the thread count for
    5 to 11 rows."""
    import json

    docs = []
    for count in ("1", "2"):
        got = cli(*SAME_AT_ANY_COUNT[name], "--model", str(tiny[0]), "--threads", count, "--json")
        assert got.exit_code == 0, got.output
        docs.append(json.loads(got.stdout))
    assert TIMING & set(docs[0]) == (TIMING if name == "generate" else set())  # what is left out exists
    assert _without_timing(docs[0]) == _without_timing(docs[1])


def test_ordered_sum_adds_in_an_order_the_thread_count_does_not_change(restore_threads):
    """head.ordered_sum, which every sum over the vocabulary goes through: the same bits on 1 to 4
    threads, for one row and for many, and the sum itself (float64 reference)."""
    from lmhead_cli.head import SUM_BLOCK, log_sum_exp, ordered_sum

    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(shape, generator=g) * 4 for shape in
            [(50257,), (1, 50257), (3, 50257), (2, 152064), (SUM_BLOCK,), (SUM_BLOCK - 1,), (40000,)]]
    seen = []
    for count in (1, 2, 3, 4):
        torch.set_num_threads(count)
        seen.append([(ordered_sum(x), ordered_sum(x, keepdim=True), log_sum_exp(x)) for x in rows])
    for later in seen[1:]:
        for a, b in zip(seen[0], later):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
    for x, (total, kept, lse) in zip(rows, seen[0]):
        want = x.double().sum(-1)
        assert kept.shape == (*x.shape[:-1], 1) and torch.equal(kept[..., 0], total)
        assert torch.allclose(total.double(), want, rtol=0, atol=1e-6 * x.abs().sum(-1).max().item())
        assert torch.allclose(lse.double(), torch.logsumexp(x.double(), -1), rtol=1e-6, atol=0)
