"""lmhead's own Llama engine (engine/llama.py, LeanLlama) against transformers: LlamaForCausalLM (grouped
and plain attention, tied and untied heads, Llama 3's rope scaling), Qwen2ForCausalLM (q/k/v biases)
and MistralForCausalLM without a sliding window, each a tiny random checkpoint saved by transformers.
The logits at every position are transformers' forward (allclose), greedy ids its generate() (equal)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPT, _tokenizer_files, cli

import lmhead_cli

SIZES = dict(vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, initializer_range=0.15, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CASES = {
    "llama-gqa-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_parameters=LLAMA3)),
    "qwen2-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-untied-one-kv-head": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "mistral": ("mistral", dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)),
}
IDS = [464, 8251, 319, 262, 3084, 11, 290, 262, 3290, 318, 257, 1310, 286, 262, 1110, 13, 383, 3290, 318, 845]


def build(folder, kind: str, seed: int = 0, **sizes):
    """A random transformers checkpoint of `kind` saved in `folder` (GPT-2's tokenizer files beside it),
    its final and layer norms' gains and its biases random too, so that each is really read."""
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{name}Config")(**(SIZES | sizes))
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    for n, p in model.named_parameters():
        if "norm" in n:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif n.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _tokenizer_files(folder)
    return folder, model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    kind, sizes = CASES[request.param]
    return build(tmp_path_factory.mktemp(request.param), kind, **sizes)


def test_logits_at_every_position_are_transformers_forward(case):
    folder, model = case
    m = lmhead_cli.load(str(folder), device="cpu")
    eng = m.loaded.engine
    assert type(eng).__name__ == "LeanLlama" and eng.name == "lean"
    assert eng.tied == model.config.tie_word_embeddings
    ids = torch.tensor([IDS])
    with torch.no_grad():
        want = model(ids).logits[0]
    got = eng.head(eng.body(ids))[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_ids_are_transformers_generate(case):
    folder, model = case
    m = lmhead_cli.load(str(folder), device="cpu")
    got = m.generate(PROMPT, greedy=True, max_new_tokens=20, ignore_eos=True).to_dict()
    ids = torch.tensor([got["prompt_ids"]])
    want = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert got["generated_ids"] == want


def test_rows_of_a_batch_decode_as_they_do_alone(case):
    """Two prompts of different lengths in one batch (left-padded, a mask, the grouped-query step over
    the shared cache) make the ids each makes alone."""
    folder, _ = case
    m = lmhead_cli.load(str(folder), device="cpu")
    prompts = [PROMPT, "And it came to pass in those days that"]
    together = [r.to_dict()["generated_ids"] for r in m.generate(prompts, greedy=True, max_new_tokens=8,
                                                                 ignore_eos=True)]
    alone = [m.generate(p, greedy=True, max_new_tokens=8, ignore_eos=True).to_dict()["generated_ids"]
             for p in prompts]
    assert together == alone


def test_rows_that_take_turns_decode_as_they_do_alone(case):
    """Rows past max_rows take turns (engine.step_rows: a step of some rows over views of the shared
    cache, the others' new column left empty and dropped when the cache is rebuilt): a one-row request
    beside one of 3 choices, 2 rows a step, each choice makes the ids it makes alone."""
    from lmhead_cli.decoding.decoder import Decoder
    from lmhead_cli.decoding.request import Request
    from lmhead_cli.decoding.settings import make

    folder, _ = case
    m = lmhead_cli.load(str(folder), device="cpu")
    requests = {"many": Request.of(make(seed=2, n=3, temperature=0.9), [IDS[:6]], 10),
                "one": Request.of(make(greedy=True), [IDS[3:12]], 8)}

    def ids(events, out: dict) -> dict:
        for e in events:
            if e.kind == "token":
                out.setdefault((e.key, e.index), []).append(e.token.id)
        return out

    d = Decoder(m.loaded, max_rows=2)
    d.submit("many", requests["many"])
    together = ids(d.round(), {})  # two of the 3 choices join (max_rows): their first tokens
    d.submit("one", requests["one"])
    ids(d.events(), together)
    for key, request in requests.items():
        alone = Decoder(m.loaded)
        alone.submit(key, request)
        for k, want in ids(alone.events(), {}).items():
            assert together[k] == want


def test_llama3_rope_scaling_is_read(tmp_path):
    """The llama3 case's logits are transformers' (above); here, the same weights without the scaling
    give other logits, so the scaling was not ignored."""
    _, scaled = build(tmp_path / "scaled", "llama", num_key_value_heads=2, rope_parameters=LLAMA3)
    folder, plain = build(tmp_path / "plain", "llama", num_key_value_heads=2)
    ids = torch.tensor([IDS])
    eng = lmhead_cli.load(str(tmp_path / "scaled"), device="cpu").loaded.engine
    got = eng.head(eng.body(ids))[0]
    with torch.no_grad():
        assert torch.allclose(got, scaled(ids).logits[0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, plain(ids).logits[0], atol=1e-3)


def test_the_residual_stream_splits_into_its_parts(case):
    """attribute's parts (the embedding, each head, each MLP) sum to the residual, and the head on the
    final norm of that residual is the forward's last logits."""
    folder, model = case
    eng = lmhead_cli.load(str(folder), device="cpu").loaded.engine
    ids = torch.tensor([IDS[:7]])
    c = eng.components(ids)
    parts = sum(c.embed.values()) + c.heads.sum((1, 2)) + c.attn_bias.sum(0) + c.mlp.sum(1)
    assert torch.allclose(parts, c.resid, atol=1e-4)
    with torch.no_grad():
        want = model(ids, output_hidden_states=True)
    assert torch.allclose(eng.head(eng.final_norm(c.resid)), want.logits[:, -1], atol=1e-5)
    for got, ref in zip(eng.residuals(ids), want.hidden_states[:-1]):
        assert torch.allclose(got, ref, atol=1e-5)


def test_a_config_the_lean_engine_does_not_compute_runs_on_transformers_with_a_note(tmp_path):
    folder, model = build(tmp_path / "yarn", "llama", num_key_value_heads=2,
                          rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 64})
    got = cli("inspect", PROMPT, "--model", str(folder), "--json")
    assert got.exit_code == 0, got.output
    assert "running on transformers' llama: the config asks for rope type 'yarn'" in got.stderr
    assert json.loads(got.stdout)["engine"] == "transformers"
    got = cli("inspect", PROMPT, "--model", str(folder), "--engine", "lean")
    assert got.exit_code == 2 and got.stderr.strip().splitlines() == [
        "lmhead: error: the lean engine computes plain llama, and this config asks for rope type 'yarn'; use "
        "--engine transformers"]


@pytest.mark.parametrize("rows,masked", [(1, False), (3, False), (3, True)])
def test_grouped_attention_in_the_kernel_is_sdpa_s(rows, masked):
    """One new position's grouped-query attention in the compiled kernel (each key head read by its G
    query heads through a stride of 0) over views of a cache, against torch's SDPA with enable_gqa."""
    from lmhead_cli.engine import kernels, llama_step

    if kernels.load() is None:
        pytest.skip("the compiled kernels are not built here")
    g = torch.Generator().manual_seed(rows)
    B, H, K, T, hd = rows, 8, 2, 7, 16
    keys, values = (torch.randn(B, K, 16, hd, generator=g) for _ in range(2))  # (B, K, T_max, hd), as KVCache
    k, v = keys[:, :, :T], values[:, :, :T]
    q = torch.randn(B, 1, H, hd, generator=g).transpose(1, 2)  # (B, H, 1, hd), a view as the engine's
    mask = None
    if masked:
        mask = torch.zeros(B, 1, 1, T)
        mask[0, ..., :3] = torch.finfo(torch.float32).min  # row 0 left-padded by 3
    got = llama_step.attend_grouped(q, k, v, mask)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert got is not None and torch.allclose(got, want.transpose(1, 2).reshape(B, 1, H * hd), atol=1e-6)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    """A Q8_0 GGUF of a small Llama (grouped-query, untied), its matrices kept as the file's blocks."""
    from helpers import write_gguf

    folder = tmp_path_factory.mktemp("q8")
    _, model = build(folder / "hf", "llama", num_key_value_heads=2, tie_word_embeddings=False)
    write_gguf(model, folder / "tiny-Q8_0.gguf", "Q8_0")
    return folder


def test_generate_says_what_its_products_ran_on(q8_file):
    """generate --json's `products`: the GGUF blocks' type in the compiled kernels, with its arithmetic;
    a float Llama's matrices in torch's products (it said "compiled kernels" for both)."""
    from lmhead_cli.engine import kernels

    k = kernels.load()
    if k is None:
        pytest.skip("the compiled kernels are not built here")
    runs = {f: json.loads(cli("greedy", PROMPT, "--model", str(q8_file / f), "-n", "2", "--json").stdout)["products"]
            for f in ("tiny-Q8_0.gguf", "hf")}
    assert runs == {"tiny-Q8_0.gguf": f"compiled kernels ({k.variant}): Q8_0 with x unrounded",
                    "hf": f"torch's products (float32), attention in compiled kernels ({k.variant})"}


def test_layer_taps_dequantise_a_matrix_only_when_read(q8_file, monkeypatch):
    """A quantised Llama's layer taps hold no dequantised matrix: each o_proj weight or down_proj's value
    vectors is dequantised when read, one at a time (all of them were, at once)."""
    from lmhead_cli.engine import quant

    eng = lmhead_cli.load(str(q8_file / "tiny-Q8_0.gguf"), device="cpu").loaded.engine
    made = []
    real = quant.Blocks.dequantise
    monkeypatch.setattr(quant.Blocks, "dequantise", lambda self: made.append(self.shape) or real(self))
    taps = eng.layer_taps()
    assert made == []
    down = eng.llama.model.layers[1].mlp.down_proj.weight
    assert torch.equal(taps[1].values, real(down).t()) and made == [down.shape]


def test_a_hook_on_a_fused_projection_sees_its_own_output(case):
    """q, k and v run as one product, unless a hook is on one of them: then their own modules run, and the
    hook sees what it sees in transformers."""
    folder, model = case
    eng = lmhead_cli.load(str(folder), device="cpu").loaded.engine
    seen = {}
    for name, m in (("ours", eng.llama), ("theirs", model)):
        h = m.model.layers[0].self_attn.k_proj.register_forward_hook(lambda _m, _i, o, name=name: seen.__setitem__(name, o))
        try:
            with torch.no_grad():
                eng.body(torch.tensor([IDS])) if name == "ours" else model(torch.tensor([IDS]))
        finally:
            h.remove()
    assert torch.allclose(seen["ours"], seen["theirs"], atol=1e-6)
