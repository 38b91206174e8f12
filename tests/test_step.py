"""The compiled decoding step (engine/step.py, engine/csrc/step.c): every block of one new position in one
C call, against transformers (the oracle) and against the engine's own torch path, in float32, bfloat16
and int8, for one row and for left-padded rows, on models whose sizes leave every loop a tail."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import build_checkpoint

from lmhead_cli.engine import kernels, step
from lmhead_cli.loading.sources import load_model

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="the compiled kernels are not built")
DTYPES = ["float32", "bfloat16", "int8"]
# (logits atol against transformers, against the engine's torch path): bfloat16 rounds its activations
# where transformers' float32 reference does not
ATOL = {"float32": (1e-4, 1e-5), "bfloat16": (6e-2, 2e-2), "int8": (1e-4, 1e-5)}


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    """(folder, transformers model): a tied GPT-2 whose sizes no vector width divides (D = 66, two heads
    of 33, 264 inner: each product's column and row loops and the attention's dot products end in a
    tail), three layers."""
    folder = tmp_path_factory.mktemp("ragged")
    model = build_checkpoint(folder, n_embd=66, n_head=2, n_layer=3, seed=5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-trivial biases and norm parameters, so that each one is really read
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif ".ln_" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(folder, transformers model): D = 384 (1536 inner), wider than one chunk of a product's sums for
    several rows, so that the float32 product's column chunks are crossed."""
    folder = tmp_path_factory.mktemp("wide")
    return folder, build_checkpoint(folder, n_embd=384, n_head=4, n_layer=2, seed=6)


def reference_for(eng, model, dtype: str):
    """transformers' GPT-2 (float32) holding exactly the weights the engine runs: its own for float32, the
    engine's bfloat16 values, or the engine's dequantised int8 tables (the head tied to the embedding)."""
    if dtype == "float32":
        return model
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for mine, theirs in zip(eng.gpt.h, ref.transformer.h):
            for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                a, b = mine.get_submodule(name), theirs.get_submodule(name)
                b.weight.copy_(a.weight.float())
                b.bias.copy_(a.bias.float())
            for name in ("ln_1", "ln_2"):
                a, b = mine.get_submodule(name), theirs.get_submodule(name)
                b.weight.copy_(a.weight.float())
                b.bias.copy_(a.bias.float())
        ref.transformer.wte.weight.copy_(eng.head_rows(torch.arange(eng.vocab_size)).float())
        ref.transformer.wpe.weight.copy_(eng.gpt.wpe.weight.float())
        ref.transformer.ln_f.weight.copy_(eng.gpt.ln_f.weight.float())
        ref.transformer.ln_f.bias.copy_(eng.gpt.ln_f.bias.float())
    return ref


