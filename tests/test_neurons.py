"""`lmhead neurons`: every figure against transformers' own weights and hooks, computed here: each
value vector's readout e_k · (γ ⊙ centre(v)) and its top tokens, the writers of a token, and each
neuron's share of a logit, whose sum is attribute's MLP part. Llama's (down_proj, RMSNorm) is in
test_architectures.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, cli, perturbed

from lmhead_cli.loading.sources import load_model
from lmhead_cli.readings.attribute import attribute_logit
from lmhead_cli.readings.neurons import layer_neurons, neuron_shares, token_writers

ARE = 389
N_LAYER = 3


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def ckpt(request, tmp_path_factory):
    return perturbed(tmp_path_factory.mktemp("neurons"), tied=request.param, seed=11 if request.param else 12,
                     n_layer=N_LAYER)


def readouts(model, layer: int) -> torch.Tensor:
    """(N, V): e_k · (γ ⊙ (v − mean v)) for every value vector v of `layer` (rows of c_proj's Conv1D weight)."""
    with torch.no_grad():
        v = model.transformer.h[layer].mlp.c_proj.weight.double()  # (4D, D): transformers' Conv1D is (in, out)
        g = model.transformer.ln_f.weight.double() * (v - v.mean(-1, keepdim=True))
        return g @ model.lm_head.weight.double().T


@pytest.mark.parametrize("engine", ["lean", "transformers"])
@pytest.mark.slow
def test_each_neurons_top_tokens_are_its_value_vectors_readout(ckpt, engine):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    layer = 1
    got = layer_neurons(loaded, layer, top=4)
    r = readouts(model, layer)
    assert [n.index for n in got.neurons] == list(range(r.shape[0]))
    for n in got.neurons:
        hi, lo = r[n.index].topk(4), (-r[n.index]).topk(4)
        assert [t.id for t in n.promotes] == hi.indices.tolist()
        assert [t.id for t in n.suppresses] == lo.indices.tolist()
        assert [t.value for t in n.promotes] == pytest.approx(hi.values.tolist(), abs=1e-4)
        assert [t.value for t in n.suppresses] == pytest.approx((-lo.values).tolist(), abs=1e-4)
        assert n.promotes[0].token == loaded.tokenizer.token_text(n.promotes[0].id)


def test_chosen_neurons_and_chunks_give_the_same_rows(ckpt, monkeypatch):
    folder, _ = ckpt
    loaded = load_model(str(folder), device="cpu")
    whole = {n.index: n for n in layer_neurons(loaded, 0, top=3).neurons}
    import lmhead_cli.readings.neurons as reading

    monkeypatch.setattr(reading, "CHUNK", 7)  # several chunks, one cut short
    some = layer_neurons(loaded, 0, top=3, indices=[200, 3, 17])
    assert [n.index for n in some.neurons] == [200, 3, 17]
    for n in some.neurons:  # the same tokens; values up to float32 rounding (another product shape)
        w = whole[n.index]
        assert [t.id for t in n.promotes] == [t.id for t in w.promotes]
        assert [t.id for t in n.suppresses] == [t.id for t in w.suppresses]
        assert [t.value for t in n.promotes + n.suppresses] == pytest.approx(
            [t.value for t in w.promotes + w.suppresses], abs=1e-6)


def test_token_writers_are_the_largest_readouts_of_every_layer(ckpt):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu")
    got = token_writers(loaded, " are", top=6)
    every = torch.stack([readouts(model, layer)[:, ARE] for layer in range(N_LAYER)])  # (L, N)
    best = every.flatten().topk(6)
    N = every.shape[1]
    assert [(w.layer, w.index) for w in got.neurons] == [(int(i) // N, int(i) % N) for i in best.indices]
    assert [w.value for w in got.neurons] == pytest.approx(best.values.tolist(), abs=1e-5)
    one = token_writers(loaded, " are", top=3, layer=2)
    assert [(w.layer, w.index) for w in one.neurons] == [(2, int(i)) for i in every[2].topk(3).indices]


def hooked(model, ids=PROMPT_IDS):
    """transformers' forward with each c_proj's input (the activations) and each MLP's output kept at the
    last position, and the final residual before ln_f."""
    got = {"act": {}, "mlp": {}}
    hooks = []
    for i, block in enumerate(model.transformer.h):
        hooks.append(block.mlp.c_proj.register_forward_pre_hook(
            lambda _m, args, i=i: got["act"].__setitem__(i, args[0][0, -1].double())))
        hooks.append(block.mlp.register_forward_hook(
            lambda _m, _i, out, i=i: got["mlp"].__setitem__(i, out[0, -1].double())))
    hooks.append(model.transformer.h[-1].register_forward_hook(
        lambda _m, _i, out: got.__setitem__("resid", (out[0] if isinstance(out, tuple) else out)[0, -1].double())))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_neuron_shares_add_up_to_attributes_mlp_parts(ckpt, engine):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    got = neuron_shares(loaded, PROMPT, " are", top=5)
    ref = hooked(model)
    ln = model.transformer.ln_f
    x = ref["resid"]
    sigma = float((x.var(unbiased=False) + ln.eps).sqrt())
    e = model.lm_head.weight[ARE].double().detach()
    gamma = ln.weight.double().detach()
    share = lambda part: float((gamma * (part - part.mean(-1, keepdim=True)) / sigma) @ e)  # noqa: E731
    every = []
    for layer, block in enumerate(model.transformer.h):
        v = block.mlp.c_proj.weight.double().detach()
        readout = (gamma * (v - v.mean(-1, keepdim=True)) / sigma) @ e  # (N,)
        value = ref["act"][layer] * readout
        every += [(float(value[i]), layer, i, float(ref["act"][layer][i]), float(readout[i])) for i in range(len(v))]
        # the layer's neurons and its bias add up to its MLP output's share, computed from the MLP's own output
        assert got.neuron_sums[layer] + got.bias_parts[layer] == pytest.approx(share(ref["mlp"][layer]), abs=1e-4)
        assert got.neuron_sums[layer] == pytest.approx(float(value.sum()), abs=1e-4)
        assert got.bias_parts[layer] == pytest.approx(share(block.mlp.c_proj.bias.double().detach()), abs=1e-5)
    every.sort(key=lambda t: -abs(t[0]))
    assert [(s.layer, s.index) for s in got.neurons] == [(t[1], t[2]) for t in every[:5]]
    for s, t in zip(got.neurons, every):
        assert (s.value, s.activation, s.readout) == pytest.approx((t[0], t[3], t[4]), abs=1e-4)
    attr = attribute_logit(loaded, PROMPT, " are")
    assert got.mlp_parts == [p.value for p in attr.parts if p.kind == "mlp"]
    assert got.sum == pytest.approx(sum(got.mlp_parts), abs=1e-5)
    assert abs(got.error) < 1e-5 and got.logit == attr.logit and got.sigma == pytest.approx(sigma, rel=1e-5)


def test_a_layer_limits_the_list_not_the_check(ckpt):
    folder, _ = ckpt
    loaded = load_model(str(folder), device="cpu")
    whole, one = neuron_shares(loaded, PROMPT, " are", top=4), neuron_shares(loaded, PROMPT, " are", top=4, layer=1)
    assert {s.layer for s in one.neurons} == {1}
    assert one.sum == whole.sum and one.neuron_sums == whole.neuron_sums


# ---- the command ----------------------------------------------------------------------------------

def test_layer_json_has_the_documented_shape(tiny):
    folder, _ = tiny
    r = cli("neurons", "--layer", "1", "--neuron", "5", "--top", "3", "--model", str(folder), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["mode"] == "layer" and doc["layer"] == 1 and len(doc["neurons"]) == 1
    n = doc["neurons"][0]
    assert set(n) == {"layer", "index", "promotes", "suppresses"} and n["index"] == 5
    assert set(n["promotes"][0]) == {"id", "token", "value"} and len(n["suppresses"]) == 3


def test_token_json_is_largest_first_and_a_long_token_uses_its_first_piece(tiny):
    folder, _ = tiny
    r = cli("neurons", "--token", " tablecloth", "--model", str(folder), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [set(n) for n in doc["neurons"]] == [{"layer", "index", "value"}] * 10
    values = [n["value"] for n in doc["neurons"]]
    assert values == sorted(values, reverse=True)
    assert doc["token"]["pieces"][0] == " table" and len(doc["token"]["pieces"]) == 2
    assert "using the first" in r.stderr and "␣table" not in r.stdout


def test_prompt_report_prints_the_check(tiny):
    folder, _ = tiny
    r = cli("neurons", PROMPT, "--target", " are", "--model", str(folder))
    assert r.exit_code == 0, r.output
    assert "check: Σ neurons + Σ MLP biases =" in r.stdout and "attribute's MLP parts sum to" in r.stdout


@pytest.mark.parametrize("args, message", [
    (("--layer", "2"), "--layer must be 0 to 1 for this model's 2 layers (got 2)"),
    (("--layer", "-1"), "--layer must be at least 0 (got -1)"),
    (("--layer", "0", "--neuron", "256"), "--neuron must be 0 to 255"),
    ((), "give --layer (a layer's neurons), --token (the neurons that write it) or a prompt and --target"),
    ((PROMPT,), "with a prompt, give --target"),
    (("--target", " are"), "--target needs a prompt"),
    (("--token", ""), "--token must be a non-empty text"),
    (("--layer", "0", "--top", "0"), "--top must be at least 1 (got 0)"),
])
def test_bad_input_is_one_line(tiny, args, message):
    folder, _ = tiny
    r = cli("neurons", *args, "--model", str(folder))
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


@pytest.mark.slow
def test_a_layers_table_is_bounded_and_one_neurons_is_capped_at_the_vocabulary(tiny):
    """Issue 50: `neurons --layer 0 --top 100000` was still running after 15 s at 980 MB."""
    from lmhead_cli.readings.neurons import MAX_TABLE_TOKENS

    folder, _ = tiny
    most = MAX_TABLE_TOKENS // (2 * 256)  # the tiny model's 4 × 64 neurons a layer, both sides
    r = cli("neurons", "--layer", "0", "--top", "100000", "--model", str(folder))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert r.stderr.startswith(f"lmhead: error: --top must be at most {most} for 256 neurons") and "(got 100,000)" in r.stderr
    loaded = load_model(str(folder), device="cpu")
    assert len(layer_neurons(loaded, 0, top=most).neurons[0].promotes) == most
    one = layer_neurons(loaded, 0, top=100000, indices=[3]).neurons[0]
    assert len(one.promotes) == len(one.suppresses) == loaded.engine.vocab_size


@pytest.mark.parametrize("value", [[1.5], [True], "12", None, [0, "3"]])
def test_the_api_refuses_neuron_indices_that_are_not_integers(tiny, value):
    import lmhead_cli
    from lmhead_cli.errors import BadValue

    m = lmhead_cli.load(str(tiny[0]), device="cpu")
    with pytest.raises(BadValue) as e:
        m.neurons(layer=0, neurons=value)
    assert e.value.key == "neurons" and str(e.value).startswith("neurons must be a list of integers")
    assert [n.index for n in m.neurons(layer=0, neurons=(3, 1), top=2).neurons] == [3, 1]



@pytest.mark.parametrize("args", [("--layer", "0"), ("--token", " on"), (PROMPT, "--target", " are")])
def test_a_nan_weight_is_one_line_never_a_ranking_of_nans(tiny, tmp_path, args):
    """A NaN in ln_f's γ makes every readout NaN: one line and exit 1, not a list of arbitrary tokens with
    null values (--layer) or a crash (--token)."""
    from helpers import nan_checkpoint

    r = cli("neurons", *args, "--model", str(nan_checkpoint(tiny[0], tmp_path)), "--json")
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and ("non-finite" in lines[0] or "not finite" in lines[0]), lines
    assert r.stdout == ""
