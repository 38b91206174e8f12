"""The decoding stages, each alone, and the draws: pure functions over small logits vectors.

Every expected figure is computed here independently (by hand or with plain torch), not read back
from the code under test.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from lmhead_cli.decoding import stages, stages as decoding
from lmhead_cli.decoding.stages import Knobs
from lmhead_cli.errors import BadValue, UsageError
from lmhead_cli.head import entropy, log_softmax
import json
from helpers import invoke, one_line

# A fixed logits vector for the draws: 12 tokens, a clear favourite and a long tail.
LOGITS = torch.tensor([3.1, 2.6, 2.2, 1.9, 1.0, 0.7, 0.3, -0.2, -0.9, -1.5, -2.4, -3.0])
DRAWS = 20_000
TV_LIMIT = 0.02
# probabilities 0.5, 0.3, 0.15, 0.05: easy to filter by hand
HAND = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def kept(z: torch.Tensor) -> list[int]:
    return torch.isfinite(z).nonzero().flatten().tolist()


# ---- soft-capping ---------------------------------------------------------------------------

def test_softcap_keeps_the_ranking_and_never_raises_the_top_probability():
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 10.0, 40.0):
        z = torch.randn(2000, generator=g) * scale
        for cap in (5.0, 30.0):
            capped = decoding.softcap(z, cap)
            order = torch.argsort(z, descending=True)
            assert bool((capped[order].diff() <= 0).all())  # never reordered (float32 tanh may tie far out)
            if scale * 4 < cap * 3:  # no saturation: the very same order
                assert torch.equal(torch.argsort(capped, descending=True), order)
            top = int(z.argmax())
            assert torch.softmax(capped, -1)[top] <= torch.softmax(z, -1)[top] + 1e-7


def test_softcap_values_lie_strictly_inside_the_cap():
    z = torch.tensor([-float("inf"), -1e9, -1e4, -300.0, -30.0, 0.0, 29.0, 30.0, 300.0, 1e4, 1e9, float("inf")])
    for cap in (1.0, 30.0, 50.0):
        capped = decoding.softcap(z, cap)
        assert bool(((capped > -cap) & (capped < cap)).all()), capped


def test_softcap_is_the_formula_and_near_identity_for_small_logits():
    z = torch.tensor([-5.0, -0.5, 0.0, 0.5, 5.0])
    expected = torch.tensor([30 * math.tanh(v / 30) for v in z.tolist()])
    torch.testing.assert_close(decoding.softcap(z, 30.0), expected)
    torch.testing.assert_close(decoding.softcap(z * 0.01, 30.0), z * 0.01, atol=1e-6, rtol=1e-4)


# ---- temperature ----------------------------------------------------------------------------

def test_temperature_one_without_filters_is_plain_softmax():
    z = decoding.process(LOGITS, Knobs(temperature=1.0).pipeline())
    assert torch.equal(torch.softmax(z, -1), torch.softmax(LOGITS, -1))
    assert torch.equal(decoding.process(LOGITS, Knobs().pipeline()), LOGITS)


def test_temperature_towards_zero_approaches_greedy():
    best = int(LOGITS.argmax())
    tops = [float(log_softmax(decoding.temperature(LOGITS, t))[best].exp()) for t in (1.0, 0.3, 0.1, 1e-3)]
    assert tops == sorted(tops) and tops[-1] > 0.999999
    g = torch.Generator().manual_seed(0)
    lp = log_softmax(decoding.temperature(LOGITS, 1e-3))[None]
    assert all(int(decoding.choose(lp, False, g)) == best for _ in range(200))


def test_temperature_above_one_flattens():
    h = [float(entropy(log_softmax(decoding.temperature(LOGITS, t)))) for t in (0.5, 1.0, 2.0)]
    assert h[0] < h[1] < h[2] < math.log(len(LOGITS))


# ---- filters --------------------------------------------------------------------------------

def test_top_k_by_hand():
    assert kept(decoding.top_k(HAND, 2)) == [0, 1]
    assert kept(decoding.top_k(HAND, 1)) == [0]
    assert torch.equal(decoding.top_k(HAND, 4), HAND) and torch.equal(decoding.top_k(HAND, 99), HAND)
    assert kept(decoding.top_k(torch.tensor([1.0, 2.0, 2.0, 0.0]), 2)) == [1, 2]  # ties with the k-th stay


def test_top_p_by_hand():
    assert kept(decoding.top_p(HAND, 0.75)) == [0, 1]  # 0.5 < 0.75 <= 0.5 + 0.3
    assert kept(decoding.top_p(HAND, 0.85)) == [0, 1, 2]
    assert kept(decoding.top_p(HAND, 0.01)) == [0]  # the best token always survives
    assert torch.equal(decoding.top_p(HAND, 1.0), HAND)
    shuffled = HAND[[2, 0, 3, 1]]  # order in the vocabulary does not matter
    assert kept(decoding.top_p(shuffled, 0.75)) == [1, 3]


def test_min_p_by_hand():
    assert kept(decoding.min_p(HAND, 0.25)) == [0, 1, 2]  # keep p >= 0.125
    assert kept(decoding.min_p(HAND, 0.4)) == [0, 1]  # keep p >= 0.2
    assert kept(decoding.min_p(HAND, 0.99)) == [0]
    assert torch.equal(decoding.min_p(HAND, 0.0), HAND)


def test_filters_work_on_rows():
    rows = torch.stack([HAND, HAND.flip(0)])  # (2, 4)
    for f, v in ((decoding.top_k, 2), (decoding.top_p, 0.75), (decoding.min_p, 0.4)):
        out = f(rows, v)
        assert kept(out[0]) == [0, 1] and kept(out[1]) == [2, 3]


# ---- the order, and process -----------------------------------------------------------------

def test_the_documented_order_of_stages():
    assert [s.knob for s in decoding.STAGES] == ["softcap", "temperature", "top_k", "top_p", "min_p"]
    assert [f for f in Knobs.__dataclass_fields__] == [s.knob for s in decoding.STAGES]


def test_every_stage_reaches_knobs_presets_the_options_and_the_table():
    """What a registry entry must give without further edits: a Knobs field, a preset key of its type,
    a column, and an option on every decoding command and on inspect (where top-k is --filter-top-k)."""
    from typer.main import get_command

    from lmhead_cli.cli import app
    from lmhead_cli.api import presets

    commands = get_command(app).commands
    for s in decoding.STAGES:
        assert s.key in Knobs.__dataclass_fields__ and s.key in presets.KEYS and s.column in decoding.COLUMNS
        for name in ("generate", "greedy", "sample", "softcap", "inspect"):
            opts = [p.opts for p in commands[name].params if p.name == f"knob_{s.key}"]
            expected = ["--filter-top-k"] if (name, s.key) == ("inspect", "top_k") else list(s.options or (s.option,))
            assert opts == [expected], (name, s.key)
        with pytest.raises(UsageError, match=s.key):  # a preset is checked by the stage's own rule
            presets.validate("bad", "test.toml", {s.key: s.type(-2)})  # -1 is top-k's off


def test_process_composes_the_active_stages_in_order():
    knobs = Knobs(softcap=2.0, temperature=0.7, top_k=8, top_p=0.9, min_p=0.05)
    by_hand = LOGITS.clone()
    by_hand = 2.0 * torch.tanh(by_hand / 2.0)
    by_hand = by_hand / 0.7
    by_hand = decoding.min_p(decoding.top_p(decoding.top_k(by_hand, 8), 0.9), 0.05)
    torch.testing.assert_close(decoding.process(LOGITS, knobs.pipeline()), by_hand)
    assert knobs.active() == {"softcap": 2.0, "temperature": 0.7, "top_k": 8, "top_p": 0.9, "min_p": 0.05}


# ---- choose: the draws follow exactly the processed distribution -----------------------------

SETTINGS = {
    "plain": Knobs(),
    "temperature": Knobs(temperature=0.6),
    "top-k": Knobs(top_k=4),
    "top-p": Knobs(top_p=0.8),
    "min-p": Knobs(min_p=0.1),
    "soft-capped": Knobs(softcap=1.5),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.slow
def test_sampling_frequencies_match_the_processed_probabilities(name):
    logprobs = log_softmax(decoding.process(LOGITS, SETTINGS[name].pipeline()))[None]  # (1, V)
    probs = logprobs.exp()[0]
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(LOGITS))
    for _ in range(DRAWS):
        counts[int(decoding.choose(logprobs, False, g))] += 1
    tv = 0.5 * float((counts / DRAWS - probs).abs().sum())
    assert tv < TV_LIMIT, (name, tv)
    assert float(counts[probs == 0].sum()) == 0  # a filtered token is never drawn


def test_choose_is_reproducible_with_a_seed_and_greedy_is_argmax():
    lp = log_softmax(LOGITS)[None]
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [int(decoding.choose(lp, False, g1)) for _ in range(50)] == [int(decoding.choose(lp, False, g2)) for _ in range(50)]
    assert int(decoding.choose(lp, True)) == int(LOGITS.argmax())
    assert int(decoding.choose(torch.tensor([[0.0, 1.0, 1.0]]), True)) == 1  # the first on ties


def test_entropy():
    n = 50
    assert math.isclose(float(entropy(torch.full((n,), -math.log(n)))), math.log(n), rel_tol=1e-6)
    lp = log_softmax(decoding.top_k(HAND, 2))  # dropped tokens (p = 0) add nothing
    p = torch.tensor([0.5, 0.3]) / 0.8
    assert math.isclose(float(entropy(lp)), float(-(p * p.log()).sum()), rel_tol=1e-6)


# ---- checks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,words", [
    ("temperature", 1e-9, "0 is greedy"), ("temperature", -1.0, "at least 1e-06"),
    ("temperature", float("nan"), "finite"), ("temperature", float("inf"), "finite"),
    ("top_k", -2, "at least 1"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.01, "(0, 1]"), ("top_p", float("nan"), "(0, 1]"),
    ("min_p", 1.0, "[0, 1)"), ("min_p", -0.1, "[0, 1)"), ("softcap", 0.0, "between 1e-06 and 1e+06"),
    ("softcap", 2e6, "between 1e-06 and 1e+06"), ("softcap", float("inf"), "finite"), ("beams", 0, "at least 1"), ("max_new_tokens", 0, "at least 1"),
])
def test_check_names_the_setting_and_the_range(key, value, words):
    with pytest.raises(BadValue) as e:
        decoding.check({key: value})
    # the core names the setting by its key; the CLI spells it as the option (test_generate_cli)
    assert e.value.key == key and str(e.value).startswith(key) and words in str(e.value)
    assert e.value.spelled(decoding.option(key)).startswith(decoding.option(key))


def test_check_accepts_the_edges():
    edges = {"temperature": 1e-6, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "softcap": 1e-6, "beams": 1,
             "max_new_tokens": 1}
    assert decoding.check({**edges, "seed": 0, "top_k_unset": None}) == {**edges, "seed": 0, "top_k_unset": None}
    for key, value in edges.items():
        assert decoding.SETTINGS[key].rule.ok(value), key  # each edge is inside its own rule
    beyond = {"temperature": 1e-7, "top_k": -2, "top_p": 1.0 + 1e-6, "min_p": -1e-9, "softcap": 1e-7, "beams": 0,
              "max_new_tokens": 0}
    for key, value in beyond.items():
        with pytest.raises(BadValue):
            decoding.check({key: value})


# ---- the stage table ------------------------------------------------------------------------

def test_stage_table_follows_the_top_tokens_through_every_stage():
    knobs = Knobs(softcap=2.0, temperature=0.5, top_k=3)
    t = decoding.stage_table(LOGITS, knobs, 5, lambda i: f"t{i}")
    assert t.columns == ["raw", "soft-capped", "tempered", "filtered"] and t.kept == 3 and t.vocab == 12
    assert [r.id for r in t.rows] == [0, 1, 2, 3, 4]
    for rank, r in enumerate(t.rows, 1):
        raw = float(LOGITS[r.id])
        capped = 2.0 * math.tanh(raw / 2.0)
        assert [c.rank for c in r.cells[:3]] == [rank] * 3  # capping and temperature keep the ranking
        assert math.isclose(r.cells[0].value, raw, rel_tol=1e-6)
        assert math.isclose(r.cells[1].value, capped, rel_tol=1e-5)
        assert math.isclose(r.cells[2].value, capped / 0.5, rel_tol=1e-5)
    assert [c.value is None for c in (r.cells[3] for r in t.rows)] == [False, False, False, True, True]
    z = torch.tensor([2.0 * math.tanh(v / 2.0) / 0.5 for v in LOGITS[:3].tolist()])
    expected = torch.softmax(z, -1).tolist() + [0.0, 0.0]
    assert [r.prob for r in t.rows] == pytest.approx(expected, rel=1e-5)


# ---- soft-capping inside transformers' generate() -------------------------------------------

def test_decoding_never_imports_transformers():
    code = "import sys, lmhead_cli.decoding.stages; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_softcap_processor_in_transformers_generate(tiny):
    from transformers import LogitsProcessor, LogitsProcessorList

    from lmhead_cli.decoding.stages import SoftCapLogitsProcessor

    _, model = tiny
    cap = 0.5  # the tiny model's logits are small; a small cap shows
    processor = decoding.softcap_processor(cap)
    assert isinstance(processor, LogitsProcessor) and isinstance(processor, SoftCapLogitsProcessor)
    ids = torch.tensor([[464, 8251, 319, 262, 3084]])
    out = model.generate(ids, do_sample=False, max_new_tokens=3, pad_token_id=50256, output_scores=True,
                         output_logits=True, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([processor]))
    for raw, scores in zip(out.logits, out.scores):
        torch.testing.assert_close(scores, cap * torch.tanh(raw / cap))
        assert bool((scores.abs() < cap).all())
    plain = model.generate(ids, do_sample=False, max_new_tokens=3, pad_token_id=50256)
    assert torch.equal(out.sequences, plain)  # capping never changes the greedy choice
    with pytest.raises(UsageError):
        decoding.softcap_processor(0.0)


# ---- presets: the bundled file, your own, and the layers -----------------------------------------

def test_bundled_presets_are_the_tables_of_configs_presets_toml():
    import tomllib
    from pathlib import Path

    from lmhead_cli.api import presets

    on_disk = tomllib.loads((Path(__file__).resolve().parent.parent / "configs" / "presets.toml").read_text())
    assert presets.bundled() == on_disk and presets.preset_names() == sorted(on_disk)
    precise = presets.load_preset("precise")
    assert (precise.name, precise.description) == ("precise", on_disk["precise"]["description"])
    assert precise.values == {"temperature": 0.7, "top_k": 40, "min_p": 0.05}
    assert precise.path.endswith("presets.toml")


def test_a_preset_file_of_your_own(tmp_path):
    from lmhead_cli.api import presets

    f = tmp_path / "mine.toml"
    f.write_text('description = "mine"\ntemperature = 2\ntop_k = 3\n')
    p = presets.load_preset(str(f))
    assert (p.name, p.path, p.description) == ("mine", str(f), "mine")
    assert p.values == {"temperature": 2.0, "top_k": 3} and isinstance(p.values["temperature"], float)
    with pytest.raises(UsageError) as e:
        presets.load_preset(str(tmp_path / "absent.toml"))
    assert str(e.value) == f"no such preset file: {tmp_path / 'absent.toml'}"  # inputs.read_small_file's words
    bad = tmp_path / "bad.toml"
    bad.write_text("temperature = = 1\n")
    with pytest.raises(UsageError, match=rf"^{bad} is not valid TOML: "):
        presets.load_preset(str(bad))
    with pytest.raises(UsageError) as e:
        presets.load_preset("nosuch")
    assert str(e.value) == (f"unknown preset 'nosuch'; choose one of: {', '.join(presets.preset_names())} "
                            "(or give a .toml file)")


def test_presets_merge_under_the_flags_and_over_the_defaults():
    from lmhead_cli.api import presets

    assert presets.merge(None, {"top_k": 5}, {"top_k": None, "top_p": 0.9}) == {"top_k": 5, "top_p": 0.9}
    assert presets.merge("precise", {"top_k": 5, "seed": 1}, {"top_k": 7, "min_p": None}) == {
        "top_k": 7, "seed": 1, "temperature": 0.7, "min_p": 0.05}
    assert presets.knobs("precise", top_k=7) == Knobs(temperature=0.7, top_k=7, min_p=0.05)
    assert presets.knobs(None) == Knobs()
    with pytest.raises(BadValue, match="top_p"):
        presets.knobs(None, top_p=2.0)


def test_a_presets_own_max_new_tokens_is_not_a_stage(tmp_path):
    from lmhead_cli.api import presets

    f = tmp_path / "long.toml"
    f.write_text("max_new_tokens = 5\ntemperature = 0.5\n")
    assert presets.load_preset(str(f)).values == {"max_new_tokens": 5, "temperature": 0.5}
    assert presets.knobs(str(f)) == Knobs(temperature=0.5)


@pytest.mark.parametrize("table,message", [
    ([1, 2], "must be a table of settings, not list"),
    ({"temprature": 1.0}, "unknown key 'temprature'; allowed: description, softcap, temperature, top_k, top_p, "
                          "min_p, max_new_tokens"),
    ({"temperature": "hot"}, "temperature must be a number (got 'hot')"),
    ({"temperature": True}, "temperature must be a number (got True)"),
    ({"top_k": 2.5}, "top_k must be an integer (got 2.5)"),
    ({"top_k": True}, "top_k must be an integer (got True)"),
    ({"description": 3}, "description must be a string (got 3)"),
    ({"top_p": 0}, "top_p must be in (0, 1] (got 0)"),  # as the file gives it
])
def test_validate_names_the_file_the_preset_and_the_key(table, message):
    from lmhead_cli.api import presets

    with pytest.raises(UsageError) as e:
        presets.validate("p", "f.toml", table)
    assert str(e.value) == f"preset 'p' in f.toml: {message}"


def test_validate_keeps_ints_where_ints_are_asked_and_floats_where_floats_are():
    from lmhead_cli.api import presets

    p = presets.validate("p", "f.toml", {"temperature": 1, "top_k": 3, "description": "d"})
    assert p.values == {"temperature": 1.0, "top_k": 3} and type(p.values["temperature"]) is float
    assert type(p.values["top_k"]) is int and (p.name, p.path, p.description) == ("p", "f.toml", "d")
    assert presets.validate("q", "f.toml", {}).description == ""


@pytest.mark.parametrize("logits,knobs", [
    (LOGITS * 1e33, Knobs(temperature=1e-6)),  # overflow to +inf
    (torch.tensor([float("nan"), 1.0, 0.5]), Knobs()),  # a NaN logit, no infinity
])
def test_stage_table_refuses_logits_pushed_past_float32(logits, knobs):
    from lmhead_cli.errors import NonFiniteLogits

    with pytest.raises(NonFiniteLogits) as e:
        decoding.stage_table(logits, knobs, 2, str)
    assert str(e.value) == ("the stages pushed the logits past float32's range (NaN or inf); a larger "
                            "temperature, or a smaller soft-cap first (c·tanh(z/c) stays within ±c), keeps them finite")


def test_option_spells_each_setting_as_its_command_line_flag():
    assert decoding.option("softcap") == "--softcap" and decoding.option("top_k") == "--top-k"
    assert decoding.option("max_new_tokens") == "--max-new-tokens"
    assert decoding.option("ignore_eos") == "--ignore-eos"  # not a setting: the flag by the same rule


def test_stage_table_rows_carry_their_text_log_probability_and_the_table_its_entropy():
    knobs = Knobs(top_k=2)
    t = decoding.stage_table(LOGITS, knobs, 3, lambda i: f"t{i}")
    lp = torch.log_softmax(torch.tensor(LOGITS[:2].tolist()), -1)
    assert [r.token for r in t.rows] == ["t0", "t1", "t2"] and t.knobs is knobs
    assert [r.logprob for r in t.rows][:2] == pytest.approx(lp.tolist(), abs=1e-6) and t.rows[2].logprob == -math.inf
    assert [c.rank for c in t.rows[2].cells] == [3, 3, 3, None]  # filtered out: no rank in the last column
    assert t.entropy == pytest.approx(float(-(lp.exp() * lp).sum()), abs=1e-6)


def test_top_p_of_one_keeps_even_a_tail_that_float32_rounds_away():
    """p = 1 keeps every token; the cumulative sum would reach 1.0 early (0.99999999... rounds to 1)."""
    z = torch.tensor([0.0, -30.0, -30.0, -31.0])
    assert kept(decoding.top_p(z, 1.0)) == [0, 1, 2, 3]


def test_a_rule_without_advice_adds_nothing_to_its_message():
    with pytest.raises(BadValue) as e:
        decoding.check({"min_p": 1.0})
    assert str(e.value) == "min_p must be in [0, 1) (got 1.0)"
    with pytest.raises(BadValue) as e:
        decoding.check({"temperature": 1e-9})
    assert str(e.value) == ("temperature must be 0 (greedy) or a finite number of at least 1e-06 (got 1e-09); "
                            "0 is greedy: the most likely token every time")


def test_an_unknown_attribute_of_stages_is_an_attribute_error():
    with pytest.raises(AttributeError) as e:
        decoding.no_such_thing  # noqa: B018
    assert str(e.value) == "module 'lmhead_cli.decoding.stages' has no attribute 'no_such_thing'"


def test_a_rows_rank_is_its_raw_rank_even_where_a_stage_ties_the_rows():
    """A soft-cap far below the logits saturates them all to the same value (ranks tie at 1 in that
    column); the row's own rank stays the raw logits' rank."""
    t = decoding.stage_table(LOGITS, Knobs(softcap=0.01), 4, lambda i: f"t{i}")
    assert [r.rank for r in t.rows] == [1, 2, 3, 4]
    assert [r.cells[1].rank for r in t.rows] == [1, 1, 1, 1]  # every top logit capped to the same value


def test_the_softcap_processor_pickles_as_the_class_stages_exports():
    """Its __qualname__ names it where pickle (and multiprocessing) look it up: stages.SoftCapLogitsProcessor."""
    import pickle

    processor = decoding.softcap_processor(0.5)
    back = pickle.loads(pickle.dumps(processor))
    assert type(back) is type(processor) and back.cap == 0.5
    scores = torch.tensor([[3.0, 0.1, -2.0]])
    torch.testing.assert_close(back(None, scores), 0.5 * torch.tanh(scores / 0.5))
    assert repr(processor).startswith("<lmhead_cli.decoding.stages.SoftCapLogitsProcessor object at ")


def test_a_preset_file_with_a_utf8_byte_order_mark(tmp_path):
    """Editors on Windows often save UTF-8 with a BOM (EF BB BF); TOML itself does not allow one."""
    from lmhead_cli.api import presets

    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbftemperature = 0.5\n")
    assert presets.load_preset(str(f)).values == {"temperature": 0.5}


def test_a_preset_file_that_cannot_be_read_says_why(tmp_path):
    """/proc/self/mem is a regular file whose read at offset 0 fails (EIO), even for root."""
    from lmhead_cli.api import presets

    f = tmp_path / "mem.toml"
    f.symlink_to("/proc/self/mem")
    with pytest.raises(UsageError) as e:
        presets.load_preset(str(f))
    assert str(e.value) == f"the preset file {f} cannot be read: Input/output error"


def test_a_huge_preset_file_is_refused_after_reading_only_past_the_limit(tmp_path):
    """A 1 TiB (sparse) file: only MAX_PRESET_BYTES + 1 bytes are read, never the whole file."""
    from lmhead_cli.api import presets

    f = tmp_path / "huge.toml"
    with open(f, "wb") as out:
        out.truncate(1 << 40)
    with pytest.raises(UsageError) as e:
        presets.load_preset(str(f))
    assert str(e.value) == f"the preset file {f} is longer than 1,048,576 bytes"


def test_a_preset_that_is_not_utf8_is_named_in_the_error(tmp_path):
    from lmhead_cli.api import presets

    f = tmp_path / "mine.toml"
    f.write_bytes(b'temperature = 0.8\ndescription = "caf\xe9"\n')
    with pytest.raises(UsageError) as e:
        presets.load_preset(str(f))
    assert str(e.value).startswith(f"the preset file {f} is not UTF-8 text (byte 0xe9 at byte ")


def test_a_settings_first_listed_option_is_its_name_on_the_command_line():
    """Setting.option: the first of `options` where it lists any, else --key-with-dashes."""
    from lmhead_cli.decoding.stages import Rule, Setting

    rule = Rule("0 or more", ge=0)
    assert Setting("max_width", int, rule, options=("--width", "-w")).option == "--width"
    assert Setting("max_width", int, rule).option == "--max-width"


def test_sampling_draws_one_token_per_row():
    """choose: (R, V) -> (R,) for any number of rows, greedy or drawn."""
    logprobs = torch.log_softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(0)), -1)
    for greedy in (True, False):
        got = decoding.choose(logprobs, greedy, torch.Generator().manual_seed(1))
        assert got.shape == (3,) and got.dtype == torch.int64


def test_softcap_stays_inside_under_a_float64_default_dtype(restore_default_dtype):
    """A notebook may set torch's default dtype to float64: the cap is still never reached in float32."""
    torch.set_default_dtype(torch.float64)
    z = torch.tensor([1e6, -1e6, 29.0], dtype=torch.float32)
    got = decoding.softcap(z, 30.0)
    assert got.dtype == torch.float32 and bool((got.abs() < 30.0).all())