def decode(eng, prompts: list[list[int]], n: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Left-padded rows prefilled, then n greedy one-position steps: each step's logits (n, B, V) and
    each row's new ids."""
    S, B = max(map(len, prompts)), len(prompts)
    ids = torch.tensor([[50256] * (S - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts])
    padded = bool((mask == 0).any())
    cache = eng.new_cache(B, S + n)
    z = eng.head(eng.body(ids, cache, mask if padded else None)[:, -1:])[:, 0].float()  # (B, V)
    steps, new = [], [[] for _ in prompts]
    for _ in range(n):
        steps.append(z)
        chosen = z.argmax(-1)
        for row, t in zip(new, chosen.tolist()):
            row.append(t)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
        z = eng.head(eng.body(chosen[:, None], cache, mask if padded else None))[:, 0].float()
    return torch.stack(steps), new


def count_steps(monkeypatch, method: str = "run", positions: int = 1) -> list[int]:
    """How many decoding steps the compiled step took (StepPlan.run returned a result for `positions`
    new positions a row: 1, a decoding step; more, a prompt read; `method` "logits": the whole step,
    token to logits in one call)."""
    taken = [0]
    real = getattr(step.StepPlan, method)

    def counted(self, *args):
        out = real(self, *args)
        taken[0] += out is not None and args[0].shape[1] == positions
        return out

    monkeypatch.setattr(step.StepPlan, method, counted)
    return taken


PROMPTS = {1: [[464, 8251, 319, 262, 3084]], 5: [[464], [8251, 319, 262, 3084, 13, 198, 40], [11, 13],
                                                 list(range(100, 121)), [318, 257, 1332]]}
PROMPTS[16] = PROMPTS[5] + [[1000 + 7 * i + j for j in range(i % 6 + 1)] for i in range(11)]  # the most rows a step takes
NEW = 12


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_compiled_steps_give_transformers_logits_and_greedy_ids(ragged, dtype, rows, monkeypatch):
    """Every step's logits equal transformers' forward over the row alone (no cache, no padding) at that
    position, and the greedy ids equal transformers' generate(): one row, and five left-padded rows of
    lengths 1 to 21 (more rows than a product's kernels take at once), and sixteen (the most a step takes:
    float32's products and head read each weight once for all of them). The compiled step ran every step."""
    folder, model = ragged
    eng = load_model(str(folder), device="cpu", dtype=dtype, engine="lean").engine
    assert eng.step is not None
    ref = reference_for(eng, model, dtype)
    taken = count_steps(monkeypatch)
    steps, new = decode(eng, PROMPTS[rows], NEW)
    assert taken[0] == NEW
    for b, p in enumerate(PROMPTS[rows]):
        with torch.inference_mode():
            expected = ref(torch.tensor([p + new[b]])).logits[0, len(p) - 1:len(p) - 1 + NEW]  # (NEW, V)
            torch.testing.assert_close(steps[:, b], expected, atol=ATOL[dtype][0], rtol=0)
            if dtype != "bfloat16":  # bfloat16's ids are its own rounding's: checked against its torch path below
                generated = ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW,
                                         min_new_tokens=NEW, pad_token_id=50256)[0, len(p):].tolist()
                assert new[b] == generated


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_compiled_steps_equal_the_torch_path(ragged, dtype, rows, monkeypatch):
    """The same steps with the compiled step turned off (LMHEAD_STEP=0: the engine's modules, its
    products and attention kernels): the same greedy ids, the logits within float rounding (bfloat16:
    within its rounding, the sums being in another order)."""
    eng = load_model(str(ragged[0]), device="cpu", dtype=dtype, engine="lean").engine
    taken = count_steps(monkeypatch)
    compiled, ids = decode(eng, PROMPTS[rows], NEW)
    assert taken[0] == NEW
    monkeypatch.setenv(step.ENV, "0")
    plain, plain_ids = decode(eng, PROMPTS[rows], NEW)
    assert taken[0] == NEW  # none more
    assert ids == plain_ids
    torch.testing.assert_close(compiled, plain, atol=ATOL[dtype][1], rtol=0)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.slow
def test_float32_columns_cross_their_chunks(wide, threads, monkeypatch):
    """D = 384: on one thread the product's sums for four rows take its 1536 columns in two chunks; the
    logits are transformers' on one and on two threads, for 1 and 4 rows."""
    folder, model = wide
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean", threads=threads).engine
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for prompts in (PROMPTS[1], PROMPTS[5][:4]):
            steps, new = decode(eng, prompts, 4)
            for b, p in enumerate(prompts):
                with torch.inference_mode():
                    expected = model(torch.tensor([p + new[b]])).logits[0, len(p) - 1:len(p) + 3]
                torch.testing.assert_close(steps[:, b], expected, atol=1e-4, rtol=0)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_the_thread_count_does_not_change_float32_figures(ragged):
    """Threads split a product's output columns (several rows) or take its fixed blocks of rows of W
    (one row), and the sums' order never depends on them: one, two and three threads give the same bits
    (prompts of one token, so that the prefill is a compiled step too, not BLAS's products)."""
    eng = load_model(str(ragged[0]), device="cpu", dtype="float32", engine="lean").engine
    before = torch.get_num_threads()
    try:
        for prompts in ([[464], [8251], [11]], [[8251]]):
            got = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                got.append(decode(eng, prompts, 6)[0])
            assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2]), prompts
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_a_hook_sends_the_step_back_to_the_modules(ragged, monkeypatch):
    """A reading's hook on any module of the body (here the MLP of the last block) sees every step: the
    compiled step stands aside while it is registered, and takes the steps again once it is removed.
    torch's global forward hooks do the same."""
    eng = load_model(str(ragged[0]), device="cpu", dtype="float32", engine="lean").engine
    taken = count_steps(monkeypatch)
    seen = []
    handle = eng.gpt.h[-1].mlp.register_forward_hook(lambda _m, _i, out: seen.append(out.shape[1]))
    try:
        hooked, ids = decode(eng, PROMPTS[1], 4)
    finally:
        handle.remove()
    assert taken[0] == 0 and seen == [5, 1, 1, 1, 1]  # the prefill's five positions, then each step
    handle = torch.nn.modules.module.register_module_forward_hook(lambda _m, _i, _o: None)
    try:
        decode(eng, PROMPTS[1], 2)
    finally:
        handle.remove()
    assert taken[0] == 0
    free, free_ids = decode(eng, PROMPTS[1], 4)
    assert taken[0] == 4 and free_ids == ids
    torch.testing.assert_close(free, hooked, atol=1e-5, rtol=0)


