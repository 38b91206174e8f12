"""`lmhead generate / greedy / sample / softcap` and `inspect --stages` through the CLI.

Ids are checked against transformers' generate() on the tiny checkpoint; bad input exits 2 with
one line and no traceback, before any model is loaded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, build_checkpoint, cli


EOS = 50256


def run(tiny, *args, input=None):
    return cli(*args, "--model", str(tiny[0]), input=input)


def doc(tiny, *args, input=None) -> dict:
    got = run(tiny, *args, "--json", input=input)
    assert got.exit_code == 0, got.output
    return json.loads(got.stdout)


def reference(tiny, ids=PROMPT_IDS, **kwargs) -> list[int]:
    out = tiny[1].generate(torch.tensor([ids]), do_sample=False, pad_token_id=EOS, **kwargs)
    return out[0, len(ids):].tolist()


# ---- the four commands ------------------------------------------------------------------------

def test_greedy_json_matches_transformers_and_holds_what_a_replay_needs(tiny):
    d = doc(tiny, "greedy", PROMPT, "--max-new-tokens", "10")
    assert d["prompt_ids"] == PROMPT_IDS and d["generated_ids"] == reference(tiny, max_new_tokens=10)
    assert d["mode"] == "greedy" and d["seed"] is None and d["stop"] == "max_new_tokens"
    assert d["tokens_generated"] == 10 and d["tokens_per_second"] > 0 and d["elapsed_s"] > 0
    assert d["tokens_per_second"] == pytest.approx(10 / d["elapsed_s"])
    assert d["decode_tokens_per_second"] == pytest.approx(9 / (d["elapsed_s"] - d["first_token_s"]))
    assert [s["id"] for s in d["steps"]] == d["generated_ids"]
    assert set(d["steps"][0]) == {"id", "token", "prob", "logprob", "logit", "entropy", "rank", "raw_logprob",
                                  "raw_entropy", "removed_mass"}
    assert all(s["rank"] == 1 for s in d["steps"])
    assert d["mean_entropy"] == pytest.approx(sum(s["entropy"] for s in d["steps"]) / 10)


def test_generate_streams_text_and_prints_a_summary(tiny):
    got = run(tiny, "generate", "--temperature", "0.8", "--seed", "1", "-n", "6")
    assert got.exit_code == 0, got.output
    lines = got.stdout.splitlines()
    assert lines[0].startswith(PROMPT)  # no prompt given: the default one
    assert "6 tokens in" in got.stdout and "tokens/s" in got.stdout and "mean entropy" in got.stdout
    assert "entropy per step" in got.stdout and "seed 1 (replay with --seed 1)" in got.stdout
    again = doc(tiny, "generate", "--temperature", "0.8", "--seed", "1", "-n", "6")
    assert lines[0] == PROMPT + again["text"]


def test_sampling_without_a_seed_reports_one_that_replays(tiny):
    first = doc(tiny, "sample", "-n", "8")
    assert isinstance(first["seed"], int)
    again = doc(tiny, "sample", "-n", "8", "--seed", str(first["seed"]))
    assert again["generated_ids"] == first["generated_ids"] and again["seed"] == first["seed"]


def test_softcap_defaults_to_30_and_takes_cap(tiny):
    assert doc(tiny, "softcap", "-n", "2", "--seed", "0")["settings"]["softcap"] == 30.0
    d = doc(tiny, "softcap", "--cap", "0.5", "-n", "3", "--seed", "0")
    assert d["settings"]["softcap"] == 0.5 and d["mode"] == "sample"
    plain = doc(tiny, "sample", "-n", "3", "--seed", "0")
    assert d["steps"][0]["prob"] != plain["steps"][0]["prob"]  # capping at 0.5 flattens these logits


def test_beams_match_transformers(tiny):
    d = doc(tiny, "generate", PROMPT, "--beams", "4", "-n", "6")
    assert d["mode"] == "beam" and d["generated_ids"] == reference(tiny, num_beams=4, max_new_tokens=6)
    assert doc(tiny, "greedy", PROMPT, "--beams", "4", "-n", "6")["generated_ids"] == d["generated_ids"]


def test_transformers_engine_gives_the_same_tokens(tiny):
    lean = doc(tiny, "greedy", PROMPT, "-n", "6")
    hf = doc(tiny, "greedy", PROMPT, "-n", "6", "--engine", "transformers")
    assert hf["engine"] == "transformers" and hf["generated_ids"] == lean["generated_ids"]


def test_show_steps_table(tiny):
    got = run(tiny, "greedy", PROMPT, "-n", "3", "--show-steps", "4")
    assert got.exit_code == 0, got.output
    assert "and the 4 most probable tokens" in got.stdout and "rank" in got.stdout
    d = doc(tiny, "greedy", PROMPT, "-n", "3", "--show-steps", "4")
    for step in d["steps"]:
        alts = step["alternatives"]
        assert len(alts) == 4 and alts[0]["id"] == step["id"]
        assert [a["prob"] for a in alts] == sorted((a["prob"] for a in alts), reverse=True)


def test_prompt_from_stdin(tiny):
    d = doc(tiny, "greedy", "-", "-n", "2", input="Hello there\n")
    assert d["prompt"] == "Hello there" and d["prompt_ids"] == [15496, 612]


# ---- presets ------------------------------------------------------------------------------------

def test_presets_apply_and_flags_override(tiny):
    d = doc(tiny, "generate", "--preset", "creative", "-n", "2", "--seed", "0")
    assert d["settings"]["temperature"] == 1.1 and d["settings"]["top_p"] == 0.95 and d["preset"] == "creative"
    d = doc(tiny, "generate", "--preset", "creative", "--temperature", "0.5", "-n", "2", "--seed", "0")
    assert d["settings"]["temperature"] == 0.5 and d["settings"]["top_p"] == 0.95
    assert doc(tiny, "sample", "--preset", "gemma-softcap", "-n", "1", "--seed", "0")["settings"]["softcap"] == 30.0


def test_every_bundled_preset_is_valid():
    from lmhead_cli.api.presets import load_preset, preset_names

    assert {"creative", "gemma-softcap", "precise"} <= set(preset_names())
    for name in preset_names():
        assert load_preset(name).description


@pytest.mark.parametrize("body,words", [
    ("temperature = 0.7\ncolour = 3\n", "unknown key 'colour'"),
    ("temperature = -1.0\n", "temperature must be 0 (greedy) or a finite number of at least 1e-06"),
    ("top_k = 2.5\n", "top_k must be an integer (got 2.5)"),
    ("top_p = 'high'\n", "top_p must be a number"),
    ("temperature = \n", "not valid TOML"),
])
def test_a_bad_preset_file_is_a_usage_error_naming_the_file(tmp_path, body, words):
    path = tmp_path / "mine.toml"
    path.write_text(body)
    got = cli("generate", "--preset", str(path), "--model", "random:gpt2")
    assert got.exit_code == 2 and words in got.stderr and str(path) in got.stderr, got.stderr


def test_an_unknown_preset_lists_them():
    got = cli("generate", "--preset", "wild", "--model", "random:gpt2")
    assert got.exit_code == 2
    assert "unknown preset 'wild'; choose one of: creative, gemma-softcap, precise" in got.stderr


# ---- bad input: one line, exit 2, before the model loads ----------------------------------------

@pytest.mark.parametrize("args,words", [
    (["sample", "--temperature", "0"], "use lmhead greedy"),
    (["generate", "--temperature", "-1"], "--temperature must be"),
    (["generate", "--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number"),
    (["generate", "--temperature", "inf"], "--temperature must be 0 (greedy) or a finite number"),
    (["generate", "--top-k", "-2"], "--top-k must be at least 1 (0 or -1: off)"),
    (["generate", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "--min-p", "1"], "--min-p must be in [0, 1)"),
    (["generate", "--min-p", "-0.1"], "--min-p must be in [0, 1)"),
    (["generate", "--softcap", "0"], "--softcap must be"),
    (["softcap", "--cap", "-30"], "--softcap must be"),
    (["generate", "--beams", "0"], "--beams must be at least 1"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["generate", "--show-steps", "-1"], "--show-steps must be 0 or more"),
    (["sample", "--greedy"], "use lmhead greedy"),
    (["softcap", "--beams", "3"], "use lmhead greedy --beams 3"),
    (["generate", ""], "the prompt is empty"),
    (["greedy", "-"], "the prompt is empty"),  # stdin empty
])
def test_bad_input_is_one_clear_line(args, words):
    # a model that does not exist: the check must come first, or this would say "not found"
    got = cli(*args, "--model", "./no-such-model")
    assert got.exit_code == 2, got.output
    assert got.stderr.count("\n") == 1 and got.stderr.startswith("lmhead: error: ") and words in got.stderr
    assert "Traceback" not in got.output


@pytest.mark.parametrize("args,words", [
    (["generate", "--beams", "1000000"], "--beams of 1,000,000 need about"),
    (["greedy", "--beams", "1000000"], "--beams of 1,000,000 need about"),
    (["generate", "--beams", "1000000", "--show-steps", "3"], "--beams of 1,000,000 need about"),
    (["generate", "--top-logprobs", "50258", "--format", "openai"], "--top-logprobs"),
])
def test_checks_that_need_the_model_come_before_any_output(tiny, monkeypatch, args, words):
    # the banner and the prompt are printed once the model is loaded; a value it refuses prints neither
    from lmhead_cli.loading import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 10**9)
    got = run(tiny, args[0], "The keys", *args[1:])
    assert got.exit_code == 2, got.output
    assert got.stdout == ""
    assert got.stderr.count("\n") == 1 and got.stderr.startswith("lmhead: error: ") and words in got.stderr


# ---- limits, interruptions, pipes, broken weights -------------------------------------------------

def test_the_context_limit_stops_with_a_notice(tmp_path):
    folder = tmp_path / "short"
    build_checkpoint(folder, n_positions=16)
    got = cli("greedy", PROMPT * 2, "-n", "40", "--model", str(folder), "--json")
    assert got.exit_code == 0, got.output
    d = json.loads(got.stdout)
    assert d["stop"] == "context" and len(d["generated_ids"]) == 7
    assert "stopped at the context limit: 10 prompt tokens + 7 new fill the model's 16 positions" in got.stderr


def test_ctrl_c_keeps_the_text_so_far_and_exits_130(tiny, monkeypatch):
    from lmhead_cli.render import generate as show

    written = []

    def stream(piece):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(piece)
        sys.stdout.write(piece)

    monkeypatch.setattr(show, "stream", stream)
    got = run(tiny, "sample", PROMPT, "-n", "20", "--seed", "0")
    assert got.exit_code == 130
    assert got.stdout.startswith(PROMPT + "".join(written)) and "interrupted" in got.stderr


def test_non_finite_logits_stop_with_a_clear_error(tmp_path):
    folder = tmp_path / "nan"
    model = build_checkpoint(folder)
    with torch.no_grad():
        model.transformer.ln_f.weight[0] = float("nan")
    model.save_pretrained(folder)
    got = cli("greedy", PROMPT, "-n", "3", "--model", str(folder))
    assert got.exit_code == 1 and "non-finite logits" in got.stderr and "Traceback" not in got.output


def test_sampling_non_finite_logits_is_one_line_not_an_unexpected_error(tmp_path, tiny):
    from helpers import nan_checkpoint

    folder = nan_checkpoint(tiny[0], tmp_path)
    got = cli("sample", PROMPT, "-n", "3", "--seed", "0", "--model", str(folder))
    assert got.exit_code == 1 and "Traceback" not in got.output and "unexpected" not in got.output
    assert re.match(r"lmhead: error: the head produced (\d+ )?non-finite logits \(NaN or inf\)", got.stderr.strip())
    assert len(got.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_piping_into_head_ends_quietly(tiny):
    cmd = (f"{sys.executable} -m lmhead_cli greedy {PROMPT!r} --max-new-tokens 300 --ignore-eos "
           f"--model {tiny[0]} | head -c 30; exit ${{PIPESTATUS[0]}}")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and done.stdout.startswith(PROMPT)


# ---- inspect --stages -------------------------------------------------------------------------

def test_inspect_stages_table_and_json(tiny):
    got = run(tiny, "inspect", PROMPT, "--stages", "--softcap", "1", "--temperature", "0.5", "--filter-top-k", "3",
              "-k", "5")
    assert got.exit_code == 0, got.output
    assert "through the stages: softcap 1 → temperature 0.5 → top-k 3 → softmax" in got.stdout
    assert got.stdout.count("dropped") == 2 and "3 of 50,257 tokens survive" in got.stdout
    d = doc(tiny, "inspect", PROMPT, "--temperature", "0.5", "--filter-top-k", "3", "-k", "5")  # knobs imply --stages
    st = d["stages"]
    assert st["columns"] == ["raw", "soft-capped", "tempered", "filtered"] and st["kept"] == 3
    with torch.no_grad():
        z = tiny[1](torch.tensor([PROMPT_IDS])).logits[0, -1]
    top = torch.topk(z, 5)
    assert [r["id"] for r in st["rows"]] == top.indices.tolist() == [t["id"] for t in d["top"]]
    p = torch.softmax(top.values[:3] / 0.5, -1).tolist() + [0.0, 0.0]
    assert [r["prob"] for r in st["rows"]] == pytest.approx(p, rel=1e-4)
    assert [r["stages"][2]["rank"] for r in st["rows"]] == [1, 2, 3, 4, 5]
    assert [r["stages"][3]["rank"] for r in st["rows"]] == [1, 2, 3, None, None]


def test_inspect_without_stages_is_unchanged_and_bad_knobs_exit_2(tiny):
    assert "stages" not in doc(tiny, "inspect", PROMPT)
    got = cli("inspect", PROMPT, "--stages", "--top-p", "2", "--model", "./no-such-model")
    assert got.exit_code == 2 and "--top-p must be in (0, 1]" in got.stderr


# ---- the command from the issue, on random:gpt2 ------------------------------------------------

def test_done_when_generate_on_random_gpt2():
    got = cli("generate", "--temperature", "0.8", "--seed", "1", "--model", "random:gpt2",
                              "-n", "5")
    assert got.exit_code == 0, got.output
    assert got.stdout.startswith("random weights (random:gpt2, seeded)")  # every random-weights output says so
    text = got.stdout.split("the predictions are not.\n", 1)[1]
    assert text.startswith(PROMPT) and "5 tokens in" in got.stdout and "seed 1" in got.stdout


def test_the_speed_says_what_it_ran_on(tiny, monkeypatch):
    """generate's speed is reported with what the products ran on: the compiled kernels' variant, or
    torch's products where they are unavailable, said once, in the summary line and the JSON."""
    from lmhead_cli.engine import kernels

    k = kernels.load()
    args = ("greedy", "The keys", "-n", "3", "--model", str(tiny[0]))
    doc = json.loads(cli(*args, "--json").stdout)
    assert doc["products"] == (f"compiled kernels ({k.variant})" if k is not None else "torch's products")
    monkeypatch.setattr(kernels, "load", lambda: None)
    assert json.loads(cli(*args, "--json").stdout)["products"] == "torch's products"
    said = cli(*args).stdout
    lines = [line for line in said.splitlines() if "tokens/s" in line]
    assert len(lines) == 1 and "tokens/s (torch's products) ·" in lines[0] and said.count("torch's products") == 1


