"""Every command on a tiny random Llama and a tiny random Gemma-2, against transformers' own forward.

Both checkpoints are built with transformers from random weights and saved with safetensors (2 layers,
width 64, the GPT-2 vocabulary and tokenizer). Their final norms get random gains and the weights a
wider spread than transformers' init, so a wrong norm, a missing soft-cap or a wrong layer shows up in
the figures; Gemma-2's cap is small (c = 2) so that capping changes every logit visibly.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, _tokenizer_files, cli

from lmhead_cli.errors import CorruptCheckpoint
from lmhead_cli.loading.sources import load_model

EOS = 50256
CAP = 2.0  # the tiny Gemma-2's final_logit_softcapping
SIZES = dict(vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=EOS, eos_token_id=EOS,
             pad_token_id=EOS, initializer_range=0.15)


def _build(folder, model):
    """Give the final norm a random gain, save with safetensors beside the GPT-2 tokenizer files."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.copy_(torch.rand(norm.shape, generator=g) + 0.5)
    model.save_pretrained(folder)
    _tokenizer_files(folder)
    return folder, model.eval().requires_grad_(False)  # an oracle: no autograd, no scalar warnings


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """(folder, model): a Llama with its own (untied) head and an RMSNorm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return _build(tmp_path_factory.mktemp("llama"), LlamaForCausalLM(LlamaConfig(**SIZES)))


@pytest.fixture(scope="session")
def gemma2(tmp_path_factory):
    """(folder, model): a Gemma-2, tied, with sliding-window layers and its own logit soft-cap."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(**SIZES, final_logit_softcapping=CAP, sliding_window=4)
    return _build(tmp_path_factory.mktemp("gemma2"), Gemma2ForCausalLM(config))


@pytest.fixture(params=["llama", "gemma2"])
def arch(request):
    return request.getfixturevalue(request.param)


def run(ckpt, *args, input=None):
    return cli(*args, "--model", str(ckpt[0]), input=input)


def doc(ckpt, *args, input=None) -> dict:
    got = run(ckpt, *args, "--json", input=input)
    assert got.exit_code == 0, got.output
    return json.loads(got.stdout)


def forward(model, ids=PROMPT_IDS):
    """transformers' own output for one prompt, with hidden states."""
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True)


def head_of(model, h):
    """The model's own head on hidden states h (..., D), with its own soft-cap: logits (..., V)."""
    z = model.lm_head(h)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(z / cap) * cap if cap else z


# ---- inspect, tie -----------------------------------------------------------------------------

def test_inspect_json_matches_the_forward(arch):
    folder, model = arch
    d = doc(arch, "inspect", PROMPT, "-k", "5", "--target", " are")
    ref = forward(model).logits[0, -1]
    logprobs = torch.log_softmax(ref.double(), -1)
    assert [t["id"] for t in d["top"]] == torch.topk(ref, 5).indices.tolist()
    for t in d["top"]:
        assert t["logit"] == pytest.approx(float(ref[t["id"]]), abs=1e-4)
        assert t["logprob"] == pytest.approx(float(logprobs[t["id"]]), abs=1e-4)
    target = d["targets"][0]
    assert target["prob"] == pytest.approx(float(logprobs[target["id"]].exp()), abs=1e-6)
    assert target["rank"] == 1 + int((ref > ref[target["id"]]).sum())
    assert d["entropy"] == pytest.approx(float(-(logprobs.exp() * logprobs).sum()), abs=1e-4)
    # Llama runs on lmhead's own engine (engine/llama.py), Gemma-2 on transformers'
    assert d["engine"] == ("lean" if model.config.model_type == "llama" else "transformers")
    assert d["shapes"]["logits"] == [1, 1, 50257]


def test_tie_report_names_the_models_own_parameters(llama, gemma2):
    untied = doc(llama, "tie")
    assert untied["tied"] is False and untied["same_object"] is False
    assert untied["head_name"] == "lm_head.weight" and untied["embedding_name"] == "model.embed_tokens.weight"
    assert untied["config_tie_word_embeddings"] is False and untied["file_has_lm_head"] is True
    assert untied["file_lm_head_equals_wte"] is False and untied["own_softcap"] is None
    tied = doc(gemma2, "tie")
    assert tied["tied"] is True and tied["same_object"] is True and tied["same_data_ptr"] is True
    assert (tied["head_name"], tied["embedding_name"]) == tuple(gemma2[1].all_tied_weights_keys.items())[0]
    assert tied["embedding_name"] == "model.embed_tokens.weight" and tied["file_has_lm_head"] is False
    assert tied["own_softcap"] == CAP


