"""`lmhead attribute`: every part against transformers' own module outputs captured with hooks, the sum
against transformers' logit, on both engines, tied and untied. Llama (through the engine contract) and
Gemma-2 (refused in one line) are in test_architectures.py, beside every other command on them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, build_checkpoint, cli, perturbed

from lmhead_cli.loading.sources import load_model
from lmhead_cli.readings.attribute import attribute_logit

ARE, IS = 389, 318


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def ckpt(request, tmp_path_factory):
    return perturbed(tmp_path_factory.mktemp("attr"), tied=request.param, seed=7 if request.param else 8)


def hooked(model, ids=PROMPT_IDS) -> dict:
    """transformers' own forward, with each module's output (and each c_proj's input) kept at the last position."""
    got: dict = {"c_proj_in": {}, "attn": {}, "mlp": {}}
    t = model.transformer
    hooks = [t.wte.register_forward_hook(lambda _m, _i, o: got.__setitem__("wte", o[0, -1])),
             t.wpe.register_forward_hook(lambda _m, _i, o: got.__setitem__("wpe", o[0, -1])),
             t.h[-1].register_forward_hook(
                 lambda _m, _i, o: got.__setitem__("resid", (o[0] if isinstance(o, tuple) else o)[0, -1]))]
    for i, block in enumerate(t.h):
        hooks.append(block.attn.c_proj.register_forward_pre_hook(
            lambda _m, args, i=i: got["c_proj_in"].__setitem__(i, args[0][0, -1])))
        hooks.append(block.attn.register_forward_hook(lambda _m, _i, o, i=i: got["attn"].__setitem__(i, o[0][0, -1])))
        hooks.append(block.mlp.register_forward_hook(lambda _m, _i, o, i=i: got["mlp"].__setitem__(i, o[0, -1])))
    try:
        with torch.no_grad():
            got["logits"] = model(torch.tensor([ids])).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    return {k: ({i: x.double() for i, x in v.items()} if isinstance(v, dict) else v.double()) for k, v in got.items()}


@pytest.mark.parametrize("engine", ["lean", "transformers"])
@pytest.mark.parametrize("vs", [None, " is"])
def test_every_part_against_transformers_hooks(ckpt, engine, vs):
    folder, model = ckpt
    a = attribute_logit(load_model(str(folder), device="cpu", engine=engine), PROMPT, " are", vs)
    ref = hooked(model)
    ln = model.transformer.ln_f
    gamma, beta = ln.weight.detach().double(), ln.bias.detach().double()
    x = ref["resid"]
    sigma = (x.var(unbiased=False) + model.config.layer_norm_epsilon).sqrt()  # from the actual final residual
    W = model.lm_head.weight.detach().double()
    e = W[ARE] - (W[IS] if vs else 0)

    def share(v):  # e · (γ ⊙ centre(v)) / σ, written out here
        return float(e @ (gamma * (v - v.mean()) / sigma))

    want = {"embed.token": share(ref["wte"]), "embed.position": share(ref["wpe"]), "ln_f.bias": float(e @ beta)}
    for i in range(3):
        want[f"attn.{i}"], want[f"mlp.{i}"] = share(ref["attn"][i]), share(ref["mlp"][i])
    got = {p.name: p.value for p in a.parts}
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-4), name
    assert abs(got["ln_f.bias"]) > 1e-5 and a.sigma == pytest.approx(float(sigma), rel=1e-5)

    c_proj = model.transformer.h[0].attn.c_proj
    hd = 64 // 4
    for h in a.heads:  # each head: its slice of c_proj's input times its rows of c_proj's weight
        w = model.transformer.h[h.layer].attn.c_proj.weight.detach().double()[h.head * hd:(h.head + 1) * hd]
        assert h.value == pytest.approx(share(ref["c_proj_in"][h.layer][h.head * hd:(h.head + 1) * hd] @ w), abs=1e-4)
    assert len(a.heads) == 12 and len(a.attn_bias) == 3
    for b in a.attn_bias:
        bias = model.transformer.h[b.layer].attn.c_proj.bias.detach().double()
        assert b.value == pytest.approx(share(bias), abs=1e-4) and abs(b.value) > 1e-4
        heads = sum(h.value for h in a.heads if h.layer == b.layer)
        assert heads + b.value == pytest.approx(got[f"attn.{b.layer}"], abs=1e-9)
    assert c_proj.weight.shape == (64, 64)

    z = ref["logits"]
    logit = float(z[ARE] - (z[IS] if vs else 0))
    assert a.logit == pytest.approx(logit, abs=1e-4)
    assert a.sum == pytest.approx(logit, abs=1e-4)
    assert a.sum == pytest.approx(sum(got.values()), abs=1e-12)
    assert abs(a.error) < 1e-4 and a.error == pytest.approx(a.sum - a.logit, abs=1e-12)
    assert a.tied == model.config.tie_word_embeddings


