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
from helpers import PROMPT_IDS, build_checkpoint

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
    with pytest.raises(ValueError, match=f"^{N_POSITIONS + 1} positions exceed the context of {N_POSITIONS}$"):
        engine.body(torch.zeros(1, N_POSITIONS + 1, dtype=torch.long))
    cache = engine.new_cache(1, N_POSITIONS + 2)
    engine.body(torch.zeros(1, N_POSITIONS - 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=f"^{N_POSITIONS + 1} positions exceed"):  # the cache's and the new ones
        engine.body(torch.zeros(1, 2, dtype=torch.long), cache)


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
    """A few positions' body and head products in each float32 form (BLAS's gemm and gemv, batched
    matmuls over row blocks of the weights) give what addmm and F.linear give, for any thread count, a
    row count that no block count divides, with and without a bias, over the checkpoint's (in, out)
    layout and over (out, in) rows alike."""
    from lmhead_cli.engine.lean import Conv1D
    from lmhead_cli.engine.products import Products, few_rows_product, products_for, rows_times

    g = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = Conv1D(64, 190)
        from lmhead_cli.engine import kernels

        one = ("kernel",) if kernels.load() is not None else ("gemv",)
        assert products_for(torch.float32, torch.device("cpu")).forms == one  # float32 runs one
        layer.products = Products(forms=("linear", "gemv", "blocked"))  # every form, over float32 sums
        with torch.no_grad():
            layer.weight.copy_(torch.randn(64, 190, generator=g))
            layer.bias.copy_(torch.randn(190, generator=g))
        w = layer.weight.detach().clone()
        E = torch.randn(50257, 64, generator=g)
        for layout in ("checkpoint", "rows"):
            if layout == "rows":
                layer.weight = torch.nn.Parameter(w.t().contiguous().t())
            assert layer.weight.shape == (64, 190) and layer.weight.t().is_contiguous() == (layout == "rows")
            for form in layer.products.forms:
                layer.products.use(form)
                for rows in (1, 3):
                    x = torch.randn(rows, 64, generator=g)
                    with torch.inference_mode():
                        assert_same_sums(layer(x), torch.addmm(layer.bias, x, w), x, w, layer.bias)
                    assert_same_sums(few_rows_product(form, x, E, None), torch.nn.functional.linear(x, E), x, E.t())
        assert_same_sums(rows_times(E, x), torch.nn.functional.linear(x, E), x, E.t())
    finally:
        torch.set_num_threads(before)


def test_decoding_times_the_forms_and_keeps_one(tiny):
    """greedy decoding times each (thread count, product form) setting and keeps one; the ids are those
    of every other form (the forms differ in float rounding only). float32 runs one form; two are
    offered here, as bfloat16 offers three without the compiled kernels."""
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    from lmhead_cli.engine import kernels

    one = ("kernel",) if kernels.load() is not None else ("gemv",)  # the head's compiled rows, else BLAS's gemv
    assert loaded.engine.forms == one and not loaded.execution.chooser.forms
    loaded.engine.products.forms = ("linear", "gemv")
    loaded.execution.offer(loaded.engine)
    ids = []
    for form in loaded.engine.forms:
        loaded.engine.use_form(form)
        got, _ = lean_decode(loaded.engine, prompt(5), 8, lambda z: int(z.argmax()))
        ids.append(got)
    assert ids[0] == ids[1]
    chooser = loaded.execution.chooser
    # a warm-up call, then one call per setting; a trial whose counts come out close (or whose calls
    # did not have their cores) times each setting twice more: at most three rounds in all
    for _ in range(1 + 3 * len(chooser._settings)):
        chooser.run(lambda: lean_decode(loaded.engine, prompt(3), 2, lambda z: int(z.argmax())))
        if chooser.form_choices:
            break
    assert chooser.form_choices and chooser.form_choices[-1] in loaded.engine.forms
    assert loaded.engine.products.form == chooser.form_choices[-1] and not chooser.deciding


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_bfloat16_products_equal_f_linear(tiny, path, monkeypatch):
    """bfloat16 on the CPU runs its products over (out, in) rows made at load, in each of its forms (the
    compiled kernel where it loads, torch's three where not): the same logits as the plain bfloat16
    products, one position or several."""
    from lmhead_cli.engine import kernels

    if path == "torch":
        monkeypatch.setattr(kernels, "load", lambda: None)
    elif kernels.load() is None:
        pytest.skip(f"the compiled kernels did not load: {kernels.unavailable()}")
    eng = load_model(str(tiny[0]), device="cpu", dtype="bfloat16", engine="lean").engine
    assert eng.forms == (("kernel",) if path == "compiled" else ("gemv", "linear", "blocked"))
    h = eng.body(torch.tensor([[464, 8251, 319]]))  # (1, 3, D)
    block = eng.gpt.h[0].attn.c_attn
    x = torch.randn(1, 2, block.weight.shape[0]).to(torch.bfloat16)
    for form in eng.forms:
        eng.use_form(form)
        for positions in (h[:, -1:], h):
            with torch.inference_mode():
                expected = torch.nn.functional.linear(positions, eng.head_weight)
            torch.testing.assert_close(eng.head(positions), expected, atol=2e-2, rtol=2e-2)
        for rows in (x[:, :1], x):
            with torch.inference_mode():
                torch.testing.assert_close(block(rows), torch.addmm(block.bias, rows[0], block.weight)[None],
                                           atol=2e-2, rtol=2e-2)


def test_bfloat16_attention_and_cache_are_float32_on_the_cpu(tiny):
    """bfloat16 weights, float32 attention: the KV cache is float32, and a cached step's logits are the
    uncached forward's at that position (both attend in float32), within bfloat16's rounding."""
    eng = load_model(str(tiny[0]), device="cpu", dtype="bfloat16", engine="lean").engine
    assert eng.attention_dtype == torch.float32 and eng.dtype == torch.bfloat16
    ids = prompt(6)
    cache = eng.new_cache(1, 8)
    assert cache.k.dtype == torch.float32
    eng.body(torch.tensor([ids[:-1]]), cache)
    stepped = eng.head(eng.body(torch.tensor([ids[-1:]]), cache))[0, -1].float()
    whole = eng.head(eng.body(torch.tensor([ids])))[0, -1].float()
    torch.testing.assert_close(stepped, whole, atol=5e-2, rtol=2e-2)
    assert eng.body(torch.tensor([ids])).dtype == torch.bfloat16  # the residual stream stays bfloat16


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


def test_weights_stay_where_they_were_loaded(tiny):
    """No decoding step copies a weight: float32 matrices stay the checkpoint's (in, out) memory after
    prefill and steps; bfloat16 ones are (out, in) rows from the load on, holding the checkpoint's values."""
    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    layer = eng.gpt.h[1].mlp.c_fc
    where = layer.weight.data_ptr()
    cache = eng.new_cache(1, 10)
    eng.body(torch.tensor([[464, 8251, 319, 262, 3084, 13]]), cache)  # a prefill of 6 positions
    for _ in range(3):
        eng.body(torch.tensor([[13]]), cache)
    assert layer.weight.is_contiguous() and layer.weight.data_ptr() == where
    half = load_model(str(tiny[0]), device="cpu", dtype="bfloat16", engine="lean").engine.gpt.h[1].mlp.c_fc
    assert half.weight.shape == layer.weight.shape and half.weight.t().is_contiguous()
    assert torch.equal(half.weight, layer.weight.detach().to(torch.bfloat16))


def test_other_devices_take_the_plain_products():
    """The product forms are the CPU's; a GPU (here the meta device) runs addmm and F.linear in the
    dtype asked for, and nothing is timed."""
    from lmhead_cli.engine.products import few_cpu_rows, products_for

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


def test_the_padding_mask_is_causal_hides_padded_keys_and_leaves_no_row_all_minus_infinity():
    """lean._mask for a left-padded row and a full one: each query sees the real keys up to itself; a
    query that is itself padding (no real key up to it) sees every position rather than none (a row of
    -inf would make NaN; its output is never read). The mask is in the dtype asked for (attention's).
    Mutants: the "no key" test over the whole batch instead of each row; the dtype left out."""
    from lmhead_cli.engine.lean import _mask

    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    m = _mask(pad, 4, torch.bfloat16)
    assert m.shape == (2, 1, 4, 4) and m.dtype == torch.bfloat16
    sees = torch.isfinite(m[:, 0])  # (B, query, key)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(sees[1], causal)
    assert torch.equal(sees[0, 2:], causal[2:] & pad[0].bool())  # the real queries: real keys up to them
    assert sees[0, :2].all()  # the padded queries: every position
    assert set(m[m != 0].tolist()) == {float("-inf")}
    last = _mask(pad, 1, torch.float64)  # one new position, as a decoding step
    assert last.dtype == torch.float64 and torch.equal(torch.isfinite(last[:, 0, 0]), pad.bool())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_few_positions_run_the_head_in_the_engine_s_product_form(tiny, dtype, monkeypatch):
    """The head of one or a few positions is the engine's product form over W_out's rows, bit for bit;
    for bfloat16 that is lmhead's kernel where it loads, one call per product (its figures equal torch's
    mm here, so the calls are what show the form), and none for more positions than a few. Mutants: no
    form passed (torch's mm), in the head or a layer; a layer's few-rows test joined by `or`."""
    from lmhead_cli.engine import kernels
    from lmhead_cli.engine.products import few_rows_product

    eng = load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean").engine
    head = eng.gpt.lm_head
    h = torch.randn(3, eng.config["n_embd"], generator=torch.Generator().manual_seed(0)).to(head.weight.dtype)
    for rows in (h[:1], h):
        assert torch.equal(head(rows), few_rows_product(eng.products.form, rows, head.weight, None))
    if eng.products.form == "kernel":
        from lmhead_cli.engine.products import BLOCKED_MAX_ROWS

        calls = []  # the products the kernel computed (it hands back None for those it does not take)
        name = "f32_times" if dtype == "float32" else "bf16_times"
        real = getattr(kernels.Kernels, name)

        def counted(self, *args):
            y = real(self, *args)
            calls.extend([1] if y is not None else [])
            return y

        monkeypatch.setattr(kernels.Kernels, name, counted)
        head(h[:1])
        assert calls == [1]
        calls.clear()  # a one-position body: each layer's 4 Conv1D products in the kernel too for bfloat16's
        eng.body(torch.tensor([[464]]))  # rows; float32's (in, out) matrices are BLAS's (the compiled step's in steps)
        assert len(calls) == (4 * eng.config["n_layer"] if dtype == "bfloat16" else 0)
        calls.clear()  # more positions than a few: torch's plain products, the kernel never called
        eng.body(torch.zeros(1, BLOCKED_MAX_ROWS + 1, dtype=torch.long))
        assert calls == []


def test_a_float16_engine_on_the_cpu_holds_float16_weights_and_gives_float32_s_logits(tiny):
    """float16 is not one of the dtypes stored as rows at load: its Conv1D weights are converted as the
    checkpoint lays them out, and every weight is float16. Mutant: the conversion left out."""
    ids = torch.tensor([[464, 8251, 319, 262, 3084]])
    half = load_model(str(tiny[0]), device="cpu", dtype="float16", engine="lean").engine
    full = load_model(str(tiny[0]), device="cpu", dtype="float32", engine="lean").engine
    assert {p.dtype for p in half.gpt.parameters()} == {torch.float16}
    assert half.gpt.h[0].attn.c_attn.weight.shape == full.gpt.h[0].attn.c_attn.weight.shape
    torch.testing.assert_close(half.head(half.body(ids)).float(), full.head(full.body(ids)), atol=2e-2, rtol=0)


def test_the_module_takes_gpt2_s_norm_epsilon_by_default_and_skips_the_embeddings_random_init(tmp_path):
    """A config that names no layer_norm_epsilon gets GPT-2's 1e-5 in every LayerNorm, and the head is
    tied to the embedding unless `tied` says otherwise. The embeddings
    are built from an empty weight (the checkpoint's comes next), not randomly initialised: on the meta
    device that init imported torch._dynamo (~1.5 s), checked in a fresh interpreter. Mutants: another
    default epsilon; untied by default; nn.Embedding's own init."""
    import subprocess
    import sys

    from lmhead_cli.engine.lean import GPT2

    config = {"n_embd": 16, "vocab_size": 50, "n_positions": 8, "n_layer": 2, "n_head": 2}
    with torch.device("meta"):
        module = GPT2(config)
    assert {m.eps for m in module.modules() if isinstance(m, torch.nn.LayerNorm)} == {1e-5}
    assert module.lm_head.weight is module.wte.weight  # tied unless told otherwise, as GPT-2 is
    with torch.device("meta"):
        untied = GPT2(config, tied=False)
    assert untied.lm_head.weight is not untied.wte.weight
    code = ("import sys, torch\nfrom lmhead_cli.engine.lean import GPT2\n"
            f"with torch.device('meta'):\n    GPT2({config!r})\nprint('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_attention_runs_in_float32_for_half_dtypes_on_the_cpu_only():
    """attention_dtype: float32 for bfloat16 and float16 on the CPU (its half kernels are slow and round
    the scores); a GPU attends in the model's own dtype, and float32 or float64 stay as they are.
    Mutants: float32 everywhere; float32 for every CPU dtype or every half one."""
    from lmhead_cli.engine.lean import attention_dtype

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert attention_dtype(cpu, dtype) == torch.float32
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert attention_dtype(gpu, dtype) == dtype
    assert attention_dtype(cpu, torch.float64) == torch.float64


def _attention_steps(att, x, mask, cache):
    """Prefill all but the last position of x (B, T, D), then one decoding step: the step's output."""
    from lmhead_cli.engine.lean import _mask

    T = x.shape[1]
    att(x[:, :T - 1], 0, cache, None if mask is None else _mask(mask[:, :T - 1], T - 1, torch.float32))
    cache.length += T - 1  # as the engine's body does after its last layer
    return att(x[:, T - 1:], 0, cache, None if mask is None else _mask(mask, 1, torch.float32))


def test_a_decoding_step_attends_to_the_real_positions_on_the_cpu_and_off_it():
    """One attention layer, a prompt and one decoding step through the KV cache: a left-padded row's step
    equals the same row decoded alone, on the CPU (attend_one) and on a second device (emulated,
    tests/helpers.py: torch's scaled_dot_product_attention, a GPU's path), with and without padding.
    Mutants: the step's padding mask dropped; a step of one query made causal (it would see key 0 only)."""
    from helpers import Elsewhere, elsewhere

    from lmhead_cli.engine import lean

    g = torch.Generator().manual_seed(0)
    D, H = 16, 2
    att = lean.Attention(D, H)
    for conv in (att.c_attn, att.c_proj):
        conv.weight.data = torch.randn(conv.weight.shape, generator=g) * 0.5
        conv.bias.data = torch.randn(conv.bias.shape, generator=g) * 0.5
    x = torch.randn(2, 6, D, generator=g)
    x[0, :2] = 0.0  # row 0: two pads, then its 4 positions
    pad = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    new_cache = lambda rows, dev=torch.device("cpu"): lean.KVCache(1, rows, H, 8, D // H, dev, torch.float32)  # noqa: E731
    with torch.inference_mode():
        alone = [_attention_steps(att, x[0:1, 2:], None, new_cache(1)), _attention_steps(att, x[1:2], None, new_cache(1))]
        cpu = _attention_steps(att, x, pad, new_cache(2))
        for conv in (att.c_attn, att.c_proj):  # the layer on the second device
            w, b = conv.weight.data, conv.bias.data
            del conv._parameters["weight"], conv._parameters["bias"]
            conv.weight, conv.bias = Elsewhere(w), Elsewhere(b)

        def there(x, mask, rows):
            cache = new_cache(rows)
            cache.k, cache.v = Elsewhere(cache.k), Elsewhere(cache.v)
            cache._split()
            return _attention_steps(att, Elsewhere(x), None if mask is None else Elsewhere(mask), cache).cpu()

        with elsewhere():
            off = [there(x, pad, 2), there(x[1:2], None, 1)]
    for row in (0, 1):
        torch.testing.assert_close(cpu[row], alone[row][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(off[0][row], alone[row][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(off[1][0], alone[1][0], atol=1e-5, rtol=0)


def test_residuals_build_their_mask_in_attention_s_dtype(tiny, monkeypatch):
    """residuals(ids, attention_mask) builds its padding mask as body does, in the dtype attention runs
    in (a GPU's half dtypes attend in their own; on the CPU every dtype attends in float32, where a mask
    of torch's default dtype shows no difference, hence the look at what is asked for). Mutant: the
    dtype left out."""
    from lmhead_cli.engine import lean

    eng = load_model(str(tiny[0]), device="cpu", dtype="float32", engine="lean").engine
    asked = []
    real = lean._mask
    monkeypatch.setattr(lean, "_mask", lambda mask, t, dtype: asked.append(dtype) or real(mask, t, dtype))
    ids, pad = torch.tensor([[50256, 464, 8251]]), torch.tensor([[0, 1, 1]])
    list(eng.residuals(ids, pad))
    eng.body(ids, attention_mask=pad)
    assert asked == [eng.attention_dtype] * 2


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_more_positions_than_a_few_run_the_plain_product_in_every_form(tiny, path, monkeypatch):
    """Above the compiled kernels' rows (up to 16 of float32, tests/test_kernels.py) the head is F.linear
    and a layer addmm, bit for bit, whatever product form the few-position steps use (the compiled
    kernel's, or torch's own without it). (At fewer rows the kernel's sums and MKL's GEMM differ in the
    last bits, and MKL's own differ with the thread count for 5 to 11 rows.)"""
    from lmhead_cli.engine import kernels

    if path == "torch":
        monkeypatch.setattr(kernels, "load", lambda: None)

    for dtype in ("float32", "bfloat16"):
        eng = load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean").engine
        cache = eng.new_cache(1, kernels.STEP_MAX_ROWS + 4)
        h = eng.body(torch.tensor([prompt(kernels.STEP_MAX_ROWS + 2)]), cache)  # (1, 18, D)
        for _ in range(2):  # one-position steps in between change nothing about the weights
            eng.head(eng.body(torch.tensor([[13]]), cache))
        layer = eng.gpt.h[0].mlp.c_fc
        x = torch.randn(1, kernels.STEP_MAX_ROWS + 2, layer.weight.shape[0], generator=torch.Generator().manual_seed(1))
        x = x.to(layer.weight.dtype)
        for form in eng.forms:
            eng.use_form(form)
            with torch.inference_mode():
                assert torch.equal(eng.head(h), torch.nn.functional.linear(h, eng.head_weight)), (dtype, form)
                assert torch.equal(layer(x), torch.addmm(layer.bias, x[0], layer.weight)[None]), (dtype, form)


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


def test_the_mask_and_the_cache_are_made_on_the_engines_device(tiny):
    """A padding mask and a KV cache are built on the engine's device, not on torch's default one
    (here the meta device, as a GPU engine would differ from a CPU default)."""
    from lmhead_cli.engine.lean import _mask

    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    padding = torch.tensor([[0, 1, 1]])
    with torch.device("meta"):
        mask = _mask(padding, 2, torch.float32)
        cache = eng.new_cache(1, 8)
    assert mask.device.type == "cpu" and mask.shape == (1, 1, 2, 3)
    assert cache.k.device.type == cache.v.device.type == "cpu"


def test_one_new_position_on_the_cpu_attends_without_sdpa_and_its_head_takes_the_few_rows_path(tiny, monkeypatch):
    """A decoding step's attention runs as three small products (SDPA's CPU kernel costs more than
    the attention for one query), and its head as the engine's few-row product form."""
    from lmhead_cli.engine import lean

    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    cache = eng.new_cache(1, 8)
    eng.body(torch.tensor([prompt(4)]), cache)  # the prefill may use SDPA

    def refuse(*args, **kwargs):
        raise AssertionError("scaled_dot_product_attention for a single new position")

    monkeypatch.setattr(lean.F, "scaled_dot_product_attention", refuse)
    h = eng.body(torch.tensor([[13]]), cache)  # (1, 1, D)
    seen = []
    own = lean.few_rows_product
    monkeypatch.setattr(lean, "few_rows_product", lambda form, x2, *rest: seen.append(tuple(x2.shape)) or own(form, x2, *rest))
    eng.head(h)
    assert seen == [(1, h.shape[-1])]


def test_lean_engine_matches_transformers_where_gelu_new_and_gelu_differ(loud):
    """On loud_checkpoint, transformers' logits under exact gelu differ from its gelu_new ones by more than
    10 × the parity tolerance; the lean engine matches gelu_new within it, for the whole prompt and for
    one-position cached steps (the blocked products). Mutant: F.gelu without approximate="tanh"."""
    from transformers import GPT2LMHeadModel

    folder, model = loud
    ids = torch.tensor([list(range(100, 2000, 97))])  # (1, 20)
    exact = GPT2LMHeadModel.from_pretrained(folder, activation_function="gelu").eval()
    with torch.no_grad():
        expected = model(ids).logits[0]  # (20, V) gelu_new, GPT-2's activation
        gap = float((exact(ids).logits[0] - expected).abs().max())
    atol = 1e-4
    assert gap > 10 * atol
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean").engine
    torch.testing.assert_close(eng.head(eng.body(ids))[0], expected, atol=atol, rtol=0)
    cache = eng.new_cache(1, ids.shape[1])
    eng.body(ids[:, :-3], cache)
    for t in range(ids.shape[1] - 3, ids.shape[1]):  # the last three positions one at a time
        step = eng.head(eng.body(ids[:, t:t + 1], cache))[0, 0]
        torch.testing.assert_close(step, expected[t], atol=atol, rtol=0)


def test_a_left_padded_batch_through_body_gives_transformers_logits_at_the_real_positions(tiny):
    """body(ids, attention_mask=…) with left padding: each row's logits are transformers' with the same
    mask and positions, so no real position attends to a pad. Mutant: the body's blocks given no mask."""
    folder, reference = tiny
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean").engine
    ids = torch.tensor([[50256, 50256, 464, 8251, 319], [464, 8251, 319, 262, 3084]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        got = eng.head(eng.body(ids, attention_mask=mask))
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)


def test_a_config_s_n_inner_sets_the_mlp_width(tmp_path):
    """n_inner given (96, not 4 · 64): the lean engine builds MLPs that wide and gives transformers'
    logits. Mutant: n_inner read under another key (the 4·d default, and the checkpoint then does not fit)."""
    reference = build_checkpoint(tmp_path, n_inner=96, seed=5)
    eng = load_model(str(tmp_path), device="cpu", dtype="float32", engine="lean").engine
    assert eng.gpt.h[0].mlp.c_fc.weight.shape == (64, 96)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT_IDS])).logits
    torch.testing.assert_close(eng.head(eng.body(torch.tensor([PROMPT_IDS]))), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_lean_engine_names_how_its_weights_are_stored(tiny, dtype):
    """weight_format is the stored format: float32, bfloat16 or int8. Mutant: always "int8"."""
    assert load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean").engine.weight_format == dtype


def test_the_kv_cache_keeps_the_attention_dtype_whatever_torch_s_default(tiny):
    """A notebook may set torch's default dtype to float64; the cache is still made in the dtype
    attention runs in (float32 here). Mutant: the cache in torch's default dtype."""
    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cache = eng.new_cache(1, 8)
    finally:
        torch.set_default_dtype(before)
    assert cache.k.dtype == cache.v.dtype == torch.float32 == eng.attention_dtype
