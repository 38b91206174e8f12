"""`lmhead inspect` and `lmhead tie`: every figure checked against transformers' full forward."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, build_checkpoint, cli, nan_checkpoint

from lmhead_cli.readings.inspect import inspect_prompt
from lmhead_cli.loading.sources import load_model


def run(*args):
    return cli(*args)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(str(tiny[0]), device="cpu")


def test_figures_match_transformers_full_forward(tiny, loaded):
    _, ref = tiny
    with torch.no_grad():
        z = ref(torch.tensor([PROMPT_IDS])).logits[0, -1]  # transformers: logits at every position
    p = torch.softmax(z.double(), -1)
    result = inspect_prompt(loaded, PROMPT, top_k=7, targets=[" are", " is"])
    assert [t.id for t in result.prompt_tokens] == PROMPT_IDS
    assert [t.id for t in result.top] == torch.topk(z, 7).indices.tolist()
    for t in result.top:
        assert t.logit == pytest.approx(float(z[t.id]), abs=1e-4)
        assert t.prob == pytest.approx(float(p[t.id]), rel=1e-4)
        assert t.logprob == pytest.approx(math.log(float(p[t.id])), abs=1e-4)
    for t, token_id in zip(result.targets, (389, 318)):
        assert t.id == token_id
        assert t.rank == 1 + int((z > z[token_id]).sum())
        assert t.prob == pytest.approx(float(p[token_id]), rel=1e-4)
    assert result.entropy == pytest.approx(float(-(p * p.log()).sum()), rel=1e-4)
    assert result.entropy_bits == pytest.approx(result.entropy / math.log(2))


def test_head_runs_on_the_last_position_only(loaded):
    seen = []
    hook = loaded.engine.head_module.register_forward_hook(lambda m, i, o: seen.append((tuple(i[0].shape), tuple(o.shape))))
    try:
        result = inspect_prompt(loaded, PROMPT)
    finally:
        hook.remove()
    D, V = loaded.engine.head_weight.shape[1], loaded.engine.vocab_size
    assert seen == [((1, 1, D), (1, 1, V))]
    s = result.shapes
    assert s.hidden == (1, 5, D) and s.last == (1, 1, D) and s.logits == (1, 1, V)
    assert s.head_macs_full == 5 * s.head_macs_last == 5 * D * V
    assert s.logits_bytes_full == 5 * V * 4


def test_cli_table(tiny):
    r = run("inspect", PROMPT, "--model", str(tiny[0]), "--target", " are", "--target", " is", "-k", "3")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "tie: lm_head.weight is wte.weight" in out
    assert "␣keys" in out and "8251" in out
    assert "hidden [1, 5, 64] → last position [1, 1, 64] → logits [1, 1, 50257]" in out
    assert "next token: top 3 of 50,257" in out
    assert "entropy:" in out and "targets" in out
    assert "random weights" not in out


def test_cli_json_is_one_document_with_documented_fields(tiny):
    _, ref = tiny
    r = run("inspect", PROMPT, "--model", str(tiny[0]), "--json", "--target", " are", "-k", "4")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    for key in ("model", "random_weights", "tied", "prompt_tokens", "top", "targets", "entropy"):
        assert key in doc
    assert doc["tied"] is True and doc["random_weights"] is False
    assert doc["prompt_tokens"][1] == {"id": 8251, "text": " keys"}
    assert set(doc["top"][0]) == {"rank", "id", "token", "logit", "prob", "logprob"}
    assert set(doc["targets"][0]) >= {"token", "id", "rank", "logit", "prob"}
    with torch.no_grad():
        z = ref(torch.tensor([PROMPT_IDS])).logits[0, -1]
    assert [t["id"] for t in doc["top"]] == torch.topk(z, 4).indices.tolist()


def test_random_weights_are_said_plainly():
    r = run("inspect", "Hi", "--model", "random:distilgpt2", "-k", "2")
    assert r.exit_code == 0, r.output
    assert "random weights" in r.output
    doc = json.loads(run("inspect", "Hi", "--model", "random:distilgpt2", "--json").stdout)
    assert doc["random_weights"] is True


def test_model_from_environment(tiny, monkeypatch):
    monkeypatch.setenv("LMHEAD_MODEL", str(tiny[0]))
    r = run("inspect", PROMPT, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"] == str(tiny[0])


def test_untied_is_reported(tiny_untied):
    r = run("tie", "--model", str(tiny_untied[0]))
    assert r.exit_code == 0, r.output
    assert "untied" in r.output
    doc = json.loads(run("tie", "--model", str(tiny_untied[0]), "--json").stdout)
    assert doc["tied"] is False and doc["file_has_lm_head"] is True


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_tie_command(tiny, engine):
    r = run("tie", "--model", str(tiny[0]), "--engine", engine, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["same_object"] and doc["same_data_ptr"] and doc["engine"] == engine


def test_non_ascii_prompts(tiny):
    for prompt in ("你好，世界", "日本語のテキスト", "keys 🔑 on the table"):
        r = run("inspect", prompt, "--model", str(tiny[0]), "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert len(doc["prompt_tokens"]) > 0


def test_long_prompt_keeps_the_last_tokens(tmp_path):
    folder = tmp_path / "short_ctx"
    build_checkpoint(folder, n_positions=32)
    prompt = " ".join(f"w{i}" for i in range(40))
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    ids = GPT2Tokenizer.bundled().encode(prompt)
    assert len(ids) > 32
    r = run("inspect", prompt, "--model", str(folder), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [t["id"] for t in doc["prompt_tokens"]] == ids[-32:] and doc["truncated"] == len(ids) - 32
    assert "keeping the last 32" in r.stderr


def test_top_k_above_vocab_is_clamped(tiny):
    r = run("inspect", PROMPT, "--model", str(tiny[0]), "--json", "-k", "60000")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["top"]) == 50257


def test_multi_token_target_uses_its_first_token(tiny):
    r = run("inspect", PROMPT, "--model", str(tiny[0]), "--json", "--target", " keys on")
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)["targets"][0]
    assert t["id"] == 8251 and t["pieces"] == [" keys", " on"]
    assert "is 2 tokens" in r.stderr


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["inspect", ""], 2, "the prompt is empty"),
        (["inspect", "   \n"], 2, "the prompt is empty"),
        (["inspect"], 2, "give a prompt"),
        (["inspect", PROMPT, "-k", "0"], 2, "--top-k must be at least 1 (got 0)"),
        (["inspect", PROMPT, "--target", ""], 2, "encodes to no tokens"),
        (["inspect", PROMPT, "--model", "random:gpt5"], 2, "unknown random model 'random:gpt5'; choose one of: random:distilgpt2"),
        (["inspect", PROMPT, "--model", "./no/such/folder"], 2, "no such folder"),  # a bad path: usage
        (["inspect", PROMPT, "--model", "random:gpt2", "--dtype", "float8"], 2, "unknown --dtype"),
    ],
)
def test_bad_input_gets_one_line_and_an_exit_code(args, code, message):
    r = run(*args)
    assert r.exit_code == code, r.output
    assert message in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lmhead: error: ")
    assert "Traceback" not in r.output


def test_nan_weight_is_a_clear_error(tmp_path, tiny):
    r = run("inspect", PROMPT, "--model", str(nan_checkpoint(tiny[0], tmp_path)))
    assert r.exit_code == 1
    assert "non-finite logits" in r.stderr and "Traceback" not in r.output


def test_corrupt_file_cli_names_it(tmp_path, tiny):
    folder, _ = tiny
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    r = run("inspect", PROMPT, "--model", str(tmp_path))
    assert r.exit_code == 1
    assert "model.safetensors cannot be read" in r.stderr


def test_real_gpt2_prefers_are_after_plural_subject(real_gpt2):
    loaded = load_model(str(real_gpt2), device="cpu")
    result = inspect_prompt(loaded, PROMPT, targets=[" are", " is"])
    are, is_ = result.targets
    assert are.logit > is_.logit


@pytest.mark.slow
def test_piping_into_head_ends_quietly(tiny):
    import subprocess
    import sys

    cmd = f'"{sys.executable}" -m lmhead_cli inspect "{PROMPT}" --model "{tiny[0]}" -k 5000 | head -n 2'
    proc = subprocess.run(["bash", "-c", cmd + '; exit "${PIPESTATUS[0]}"'], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and len(proc.stdout.splitlines()) == 2
