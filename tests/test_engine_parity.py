"""The lean engine against transformers (the oracle), on the same checkpoints.

Last-position logits agree within 1e-4 in float32; greedy ids are token-identical with
`generate(do_sample=False)`; seeded sampling is token-identical with `generate(do_sample=True)`
(the same global seed, one torch.multinomial per step), and every step's logits agree too.
Prompts of 1, 17 and 1024 tokens, tied and untied heads.
"""

from __future__ import annotations

import pytest
import torch

from lmhead_cli.loading.sources import load_model
from helpers import build_checkpoint

NEW = 12  # new tokens per generation test
N_POSITIONS = 1024 + NEW  # room for a 1024-token prompt and what follows it
PROMPT_LENGTHS = (1, 17, 1024)
ATOL = 1e-4


@pytest.fixture(scope="module", params=["tied", "untied"])
def checkpoint(request, tmp_path_factory):
    """(folder, transformers model) of a tiny GPT-2 with room for a 1024-token prompt."""
    tied = request.param == "tied"
    folder = tmp_path_factory.mktemp(f"parity_{request.param}")
    return folder, build_checkpoint(folder, tied=tied, n_positions=N_POSITIONS, seed=3 if tied else 4)


@pytest.fixture(scope="module")
def pair(checkpoint):
    """(lean engine, transformers model) loaded from one checkpoint folder."""
    folder, reference = checkpoint
    loaded = load_model(str(folder), device="cpu", dtype="float32", engine="lean")
    assert loaded.engine.name == "lean" and loaded.tie.tied == reference.config.tie_word_embeddings
    return loaded.engine, reference


def prompt(n: int) -> list[int]:
    """n token ids, fixed by a seed (the text does not matter to the engines)."""
    return torch.randint(0, 50256, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def lean_decode(engine, ids: list[int], n: int, choose) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill with a KV cache, then one position per step, the head on the last only; stops at eos
    as generate() does. Returns the new ids and each step's logits (V,)."""
    cache = engine.new_cache(1, len(ids) + n)
    x = torch.tensor([ids])
    out, steps = [], []
    for _ in range(n):
        logits = engine.head(engine.body(x, cache)[:, -1:])[0, 0]  # (V,)
        steps.append(logits)
        token = choose(logits)
        out.append(token)
        if token == engine.eos_token_id:
            break
        x = torch.tensor([[token]])
    return out, steps


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_last_position_logits_match(pair, length):
    engine, reference = pair
    ids = prompt(length)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    got = engine.head(engine.body(torch.tensor([ids]))[:, -1:])[0, 0]
    assert got.shape == expected.shape == (50257,)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_ids_match_generate(pair, length):
    engine, reference = pair
    ids = prompt(length)
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                      pad_token_id=engine.eos_token_id)[0, length:].tolist()
    got, _ = lean_decode(engine, ids, NEW, lambda z: int(z.argmax()))
    assert got == expected


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_seeded_sampling_matches_generate_step_by_step(pair, length):
    """transformers draws with torch.multinomial(softmax(logits)) on the global generator; the same
    draw on the lean logits gives the same tokens, and the logits agree at every step."""
    engine, reference = pair
    ids = prompt(length)
    seed = 1000 + length
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                 max_new_tokens=NEW, pad_token_id=engine.eos_token_id,
                                 return_dict_in_generate=True, output_logits=True)
    expected = out.sequences[0, length:].tolist()

    torch.manual_seed(seed)
    got, steps = lean_decode(engine, ids, NEW, lambda z: int(torch.multinomial(torch.softmax(z.float(), -1), 1)))
    assert got == expected
    assert len(steps) == len(out.logits)
    for mine, theirs in zip(steps, out.logits):
        torch.testing.assert_close(mine, theirs[0], atol=ATOL, rtol=0)


def test_prompt_longer_than_the_context_is_refused(pair):
    engine, _ = pair
    with pytest.raises(ValueError, match=f"exceed the context of {N_POSITIONS}"):
        engine.body(torch.zeros(1, N_POSITIONS + 1, dtype=torch.long))


def test_cache_reorder_keeps_the_chosen_rows(pair):
    """Two different prompts in one batch, cache reordered to [1, 1]: both rows continue prompt 1."""
    engine, _ = pair
    a, b = prompt(17), prompt(16) + [7]
    cache = engine.new_cache(2, 32)
    engine.body(torch.tensor([a, b]), cache)
    cache.reorder(torch.tensor([1, 1]))
    h = engine.body(torch.tensor([[5], [5]]), cache)  # (2, 1, D)
    alone = engine.new_cache(1, 32)
    engine.body(torch.tensor([b]), alone)
    expected = engine.body(torch.tensor([[5]]), alone)
    torch.testing.assert_close(h, expected.expand(2, -1, -1), atol=ATOL, rtol=0)