@needs_kernels
def test_what_the_step_does_not_take_runs_the_modules(ragged, monkeypatch):
    """More rows than MAX_ROWS, no cache, and the kernels turned off: the torch path, the same figures."""
    eng = load_model(str(ragged[0]), device="cpu", dtype="float32", engine="lean").engine
    taken = count_steps(monkeypatch)
    many = [[464 + i, 8251] for i in range(step.MAX_ROWS + 1)]
    steps, _ = decode(eng, many, 2)
    assert taken[0] == 0
    expected, _ = decode(eng, many[:step.MAX_ROWS], 2)
    assert taken[0] == 2
    torch.testing.assert_close(steps[:, :step.MAX_ROWS], expected, atol=1e-5, rtol=0)
    with torch.inference_mode():
        eng.body(torch.tensor([[464]]))  # no cache: a one-position forward
    assert taken[0] == 2
    monkeypatch.setattr(kernels, "load", lambda: None)
    decode(eng, PROMPTS[1], 2)
    assert taken[0] == 2


def test_no_plan_off_the_cpu_or_for_other_dtypes(ragged):
    """float16 weights have no step (csrc/step.c reads float32, bfloat16 and int8): the engine holds no plan."""
    eng = load_model(str(ragged[0]), device="cpu", dtype="float16", engine="lean").engine
    assert eng.step is None


@needs_kernels
def test_every_variant_passes_the_step_check_and_a_wrong_step_fails_it(monkeypatch):
    """kernels.load() checks the compiled step against torch on one ragged float32 block before use, in
    every variant this CPU runs; a step that adds a bias twice (the check's own mutant) fails it."""
    import ctypes

    lib = ctypes.CDLL(str(kernels.module_path()))
    for variant in kernels.variants(lib):
        assert kernels._step_check(kernels.Kernels(lib, variant)), variant
    k = kernels.Kernels(lib, "base")
    real = k.lib.lmhead_step

    def doubled_bias(layers, *args):  # the MLP's output bias added twice, through a copy of the plan
        layer = kernels.Layer.from_address(layers)
        b = torch.tensor(ctypes.cast(layer.b[3], ctypes.POINTER(ctypes.c_float))[:args[5]]) * 2
        layer.b[3] = b.data_ptr()
        return real(layers, *args)

    k.lib = kernels._Variant(**{**k.lib.__dict__, "lmhead_step": doubled_bias})
    assert not kernels._step_check(k)

    def seeing_ahead(layers, L, kind, x, B, T, *args):  # a prompt's positions each seeing every new one
        if T == 1 or args[-3] is not None:
            return real(layers, L, kind, x, B, T, *args)
        *rest, mask, msb, threads = args
        past = rest[-1]
        zeros = torch.zeros(B * T, past + T)
        return real(layers, L, kind, x, B, T, *rest, zeros.data_ptr(), zeros.stride(0), threads)

    k.lib = kernels._Variant(**{**k.lib.__dict__, "lmhead_step": seeing_ahead})
    assert not kernels._step_check(k)