def test_tie_and_inspect_say_the_model_caps_its_own_logits(gemma2, llama):
    for args in (["tie"], ["inspect", PROMPT]):
        out = run(gemma2, *args).stdout
        assert "tie: lm_head.weight is model.embed_tokens.weight" in out
        assert f"the model soft-caps its own logits: z → c·tanh(z/c) with c = {CAP:g}" in out
    out = run(llama, "tie").stdout
    assert "untied" in out and "soft-caps" not in out


def test_stages_start_from_the_models_capped_logits_and_a_second_cap_is_announced(gemma2):
    got = run(gemma2, "inspect", PROMPT, "--stages", "--softcap", "3", "-k", "3", "--json")
    assert got.exit_code == 0, got.output
    assert got.stderr.count("\n") == 1
    assert f"the model already soft-caps its own logits at c = {CAP:g}" in got.stderr
    d = json.loads(got.stdout)
    assert d["stages"]["own_softcap"] == CAP and d["tie"]["own_softcap"] == CAP
    ref = forward(gemma2[1]).logits[0, -1]
    assert ref.abs().max() <= CAP  # the forward's logits are capped already
    for row in d["stages"]["rows"]:
        raw, capped = row["stages"][0]["value"], row["stages"][1]["value"]
        assert raw == pytest.approx(float(ref[row["id"]]), abs=1e-4)
        assert capped == pytest.approx(3 * float(torch.tanh(ref[row["id"]] / 3)), abs=1e-4)


def test_softcap_command_announces_the_models_own_cap(gemma2, llama):
    got = run(gemma2, "softcap", PROMPT, "-n", "2", "--seed", "1")
    assert got.exit_code == 0, got.output
    assert f"already soft-caps its own logits at c = {CAP:g}; the softcap stage (c = 30)" in got.stderr
    assert "soft-caps" not in run(llama, "softcap", PROMPT, "-n", "2", "--seed", "1").stderr


# ---- decoding -----------------------------------------------------------------------------------

def reference_ids(model, **kwargs) -> list[int]:
    out = model.generate(torch.tensor([PROMPT_IDS]), do_sample=False, pad_token_id=EOS, **kwargs)
    return out[0, len(PROMPT_IDS):].tolist()


def test_greedy_and_beams_match_transformers_generate(arch):
    _, model = arch
    d = doc(arch, "greedy", PROMPT, "-n", "6")  # past Gemma-2's sliding window of 4
    assert d["generated_ids"] == reference_ids(model, max_new_tokens=6)
    ref_logits = forward(model).logits[0, -1]
    assert d["steps"][0]["logit"] == pytest.approx(float(ref_logits.max()), abs=1e-4)
    beams = doc(arch, "generate", PROMPT, "-n", "4", "--beams", "3")
    assert beams["generated_ids"] == reference_ids(model, max_new_tokens=4, num_beams=3)


def test_sampling_replays_with_its_seed(arch):
    a, b = (doc(arch, "sample", PROMPT, "-n", "3", "--seed", "7", "--top-k", "20") for _ in range(2))
    assert a["generated_ids"] == b["generated_ids"] and len(a["generated_ids"]) == 3
    top20 = set(torch.topk(forward(arch[1]).logits[0, -1], 20).indices.tolist())
    assert a["generated_ids"][0] in top20