def assert_same_sums(got, want, x, w, bias=None):
    """got and want: x (R, K) @ w (K, N) (+ bias) in float32, each summed in its own order (blocked vs
    plain products, different thread splits). A float32 sum of n terms is off by at most γ_n·Σ|terms|,
    γ_n = n·u/(1 − n·u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), so
    two orders differ by at most 2·γ_n·Σ|terms| per output: a bound that grows with the values, where
    a fixed atol fails on N(0, 1) weights as soon as a few outputs reach |Σ| ≈ 40."""
    n = x.shape[-1] + (bias is not None)
    u = 2.0 ** -24
    gamma = n * u / (1 - n * u)
    magnitude = x.double().abs() @ w.double().abs()  # (R, N): Σ|x_k w_k|
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    err = (got.double() - want.double()).abs()
    assert got.shape == want.shape
    assert bool((err <= 2 * gamma * magnitude).all()), f"largest excess {float((err / (2 * gamma * magnitude)).max()):.2f}x"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_product_form_equals_the_plain_product(threads):
    """A few positions' body and head products in each float32 form (BLAS over rows, batched matmuls over
    row blocks of the weights) give what addmm and F.linear give, for any thread count, a row count that
    no block count divides, with and without a bias."""
    from lmhead_cli.engine.lean import Conv1D
    from lmhead_cli.engine.products import few_rows_product, products_for, rows_times

    g = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = Conv1D(64, 190)
        layer.products = products_for(torch.float32, torch.device("cpu"))
        assert set(layer.products.forms) == {"linear", "gemv", "blocked"}
        with torch.no_grad():
            layer.weight.copy_(torch.randn(64, 190, generator=g))
            layer.bias.copy_(torch.randn(190, generator=g))
        w = layer.weight.detach().clone()
        layer.lay_out_()
        assert layer.weight.shape == (64, 190) and layer.weight.t().is_contiguous()  # (in, out) as checkpoints name it
        E = torch.randn(50257, 64, generator=g)
        for form in layer.products.forms:
            layer.products.use(form)
            for rows in (1, 3):
                x = torch.randn(rows, 64, generator=g)
                with torch.inference_mode():
                    assert_same_sums(layer(x), torch.addmm(layer.bias, x, w), x, w, layer.bias)
                assert_same_sums(few_rows_product(form, x, E, None, None), torch.nn.functional.linear(x, E), x, E.t())
        assert_same_sums(rows_times(E, x), torch.nn.functional.linear(x, E), x, E.t())
    finally:
        torch.set_num_threads(before)


def test_decoding_times_the_forms_and_keeps_one(tiny):
    """greedy decoding times each (thread count, product form) setting and keeps one; the ids are those
    of every other form (the forms differ in float rounding only)."""
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    assert loaded.engine.forms == ("linear", "gemv", "blocked")
    ids = []
    for form in loaded.engine.forms:
        loaded.engine.use_form(form)
        got, _ = lean_decode(loaded.engine, prompt(5), 8, lambda z: int(z.argmax()))
        ids.append(got)
    assert ids[0] == ids[1] == ids[2]
    chooser = loaded.threads
    for _ in range(2 + len(chooser._settings)):
        chooser.run(lambda: lean_decode(loaded.engine, prompt(3), 2, lambda z: int(z.argmax())))
    assert chooser.form_choices and chooser.form_choices[-1] in loaded.engine.forms
    assert loaded.engine.products.settled and not chooser.deciding


def test_bfloat16_products_equal_f_linear(tiny):
    """bfloat16 on the CPU runs the products over oneDNN-packed weights (where torch has them): the
    same logits as the plain bfloat16 products, one position or several."""
    eng = load_model(str(tiny[0]), device="cpu", dtype="bfloat16", engine="lean").engine
    cache = eng.new_cache(1, 8)
    h = eng.body(torch.tensor([[464, 8251, 319]]), cache)  # (1, 3, D)
    for _ in range(2):  # two one-position steps: the second packs the weights
        eng.head(eng.body(torch.tensor([[13]]), cache))
    block = eng.gpt.h[0].attn.c_attn
    for positions in (h[:, -1:], h):
        with torch.inference_mode():
            expected = torch.nn.functional.linear(positions, eng.head_weight)
        torch.testing.assert_close(eng.head(positions), expected, atol=2e-2, rtol=2e-2)
    x = torch.randn(1, 2, block.weight.shape[0]).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), torch.addmm(block.bias, x[0], block.weight)[None], atol=2e-2, rtol=2e-2)


