"""`lmhead toy`: the four-word head against hand arithmetic and torch.softmax (the CLI itself never imports torch)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import cli

from lmhead_cli.readings.toy import (
    HIDDEN, ROWS, WORDS, argmax, logits, parse_hidden, repeat_argmax, sample, scale_demo, shift_demo,
    softcap_demo, softmax, toy_example,
)


def torch_probs(z, temperature: float = 1.0) -> list[float]:
    return torch.softmax(torch.tensor(z, dtype=torch.float64) / temperature, dim=-1).tolist()


def test_the_worked_example_by_hand():
    z = logits(HIDDEN, ROWS)
    assert z == (2, 1, 1, 0)  # [1,0,1]·[1,0,1], ·[1,0,0], ·[0,1,1], ·[0,1,0]
    p = softmax(z)
    e = math.e
    denominator = e**2 + 2 * e + 1  # exp(2) + exp(1) + exp(1) + exp(0)
    assert p == pytest.approx([e**2 / denominator, e / denominator, e / denominator, 1 / denominator], abs=1e-15)
    assert [round(x, 3) for x in p] == [0.534, 0.197, 0.197, 0.072]
    assert math.fsum(p) == pytest.approx(1, abs=1e-15)
    assert p == pytest.approx(torch_probs(z), abs=1e-15)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_softmax_matches_torch_and_survives_large_logits(temperature):
    z = (1000.0, 999.0, -5.0, 0.0)  # exp(1000) overflows unless the max is subtracted
    assert softmax(z, temperature) == pytest.approx(torch_probs(z, temperature), abs=1e-12)


def test_argmax_and_seeded_sample():
    z = logits(HIDDEN, ROWS)
    assert WORDS[argmax(z)] == "cat"
    assert argmax((1, 3, 3)) == 1  # first of a tie, like torch.argmax
    assert repeat_argmax(z, WORDS, 50).counts == {"cat": 50, "dog": 0, "fish": 0, "run": 0}

    drawn = sample(softmax(z), WORDS, 200, seed=0)
    assert drawn == sample(softmax(z), WORDS, 200, seed=0)  # the same seed, the same draws
    assert sum(drawn.counts.values()) == 200
    assert sum(n for w, n in drawn.counts.items() if w != "cat") > 0  # sometimes another word
    assert drawn.counts["cat"] / 200 == pytest.approx(math.e**2 / (math.e**2 + 2 * math.e + 1), abs=0.1)


def test_shift_changes_nothing():
    z = logits(HIDDEN, ROWS)
    v = shift_demo(z, 10.0)
    assert v.logits == (12, 11, 11, 10)
    assert v.probs == pytest.approx(torch_probs(z), abs=1e-15)
    assert v.effect == "unchanged" and v.order_kept


@pytest.mark.parametrize(("factor", "effect"), [(2.0, "sharper"), (0.5, "flatter")])
def test_scaling_h_is_temperature(factor, effect):
    v = scale_demo(HIDDEN, ROWS, factor)
    assert v.logits == tuple(factor * x for x in (2, 1, 1, 0))
    assert v.probs == pytest.approx(torch_probs([2, 1, 1, 0], 1 / factor), abs=1e-15)
    assert v.equivalent_temperature == 1 / factor
    assert v.equivalence_gap < 1e-15
    assert v.effect == effect and v.order_kept
    if factor == 2.0:
        assert v.probs[0] > softmax((2, 1, 1, 0))[0]  # the top word gains


def test_softcap_flattens_and_keeps_order():
    z = logits(HIDDEN, ROWS)
    v = softcap_demo(z, 1.0)
    assert v.logits == pytest.approx([math.tanh(2), math.tanh(1), math.tanh(1), 0.0], abs=1e-15)
    assert v.probs == pytest.approx(torch_probs([math.tanh(2), math.tanh(1), math.tanh(1), 0.0]), abs=1e-15)
    assert v.effect == "flatter" and v.order_kept
    assert max(v.probs) < max(softmax(z))


def test_toy_example_with_temperature():
    ex = toy_example((0.5, 1.0, 2.0), temperature=0.7, seed=3, draws=10)
    z = [0.5 + 2.0, 0.5, 1.0 + 2.0, 1.0]  # cat, dog, fish, run
    assert ex.logits == tuple(z)
    assert ex.probs == pytest.approx(torch_probs(z, 0.7), abs=1e-15)
    assert ex.greedy == "fish"
    assert len(ex.sample.draws) == 10


def test_parse_hidden():
    assert parse_hidden("0.5,1,2") == (0.5, 1.0, 2.0)
    assert parse_hidden(" [1, -2, 3e-1] ") == (1.0, -2.0, 0.3)


def test_cli_default_reproduces_the_figures():
    r = cli("toy")
    assert r.exit_code == 0, r.output
    for figure in ("0.534", "0.197", "0.072", "1.000", "unchanged", "sharper, same order", "flatter, same order"):
        assert figure in r.stdout


def test_cli_json_and_own_numbers():
    r = cli("toy", "--hidden", "-1,0,1", "--temperature", "0.5", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["logits"] == [0, -1, 1, 0]
    assert doc["probs"] == pytest.approx(torch_probs([0, -1, 1, 0], 0.5), abs=1e-15)
    assert [v["name"] for v in doc["variants"]] == ["shift", "scale", "scale", "softcap"]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--hidden", "1,2"], "--hidden needs 3 numbers, one per column of the toy table; got 2 in '1,2'"),
        (["--hidden", "1,2,3,4"], "--hidden needs 3 numbers, one per column of the toy table; got 4 in '1,2,3,4'"),
        (["--hidden", "a,b,c"], "--hidden must be 3 comma-separated numbers, like 1,0,1; got 'a,b,c'"),
        (["--hidden", "1,,2"], "--hidden must be 3 comma-separated numbers, like 1,0,1; got '1,,2'"),
        (["--hidden", "nan,1,2"], "--hidden must be finite numbers (no nan or inf); got 'nan,1,2'"),
        (["--hidden", "1,inf,2"], "--hidden must be finite numbers (no nan or inf); got '1,inf,2'"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number of at least 1e-06 (got -1.0); 0 is greedy: the most likely token every time"),
        (["--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number of at least 1e-06 (got nan); 0 is greedy: the most likely token every time"),
        (["--draws", "0"], "--draws must be between 1 and 100,000; got 0"),
    ],
)
def test_cli_bad_input(args, line):
    r = cli("toy", *args)
    assert r.exit_code == 2
    assert r.stderr == f"lmhead: error: {line}\n"
    assert r.stdout == ""


def test_temperature_0_is_greedy_as_at_every_other_door():
    """T -> 0: all the probability on the largest logit (ties share it); every draw is the greedy word."""
    ex = toy_example((0.5, 1.0, 2.0), temperature=0, seed=3, draws=10)
    best = max(range(len(ex.logits)), key=lambda i: ex.logits[i])
    assert ex.probs == tuple(1.0 if i == best else 0.0 for i in range(len(ex.logits)))
    assert ex.sample.draws == (ex.greedy,) * 10 and ex.entropy_bits == 0
    assert softmax([1.0, 3.0, 3.0], 0) == (0.0, 0.5, 0.5)
    assert softmax([1.0, 3.0], 1e-6) == pytest.approx(softmax([1.0, 3.0], 0))