# ---- what the summary and the first line say ---------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "greedy", "sample", "softcap"])
def test_without_a_prompt_the_first_line_says_which_prompt_it_continues(tiny, command):
    """inspect and lens refuse to run without a prompt; the generating commands keep the default one,
    and say so in their first line (on stderr, so --json stays one document)."""
    got = run(tiny, command, "-n", "1", "--seed", "1")
    assert got.exit_code == 0, got.output
    assert got.stderr.splitlines()[0] == (f'no prompt given: continuing "{PROMPT}" (give one: lmhead {command} '
                                          '"TEXT")')
    assert "no prompt given" not in run(tiny, command, PROMPT, "-n", "1", "--seed", "1").output
    assert json.loads(run(tiny, command, "-n", "1", "--seed", "1", "--json").stdout)["mode"]


def test_one_token_is_one_token_and_a_flat_entropy_draws_flat(tiny):
    """"1 token in", not "1 tokens in"; entropies that the caption prints as one number draw as low
    bars, not as full-height bars for digits nobody sees."""
    from lmhead_cli.render import SPARK, plural, sparkline

    got = run(tiny, "greedy", PROMPT, "-n", "1")
    assert "── 1 token in " in got.stdout, got.stdout
    assert (plural(1, "token"), plural(2, "token"), plural(1024, "token")) == ("1 token", "2 tokens", "1,024 tokens")
    flat = [10.6701, 10.6712, 10.6704]
    assert sparkline(flat) == SPARK[0] + SPARK[-1] + SPARK[2]  # scaled to its own span: full height
    assert set(sparkline(flat, resolution=0.01)) <= set(SPARK[:2])  # scaled to the caption's digit: flat
    assert sparkline([1.0, 2.0], resolution=0.01) == SPARK[0] + SPARK[-1]  # a real range still spans the bars


def test_one_generate_checks_its_settings_once(tiny, monkeypatch):
    """`lmhead sample` converts its options into the one Settings in one call of decoding.settings.make,
    before the load, and hands them to Model.generate as they are (it checked them twice before). A value
    that is not Settings is refused by name."""
    from lmhead_cli.decoding import settings as decoding_settings
    from lmhead_cli.errors import BadType

    seen = []
    real = decoding_settings.make
    monkeypatch.setattr(decoding_settings, "make", lambda **values: seen.append(values) or real(**values))
    got = run(tiny, "sample", "--seed", "3", "--temperature", "0.7", "--max-new-tokens", "3", "--json")
    assert got.exit_code == 0, got.output
    assert len(seen) == 1 and seen[0]["temperature"] == 0.7 and seen[0]["seed"] == 3
    import lmhead_cli

    with pytest.raises(BadType) as e:
        lmhead_cli.load(str(tiny[0]), device="cpu").generate("x", settings={"temperature": 0.7})
    assert e.value.key == "settings"
