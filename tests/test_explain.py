"""`lmhead inspect --explain TOKEN`: z = e·h (+ b) against inspect's logits, |e|·|h|·cos θ against the
dot product, the layer norm's figures against arithmetic in the test."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, cli, with_ln_f

from lmhead_cli.readings.explain import explain_logit
from lmhead_cli.readings.inspect import inspect_prompt
from lmhead_cli.loading.sources import load_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny tied GPT-2 with a non-trivial ln_f gain and bias (so |x̂| and |h| differ)."""
    return with_ln_f(tmp_path_factory.mktemp("explain"), seed=5)


def last_vectors(model, ids=PROMPT_IDS):
    """x (raw, before ln_f) and h (after) at the last position, from transformers with a hook."""
    raw = {}
    hook = model.transformer.h[-1].register_forward_hook(
        lambda _m, _i, out: raw.setdefault("x", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            h = model.transformer(torch.tensor([ids])).last_hidden_state[0, -1]
    finally:
        hook.remove()
    return raw["x"][0, -1].double(), h.double()


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_logit_is_the_dot_product_with_the_tokens_own_row(ckpt, engine):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    ex = explain_logit(loaded, PROMPT, " are", top_k=5)
    result = inspect_prompt(loaded, PROMPT, 5, [" are"])
    _, h = last_vectors(model)
    E = model.transformer.wte.weight.detach().double()
    assert ex.tied and not ex.head_has_bias
    assert ex.norm_after == pytest.approx(float(h.norm()), rel=1e-5)
    assert [p.id for p in ex.top[:5]] == [t.id for t in result.top]
    assert ex.top[-1].id == ex.explained.id == 389  # " are", outside the top 5, comes last
    for p in ex.top:
        z = float(result.logits[p.id])
        assert p.logit == z  # the very logits inspect shows
        assert p.dot == pytest.approx(z, abs=1e-4)  # z = e · h: the head is a dot product with e
        assert p.dot == pytest.approx(float(E[p.id] @ h), abs=1e-4)  # ... with the token's embedding row
        assert p.row_norm == pytest.approx(float(E[p.id].norm()), rel=1e-6)
        assert p.cos == pytest.approx(float(torch.nn.functional.cosine_similarity(E[p.id], h, dim=0)), abs=1e-5)
        assert p.product == pytest.approx(p.dot, abs=1e-9)  # |e|·|h|·cos θ = e · h
        assert p.margin_to_top == pytest.approx(z - float(result.logits.max()), abs=1e-6)
        assert p.margin_to_runner_up == pytest.approx(z - float(result.logits.topk(2).values[1]), abs=1e-6)
    target = result.targets[0]
    assert (ex.explained.rank, ex.explained.prob) == (target.rank, pytest.approx(target.prob, rel=1e-6))


def test_layer_norm_figures(ckpt):
    folder, model = ckpt
    ex = explain_logit(load_model(str(folder), device="cpu"), PROMPT, " are")
    x, h = last_vectors(model)
    eps = model.config.layer_norm_epsilon
    mean, std = float(x.mean()), math.sqrt(float(x.var(unbiased=False)) + eps)
    assert ex.norm_before == pytest.approx(float(x.norm()), rel=1e-5)
    assert (ex.mean_before, ex.std_before) == (pytest.approx(mean, abs=1e-5), pytest.approx(std, rel=1e-5))
    assert ex.norm_standardised == pytest.approx(float(((x - mean) / std).norm()), rel=1e-5)
    assert ex.norm_standardised == pytest.approx(math.sqrt(64), rel=2e-2)  # √D, a little less for eps
    assert ex.norm_standardised < math.sqrt(64)
    ln = model.transformer.ln_f
    gamma, beta = ln.weight.detach().double(), ln.bias.detach().double()
    assert ex.norm_after == pytest.approx(float(((x - mean) / std * gamma + beta).norm()), rel=1e-5)
    assert ex.norm_after != pytest.approx(ex.norm_standardised, rel=1e-2)  # γ and β change the length


def test_untied_head_uses_its_own_row(tiny_untied):
    folder, model = tiny_untied
    loaded = load_model(str(folder), device="cpu")
    ex = explain_logit(loaded, PROMPT, " is", top_k=3)
    _, h = last_vectors(model)
    W, E = model.lm_head.weight.detach().double(), model.transformer.wte.weight.detach().double()
    assert not ex.tied
    p = ex.explained
    assert p.dot == pytest.approx(float(W[p.id] @ h), abs=1e-4)
    assert p.row_norm == pytest.approx(float(W[p.id].norm()), rel=1e-6)
    assert abs(p.dot - float(E[p.id] @ h)) > 1e-3  # the embedding row would give another score


def test_targets_join_the_side_by_side_rows(ckpt):
    loaded = load_model(str(ckpt[0]), device="cpu")
    ex = explain_logit(loaded, PROMPT, " are", top_k=2, targets=[" is", " are"])
    assert [p.id for p in ex.top[2:]] == [389, 318]  # the explained token, then the targets; no repeats


def test_cli_shows_the_decomposition(ckpt):
    got = cli("inspect", PROMPT, "--explain", " are", "-k", "3", "--model", str(ckpt[0]))
    assert got.exit_code == 0, got.output
    out = got.stdout
    assert "one logit taken apart: ␣are (id 389)" in out
    assert "z = e · h" in out and "|e| · |h| · cos θ" in out and "|x̂|" in out and "|h|" in out
    assert "margin to the top token" in out and "side by side" in out


def test_cli_json(ckpt):
    got = cli("inspect", PROMPT, "--explain", " table top", "--model", str(ckpt[0]), "--json")
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc["pieces"] == [" table", " top"] and doc["explained"]["id"] == 3084
    assert {"norm_before", "norm_standardised", "norm_after", "top"} <= doc.keys()
    assert doc["explained"]["logit"] == pytest.approx(doc["explained"]["dot"], abs=1e-4)


@pytest.mark.parametrize("args, message", [
    (["--explain", " are"], "give a prompt"),
    ([PROMPT, "--explain", ""], "encodes to no tokens"),
])
def test_cli_bad_input_exits_2(ckpt, args, message):
    got = cli("inspect", *args, "--model", str(ckpt[0]))
    assert got.exit_code == 2, got.output
    assert message in got.stderr
