"""--dtype int8: weight-only int8, symmetric per output row, quantised at load (engine/int8.py).

The oracle is transformers' own GPT-2 holding the dequantised weights, q · s, computed here from the
checkpoint's float weights: logits agree within 1e-4 and greedy ids are token-identical. The tie stays
one int8 table; the transformers engine and non-GPT-2 models are refused in one line; a device
without an int8 kernel is told which fallback runs.
"""

from __future__ import annotations

import pytest
import torch

from lmhead_cli.errors import UsageError
from lmhead_cli.loading.sources import load_model
from helpers import PROMPT_IDS, build_checkpoint, cli

ATOL = 1e-4
NEW = 12


def dequantised(w: torch.Tensor, rows_dim: int) -> torch.Tensor:
    """w with each output row r replaced by round(r / s) · s, s = max|r| / 127 (rows along `rows_dim`)."""
    rows = w if rows_dim == 0 else w.t()
    s = rows.abs().amax(1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    out = (rows / s).round().clamp(-127, 127) * s
    return out if rows_dim == 0 else out.t()


@pytest.fixture(scope="module", params=["tied", "untied"])
def pair(request, tmp_path_factory):
    """(int8 Loaded, transformers GPT-2 with the dequantised weights) from one tiny checkpoint."""
    tied = request.param == "tied"
    folder = tmp_path_factory.mktemp(f"int8_{request.param}")
    reference = build_checkpoint(folder, tied=tied, n_layer=3, seed=11 if tied else 12)
    with torch.no_grad():
        for block in reference.transformer.h:
            for conv in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                conv.weight.copy_(dequantised(conv.weight, rows_dim=1))  # Conv1D: (in, out), rows are columns
        reference.transformer.wte.weight.copy_(dequantised(reference.transformer.wte.weight, rows_dim=0))
        if not tied:
            reference.lm_head.weight.copy_(dequantised(reference.lm_head.weight, rows_dim=0))
    return load_model(str(folder), device="cpu", dtype="int8"), reference


@pytest.fixture(params=["compiled", "torch", "dequantised"])
def products(request, monkeypatch):
    """Run a test's few-row products on the compiled kernel (engine/kernels.c), counting the products it
    computed, or (the kernels turned off) on torch._int_mm over the digits, or dequantised as where
    torch._int_mm is a reference loop (`int_mm_pays`): {"path": ..., "calls": [n]}."""
    from lmhead_cli.engine import int8, kernels

    seen = {"path": request.param, "calls": [0]}
    if request.param != "compiled":
        monkeypatch.setattr(kernels, "load", lambda: None)
        monkeypatch.setattr(int8, "int_mm_pays", lambda: request.param == "torch")
        return seen
    k = kernels.load()
    if k is None:
        pytest.skip(f"the compiled kernels did not load: {kernels.unavailable()}")
    plain = k.int8_times

    def counted(*args):  # the products the kernel computed (it hands the others back: None)
        y = plain(*args)
        seen["calls"][0] += y is not None
        return y

    monkeypatch.setattr(k, "int8_times", counted)
    return seen


def prompt(n: int) -> list[int]:
    return torch.randint(0, 50256, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.parametrize("length", [1, 5, 40])
def test_logits_match_the_dequantised_model(pair, length, products):
    loaded, reference = pair
    ids = prompt(length)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]  # (T, V)
    eng = loaded.engine
    got = eng.head(eng.body(torch.tensor([ids])))[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert (products["calls"][0] > 0) == (products["path"] == "compiled" and length <= 4)


def test_greedy_ids_match_the_dequantised_model_step_by_step(pair, products, monkeypatch):
    """Prefill, then one position per step (the products' few-row path and the KV cache), on the compiled
    kernel and on torch's products; the compiled decoding step, which runs the same kernel from C, is
    turned off here so that each product is counted (tests/test_step.py checks the step itself)."""
    monkeypatch.setenv("LMHEAD_STEP", "0")
    loaded, reference = pair
    eng, ids = loaded.engine, PROMPT_IDS
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                                 pad_token_id=50256, return_dict_in_generate=True, output_logits=True)
    expected = out.sequences[0, len(ids):].tolist()
    cache = eng.new_cache(1, len(ids) + NEW)
    x, got = torch.tensor([ids]), []
    for step in range(NEW):
        z = eng.head(eng.body(x, cache)[:, -1:])[0, 0]  # (V,)
        torch.testing.assert_close(z, out.logits[step][0], atol=ATOL, rtol=0)
        got.append(int(z.argmax()))
        x = torch.tensor([[got[-1]]])
    assert got == expected
    per_step = 4 * len(eng.gpt.h) + 1  # each block's four products and the head
    # every step after the prefill, and the prefill's head on its last position
    assert products["calls"][0] == (per_step * (NEW - 1) + 1 if products["path"] == "compiled" else 0)


def test_the_tie_is_one_int8_table(pair):
    loaded, reference = pair
    eng, tie = loaded.engine, loaded.tie
    assert eng.weight_format == "int8" and eng.dtype == torch.float32
    V, D = reference.transformer.wte.weight.shape
    tables = [p for p in eng.module.parameters() if p.dtype == torch.int8 and tuple(p.shape) == (V, D)]
    if reference.config.tie_word_embeddings:
        assert eng.gpt.wte.table is eng.gpt.lm_head.table and eng.head_weight is eng.embedding_weight
        assert tie.tied and tie.same_object and tie.same_data_ptr and len(tables) == 1
    else:
        assert not tie.tied and len(tables) == 2
    assert tie.storage == "int8 table + float32 scale per row" and tie.shape == (V, D)
    assert all(p.dtype in (torch.int8, torch.float32) for p in eng.module.parameters())
    # The embedding lookup reads the same table: its rows are the dequantised rows of the head.
    ids = torch.tensor([[5, 7]])
    torch.testing.assert_close(eng.gpt.wte(ids)[0], eng.head_rows([5, 7]) if tie.tied else
                               dequantised(reference.transformer.wte.weight, 0)[[5, 7]], atol=1e-6, rtol=0)


def test_activation_digits_reconstruct_float32():
    """Each row's digits give back round(c·x) exactly, so x to a step of max|x| / STEPS (23 bits);
    the top byte stays 0 even where |x| is the row's maximum, on either sign."""
    from lmhead_cli.engine.int8 import _BYTES, STEPS, digits

    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1e-3], [1.0], [300.0]])
    x[1, 7] = 0.0
    x[2, 3] = -x[2].abs().max() * 1.5  # the largest |x| of its row, negative
    for rows in (x, x[1:2], x.t().contiguous().t()[:2]):  # several positions, one, a strided view
        M = rows.shape[0]
        a, c = digits(rows)
        assert a.dtype == torch.int8 and a.shape == (500, 4 * M) and c.shape == (M, 1)
        d = a.double().view(500, M, 4)  # (K, row, byte)
        assert bool((d[..., 3 if _BYTES[3] == 0 else 0] == 0).all())  # the top byte
        v = d @ _BYTES.double()  # (K, M): the integers, exactly
        assert bool((v.abs() <= STEPS).all()) and bool((v.t() == (rows * c).round().double()).all())
        back = (v / c.double().t()).t()
        bound = 1 / c.double()  # half a step, plus float32's rounding of c·x (at most half a step more)
        assert bool(((back - rows.double()).abs() <= bound).all())