def test_engines_agree_and_untied_head_uses_its_own_rows(tmp_path):
    folder, model = perturbed(tmp_path / "u", tied=False, seed=9)
    lean = attribute_logit(load_model(str(folder), device="cpu", engine="lean"), PROMPT, " are")
    hf = attribute_logit(load_model(str(folder), device="cpu", engine="transformers"), PROMPT, " are")
    for p, q in zip(lean.parts, hf.parts):
        assert (p.name, p.kind, p.layer) == (q.name, q.kind, q.layer) and p.value == pytest.approx(q.value, abs=1e-5)
    ln = model.transformer.ln_f
    beta = ln.bias.detach().double()
    assert lean.parts[-1].value == pytest.approx(float(model.lm_head.weight[ARE].detach().double() @ beta), abs=1e-6)
    assert lean.parts[-1].value != pytest.approx(float(model.transformer.wte.weight[ARE].detach().double() @ beta), abs=1e-4)


def test_cli_table_and_check(tiny):
    r = cli("attribute", PROMPT, "-t", " are", "--vs", " is", "--heads", "--model", str(tiny[0]))
    assert r.exit_code == 0, r.output
    out = r.stdout
    for text in ("z(␣are) − z(␣is)", "check: Σ parts = ", "parts, largest first", "per layer",
                 "4 heads (2 layers × 2)", "attention = Σ heads + output bias", "ln_f.bias", "embed.position"):
        assert text in out, text


def test_cli_json_has_exactly_the_documented_fields(tiny):
    r = cli("attribute", PROMPT, "-t", " are", "--vs", " is", "--json", "--model", str(tiny[0]))
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) == {"model", "random_weights", "target", "vs", "logit", "parts", "heads", "attn_bias", "sum",
                        "error"}
    assert doc["target"] == " are" and doc["vs"] == " is"
    assert doc["model"] == str(tiny[0]) and doc["random_weights"] is False
    assert {p["kind"] for p in doc["parts"]} == {"embed", "attn", "mlp", "ln_f_bias"}
    assert all(set(p) == {"name", "layer", "kind", "value"} for p in doc["parts"])
    assert set(doc["heads"][0]) == {"layer", "head", "value"} and set(doc["attn_bias"][0]) == {"layer", "value"}
    assert doc["sum"] == pytest.approx(sum(p["value"] for p in doc["parts"]), abs=1e-12)
    assert abs(doc["error"]) < 1e-4


def test_multi_token_target_uses_its_first_token(tiny):
    r = cli("attribute", PROMPT, "-t", " keys on", "--model", str(tiny[0]))
    assert r.exit_code == 0, r.output
    assert "is 2 tokens" in r.stderr and "z(␣keys) after" in r.stdout
    assert "heads (" not in r.stdout  # only with --heads


@pytest.mark.parametrize("args, message", [
    ([PROMPT], "attribute needs --target"),
    (["-t", " are"], "give a prompt"),
    (["", "-t", " are"], "the prompt is empty"),
    ([PROMPT, "-t", ""], "--target '' encodes to no tokens; give a token such as ' are'"),
    ([PROMPT, "-t", " are", "--vs", ""], "--vs '' encodes to no tokens"),
])
def test_bad_input_exits_2(args, message):
    r = cli("attribute", *args, "--model", "random:distilgpt2")
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0]


def test_bfloat16_runs_and_reports_its_rounding(tiny):
    a = attribute_logit(load_model(str(tiny[0]), device="cpu", dtype="bfloat16"), PROMPT, " are", " is")
    assert abs(a.error) < 0.05 and a.error == pytest.approx(a.sum - a.logit, abs=1e-12)


