"""`bundled:tiny`: the small trained GPT-2 that ships in the package. Its figures are checked against
transformers (the oracle) loading the same folder; the tests assert that its predictions mean
something (held-out text, frequent continuations, the lens converging), that it needs no network
or cache, that its file is the documented one, and that a broken install is one line."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from helpers import cli

from lmhead_cli.loading import bundled
from lmhead_cli.loading.sources import load_model

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "lmhead_cli" / "data" / "bundled-tiny"
ABOUT = bundled.BUNDLED["tiny"]

# Ruth 1:1-5 and Jonah 1:1-3 (KJV): books training/train_bundled.py holds out (HELD_OUT).
HELD_OUT = ("Now it came to pass in the days when the judges ruled, that there was a famine in the land. "
            "And a certain man of Bethlehemjudah went to sojourn in the country of Moab, he, and his wife, "
            "and his two sons. And the name of the man was Elimelech, and the name of his wife Naomi, and "
            "the name of his two sons Mahlon and Chilion, Ephrathites of Bethlehemjudah. And they came into "
            "the country of Moab, and continued there. And Elimelech Naomi's husband died; and she was left, "
            "and her two sons. And they took them wives of the women of Moab; the name of the one was Orpah, "
            "and the name of the other Ruth: and they dwelled there about ten years. And Mahlon and Chilion "
            "died also both of them; and the woman was left of her two sons and her husband.")
JONAH = ("Now the word of the LORD came unto Jonah the son of Amittai, saying, Arise, go to Nineveh, that "
         "great city, and cry against it; for their wickedness is come up before me. But Jonah rose up to "
         "flee unto Tarshish from the presence of the LORD, and went down to Joppa; and he found a ship "
         "going to Tarshish: so he paid the fare thereof, and went down into it, to go with them unto "
         "Tarshish from the presence of the LORD.")
MODERN = ("The city council met on Tuesday to discuss the new budget. Most members agreed that the roads "
          "needed repair, but they could not decide how much money to spend on the schools.")


def run(*args):
    return cli(*args)


def score_json(text: str, model: str) -> dict:
    r = run("score", text, "--model", model, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def tiny():
    return load_model("bundled:tiny", device="cpu")


# ---- what ships ----------------------------------------------------------------------------

def test_the_file_is_the_documented_one():
    digest = hashlib.sha256((FOLDER / "model.safetensors").read_bytes()).hexdigest()
    doc = (ROOT / "docs" / "bundled-model.md").read_text()
    assert re.search(r"\b[0-9a-f]{64}\b", doc) and digest in doc
    sums = dict(reversed(line.split()) for line in (FOLDER / "SHA256SUMS").read_text().splitlines())
    assert sums["model.safetensors"] == digest
    assert sums["config.json"] == hashlib.sha256((FOLDER / "config.json").read_bytes()).hexdigest()
    assert (FOLDER / "model.safetensors").stat().st_size <= 25 * 2**20


def test_every_bundled_file_is_package_data():
    """A wheel carries exactly what pyproject's package-data names: each file of the folder must match."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "lmhead_cli.data" in data["packages"]
    globs = data["package-data"]["lmhead_cli.data"]
    for f in FOLDER.iterdir():
        assert any(fnmatch(f"bundled-tiny/{f.name}", g) for g in globs), f.name


def test_loads_offline_as_a_tied_float32_gpt2(tiny):
    assert (tiny.kind, tiny.random_weights, tiny.path) == ("bundled", False, str(FOLDER))
    assert tiny.tie.tied and tiny.tie.shape == (50257, tiny.config["n_embd"])
    assert {p.dtype for p in tiny.module.parameters()} == {torch.float32}
    assert tiny.tokenizer.encode(" light") == [1657]  # the real GPT-2 tokenizer


def test_logprobs_are_transformers_own(tiny):
    """The same folder through transformers' GPT2LMHeadModel gives the same log-probabilities."""
    from transformers import GPT2LMHeadModel

    oracle = GPT2LMHeadModel.from_pretrained(FOLDER, torch_dtype=torch.float32).eval()
    ids = tiny.tokenizer.encode(JONAH)
    with torch.no_grad():
        want = torch.log_softmax(oracle(torch.tensor([ids])).logits[0], -1)
    s = score_json(JONAH, "bundled:tiny")
    got = [t["logprob"] for t in s["tokens"][1:]]
    assert torch.allclose(torch.tensor(got), want[torch.arange(len(ids) - 1), ids[1:]], atol=1e-4)


