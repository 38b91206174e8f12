"""A Llama's or Qwen2's GGUF with its quantised matrices kept as the file's blocks (engine/quant.py) on
lmhead's own Llama engine: the blocks dequantise as gguf.quants does, the chunked products are the
dequantised matrix's, the figures are transformers' on the file's dequantised weights (with x unrounded:
top 5 equal, KL over the whole vocabulary <= 1e-5; in each type's own arithmetic, llama.cpp's rounding
of x for the 4-bit types: KL <= 1e-5 for F32 and Q8_0, <= 1e-3 for the 4-bit types), a loaded Q8_0 file
takes at most 1.3x its size beyond the runtime, and every reading command runs on one.

The files are written with gguf-py's GGUFWriter; Q8_0 and Q4_0 with gguf.quants.quantize, Q4_K and Q6_K
with helpers.k_quantize (gguf-py dequantises these types but cannot quantise to them)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import PROMPT, _env, _tokenizer_files, agrees_with_oracle, cli, gguf_oracle, k_quant_blocks, write_gguf

import lmhead_cli
from lmhead_cli.engine import kernels, quant

QTYPES = ("F32", "Q8_0", "Q4_0", "Q4_K", "Q6_K")
KL_BOUND = {"F32": 1e-5, "Q8_0": 1e-5, "Q4_0": 1e-3, "Q4_K": 1e-3, "Q6_K": 1e-3}
IDS = [464, 8251, 319, 262, 3084, 11, 290, 262, 3290, 318, 257, 1310, 286, 262, 1110, 13]
TEXT = "The keys on the table, and the dog is in the garden. And it came to pass in those days."


def _model(kind: str, **sizes):
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2"}[kind]
    torch.manual_seed(3)
    config = getattr(transformers, f"{name}Config")(**(dict(
        vocab_size=50257, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.05, bos_token_id=50256,
        eos_token_id=50256) | sizes))
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    for n, p in model.named_parameters():
        if "norm" in n:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif n.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def llama():
    """An untied Llama with grouped-query attention, rows of 256 and 512 (whole K-quant blocks)."""
    return _model("llama", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen2():
    """A tied Qwen2: biases on q, k and v, the head the embedding's blocks."""
    return _model("qwen2", tie_word_embeddings=True)


# ---- the blocks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_blocks_dequantise_as_gguf_quants_does(qtype, monkeypatch):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[qtype]
    if qtype in ("Q8_0", "Q4_0"):
        raw = quantize(np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32), t)
    else:
        raw = k_quant_blocks(qtype, 6, 512, seed=1)
    want = torch.from_numpy(dequantize(raw, t))
    blocks = quant.Blocks(torch.from_numpy(raw.copy()), t, 512)
    assert blocks.shape == (6, 512) and blocks.kind == qtype
    assert torch.equal(blocks.dequantise(), want)  # bit for bit, in the compiled kernels where built
    assert torch.equal(blocks.rows(torch.tensor([4, 0, 4])), want[[4, 0, 4]])
    if kernels.load() is not None:  # each variant's own, and the fallback (torch for Q8_0 and Q4_0, else gguf's)
        for v in kernels.variants(ctypes.CDLL(str(kernels.module_path()))):
            assert torch.equal(kernels._open(kernels.module_path(), v).gguf_rows(int(t), blocks.data, 512), want), v
        monkeypatch.setattr(kernels, "load", lambda: None)
        assert torch.equal(blocks.dequantise(), want)


def test_the_chunked_product_is_the_dequantised_matrix_s(monkeypatch):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    monkeypatch.setattr(quant, "CHUNK_VALUES", 3 * 256)  # 3 rows a chunk: 7 chunks, the last short
    monkeypatch.setattr(quant, "KERNEL_ROWS", 0)  # torch's product (what runs where the kernels are not built)
    raw = quantize(np.random.default_rng(2).standard_normal((20, 256)).astype(np.float32), GGMLQuantizationType.Q8_0)
    blocks = quant.Blocks(torch.from_numpy(raw), GGMLQuantizationType.Q8_0, 256)
    bias = torch.randn(20)
    x = torch.randn(2, 5, 256)
    got = quant.QuantLinear(blocks, bias)(x)
    assert got.shape == (2, 5, 20)
    assert torch.allclose(got, x @ blocks.dequantise().t() + bias, atol=1e-5)