def test_blocked_head_keeps_the_tie_and_reads_the_checkpoint_in_place(tiny):
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    eng = loaded.engine
    assert eng.head_weight is eng.embedding_weight and eng.head_weight.is_contiguous()
    assert eng.head_weight.data_ptr() == eng.gpt.wte.weight.data_ptr()
    h = eng.body(torch.tensor([[464, 8251, 319]]))  # (1, 3, D)
    for positions in (h[:, -1:], h):  # 1 position (blocked) and 3 (blocked, several rows)
        with torch.inference_mode():
            expected = torch.nn.functional.linear(positions, eng.head_weight)
        torch.testing.assert_close(eng.head(positions), expected, atol=1e-5, rtol=0)


def test_weights_are_laid_out_on_the_second_decoding_step(tiny):
    """A forward of many positions leaves the checkpoint's [K, N] matrices as loaded (inspect pays
    nothing); the second one-position step transposes them to rows, and the values stay the checkpoint's."""
    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    layer = eng.gpt.h[1].mlp.c_fc
    before = layer.weight.detach().clone()
    cache = eng.new_cache(1, 10)
    eng.body(torch.tensor([[464, 8251, 319, 262, 3084, 13]]), cache)  # a prefill of 6 positions
    eng.body(torch.tensor([[13]]), cache)
    assert layer.weight.is_contiguous()  # one step: not yet
    eng.body(torch.tensor([[13]]), cache)
    assert layer.weight.t().is_contiguous() and torch.equal(layer.weight, before)


def test_released_pages_of_a_mapped_checkpoint_read_back_from_the_file(tiny):
    """release_mapped_pages drops only file-backed pages: read again, they hold the file's values;
    ordinary memory is never touched."""
    from safetensors import safe_open

    from lmhead_cli.engine.products import release_mapped_pages

    with safe_open(str(tiny[0] / "model.safetensors"), framework="pt") as f:
        name = max(f.keys(), key=lambda k: f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1])
        t = f.get_tensor(name)
    expected = t.clone()
    assert release_mapped_pages(t)
    assert torch.equal(t, expected)
    anonymous = torch.randn(100_000)
    assert not release_mapped_pages(anonymous)


def test_other_devices_take_the_plain_products():
    """The streaming and packed products are the CPU's; a GPU (here the meta device) runs addmm and
    F.linear in the dtype asked for, and nothing is timed."""
    from lmhead_cli.engine.products import few_cpu_rows, pack_for_onednn, products_for

    assert pack_for_onednn(torch.empty(8, 4, dtype=torch.bfloat16, device="meta")) is None
    assert products_for(torch.float32, torch.device("meta")).forms == ()
    assert not few_cpu_rows(torch.empty(1, 4, device="meta"))
    assert few_cpu_rows(torch.empty(1, 4)) and not few_cpu_rows(torch.empty(5, 4))  # a few CPU rows only


def test_layer_norm_epsilon_of_the_config_is_used_in_every_block(tmp_path):
    """A config's layer_norm_epsilon (here 0.5, far from the default 1e-5) reaches ln_1, ln_2 and ln_f."""
    reference = build_checkpoint(tmp_path, layer_norm_epsilon=0.5)
    eng = load_model(str(tmp_path), device="cpu", dtype="float32", engine="lean").engine
    ids = prompt(7)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(eng.head(eng.body(torch.tensor([ids])))[0], expected, atol=ATOL, rtol=0)