# ---- its predictions mean something --------------------------------------------------------

def test_held_out_text_is_at_least_100x_less_perplexing_than_random():
    for text in (HELD_OUT, JONAH):
        trained, rand = score_json(text, "bundled:tiny"), score_json(text, "random:gpt2")
        assert trained["scored_tokens"] == rand["scored_tokens"] > 50
        assert trained["perplexity"] * 100 <= rand["perplexity"]


def test_modern_english_is_still_far_better_than_random():
    """Out of its domain (measured: about 23x below random on MODERN), but far from noise."""
    trained, rand = score_json(MODERN, "bundled:tiny"), score_json(MODERN, "random:gpt2")
    assert trained["perplexity"] * 10 <= rand["perplexity"]


@pytest.mark.parametrize("prompt, token", [
    ("And it came to", " pass"),  # "it came to" is followed by "pass" 451 times in 452 in the KJV
    ("Thus saith the", " LORD"),  # 85 "LORD", 49 "Lord"
    ("the word of the", " LORD"),  # 220 of 236
    ("the LORD thy", " God"),  # 291 of 293
])
def test_frequent_continuations_in_the_training_text_come_first(prompt, token):
    r = run("inspect", prompt, "--model", "bundled:tiny", "--json")
    assert r.exit_code == 0, r.output
    top = json.loads(r.stdout)["top"]
    assert top[0]["token"] == token
    assert top[0]["prob"] >= 2 * top[1]["prob"]


def test_the_lens_converges_on_the_continuation_at_the_last_layer():
    """Layer by layer the frequent continuation gains probability, becomes the top token only at
    the last block, where the entropy falls. (Layer 0, the embeddings read through the tied head,
    mostly predicts the current token again, with a low entropy of its own.)"""
    r = run("lens", "And it came to", "--target", " pass", "--model", "bundled:tiny", "--json")
    assert r.exit_code == 0, r.output
    layers = json.loads(r.stdout)["layers"]
    assert len(layers) == 5  # the embeddings, then 4 blocks
    probs = [layer["targets"][0]["prob"] for layer in layers]
    assert probs == sorted(probs) and probs[-1] > 100 * probs[0]
    assert [layer["top_token"] == " pass" for layer in layers] == [False] * 4 + [True]
    assert layers[-1]["entropy"] < min(layer["entropy"] for layer in layers[1:-1])


def test_the_api_loads_it_too():
    import lmhead_cli

    m = lmhead_cli.load("bundled:tiny", device="cpu")
    assert (m.source, m.random_weights, m.vocab_size, m.n_ctx) == ("bundled:tiny", False, 50257, 256)
    d = m.inspect("Thus saith the", top_k=3).to_dict()
    assert d["model"] == "bundled:tiny" and d["top"][0]["token"] == " LORD"


def test_help_and_completion_offer_it():
    from lmhead_cli.cli import complete

    assert complete.models("bund") == ["bundled:tiny"]
    for command in ("inspect", "score", "lens", "generate"):
        assert "bundled:tiny" in " ".join(run(command, "--help").stdout.split())


# ---- what the outputs say --------------------------------------------------------------------

@pytest.mark.parametrize("command", [["inspect", "And God said"], ["score", "And God said, Let there be light"],
                                     ["lens", "And God said"]])
def test_outputs_name_the_model_and_its_data_once_and_never_say_random(command):
    r = run(*command, "--model", "bundled:tiny")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.stdout.split())
    assert flat.count("King James Bible") == 1 and "bundled:tiny" in flat
    assert "random weights" not in flat


def test_the_offline_error_suggests_the_bundled_model():
    r = run("inspect", "hello", "--model", "gpt2")
    assert r.exit_code == 1
    line = " ".join(r.output.split())
    assert line.startswith("lmhead: error:") and "random:gpt2" in line and "bundled:tiny" in line


def test_an_unknown_bundled_name_lists_the_known_ones():
    r = run("inspect", "hello", "--model", "bundled:huge")
    assert r.exit_code == 2
    assert "bundled:huge" in r.output and "bundled:tiny" in r.output and "Traceback" not in r.output


# ---- a broken install is one line ------------------------------------------------------------

@pytest.fixture
def broken(tmp_path, monkeypatch):
    """A copy of the bundled folder that the loader reads instead of the package's."""
    shutil.copytree(FOLDER, tmp_path / "bundled-tiny")
    monkeypatch.setattr(bundled, "data_root", lambda: tmp_path)
    return tmp_path / "bundled-tiny"