def test_the_q8_0_kernel_is_the_dequantised_product_and_the_blocks_sizes_gguf_s():
    """csrc/kernels.h declares GGUF's blocks once (tests/test_kernel_interface.py checks quant.py's mirror of
    them against it); their sizes are gguf's, and Q8_0's compiled product of a few rows with x unrounded
    equals the dequantised matrix's within float32 rounding."""
    import ctypes

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    from lmhead_cli.engine import kernels

    for qtype, (values, block) in quant.COMPILED.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(qtype)] == (values, ctypes.sizeof(block))
    assert {GGMLQuantizationType(q).name for q in quant.COMPILED} == {"Q4_0", "Q8_0", "Q4_K", "Q6_K"}
    assert ctypes.sizeof(quant.BlockQ8_K) == 4 + 256 + 2 * 16  # ggml-common.h's static_assert
    fast = kernels.load()
    if fast is None:
        pytest.skip("the compiled kernels are not built here")
    raw = quantize(np.random.default_rng(5).standard_normal((300, 512)).astype(np.float32), GGMLQuantizationType.Q8_0)
    blocks = quant.Blocks(torch.from_numpy(raw), GGMLQuantizationType.Q8_0, 512)
    bias = torch.randn(300)
    for rows in (1, 3, quant.KERNEL_ROWS):
        x = torch.randn(rows, 512)
        got = fast.q8_0_times(x, blocks.data, bias)
        assert got is not None and torch.allclose(got, x @ blocks.dequantise().t() + bias, atol=1e-4, rtol=1e-5)
        assert torch.equal(quant.QuantLinear(blocks, bias)(x), got)  # the layer takes the kernel for a few rows


# ---- the figures --------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype, arithmetic", [(q, "default") for q in QTYPES]
                         + [(q, "exact") for q in ("Q4_0", "Q4_K", "Q6_K")])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.slow
def test_top5_and_kl_against_transformers_on_the_dequantised_weights(kind, qtype, arithmetic, request, tmp_path,
                                                                     monkeypatch):
    """x unrounded (F32, Q8_0, and every type with LMHEAD_GGUF_ARITHMETIC=exact): top 5 equal, KL <= 1e-5.
    The 4-bit types' own arithmetic (x rounded per block, llama.cpp's): KL <= 1e-3 (measured 1.4e-4 to
    3.7e-4 here); their top 5 are not held equal, since this random model's logits are flat (its top 6
    lie 1e-4 apart where the rounding moves a logit by up to 0.1)."""
    if arithmetic == "exact":
        monkeypatch.setenv(quant.ARITHMETIC, "exact")
    model = request.getfixturevalue(kind)
    path = tmp_path / f"{kind}-{qtype}.gguf"
    written = write_gguf(model, path, qtype)
    twin, _ = gguf_oracle(model, written)
    m = lmhead_cli.load(str(path), device="cpu")
    eng = m.loaded.engine
    assert type(eng).__name__ == "LeanLlama" and eng.tied == (kind == "qwen2")
    if qtype != "F32":  # the matrices stay the file's blocks
        assert qtype in eng.weight_format.split("+")
        assert isinstance(eng.llama.model.layers[0].mlp.up_proj.weight, quant.Blocks)
    from gguf.constants import GGMLQuantizationType

    exact = qtype == "F32" or not quant.rounded(GGMLQuantizationType[qtype])
    # 25 positions: more than a step's 16 rows, so the prompt's own products run (kq_row where VNNI is
    # there; torch's GEMM with x unrounded)
    agrees_with_oracle(eng, twin, torch.tensor([IDS + IDS[:9]]), KL_BOUND[qtype], exact)


