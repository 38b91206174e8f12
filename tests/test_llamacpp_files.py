"""Llama GGUF files made by llama.cpp's own tools, as people make them: a small random LlamaForCausalLM
saved by transformers with a SentencePiece tokenizer trained by `sentencepiece`, converted by llama.cpp's
convert_hf_to_gguf.py to F16 and quantised by llama-quantize to Q8_0 and Q4_K_M
(benchmarks/llama_checkpoint.py, the benchmark's own recipe at a smaller size: rows of 256 and 512,
whole K-quant blocks). lmhead's figures on each file are transformers' on the file's own dequantised
weights (gguf-py's reader and dequantisation): where the products are the dequantised matrices' (F16,
Q8_0) the top 5 ids equal and KL <= 1e-5 over the whole vocabulary; where x is rounded per block
(llama.cpp's arithmetic, engine/quant.py ROUNDED: Q4_K and Q6_K) KL <= 1e-3. `lmhead compare` gives
Q4_K_M's KL against the F16 file, transformers' on both files' weights.

Skipped where benchmarks/llamacpp.py has not built llama.cpp, or where no `sentencepiece` is there for
its converter (benchmarks/llama_checkpoint.py site(): $LMHEAD_BENCH_SITE or the benchmark's cache; it is
never imported by the tests' own processes). The files are made once per session (about 30 s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import agrees_with_oracle, cli, gguf_oracle

import lmhead_cli

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

TYPES = ("F16", "Q8_0", "Q4_K_M")
KL_BOUND = {"F16": 1e-5, "Q8_0": 1e-5, "Q4_K_M": 1e-3}
SIZES = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "initializer_range": 0.05}
TEXT = "The keys on the table, and the dog is in the garden. Tokens are read 1,234 times a day."


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """{"folder": the transformers checkpoint, "F16" / "Q8_0" / "Q4_K_M": the files}."""
    import llama_checkpoint
    import llamacpp

    if not llamacpp.ready(tools=("llama-quantize",)):
        pytest.skip(f"llama.cpp is not built ({llamacpp.cache()}: python benchmarks/llamacpp.py build)")
    if llama_checkpoint.site(install=False) is None:
        pytest.skip("no sentencepiece for llama.cpp's converter ($LMHEAD_BENCH_SITE, or python "
                    "benchmarks/llama_checkpoint.py once)")
    root = tmp_path_factory.mktemp("llamacpp-files")
    folder = llama_checkpoint.checkpoint(root / "tiny-llama", SIZES, vocab=SIZES["vocab_size"])
    return {"folder": folder, **llama_checkpoint.ggufs(folder, TYPES, out=root)}


def _read(path: Path) -> dict:
    """Each tensor of a GGUF file as gguf-py reads it: name -> (type name, data), helpers.dequantised's input."""
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, t.data) for t in GGUFReader(str(path)).tensors}


def _oracle(made, kind: str):
    """transformers' LlamaForCausalLM from the checkpoint, holding the file's dequantised weights."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(made["folder"]), dtype=torch.float32).eval().requires_grad_(False)
    return gguf_oracle(model, _read(made[kind]))[0]


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.slow
def test_top5_and_kl_against_transformers_on_the_files_weights(made, kind):
    m = lmhead_cli.load(str(made[kind]), device="cpu")
    eng = m.loaded.engine
    assert type(eng).__name__ == "LeanLlama"
    if kind != "F16":
        assert eng.weight_format.split("+")[0] == {"Q8_0": "Q8_0", "Q4_K_M": "Q4_K"}[kind], eng.weight_format
    ids = torch.tensor([m.prompt_ids(TEXT)])
    assert ids[0, 0] == 1 and ids.shape[1] > 20  # the tokenizer's BOS, then the text
    from gguf.constants import GGMLQuantizationType

    from lmhead_cli.engine import quant

    rounded = [t for t in eng.weight_format.split("+") if t in GGMLQuantizationType.__members__
               and quant.rounded(GGMLQuantizationType[t])]  # x rounded per block for these (llama.cpp's arithmetic)
    agrees_with_oracle(eng, _oracle(made, kind), ids, KL_BOUND[kind], exact=not rounded)


@pytest.mark.slow
def test_compare_gives_the_kl_of_q4_k_m_against_its_f16(made, monkeypatch):
    """compare's KL(F16 ‖ Q4_K_M) at every scored position, against transformers' forward on each file's
    dequantised weights: with x unrounded (LMHEAD_GGUF_ARITHMETIC=exact), lmhead's products are the
    dequantised matrices', so the two KLs are the same numbers."""
    monkeypatch.setenv("LMHEAD_GGUF_ARITHMETIC", "exact")
    got = cli("compare", TEXT, "--model", str(made["Q4_K_M"]), "--base", str(made["F16"]), "--json")
    assert got.exit_code == 0, got.output
    d = json.loads(got.stdout)
    assert d["bos"] is True  # the tokenizer's BOS leads the window, and each token of the text is scored
    ids = torch.tensor([[1] + [t["id"] for t in d["tokens"]]])
    with torch.no_grad():
        q, base = (_oracle(made, k)(ids).logits[0].double().log_softmax(-1) for k in ("Q4_K_M", "F16"))
    kl = (base.exp() * (base - q)).sum(-1)[:-1]  # position i predicts token i + 1
    got_kl = torch.tensor([t["kld"] for t in d["tokens"]], dtype=torch.float64)
    assert 1e-6 < float(kl.mean()) < 1e-1  # 4-bit weights: a KL well above float rounding's
    # float32 logits agree to ~1e-6, and a KL is a difference of such numbers
    assert torch.allclose(got_kl, kl, rtol=0, atol=2e-6), (got_kl - kl).abs().max()
    assert d["statistics"]["kld_mean"]["value"] == pytest.approx(float(kl.mean()), rel=0, abs=1e-6)