def test_a_stream_that_is_not_the_sum_of_the_parts_is_refused(tiny, monkeypatch):
    """The guard: if the parts read off a model did not add up to its residual (a layer adding
    something the hooks do not see), attribution refuses instead of printing wrong shares."""
    from lmhead_cli.errors import UnsupportedModel

    loaded = load_model(str(tiny[0]), device="cpu")
    own = loaded.engine.components

    def without_mlps(ids):
        c = own(ids)
        c.mlp = c.mlp * 0
        return c

    monkeypatch.setattr(loaded.engine, "components", without_mlps)
    with pytest.raises(UnsupportedModel) as e:
        attribute_logit(loaded, PROMPT, " are")
    assert str(e.value).startswith("this model's residual stream is not the sum of its embeddings, attention and "
                                   "MLP outputs (off by ")


def test_the_final_norm_is_named_as_its_kind(tiny):
    """GPT-2's final norm is a LayerNorm (centred): the table names it and centres each part."""
    a = attribute_logit(load_model(str(tiny[0]), device="cpu"), PROMPT, " are")
    assert a.norm == "LayerNorm" and a.engine == "lean"
    r = cli("attribute", PROMPT, "-t", " are", "--model", str(tiny[0]))
    assert "the final LayerNorm's scale" in r.stdout and "centre(part)" in r.stdout


def test_a_vs_with_no_token_is_named_as_vs(tiny):
    from lmhead_cli.errors import BadValue

    with pytest.raises(BadValue) as e:
        attribute_logit(load_model(str(tiny[0]), device="cpu"), PROMPT, " are", vs="")
    assert e.value.key == "vs" and e.value.spelled("--vs") == "--vs '' encodes to no tokens; give a token such as ' are'"


def test_a_final_norm_that_is_not_a_layer_norm_is_refused(tiny, monkeypatch):
    from lmhead_cli.errors import UnsupportedModel

    loaded = load_model(str(tiny[0]), device="cpu")
    own = loaded.engine.final_norm
    monkeypatch.setattr(loaded.engine, "final_norm", lambda x: own(x) * 2)
    with pytest.raises(UnsupportedModel) as e:
        attribute_logit(loaded, PROMPT, " are")
    assert str(e.value).startswith("its final norm is not γ ⊙ centre(x) / σ + β (off by ")
    assert str(e.value).endswith("), so its logit cannot be split into parts")


def test_a_residual_stream_of_large_values_still_splits(tmp_path):
    """Embeddings scaled to thousands: float32 rounds the stream by ~1e-4, which the check allows in
    proportion to the stream's size; the parts still add up to transformers' logit difference."""
    model = build_checkpoint(tmp_path, tied=False, seed=3)  # untied: the head keeps its size
    with torch.no_grad():
        model.transformer.wte.weight.mul_(5e4)
        model.transformer.wpe.weight.mul_(5e4)
    model.save_pretrained(tmp_path)
    a = attribute_logit(load_model(str(tmp_path), device="cpu", engine="lean"), PROMPT, " are", " is")
    with torch.no_grad():
        out = model(torch.tensor([PROMPT_IDS]), output_hidden_states=True)
    assert float(out.hidden_states[-2][0, -1].abs().max()) > 1000  # the case is live
    z = out.logits[0, -1]
    assert a.logit == pytest.approx(float(z[ARE] - z[IS]), abs=1e-3) and abs(a.error) < 1e-3


@pytest.mark.parametrize("vs", [None, " is"])
def test_a_head_with_a_bias_adds_its_bias_as_a_part(tiny, vs):
    """Phi and GPT-J heads carry a bias: z = W_out · ln_f(x) + b. Here transformers' GPT-2 head is given
    one; the parts (with "head.bias" = b[t] - b[u]) add up to the biased logits of the forward."""
    folder, _ = tiny
    loaded = load_model(str(folder), device="cpu", engine="transformers")
    head = loaded.engine.head_module
    bias = torch.randn(head.weight.shape[0], generator=torch.Generator().manual_seed(2)) * 3
    head.bias = torch.nn.Parameter(bias)
    a = attribute_logit(loaded, PROMPT, " are", vs)
    with torch.no_grad():
        z = loaded.engine.model(torch.tensor([PROMPT_IDS])).logits[0, -1].double()
    want = float(z[ARE] - (z[IS] if vs else 0))
    b = float(bias[ARE] - (bias[IS] if vs else 0))
    assert a.parts[-1].name == "head.bias" and a.parts[-1].value == pytest.approx(b, abs=1e-6)
    assert a.parts[-1].kind == "head_bias" and a.parts[-1].layer is None
    assert a.logit == pytest.approx(want, abs=1e-4) and a.sum == pytest.approx(want, abs=1e-4)