@pytest.mark.slow
def test_memory_of_a_loaded_q8_0_file_is_at_most_1_3x_its_size(tmp_path):
    """Peak resident memory (ru_maxrss) in a fresh process: after a tiny model of the same vocabulary
    has loaded and run (the runtime: torch, lmhead, the tokenizer), then after loading the Q8_0 file and
    reading a prompt with it. Dequantised to float32 the same file took 5.2x (measured here)."""
    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    write_gguf(_model("llama", hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                      tie_word_embeddings=False), small, "Q8_0")
    write_gguf(_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      tie_word_embeddings=False), big, "Q8_0")
    script = textwrap.dedent(f"""
        import os, resource
        import lmhead_cli
        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        lmhead_cli.load({str(small)!r}, device="cpu").inspect("The keys on the table", top_k=5)
        base = peak()
        m = lmhead_cli.load({str(big)!r}, device="cpu")
        m.inspect("The keys on the table", top_k=5)
        print(base, peak(), os.path.getsize({str(big)!r}), m.loaded.engine.weight_format)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(None), timeout=300)
    assert out.returncode == 0, out.stderr
    base, peak, size, fmt = out.stdout.split()
    assert fmt == "Q8_0"
    assert (int(peak) - int(base)) <= 1.3 * int(size), (int(peak) - int(base)) / int(size)


# ---- every reading command ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-gguf")
    written = {q: write_gguf(llama, folder / f"tiny-{q}.gguf", q) for q in ("Q8_0", "F16")}
    _tokenizer_files(folder)
    return folder, written


def _doc(*args) -> dict:
    got = cli(*args, "--json")
    assert got.exit_code == 0, got.output
    return json.loads(got.stdout)


@pytest.mark.parametrize("command", [
    ("inspect", TEXT, "-k", "3"), ("score", TEXT), ("lens", TEXT), ("attribute", TEXT, "-t", " the"),
    ("neurons", "--layer", "1", "--top", "3"), ("neurons", TEXT, "--target", " the"), ("calibrate", TEXT)])
@pytest.mark.slow
def test_every_reading_runs_on_a_q8_0_llama(files, command):
    folder, _ = files
    d = _doc(*command, "--model", str(folder / "tiny-Q8_0.gguf"))
    assert d["model"] == str(folder / "tiny-Q8_0.gguf")
    if command[0] == "lens":  # read through the final RMSNorm
        assert d["norm"] == "model.norm" and len(d["layers"]) == 3
    if command[0] == "attribute":  # the parts add up to the logit
        assert abs(d["error"]) < 1e-3


def test_compare_gives_the_kl_of_q8_0_against_its_f16(files, llama):
    """compare's KL(F16 ‖ Q8_0) at every scored position, against transformers' forward on each file's
    dequantised weights."""
    folder, written = files
    d = _doc("compare", TEXT, "--model", str(folder / "tiny-Q8_0.gguf"), "--base", str(folder / "tiny-F16.gguf"))
    ids = torch.tensor([[t["id"] for t in d["tokens"]]])
    with torch.no_grad():
        q, base = (gguf_oracle(llama, written[k])[0](ids).logits[0].double().log_softmax(-1) for k in ("Q8_0", "F16"))
    kl = (base.exp() * (base - q)).sum(-1)[:-1]  # position i predicts token i + 1
    got = [t["kld"] for t in d["tokens"][1:]]
    # float32 logits agree to ~1e-6, and a KL of ~1e-4 is a difference of such numbers
    assert got == pytest.approx(kl.tolist(), rel=0, abs=2e-6)
    assert d["statistics"]["kld_mean"]["value"] == pytest.approx(float(kl.mean()), rel=0, abs=1e-6)
    assert 0 < d["statistics"]["kld_mean"]["value"] < 1e-3