def test_a_row_with_nan_or_infinity_gives_non_finite_outputs(products):
    """The digits of a non-finite row are meaningless integers; its scale carries the NaN (or infinity)
    into the outputs, so the model's own non-finite checks still see it."""
    from lmhead_cli.engine.int8 import int8_times, quantise

    q, s = quantise(torch.randn(6, 16, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    x[0, 5], x[2, 1] = float("nan"), float("inf")
    for rows in (x, x[:1], x[2:]):
        y = int8_times(rows, q, s)
        bad = ~torch.isfinite(rows).all(1)
        assert bool((~torch.isfinite(y[bad])).all()) and bool(torch.isfinite(y[~bad]).all())


def test_torch_s_int8_product_is_used_only_where_it_is_a_real_kernel(monkeypatch):
    """int_mm_pays times torch._int_mm against the float32 product of the same shape, once per process:
    a reference loop (here a stand-in 20 ms a call) is not used; one as fast as float32 is."""
    import time

    from lmhead_cli.engine import int8

    real = torch._int_mm
    try:
        for stand_in, pays in [(lambda a, b: time.sleep(0.02) or real(a, b), False),
                               (lambda a, b: (a.float() @ b.float()).int(), True)]:
            monkeypatch.setattr(torch, "_int_mm", stand_in)
            int8.int_mm_pays.cache_clear()
            assert int8.int_mm_pays() is pays
            assert int8.int_mm_pays() is pays  # measured once
    finally:
        int8.int_mm_pays.cache_clear()


def test_dequantised_products_take_the_weight_in_blocks_and_equal_the_whole(monkeypatch):
    from lmhead_cli.engine import int8

    monkeypatch.setattr(int8, "DEQUANT_ROWS", 7)
    g = torch.Generator().manual_seed(4)
    q, s = int8.quantise(torch.randn(30, 16, generator=g))
    x, bias = torch.randn(5, 16, generator=g), torch.randn(30, generator=g)
    w = q.float() * s[:, None]
    for b in (bias, None):
        torch.testing.assert_close(int8.dequantised_times(x, q, s, b), torch.nn.functional.linear(x, w, b))


def test_without_a_kernel_the_fallback_is_named_and_gives_the_same_logits(pair, monkeypatch):
    from lmhead_cli.engine import int8

    loaded, _ = pair
    monkeypatch.setattr(int8, "kernel_for", lambda device: False)
    said = []
    slow = load_model(loaded.path, device="cpu", dtype="int8", announce=said.append)
    assert len(said) == 1 and "no int8 product kernel" in said[0] and "dequantises" in said[0]
    ids = torch.tensor([PROMPT_IDS])
    with torch.inference_mode():
        torch.testing.assert_close(slow.engine.head(slow.engine.body(ids)), loaded.engine.head(loaded.engine.body(ids)),
                                   atol=ATOL, rtol=0)


def test_the_transformers_engine_and_other_models_are_refused(tiny, tmp_path):
    from transformers import LlamaConfig

    # The core names the parameters as the API spells them (dtype, engine); the CLI as flags.
    with pytest.raises(UsageError, match="^dtype int8 is the lean engine's .*; with engine transformers use"):
        load_model(str(tiny[0]), dtype="int8", engine="transformers")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=50257).save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="^dtype int8 is lean GPT-2's"):
        load_model(str(tmp_path), dtype="int8")
    got = cli("tie", "--model", str(tmp_path), "--dtype", "int8")
    assert got.exit_code == 2 and got.stderr.strip().splitlines() == [
        "lmhead: error: --dtype int8 is lean GPT-2's (this is 'llama', run on lean); use float32, bfloat16 or "
        "float16"]