def test_residuals_of_a_left_padded_batch_match_transformers_hidden_states(tiny):
    """The engine contract's residuals(ids, attention_mask): each row as transformers computes it with the
    same padding mask and positions (hidden_states; the last one after ln_f), at the real positions."""
    folder, reference = tiny
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean").engine
    ids = torch.tensor([[50256, 50256, 464, 8251, 319], [464, 8251, 319, 262, 3084]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = reference(ids, attention_mask=mask, position_ids=position_ids, output_hidden_states=True).hidden_states
        resid = list(eng.residuals(ids, mask))
        resid[-1] = eng.final_norm(resid[-1])
    assert len(resid) == len(hidden)
    real = mask.bool()
    for ours, theirs in zip(resid, hidden):
        torch.testing.assert_close(ours[real], theirs[real], atol=ATOL, rtol=0)


def test_more_positions_than_a_few_run_the_plain_product_in_every_form(tiny):
    """Above BLOCKED_MAX_ROWS positions the head is F.linear and a layer addmm, bit for bit, whatever
    product form the few-position steps use (bfloat16: after the weights are packed)."""
    from lmhead_cli.engine.products import BLOCKED_MAX_ROWS

    for dtype in ("float32", "bfloat16"):
        eng = load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean").engine
        cache = eng.new_cache(1, 8)
        h = eng.body(torch.tensor([prompt(BLOCKED_MAX_ROWS + 2)]), cache)  # (1, 6, D)
        for _ in range(2):  # two one-position steps lay the weights out (and pack them, in bfloat16)
            eng.head(eng.body(torch.tensor([[13]]), cache))
        layer = eng.gpt.h[0].mlp.c_fc
        x = torch.randn(1, BLOCKED_MAX_ROWS + 2, layer.weight.shape[0], generator=torch.Generator().manual_seed(1))
        x = x.to(layer.weight.dtype)
        for form in eng.forms:
            eng.use_form(form)
            with torch.inference_mode():
                assert torch.equal(eng.head(h), torch.nn.functional.linear(h, eng.head_weight)), (dtype, form)
                assert torch.equal(layer(x), torch.addmm(layer.bias, x[0], layer.weight)[None]), (dtype, form)


def packed_engine(tiny, form: str, settled: bool):
    eng = load_model(str(tiny[0]), device="cpu", dtype="bfloat16", engine="lean").engine
    if "packed" not in eng.forms:
        pytest.skip("this torch has no oneDNN bfloat16 kernels: nothing is packed")
    eng.use_form(form)
    if settled:
        eng.settle_form()
    cache = eng.new_cache(1, 8)
    eng.body(torch.tensor([[464, 8251, 319]]), cache)
    for _ in range(2):  # the second one-position step lays the weights out
        eng.head(eng.body(torch.tensor([[13]]), cache))
    return eng


@pytest.mark.parametrize("form, settled, packed", [("packed", False, True), ("linear", False, True),
                                                   ("packed", True, True), ("linear", True, False)])
def test_bfloat16_weights_are_packed_while_the_packed_form_may_run(tiny, form, settled, packed):
    """The packed copies (oneDNN's layout) are made on the second step unless another form has been
    settled on: while the forms are still timed, "packed" may be chosen at any step."""
    eng = packed_engine(tiny, form, settled)
    layers = [eng.head_module, eng.gpt.h[0].attn.c_attn, eng.gpt.h[1].mlp.c_proj]
    assert [m.packed is not None for m in layers] == [packed] * 3


def test_random_init_is_gpt2s_seeded():
    """random:gpt2's weights: layer-norm gains 1, biases 0, N(0, 0.02) weights, the residual projections
    (c_proj) N(0, 0.02 / sqrt(2 · n_layer)); the same seed gives the same weights, another seed others."""
    from lmhead_cli.engine.lean import init_random_

    def state(seed):
        s = {"wte.weight": torch.empty(2000, 64), "h.0.ln_1.weight": torch.empty(64),
             "h.0.ln_2.weight": torch.empty(64), "ln_f.weight": torch.empty(64), "ln_f.bias": torch.empty(64),
             "h.0.attn.c_attn.bias": torch.empty(192), "h.1.mlp.c_proj.weight": torch.empty(256, 400)}
        init_random_(s, n_layer=8, seed=seed)
        return s

    s = state(7)
    for name in ("h.0.ln_1.weight", "h.0.ln_2.weight", "ln_f.weight"):
        assert torch.equal(s[name], torch.ones(64)), name
    assert torch.equal(s["ln_f.bias"], torch.zeros(64)) and torch.equal(s["h.0.attn.c_attn.bias"], torch.zeros(192))
    assert float(s["wte.weight"].std()) == pytest.approx(0.02, rel=0.02)
    assert float(s["h.1.mlp.c_proj.weight"].std()) == pytest.approx(0.02 / 4, rel=0.02)  # sqrt(2 · 8) = 4
    assert abs(float(s["wte.weight"].mean())) < 1e-3
    again, other = state(7), state(8)
    assert all(torch.equal(s[k], again[k]) for k in s) and not torch.equal(s["wte.weight"], other["wte.weight"])