@needs_kernels
def test_a_failing_step_check_falls_back_to_torch_once_in_one_line(monkeypatch):
    """A step that fails its check takes the kernels with it, as any failing self-check: load() is None
    for the process, unavailable() names the file in one line, and the engine runs its modules."""
    monkeypatch.setattr(kernels, "_step_check", lambda k: False)
    monkeypatch.setattr(kernels, "_told", [])
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
        why = kernels.unavailable()
        assert why == f"{kernels.module_path()}: the compiled kernels failed their self-check against torch"
    finally:
        kernels.load.cache_clear()


def decode_whole(eng, prompts: list[list[int]], n: int, plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """As `decode`, through the engine's last_logits (what the decoding loop calls): each step's logits
    (n, B, V) and the KV cache's filled positions; `plain`: Engine.last_logits, the embeddings, the
    blocks, ln_f and the head each on their own (the torch path around the compiled blocks)."""
    from lmhead_cli.engine.base import Engine

    last_logits = (lambda *a: Engine.last_logits(eng, *a)) if plain else eng.last_logits
    S, B = max(map(len, prompts)), len(prompts)
    ids = torch.tensor([[50256] * (S - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts])
    padded = bool((mask == 0).any())
    cache = eng.new_cache(B, S + n)
    z = last_logits(ids, cache, *((mask,) if padded else ()))
    steps = []
    for _ in range(n):
        steps.append(z)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
        z = last_logits(z.argmax(-1)[:, None], cache, *((mask,) if padded else ()))
    return torch.stack(steps), torch.cat([cache.k[:, :, :, :cache.length], cache.v[:, :, :, :cache.length]])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_whole_steps_equal_transformers_and_the_torch_path_around_the_blocks(ragged, dtype, rows, monkeypatch):
    """Token to logits in one call (the embeddings, the blocks, ln_f, the head): transformers' logits at
    every step, and the torch path's (Engine.last_logits: the modules around the compiled blocks) within
    float rounding, with the same KV cache, for one row, four left-padded rows and sixteen (float32's
    head takes them in one call; the other heads' kernels take four, so sixteen rows of bfloat16 and
    int8 run the torch path around the blocks, as before)."""
    folder, model = ragged
    eng = load_model(str(folder), device="cpu", dtype=dtype, engine="lean").engine
    ref = reference_for(eng, model, dtype)
    prompts = PROMPTS[16][:rows] if rows != 1 else PROMPTS[1]
    taken = count_steps(monkeypatch, "logits")
    whole, cache = decode_whole(eng, prompts, NEW)
    assert taken[0] == (NEW if rows <= 4 or dtype == "float32" else 0)
    plain, plain_cache = decode_whole(eng, prompts, NEW, plain=True)
    torch.testing.assert_close(whole, plain, atol=ATOL[dtype][1], rtol=0)
    torch.testing.assert_close(cache, plain_cache, atol=ATOL[dtype][1], rtol=0)
    new = whole.argmax(-1).t().tolist()  # (B, NEW): each step's greedy id
    for b, p in enumerate(prompts):
        with torch.inference_mode():
            expected = ref(torch.tensor([p + new[b][:-1]])).logits[0, len(p) - 1:]  # (NEW, V)
        torch.testing.assert_close(whole[:, b], expected, atol=ATOL[dtype][0], rtol=0)


@needs_kernels
def test_more_rows_than_a_step_takes_run_in_groups_of_compiled_steps(ragged, monkeypatch):
    """21 left-padded rows (a server's batch past MAX_ROWS): the whole step runs them as two compiled calls
    (16 and 5 rows, each on its rows of the cache), with the torch path's logits and cache within float
    rounding and transformers' logits. Mutant: no groups (the torch path: no compiled call)."""
    folder, model = ragged
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean").engine
    prompts = PROMPTS[16] + [[2000 + i, 7] for i in range(5)]
    assert len(prompts) > step.MAX_ROWS
    calls = []
    real = step.StepPlan.logits
    monkeypatch.setattr(step.StepPlan, "logits", lambda self, ids, *a: calls.append(ids.shape[0]) or real(self, ids, *a))
    whole, cache = decode_whole(eng, prompts, 4)
    assert calls == [21, 16, 5] * 4
    plain, plain_cache = decode_whole(eng, prompts, 4, plain=True)
    torch.testing.assert_close(whole, plain, atol=ATOL["float32"][1], rtol=0)
    torch.testing.assert_close(cache, plain_cache, atol=ATOL["float32"][1], rtol=0)
    new = whole.argmax(-1).t().tolist()
    for b in (0, 15, 16, 20):
        p = prompts[b]
        with torch.inference_mode():
            expected = model(torch.tensor([p + new[b][:-1]])).logits[0, len(p) - 1:]
        torch.testing.assert_close(whole[:, b], expected, atol=ATOL["float32"][0], rtol=0)


@needs_kernels
@pytest.mark.parametrize("module", ["wte", "wpe", "ln_f", "lm_head", "h.2.mlp"])
def test_a_hook_on_any_module_the_whole_step_replaces_sends_it_back(ragged, module, monkeypatch):
    """A hook on the embeddings, ln_f, the head or a block sees every step: the one-call step stands
    aside while it is registered (the hook sees one position a step), the same figures."""
    eng = load_model(str(ragged[0]), device="cpu", dtype="float32", engine="lean").engine
    taken = count_steps(monkeypatch, "logits")
    free, _ = decode_whole(eng, PROMPTS[1], 3)
    assert taken[0] == 3
    seen = []
    handle = eng.gpt.get_submodule(module).register_forward_hook(lambda _m, _i, out: seen.append(out.shape[1]))
    try:
        hooked, _ = decode_whole(eng, PROMPTS[1], 3)
    finally:
        handle.remove()
    prefill = 1 if module == "lm_head" else 5  # the prompt's five positions (the head: its last one)
    assert taken[0] == 3 and seen == [prefill, 1, 1, 1]  # then each step's one
    torch.testing.assert_close(hooked, free, atol=1e-5, rtol=0)


@needs_kernels
def test_a_token_or_position_outside_the_tables_gets_the_torch_path_s_error(ragged):
    """An id outside the vocabulary is never read by the compiled step: the torch path says what is
    wrong, and the cache is left as it was; a full context gets the engine's own error."""
    eng = load_model(str(ragged[0]), device="cpu", dtype="int8", engine="lean").engine
    cache = eng.new_cache(1, 8)
    eng.last_logits(torch.tensor([[464, 8251]]), cache)
    before = cache.k.clone()
    with pytest.raises(IndexError):
        eng.last_logits(torch.tensor([[eng.vocab_size]]), cache)
    assert cache.length == 2 and torch.equal(cache.k[:, :, :, :2], before[:, :, :, :2])
    cache.length = eng.n_ctx
    with pytest.raises(ValueError, match="exceed the context"):
        eng.last_logits(torch.tensor([[464]]), cache)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_generation_runs_its_steps_token_to_logits_in_one_call(ragged, dtype, monkeypatch):
    """lmhead_cli.load().generate(): every step after the prompt's is the whole step in a call (one step a
    call, or several: a run ahead, once the thread count is chosen), and the greedy ids are
    transformers' generate() on the weights the engine runs (bfloat16: its own torch path's, the
    whole step turned off)."""
    import lmhead_cli

    folder, model = ragged
    m = lmhead_cli.load(str(folder), dtype=dtype, device="cpu")
    taken = count_steps(monkeypatch, "logits")
    runs, real = [], step.StepPlan.greedy_run
    monkeypatch.setattr(step.StepPlan, "greedy_run", lambda self, *a: runs.append(real(self, *a)) or runs[-1])
    got = m.generate("The keys on the table", max_new_tokens=NEW, ignore_eos=True, greedy=True)
    ran = [r.top_ids.shape[0] for r in runs if r is not None]
    assert taken[0] + sum(ran) == NEW - 1 and max(ran) > 1
    prompt = got.prompt_ids
    if dtype == "bfloat16":
        monkeypatch.setenv(step.ENV, "0")
        again = m.generate("The keys on the table", max_new_tokens=NEW, ignore_eos=True, greedy=True)
        assert again.generated_ids == got.generated_ids
    else:
        ref = reference_for(m.loaded.engine, model, dtype)
        want = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                            pad_token_id=50256)[0, len(prompt):].tolist()
        assert got.generated_ids == want


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_step_s_record_is_the_row_kernel_s_and_a_spoilt_one_is_left_to_the_loop(ragged, dtype):
    """step_logits(record=True): each row's top-1 id, its log p, the entropy and its logit, as score's
    row kernel gives them for the returned logits (the same kernel, so the same bits); where a logit is
    not finite (a bias of +inf here) the logits come back as they are and the record is None, so that
    the loop's own record says what is wrong."""
    eng = load_model(str(ragged[0]), device="cpu", dtype=dtype, engine="lean").engine
    fast = kernels.load()
    prompts = torch.tensor([[464, 8251], [319, 262]])
    cache = eng.new_cache(2, 8)
    eng.last_logits(prompts, cache)
    z, made = eng.step_logits(torch.tensor([[3084], [13]]), cache, record=True)
    assert made is not None and cache.length == 3
    top_id, (top_logprob, entropy, logit) = made[0], made[1]
    _, _, h, want_id, want_logprob, _, _, bad = fast.score_rows(z, torch.zeros(2, dtype=torch.long), strict=True)
    assert bad == 0 and torch.equal(top_id, want_id) and torch.equal(top_logprob, want_logprob)
    assert torch.equal(entropy, h) and torch.equal(logit, z.gather(-1, top_id[:, None])[:, 0])
    with torch.no_grad():
        eng.gpt.ln_f.bias[5] = float("inf")
    z, made = eng.step_logits(torch.tensor([[3084], [13]]), cache, record=True)
    assert made is None and cache.length == 4 and not torch.isfinite(z).all()


def read_prompt(eng, rows: list[list[int]], pieces: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts read into a new cache through LeanGPT2.body, as decoding's prefill does: in one
    call, or in pieces of the given lengths (after the first, a mask of ones over the cache and the new
    positions, as decoding/prefill.py passes it). The hidden states after ln_f (B, T, D) and the cache's
    filled keys and values."""
    S, B = max(map(len, rows)), len(rows)
    ids = torch.tensor([[50256] * (S - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in rows])
    padded = bool((mask == 0).any())
    cache = eng.new_cache(B, S + 2)
    parts, at = [], 0
    for n in pieces or (S,):
        ones = (mask[:, :at + n],) if padded or at else ()
        parts.append(eng.body(ids[:, at:at + n], cache, *ones))
        at += n
    return torch.cat(parts, 1), torch.cat([cache.k[:, :, :, :cache.length], cache.v[:, :, :, :cache.length]])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_short_prompt_is_read_in_one_compiled_call(ragged, dtype, monkeypatch):
    """A prompt of up to 16 positions (a server's lone request) runs every block in one compiled call,
    each position causal over the ones before it: transformers' logits at every position, and the torch
    path's hidden states and cache within float rounding (LMHEAD_STEP=0). Read in two pieces (decoding's
    chunks: a mask of ones) it gives the same. A prompt of 17 positions, and a second piece with no mask
    (which the torch path reads without a causal mask), run the modules."""
    folder, model = ragged
    eng = load_model(str(folder), device="cpu", dtype=dtype, engine="lean").engine
    ref = reference_for(eng, model, dtype)
    prompt = list(range(100, 116))
    for T in (2, 7, 16):
        taken = count_steps(monkeypatch, positions=T)
        hidden, cache = read_prompt(eng, [prompt[:T]])
        assert taken[0] == 1
        with torch.inference_mode():
            want = ref(torch.tensor([prompt[:T]])).logits[0]  # (T, V)
            torch.testing.assert_close(eng.head(hidden[0]).float(), want, atol=ATOL[dtype][0], rtol=0)
        monkeypatch.setenv(step.ENV, "0")
        plain, plain_cache = read_prompt(eng, [prompt[:T]])
        monkeypatch.delenv(step.ENV)
        torch.testing.assert_close(hidden, plain, atol=ATOL[dtype][1], rtol=0)
        torch.testing.assert_close(cache, plain_cache, atol=ATOL[dtype][1], rtol=0)
    taken = count_steps(monkeypatch, positions=5)
    pieces, pieces_cache = read_prompt(eng, [prompt[:12]], (7, 5))
    assert taken[0] == 1
    whole, whole_cache = read_prompt(eng, [prompt[:12]])
    torch.testing.assert_close(pieces, whole, atol=ATOL[dtype][1], rtol=0)
    torch.testing.assert_close(pieces_cache, whole_cache, atol=ATOL[dtype][1], rtol=0)
    taken = count_steps(monkeypatch, positions=17)
    read_prompt(eng, [prompt + [200]])
    assert taken[0] == 0
    taken = count_steps(monkeypatch, positions=3)
    cache = eng.new_cache(1, 8)
    eng.body(torch.tensor([prompt[:2]]), cache)
    eng.body(torch.tensor([prompt[2:5]]), cache)
    assert taken[0] == 0


@needs_kernels
def test_left_padded_prompts_read_together_in_one_compiled_call(ragged, monkeypatch):
    """Prompts waiting together (decoding/prefill.py's padded pass) of at most 16 positions in all: one
    compiled call through the padding mask, each row's hidden states and cache the torch path's within
    float rounding, and each prompt's last position's logits transformers' for that prompt alone."""
    folder, model = ragged
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean").engine
    rows = [[464, 8251, 319, 262, 3084], [11, 13], [318, 257, 1332, 13, 198]]
    taken = count_steps(monkeypatch, positions=5)
    hidden, cache = read_prompt(eng, rows)
    assert taken[0] == 1
    monkeypatch.setenv(step.ENV, "0")
    plain, plain_cache = read_prompt(eng, rows)
    for b, p in enumerate(rows):
        torch.testing.assert_close(hidden[b, -len(p):], plain[b, -len(p):], atol=ATOL["float32"][1], rtol=0)
        torch.testing.assert_close(cache[:, b, :, -len(p):], plain_cache[:, b, :, -len(p):], atol=ATOL["float32"][1],
                                   rtol=0)
        with torch.inference_mode():
            want = model(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(eng.head(hidden[b, -1]).float(), want, atol=ATOL["float32"][0], rtol=0)


@needs_kernels
def test_the_thread_count_does_not_change_a_compiled_prompt_read(ragged):
    """A prompt's positions read in one compiled call: each product's output columns split among the
    threads, each sum in one order; one, two and three threads give the same bits."""
    eng = load_model(str(ragged[0]), device="cpu", dtype="float32", engine="lean").engine
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(read_prompt(eng, [list(range(300, 312))]))
        for hidden, cache in got[1:]:
            assert torch.equal(hidden, got[0][0]) and torch.equal(cache, got[0][1])
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_greedy_run_is_its_steps_in_one_call(ragged, dtype, monkeypatch):
    """Engine.greedy_run (csrc/llama_step.c lmhead_greedy_run over lmhead_decode): n steps in one call give
    step_logits' records and logits step after step and write the same cache, bit for bit; it stops
    after the step whose top-1 is end-of-text. Where the whole step would not run (a hook on a block,
    LMHEAD_STEP=0, a body replaced on the instance) it runs nothing and says so."""
    from helpers import run_against_steps

    eng = load_model(str(ragged[0]), device="cpu", dtype=dtype).engine
    prompt = [464, 8251, 319, 262]
    assert run_against_steps(eng, prompt, 8).top_ids.shape == (8,)  # even: the last logits in the second row
    assert run_against_steps(eng, prompt, 9, eos_at=1).top_ids.shape[0] <= 2  # the top-1 of step 1, first seen by then
    cache = eng.new_cache(1, 8)
    eng.body(torch.tensor([prompt]), cache)
    handle = eng.gpt.h[1].register_forward_hook(lambda *a: None)
    try:
        assert eng.greedy_run(5, cache, 3, None) is None and cache.length == 4
    finally:
        handle.remove()
    monkeypatch.setenv(step.ENV, "0")
    assert eng.greedy_run(5, cache, 3, None) is None and cache.length == 4
    monkeypatch.delenv(step.ENV)
    monkeypatch.setattr(eng, "body", eng.body)
    assert eng.greedy_run(5, cache, 3, None) is None and cache.length == 4
    monkeypatch.undo()
    assert eng.greedy_run(5, cache, 9, None).top_ids.shape == (4,) and cache.length == 8  # as far as the cache goes