def test_raw_and_processed_logprobs_and_beam_scores_match_transformers(arch):
    """Raw: log softmax of the model's own output (Gemma-2's already capped by the model); processed:
    transformers' warpers on it; beam transition scores: compute_transition_scores."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    _, model = arch
    d = doc(arch, "sample", PROMPT, "-n", "3", "--seed", "3", "--temperature", "0.7", "--top-k", "10")
    ids = PROMPT_IDS + d["generated_ids"]
    logits = forward(model, ids).logits[0].float()
    chain = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(10)])
    for i, step in enumerate(d["steps"]):
        z = logits[len(PROMPT_IDS) - 1 + i]
        raw = torch.log_softmax(z, -1)
        processed = torch.log_softmax(chain(torch.tensor([ids[:len(PROMPT_IDS) + i]]), z[None].clone())[0], -1)
        assert step["raw_logprob"] == pytest.approx(float(raw[step["id"]]), abs=1e-4)
        assert step["logprob"] == pytest.approx(float(processed[step["id"]]), abs=1e-4)
        assert step["removed_mass"] == pytest.approx(float(raw.exp()[~torch.isfinite(processed)].sum()), abs=1e-5)
    beams = doc(arch, "generate", PROMPT, "-n", "4", "--beams", "2")
    out = model.generate(torch.tensor([PROMPT_IDS]), num_beams=2, num_return_sequences=2, do_sample=False,
                         max_new_tokens=4, output_scores=True, return_dict_in_generate=True, pad_token_id=EOS)
    ts = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    for b, row, score in zip(beams["beams"], ts, out.sequences_scores):
        assert b["transition_scores"] == pytest.approx(row[:b["length"]].tolist(), abs=1e-4)
        assert b["score"] == pytest.approx(float(score), abs=1e-5) and b["adds_up"]


# ---- lens, explain, batches, explore ---------------------------------------------------------------

def test_lens_uses_the_models_own_norm_on_its_hidden_states(arch):
    _, model = arch
    d = doc(arch, "lens", PROMPT)
    out = forward(model)
    hidden = out.hidden_states  # embeddings, after block 1, ..., the last (already through the norm)
    assert len(d["layers"]) == len(hidden) == model.config.num_hidden_layers + 1
    assert d["norm"] == "model.norm" and d["tied"] is model.config.tie_word_embeddings
    for layer, h in zip(d["layers"][:-1], hidden[:-1]):
        with torch.no_grad():
            z = head_of(model, model.model.norm(h[0, -1]))
        logprobs = torch.log_softmax(z.double(), -1)
        assert layer["top_id"] == int(z.argmax())
        assert layer["top_prob"] == pytest.approx(float(logprobs.max().exp()), abs=1e-5)
        assert layer["entropy"] == pytest.approx(float(-(logprobs.exp() * logprobs).sum()), abs=1e-4)
    last = torch.log_softmax(out.logits[0, -1].double(), -1)
    assert d["layers"][-1]["top_id"] == int(last.argmax())
    assert d["layers"][-1]["top_prob"] == pytest.approx(float(last.max().exp()), abs=1e-5)


def test_explain_takes_the_logit_apart_through_an_rmsnorm(arch):
    _, model = arch
    d = doc(arch, "inspect", PROMPT, "--explain", " the")
    out = forward(model)
    h = out.hidden_states[-1][0, -1].double()  # after the model's own norm
    e = d["explained"]
    assert d["norm"] == "RMSNorm" and d["norm_after"] == pytest.approx(float(h.norm()), rel=1e-5)
    assert e["dot"] == pytest.approx(float(model.lm_head.weight[e["id"]].double() @ h), abs=1e-4)
    assert e["logit"] == pytest.approx(float(out.logits[0, -1, e["id"]]), abs=1e-4)
    assert e["product"] == pytest.approx(e["dot"], abs=1e-6)
    cap = d["own_softcap"]
    assert cap == getattr(model.config, "final_logit_softcapping", None)
    if cap:
        assert e["logit"] == pytest.approx(cap * float(torch.tanh(torch.tensor(e["dot"] / cap))), abs=1e-4)
    x = torch.tensor([d["norm_before"], d["rms_before"]])
    assert x[0] == pytest.approx(float(x[1]) * 64**0.5, rel=1e-3)  # |x| = rms · √D


def test_file_batches_match_one_forward_per_prompt(arch, tmp_path):
    _, model = arch
    prompts = ["The keys on the table", "Hello", "One two three four five six"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    got = run(arch, "inspect", "--file", str(path), "-k", "3", "--json")
    assert got.exit_code == 0, got.output
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    tok = GPT2Tokenizer.bundled()
    for line, prompt in zip(got.stdout.splitlines(), prompts):
        ref = forward(model, tok.encode(prompt)).logits[0, -1]
        d = json.loads(line)
        assert [t["id"] for t in d["top"]] == torch.topk(ref, 3).indices.tolist()
        assert d["top"][0]["logit"] == pytest.approx(float(ref.max()), abs=1e-4)


def test_explore_piped_answers_with_the_forwards_top_token(arch):
    _, model = arch
    got = run(arch, "explore", "-k", "1", input=f"{PROMPT}\n:lens\n:gen 2\n:softcap 3\n")
    assert got.exit_code == 0, got.output
    own = getattr(model.config, "final_logit_softcapping", None)
    assert got.stderr.count("already soft-caps its own logits") == (1 if own else 0)
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer
    from lmhead_cli.render import show_token

    top = GPT2Tokenizer.bundled().token_text(int(forward(model).logits[0, -1].argmax()))
    assert show_token(top) in got.stdout and "block 2" in got.stdout and "2 tokens sampled" in got.stdout


# ---- diff, attribute --------------------------------------------------------------------------

def test_diff_against_the_forwards_distributions(arch):
    _, model = arch
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    other = "The key on the table"
    d = doc(arch, "diff", other, PROMPT, "-k", "3", "-t", " are")
    lp = torch.log_softmax(forward(model, GPT2Tokenizer.bundled().encode(other)).logits[0, -1].double(), -1)
    lq = torch.log_softmax(forward(model).logits[0, -1].double(), -1)  # capped by Gemma-2 itself
    assert d["kl_ab"] == pytest.approx(float((lp.exp() * (lp - lq)).sum()), abs=2e-6) and d["kl_ab"] > 1e-4
    assert d["tv"] == pytest.approx(float((lp.exp() - lq.exp()).abs().sum() / 2), abs=1e-6)
    assert [t["id"] for t in d["b"]["top"]] == torch.topk(lq, 3).indices.tolist()
    assert d["targets"][0]["delta"] == pytest.approx(float(lq[389] - lp[389]), abs=1e-4)


def test_attribute_llama_through_its_rmsnorm(llama):
    """RMSNorm has no centring and no β; no position table, so the embedding is the first layer's input.
    Each part against the module's own output (hooks), the sum against the forward's logit difference."""
    _, model = llama
    got: dict = {}
    layers = model.model.layers
    hooks = [layers[0].register_forward_pre_hook(
        lambda _m, args, kw: got.__setitem__("embed.token", (args[0] if args else kw["hidden_states"])[0, -1]),
        with_kwargs=True),
        layers[-1].register_forward_hook(
            lambda _m, _i, o: got.__setitem__("resid", (o[0] if isinstance(o, tuple) else o)[0, -1]))]
    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.register_forward_hook(lambda _m, _i, o, i=i: got.__setitem__(f"attn.{i}", o[0][0, -1])))
        hooks.append(layer.mlp.register_forward_hook(lambda _m, _i, o, i=i: got.__setitem__(f"mlp.{i}", o[0, -1])))
    try:
        z = forward(model).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    d = doc(llama, "attribute", PROMPT, "-t", " are", "--vs", " is")
    norm = model.model.norm
    x = got["resid"].double()
    rms = (x.pow(2).mean() + norm.variance_epsilon).sqrt()
    W = model.lm_head.weight.detach().double()
    e = W[389] - W[318]
    parts = {p["name"]: p["value"] for p in d["parts"]}
    assert list(parts) == ["embed.token", "attn.0", "mlp.0", "attn.1", "mlp.1"]  # no position table, no β
    for name, value in parts.items():
        v = got[name].double()
        assert value == pytest.approx(float(e @ (norm.weight.detach().double() * v / rms)), abs=1e-5), name
    assert len(d["heads"]) == 2 * 4
    assert d["sum"] == pytest.approx(float(z[389] - z[318]), abs=1e-4) and abs(d["error"]) < 1e-4
    table = run(llama, "attribute", PROMPT, "-t", " are").stdout  # the norm named as its kind, parts not centred
    assert "the final RMSNorm's scale" in table and "centre(part)" not in table


def test_neurons_read_llamas_down_proj_columns_through_its_rmsnorm(llama):
    """Llama's value vectors are the columns of down_proj (D, N); RMSNorm has no centring. Each neuron's
    readout against the weights, and the shares (activation: down_proj's input) against attribute."""
    _, model = llama
    norm, W = model.model.norm, model.lm_head.weight.detach().double()
    v = model.model.layers[1].mlp.down_proj.weight.detach().double().T  # (N, D)
    r = (norm.weight.detach().double() * v) @ W.T  # (N, V): no centring
    d = doc(llama, "neurons", "--layer", "1", "--neuron", "3", "--top", "4")
    assert [t["id"] for t in d["neurons"][0]["promotes"]] == r[3].topk(4).indices.tolist()
    assert [t["value"] for t in d["neurons"][0]["promotes"]] == pytest.approx(r[3].topk(4).values.tolist(), abs=1e-4)
    d = doc(llama, "neurons", "--token", " are", "--top", "3")
    every = torch.stack([(norm.weight.detach().double() * layer.mlp.down_proj.weight.detach().double().T) @ W[389]
                         for layer in model.model.layers])  # (L, N)
    assert [n["value"] for n in d["neurons"]] == pytest.approx(every.flatten().topk(3).values.tolist(), abs=1e-5)
    d = doc(llama, "neurons", PROMPT, "--target", " are")
    attribution = doc(llama, "attribute", PROMPT, "-t", " are")
    mlp = [p["value"] for p in attribution["parts"] if p["kind"] == "mlp"]
    assert d["mlp_parts"] == mlp and d["bias_parts"] == [0.0, 0.0]  # Llama's down_proj has no bias
    assert d["neuron_sums"] == pytest.approx(mlp, abs=1e-5) and abs(d["error"]) < 1e-5


def test_a_tuned_lens_reads_through_llamas_rmsnorm(llama, tmp_path):
    """tune-lens trains and lens --tuned reads on a model with an RMSNorm and an untied head: the
    identity lens is the logit lens, and a trained one has its own KL per layer."""
    out = tmp_path / "llama-lens.safetensors"
    got = run(llama, "tune-lens", "The keys on the table are mine. " * 20, "--out", str(out), "--steps", "2",
              "--batch", "1", "--seq", "16")
    assert got.exit_code == 0, got.output
    d = doc(llama, "lens", PROMPT, "--tuned", str(out))
    assert [set(row["kl_to_final"]) for row in d["layers"]] == [{"logit", "tuned"}] * 3
    assert d["layers"][-1]["kl_to_final"] == {"logit": 0.0, "tuned": 0.0}


def test_attribute_refuses_gemma2_in_one_line(gemma2):
    """Gemma-2 normalises each attention and MLP output before adding it: no plain sum to split."""
    got = run(gemma2, "attribute", PROMPT, "-t", " are")
    assert got.exit_code == 1 and got.stdout == ""
    assert got.stderr == ("lmhead: error: gemma2 layers normalise their outputs before adding them to the residual "
                          "stream (post_feedforward_layernorm), so the stream is not a sum of the layers' outputs\n")


# ---- refusals -----------------------------------------------------------------------------------

def test_params_refuses_in_one_line_naming_the_model_type(arch):
    got = run(arch, "params")
    assert got.exit_code == 1 and got.stdout == ""
    kind = arch[1].config.model_type
    assert got.stderr == (f"lmhead: error: params counts GPT-2-family tensors (wte, wpe, h.N, ln_f); "
                          f"{arch[0]} is a {kind!r} model\n")


def test_a_wrong_model_type_is_an_error_naming_both_sizes_not_an_allocation(tmp_path, tiny):
    """A GPT-2 checkpoint whose config says llama: transformers would build a 6.7 billion parameter Llama
    from the defaults; the meta-device skeleton is checked against the tensors first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder, gpt2 = tiny
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(CorruptCheckpoint) as e:
        load_model(str(tmp_path), device="cpu")
    with torch.device("meta"):  # what transformers would have built: Llama's defaults, GPT-2's vocabulary
        llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    n_llama = sum(p.numel() for p in llama.parameters())
    n_file = sum(p.numel() for p in gpt2.parameters())  # the tied head is stored once, as wte
    assert n_llama > 6e9
    message = str(e.value)
    assert f"lmhead's llama with {n_llama:,} parameters, the file holds {n_file:,}" in message
    assert "it lacks model.embed_tokens.weight" in message and "\n" not in message
    got = cli("inspect", PROMPT, "--model", str(tmp_path))
    assert got.exit_code == 1 and got.stderr.startswith("lmhead: error: ") and got.stderr.count("\n") == 1


def test_a_config_that_disagrees_with_the_tensors_names_both_shapes(tmp_path, llama):
    folder, _ = llama
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(CorruptCheckpoint, match=r"model\.layers\.0\.mlp\.gate_proj\.weight is 96×64 in the "
                                                 r"config but 128×64 in the file"):
        load_model(str(tmp_path), device="cpu")


def test_a_model_that_scales_its_logits_is_refused(tmp_path):
    from transformers import GraniteConfig, GraniteForCausalLM

    from lmhead_cli.errors import UnsupportedModel

    sizes = SIZES | dict(vocab_size=512, hidden_size=32, intermediate_size=64, head_dim=8, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    GraniteForCausalLM(GraniteConfig(**sizes, logits_scaling=4.0)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=r"scale their logits after the head \(logits_scaling = 4.0\)"):
        load_model(str(tmp_path), device="cpu")


def test_a_model_without_a_findable_piece_refuses_the_reading_that_needs_it(llama):
    """A layout lmhead cannot read: inspect still runs; the lens and --explain name what is missing."""
    from torch import nn

    from lmhead_cli.errors import UnsupportedModel
    from lmhead_cli.readings.explain import explain_logit
    from lmhead_cli.readings.inspect import inspect_prompt
    from lmhead_cli.readings.lens import lens_prompt

    loaded = load_model(str(llama[0]), device="cpu", engine="transformers")
    top = inspect_prompt(loaded, PROMPT, 1).top[0].id
    loaded.engine.norm = nn.Identity()  # a final norm that is neither a LayerNorm nor an RMSNorm
    with pytest.raises(UnsupportedModel, match="final norm as a LayerNorm or an RMSNorm; this model's is Identity"):
        explain_logit(loaded, PROMPT, " are")
    loaded.engine.layers = loaded.engine.norm = None
    with pytest.raises(UnsupportedModel, match=r"cannot find the decoder layers .* of transformers' LlamaForCausalLM"):
        lens_prompt(loaded, PROMPT)
    assert inspect_prompt(loaded, PROMPT, 1).top[0].id == top


def _with_rope(llama, tmp_path, rope):
    folder, _ = llama
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"rope_scaling": rope}))
    for name in ("model.safetensors", "vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    return tmp_path


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "linear", "factor": "x"}, "rope_scaling's factor must be a number, not \"x\""),
    ({"type": "dynamic", "factor": "2"}, "rope_scaling's factor must be a number, not \"2\""),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": [32]}, "rope_scaling's beta_fast must be a number, not [32]"),
    ({"rope_type": 3, "factor": 2.0}, "rope_scaling's rope_type must be a string, not 3"),
    ({"rope_type": "longrope", "short_factor": [1, "a"]}, "rope_scaling's short_factor must be a list of numbers"),
    ({"full_attention": {"rope_type": "linear", "factor": "x"}}, "rope_scaling.full_attention's factor must be a"),
    ("x", "rope_scaling must be an object of RoPE settings, not \"x\""),
])
@pytest.mark.slow
def test_rope_scaling_of_the_wrong_type_is_one_lmhead_line(llama, tmp_path, rope, message):
    """One line naming the config and the setting, exit 1. As a user meets it, in a fresh process with
    transformers' logging on, for a flat and a nested setting: no transformers warning, printed twice,
    then "unexpected TypeError" (the other cases run in-process: a fresh process costs ~3 s)."""
    from helpers import cli, launch

    folder = _with_rope(llama, tmp_path, rope)
    if rope == "x" or "full_attention" in rope:
        got = launch("inspect", PROMPT, "--model", str(folder), timeout=120, text=True)
        code, err = got.returncode, got.stderr
    else:
        got = cli("inspect", PROMPT, "--model", str(folder))
        code, err = got.exit_code, got.stderr
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"lmhead: error: {folder / 'config.json'}: {message}")


def test_rope_scaling_of_the_right_types_loads_and_matches_transformers(llama, tmp_path):
    from transformers import LlamaForCausalLM

    import lmhead_cli

    folder = _with_rope(llama, tmp_path, {"rope_type": "linear", "factor": 2.0})
    want = LlamaForCausalLM.from_pretrained(folder).eval()(torch.tensor([PROMPT_IDS])).logits[0, -1]
    plain = llama[1](torch.tensor([PROMPT_IDS])).logits[0, -1]
    assert not torch.allclose(want, plain, atol=1e-4)  # the scaling changes the logits: it was read
    top = lmhead_cli.load(str(folder), device="cpu").inspect(PROMPT, top_k=3).to_dict()["top"]
    assert [t["id"] for t in top] == want.topk(3).indices.tolist()
    assert [t["logit"] for t in top] == pytest.approx(want.topk(3).values.tolist(), abs=1e-4)