# ---- from the full mutation run of readings/attribute.py: each test fails on the mutant it names ----

def test_a_head_module_without_a_bias_attribute_has_no_head_bias_part(tiny, monkeypatch):
    """A model's output embeddings need not be an nn.Linear: one with no `bias` attribute at all reads
    as a head without a bias."""
    loaded = load_model(str(tiny[0]), device="cpu")
    monkeypatch.setattr(type(loaded.engine), "head_module", property(lambda self: torch.nn.Module()))
    a = attribute_logit(loaded, PROMPT, " are")
    assert [p.name for p in a.parts if p.name.startswith("head")] == [] and abs(a.error) < 1e-4


def test_a_target_with_no_token_is_named_as_target(tiny):
    from lmhead_cli.errors import BadValue

    with pytest.raises(BadValue) as e:
        attribute_logit(load_model(str(tiny[0]), device="cpu"), PROMPT, "")
    assert e.value.key == "target"


@pytest.mark.parametrize("vs", [None, " is"])
def test_int8_weights_split_with_their_dequantised_rows(tiny, vs):
    """int8: the head's rows are dequantised for the split (one row without --vs, two with it), and the
    parts add up to the int8 model's own logit (difference)."""
    loaded = load_model(str(tiny[0]), device="cpu", dtype="int8")
    a = attribute_logit(loaded, PROMPT, " are", vs)
    assert a.sum == pytest.approx(a.logit, abs=1e-3) and abs(a.error) < 1e-3
    assert a.vs is None if vs is None else a.vs.id == IS


def test_a_long_prompt_keeps_its_last_tokens_and_says_how_many_went(tmp_path):
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    build_checkpoint(tmp_path, n_positions=16, n_layer=2)
    prompt = " ".join(f"w{i}" for i in range(20))
    ids = GPT2Tokenizer.bundled().encode(prompt)
    a = attribute_logit(load_model(str(tmp_path), device="cpu"), prompt, " are")
    assert [t.id for t in a.prompt_tokens] == ids[-16:] and a.truncated == len(ids) - 16 > 0


def test_the_prompt_goes_to_the_engines_device_not_the_default_one(tiny):
    """Under another default device (a GPU session's set_default_device; here the meta device) the split
    is the same: the prompt's ids are put on the engine's device."""
    loaded = load_model(str(tiny[0]), device="cpu")
    want = attribute_logit(loaded, PROMPT, " are", " is")
    with torch.device("meta"):
        got = attribute_logit(loaded, PROMPT, " are", " is")
    assert got.parts == want.parts and got.logit == want.logit


def test_the_sum_check_allows_exactly_its_tolerance_and_no_more():
    from lmhead_cli.errors import UnsupportedModel
    from lmhead_cli.readings.attribute import ROUNDING_ULPS, SUM_TOLERANCE, _check_close

    tolerance = max(SUM_TOLERANCE, ROUNDING_ULPS * torch.finfo(torch.float32).eps)
    want = torch.zeros(8, dtype=torch.float64)
    _check_close(want + torch.eye(8, dtype=torch.float64)[3] * tolerance, want, torch.float32, "x")  # at it: fine
    with pytest.raises(UnsupportedModel):
        _check_close(want + torch.eye(8, dtype=torch.float64)[3] * tolerance * 1.001, want, torch.float32, "x")


def test_the_attribution_check_is_relative_only_above_one():
    """_check_close allows rounding times max(1, |want|): for values below 1 the absolute tolerance itself.
    Mutant: max(2, |want|), twice as lenient there."""
    from lmhead_cli.errors import UnsupportedModel
    from lmhead_cli.readings.attribute import ROUNDING_ULPS, SUM_TOLERANCE, _check_close

    tolerance = max(SUM_TOLERANCE, ROUNDING_ULPS * torch.finfo(torch.float32).eps)
    want = torch.full((4,), 0.5)
    _check_close(want + 0.9 * tolerance, want, torch.float32, "the parts' sum")
    with pytest.raises(UnsupportedModel, match="off by"):
        _check_close(want + 1.5 * tolerance, want, torch.float32, "the parts' sum")