def _flip_a_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, word", [
    (lambda f: (f / "model.safetensors").unlink(), "missing"),
    (lambda f: (f / "SHA256SUMS").unlink(), "missing"),
    (lambda f: (f / "config.json").write_text("{"), "damaged"),
    (lambda f: _flip_a_byte(f / "model.safetensors", (f / "model.safetensors").stat().st_size // 2), "damaged"),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:1000]), "damaged"),
])
def test_a_missing_or_damaged_file_is_one_line_with_the_reinstall_command(broken, damage, word):
    damage(broken)
    r = run("inspect", "And God said", "--model", "bundled:tiny")
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(" ".join(lines).split("lmhead: error:")) == 2 and "Traceback" not in r.output
    line = " ".join(r.output.split())
    assert str(broken) in line and word in line and "pip install --force-reinstall lmhead" in line


def test_the_intact_copy_loads(broken):
    """The fixture alone (no damage) loads: the failures above come from the damage."""
    r = run("inspect", "And God said", "--model", "bundled:tiny", "--json")
    assert r.exit_code == 0, r.output
    assert math.isfinite(json.loads(r.stdout)["entropy"])


@pytest.mark.slow  # three fresh processes a case: 19-38 s each under load
@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_the_readme_s_first_command_runs_on_a_fresh_offline_machine(tmp_path, env):
    """`lmhead inspect "The keys on the table"` with no model named, an empty HF cache and no hub: runs on
    bundled:tiny, its first line saying why and how to insist; JSON names the model that answered.
    `--model gpt2` and LMHEAD_MODEL=gpt2 still fail in one line, as before."""
    from helpers import launch

    base = {**env, "HF_HOME": str(tmp_path / "hf")}  # LMHEAD_MODEL is unset for every test (conftest)
    r = launch("inspect", "The keys on the table", "--json", env=base, text=True)
    assert r.returncode == 0, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("gpt2 (the default model) is not in the Hugging Face cache and ")
    assert first.endswith("running on bundled:tiny instead, a small GPT-2 that ships with lmhead; --model gpt2 insists")
    assert json.loads(r.stdout)["model"] == "bundled:tiny"
    for named in (["--model", "gpt2"], []):
        r = launch("inspect", "The keys on the table", *named, env={**base, **({} if named else {"LMHEAD_MODEL": "gpt2"})},
                   text=True)
        assert r.returncode == 1 and r.stderr.startswith("lmhead: error: 'gpt2' is not in the Hugging Face cache")
        assert "bundled:tiny instead" not in r.stderr


def test_the_training_recipe_trains_the_class_the_engine_loads(tmp_path):
    """training/train_bundled.py builds engine/lean.py's GPT2 (no GPT-2 of its own), trains it a few steps
    (the held-out loss falls), and what it saves loads with --model: the logits lmhead computes from the
    file are the trained module's own (its weights rounded to float16, as saved)."""
    import importlib.util

    from lmhead_cli.engine.lean import GPT2
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    spec = importlib.util.spec_from_file_location("train_bundled", Path(__file__).parents[1] / "training" /
                                                  "train_bundled.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert not [name for name, obj in vars(recipe).items()
                if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == recipe.__name__]
    tok = GPT2Tokenizer.bundled()
    ids = torch.tensor(tok.encode("In the beginning God created the heaven and the earth. " * 40))
    cfg = {"vocab_size": 50257, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}
    torch.manual_seed(0)
    model = recipe.build_model(cfg)
    assert type(model) is GPT2 and model.lm_head.weight is model.wte.weight
    rows = recipe.train(model, ids[:400], ids[400:], steps=12, batch=4, seq=32, ctx=32, lr=1e-2, eval_every=6,
                        sampled=64)
    assert [r["step"] for r in rows] == [0, 6, 12] and rows[-1]["held_out_loss"] < rows[0]["held_out_loss"] - 1
    out = tmp_path / "trained"
    recipe.save(model, cfg, out)
    recipe.write_sums(out)

    prompt = "In the beginning God"
    r = cli("inspect", prompt, "--model", str(out), "--json", "-k", "3")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
        model.eval()
        want = model.lm_head(model(torch.tensor([tok.encode(prompt)])))[0, -1].log_softmax(-1)  # (V,)
    top = want.topk(3)
    assert [t["id"] for t in doc["top"]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([t["logprob"] for t in doc["top"]]), top.values, atol=1e-4, rtol=0)