def test_the_command_line_says_int8_and_how_the_tie_is_stored(tiny):
    """--dtype int8 on any model command: the JSON names the weights' format, `tie` how the one table
    is stored, and the transformers engine is refused in one line, exit 2."""
    import json

    from typer.testing import CliRunner

    from lmhead_cli.cli import app

    runner = CliRunner()
    folder = str(tiny[0])
    got = runner.invoke(app, ["greedy", "The keys", "-n", "3", "--model", folder, "--dtype", "int8", "--json"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["dtype"] == "int8"
    got = runner.invoke(app, ["inspect", "The keys", "--model", folder, "--dtype", "int8", "--json"])
    assert got.exit_code == 0 and json.loads(got.stdout)["dtype"] == "int8"
    got = runner.invoke(app, ["tie", "--model", folder, "--dtype", "int8", "--json"])
    doc = json.loads(got.stdout)
    assert doc["tied"] and doc["storage"] == "int8 table + float32 scale per row"
    assert "stored as" in runner.invoke(app, ["tie", "--model", folder, "--dtype", "int8"]).stdout
    got = runner.invoke(app, ["inspect", "x", "--model", folder, "--dtype", "int8", "--engine", "transformers"])
    assert got.exit_code == 2 and got.stderr.strip().splitlines() == [
        "lmhead: error: --dtype int8 is the lean engine's (GPT-2 checkpoints); with --engine transformers use "
        "float32, bfloat16 or float16"]


def test_int8_head_rows_are_made_on_the_engine_s_device(tiny):
    """head_rows on an int8 engine indexes its table with ids on the engine's device, whatever torch's
    default device (here meta, as a GPU would differ from the CPU). Mutant: ids on the default device."""
    loaded = load_model(str(tiny[0]), device="cpu", dtype="int8")
    want = loaded.engine.head_rows([5, 7])
    with torch.device("meta"):
        got = loaded.engine.head_rows([5, 7])
    assert got.device.type == "cpu" and torch.equal(got, want)