def test_the_softcap_processor_keeps_the_scores_dtype():
    """transformers hands the processor scores in the model's dtype; it returns them capped, in that dtype."""
    processor = decoding.softcap_processor(30.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        scores = torch.tensor([[100.0, -3.0, 0.5]], dtype=dtype)
        got = processor(torch.tensor([[1]]), scores)
        assert got.dtype == dtype and float(got[0, 0]) < 30.0


@pytest.fixture
def restore_default_dtype():
    before = torch.get_default_dtype()
    yield
    torch.set_default_dtype(before)


# ---- from the full mutation run of decoding/stages.py and presets.py: each fails on its mutant -------

def test_a_preset_file_of_exactly_the_limit_is_read(tmp_path):
    from lmhead_cli.api import presets

    f = tmp_path / "full.toml"
    head = b"temperature = 0.5\n"
    f.write_bytes(head + b"#" * (presets.MAX_PRESET_BYTES - len(head) - 1) + b"\n")
    assert f.stat().st_size == presets.MAX_PRESET_BYTES
    assert presets.load_preset(str(f)).values == {"temperature": 0.5}


def test_a_preset_path_that_is_a_folder_is_named_as_not_a_regular_file(tmp_path):
    from lmhead_cli.api import presets

    folder = tmp_path / "mine.toml"
    folder.mkdir()
    with pytest.raises(UsageError) as e:  # it is there, so not "no such file"
        presets.load_preset(str(folder))
    assert str(e.value) == f"the preset file {folder} is a folder, not a file"


def test_a_preset_nested_too_deeply_for_the_toml_reader_says_so(tmp_path):
    from lmhead_cli.api import presets

    f = tmp_path / "deep.toml"
    f.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(UsageError) as e:
        presets.load_preset(str(f))
    assert str(e.value) == f"{f} is not a preset lmhead can read: its TOML is nested too deeply"


def test_the_largest_soft_cap_is_allowed():
    decoding.check({"softcap": decoding.MAX_SOFTCAP})  # at the limit: fine
    with pytest.raises(BadValue):
        decoding.check({"softcap": decoding.MAX_SOFTCAP * 1.0001})


def test_stage_table_rows_carry_each_tokens_raw_logit():
    """A row's logit is the raw one (column 0), not the soft-capped or tempered value beside it."""
    t = decoding.stage_table(LOGITS, Knobs(softcap=2.0, temperature=0.5), 4, lambda i: f"t{i}")
    assert [r.logit for r in t.rows] == pytest.approx(LOGITS[:4].tolist(), rel=1e-6)
    assert all(r.logit != pytest.approx(r.cells[1].value) for r in t.rows)


@pytest.mark.parametrize("args", [
    ["sample", "x", "--softcap", "4e38", "--seed", "1"],
    ["sample", "x", "--softcap", "1e308", "--seed", "1"],
    ["inspect", "x", "--stages", "--softcap", "1e39"],
    ["greedy", "x", "--cap", "3.5e38"],
])
def test_a_softcap_beyond_its_bound_is_refused_with_the_bound(args):
    got = invoke([*args, "-n", "1", "--model", "random:distilgpt2"] if args[0] != "inspect" else
                 [*args, "--model", "random:distilgpt2"])
    one_line(got, 2, "between 1e-06 and 1e+06")


def test_the_largest_softcap_decodes_like_no_softcap():
    a = json.loads(invoke(["greedy", "The keys", "-n", "3", "--softcap", "1e6", "--model", "random:distilgpt2",
                           "--json"]).stdout)
    b = json.loads(invoke(["greedy", "The keys", "-n", "3", "--model", "random:distilgpt2", "--json"]).stdout)
    assert a["text"] == b["text"]


def test_non_finite_stages_give_advice_that_points_the_right_way():
    from lmhead_cli.decoding.stages import Knobs, stage_table
    from lmhead_cli.errors import NonFiniteLogits

    z = torch.zeros(10)
    z[0] = 3e38
    with pytest.raises(NonFiniteLogits) as e:
        stage_table(z, Knobs(temperature=1e-6), 3, str)
    assert "larger temperature or soft-cap" not in str(e.value)
    assert "larger temperature" in str(e.value) and "smaller soft-cap" in str(e.value)


EXACT = torch.log(torch.tensor([0.125, 0.5, 0.125, 0.25]))  # softmax gives these exactly in float32


def test_the_exact_probabilities_are_exact():
    """The boundary cases below mean something only if float32 softmax and cumsum are exact here."""
    p = EXACT.softmax(-1)
    assert p.tolist() == [0.125, 0.5, 0.125, 0.25]
    assert torch.sort(p, descending=True).values.cumsum(-1).tolist() == [0.5, 0.75, 0.875, 1.0]


def test_top_p_stops_at_a_mass_exactly_equal_to_p():
    """0.5 + 0.25 = 0.75 = p: the third token is not needed. Mutant: `mass_before >= p` as `>`."""
    assert kept(stages.top_p(EXACT, 0.75)) == [1, 3]
    assert kept(stages.top_p(EXACT, 0.5)) == [1]
    assert len(kept(stages.top_p(EXACT, 0.875))) == 3  # 0.5 + 0.25 + 0.125 (either of the tied 0.125s)


def test_min_p_keeps_a_token_exactly_at_its_threshold():
    """p = 0.25 = 0.5 × 0.5 stays; 0.125 = 0.25 × 0.5 stays. Mutant: `z - best < log m` as `<=`."""
    assert kept(stages.min_p(EXACT, 0.5)) == [1, 3]
    assert kept(stages.min_p(EXACT, 0.25)) == [0, 1, 2, 3]


@pytest.mark.parametrize("p", [0.5, 0.75, 0.9])
def test_top_p_at_the_boundary_matches_transformers(p):
    from transformers.generation.logits_process import TopPLogitsWarper

    theirs = TopPLogitsWarper(top_p=p)(None, EXACT[None].clone())[0]
    assert kept(stages.top_p(EXACT, p)) == kept(theirs)


@pytest.mark.parametrize("m", [0.25, 0.5, 0.6])
def test_min_p_at_the_boundary_matches_transformers(m):
    from transformers.generation.logits_process import MinPLogitsWarper

    theirs = MinPLogitsWarper(min_p=m)(None, EXACT[None].clone())[0]
    assert kept(stages.min_p(EXACT, m)) == kept(theirs)


def test_a_damaged_bundled_preset_file_is_named_in_its_error(tmp_path, monkeypatch):
    """An installed package whose presets file is not TOML: the one-line error names that file.
    Mutant: the error names None."""
    from lmhead_cli.api import presets
    from lmhead_cli.errors import UsageError

    broken = tmp_path / "presets.toml"
    broken.write_text("[greedy\n", encoding="utf-8")
    monkeypatch.setattr(presets, "_bundled_file", lambda: broken)
    with pytest.raises(UsageError, match=f"^{broken} is not valid TOML"):
        presets.bundled()
