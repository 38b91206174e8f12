"""Llama's compiled decoding step (engine/llama_step.py LlamaStepPlan, csrc/llama_step.c): every layer of
one new position in one C call gives the torch path's figures, on float32 weights and on GGUF blocks,
for one row and for left-padded rows, with q/k/v and gate/up stacked or apart; and it stands aside where
a hook must see the modules run."""

from __future__ import annotations

import pytest
import torch
from test_llama_engine import IDS, build

import lmhead_cli
from lmhead_cli.engine import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the compiled kernels are not built here")
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
            tie_word_embeddings=False)  # rows of 256: every GGUF block type fits


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A grouped-query Llama (float32 folder; F32, Q8_0, Q4_K, Q6_K GGUFs) and a Qwen2 with q/k/v biases."""
    from helpers import write_gguf

    root = tmp_path_factory.mktemp("llama-step")
    folder, model = build(root / "llama", "llama", **WIDE)
    out = {"llama": folder, "qwen2": build(root / "qwen2", "qwen2", **WIDE)[0]}
    for qtype in ("F32", "Q8_0", "Q4_K", "Q6_K"):
        out[qtype] = root / f"llama-{qtype}.gguf"
        write_gguf(model, out[qtype], qtype)
    return out


def steps(eng, rows: list[list[int]], news: list[list[int]]) -> torch.Tensor:
    """The logits of each new token after `rows` (left-padded to one length, a mask where they differ)."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    cache = eng.new_cache(len(rows), 32)
    out = []
    with torch.inference_mode():
        eng.body(ids, cache, mask if len(set(map(len, rows))) > 1 else None)
        for new in news:
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
            h = eng.body(torch.tensor(new)[:, None], cache, mask if len(set(map(len, rows))) > 1 else None)
            out.append(eng.head(h[:, -1]))
    return torch.stack(out)


def both(eng, rows, news, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The torch path's logits, the compiled step's, and how many layers the compiled run sent to torch."""
    from lmhead_cli.engine import llama

    monkeypatch.setenv("LMHEAD_STEP", "0")
    want = steps(eng, rows, news)
    monkeypatch.setenv("LMHEAD_STEP", "1")
    calls = []
    real = llama.Layer.forward
    monkeypatch.setattr(llama.Layer, "forward", lambda self, *a: calls.append(1) or real(self, *a))
    got = steps(eng, rows, news)
    monkeypatch.setattr(llama.Layer, "forward", real)
    prompt_layers = len(eng.llama.model.layers)  # the prompt itself runs the torch path (more than one position)
    return want, got, len(calls) - prompt_layers


@pytest.mark.parametrize("name", ["llama", "qwen2", "F32", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [[IDS[:5]], [IDS[:5], IDS[4:13]]], ids=["one row", "left-padded rows"])
def test_the_compiled_step_gives_the_torch_path_s_logits(files, name, rows, monkeypatch):
    monkeypatch.setenv("LMHEAD_GGUF_ARITHMETIC", "exact")  # x unrounded: no rounding to amplify sums' order
    eng = lmhead_cli.load(str(files[name]), device="cpu").loaded.engine
    news = [[IDS[j + i] for i in range(len(rows))] for j in (7, 2, 11)]
    want, got, to_torch = both(eng, rows, news, monkeypatch)
    assert eng._plan.ready and to_torch == 0  # every step ran compiled
    # float32 sums in other orders (C's norms, SiLU, attention; the prompt's products torch's GEMM): seen up
    # to 2.9e-5 on logits of up to 11.4 (2.5e-6 of the largest)
    assert torch.allclose(got, want, atol=4e-6 * float(want.abs().max()), rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("name", ["llama", "Q4_K"])
def test_projections_held_apart_run_as_their_own_products(files, name, monkeypatch):
    """Where q, k and v (or gate and up) could not be stacked (blocks of different types: Q4_K_M's v is
    often Q6_K), each is its own product, its columns copied beside the others', for one row and more."""
    monkeypatch.setenv("LMHEAD_GGUF_ARITHMETIC", "exact")
    eng = lmhead_cli.load(str(files[name]), device="cpu").loaded.engine
    for layer in eng.llama.model.layers:
        layer.self_attn.qkv = layer.mlp.gate_up = None
    for rows in ([IDS[:5]], [IDS[:5], IDS[4:13]]):
        want, got, to_torch = both(eng, rows, [[IDS[7]] * len(rows)], monkeypatch)
        assert eng._plan.layers[0].w[1] and eng._plan.layers[0].w[5] and to_torch == 0
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()


def test_a_hook_sends_the_step_to_the_modules(files, monkeypatch):
    """A hook on any layer's module must see it run: the step then runs the torch path, layer by layer."""
    eng = lmhead_cli.load(str(files["Q8_0"]), device="cpu").loaded.engine
    seen = []
    handle = eng.llama.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    try:
        want, got, to_torch = both(eng, [IDS[:5]], [[IDS[7]]], monkeypatch)
    finally:
        handle.remove()
    assert to_torch == len(eng.llama.model.layers) and len(seen) == 4  # prompt and step, each path
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_K"])
def test_the_whole_step_looks_its_tokens_up_in_the_call(files, name, monkeypatch):
    """step_logits hands the C call the token ids, and it reads their rows from the table (float32 rows,
    or GGUF blocks dequantised as gguf-py does): the logits and records of the step from x embedded by
    the table's module, bit for bit, and the module not called for the step's tokens. A hook on the
    table sees them: the module looks them up. An id outside the table: the call declines before it
    writes anything, and the torch path's lookup refuses it."""
    eng = lmhead_cli.load(str(files[name]), device="cpu").loaded.engine
    rows, news = [IDS[:5], IDS[4:13]], [IDS[7], IDS[8]]
    got, made = whole(eng, rows, news)
    eng._plan.embeds = False  # the step from x, embedded by the module
    want, want_made = whole(eng, rows, news)
    eng._plan.embeds = True
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(made, want_made))
    table = eng.llama.model.embed_tokens
    calls = []
    real = type(table).forward
    monkeypatch.setattr(type(table), "forward", lambda self, i: calls.append(tuple(i.shape)) or real(self, i))
    assert torch.equal(whole(eng, rows, news)[0], got)
    assert calls == [(2, 9)]  # the prompts' lookup only
    monkeypatch.undo()
    seen = []
    handle = table.register_forward_hook(lambda m, args, out: seen.append(args[0].tolist()))
    try:
        assert torch.equal(whole(eng, rows, news)[0], got)
    finally:
        handle.remove()
    assert seen[1:] == [[[IDS[7]], [IDS[8]]]]
    with pytest.raises(IndexError):
        whole(eng, [IDS[:5]], [table.weight.shape[0]])


def test_each_product_s_arithmetic_follows_the_setting(files, monkeypatch):
    """LMHEAD_GGUF_ARITHMETIC, read at each step as the torch path's products read it: the plan rewrites
    its products' `rounded` fields when it changes (Q8_0: unrounded by default, rounded as llama.cpp)."""
    eng = lmhead_cli.load(str(files["Q8_0"]), device="cpu").loaded.engine
    runs = {}
    for setting in ("exact", "llama.cpp", ""):
        monkeypatch.setenv("LMHEAD_GGUF_ARITHMETIC", setting)
        runs[setting] = steps(eng, [IDS[:5]], [[IDS[7]]])
        assert {eng._plan.layers[i].rounded[j] for i in range(2) for j in (0, 3, 4, 6)} == {setting == "llama.cpp"}
    assert torch.equal(runs["exact"], runs[""]) and not torch.equal(runs["exact"], runs["llama.cpp"])


def whole(eng, rows, new, record: bool = True):
    """step_logits after `rows` (left-padded where they differ): the logits and the engine's record."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    padded = len(set(map(len, rows))) > 1
    cache = eng.new_cache(len(rows), 32)
    with torch.inference_mode():
        eng.body(ids, cache, mask if padded else None)
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
        z, made = eng.step_logits(torch.tensor(new)[:, None], cache, mask if padded else None, record=record)
    assert cache.length == width + 1
    return z, made


@pytest.mark.parametrize("name", ["llama", "F32", "Q8_0", "Q4_K"])
def test_the_whole_step_gives_the_torch_path_s_logits_and_records(files, name, monkeypatch):
    """step_logits: the layers, the final norm, the head and each row's greedy record in one call
    (lmhead_llama_decode), against the modules' logits and the record computed from them."""
    monkeypatch.setenv("LMHEAD_GGUF_ARITHMETIC", "exact")
    eng = lmhead_cli.load(str(files[name]), device="cpu").loaded.engine
    for rows in ([IDS[:5]], [IDS[:5], IDS[4:13]]):
        new = [IDS[7 + i] for i in range(len(rows))]
        monkeypatch.setenv("LMHEAD_STEP", "0")
        want, none = whole(eng, rows, new)
        monkeypatch.setenv("LMHEAD_STEP", "1")
        got, (top_id, top) = whole(eng, rows, new)
        assert none is None and torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()
        logp = got.log_softmax(-1)
        assert torch.equal(top_id, got.argmax(-1))
        assert torch.allclose(top[0], logp.max(-1).values, atol=1e-5)
        assert torch.allclose(top[1], -(logp.exp() * logp).sum(-1), atol=1e-4)
        assert torch.equal(top[2], got.max(-1).values)


def test_a_hook_on_the_head_or_a_replaced_head_keeps_the_modules(files, monkeypatch):
    """The whole step replaces the final norm and the head too: a hook on either, or a head replaced on
    the engine (a reading that wraps it), runs the modules, and the step makes no record."""
    eng = lmhead_cli.load(str(files["Q8_0"]), device="cpu").loaded.engine
    seen = []
    handle = eng.llama.lm_head.register_forward_hook(lambda *a: seen.append(1))
    try:
        _, made = whole(eng, [IDS[:5]], [IDS[7]])
    finally:
        handle.remove()
    assert made is None and seen == [1]
    calls = []
    real = eng.head
    monkeypatch.setattr(eng, "head", lambda h: calls.append(1) or real(h))
    _, made = whole(eng, [IDS[:5]], [IDS[7]])
    assert made is None and calls == [1]
    monkeypatch.undo()
    assert whole(eng, [IDS[:5]], [IDS[7]])[1] is not None


@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_K", "qwen2"])
def test_a_greedy_run_is_its_steps_in_one_call(files, name, monkeypatch):
    """Engine.greedy_run (csrc/llama_step.c lmhead_greedy_run over lmhead_llama_decode): n steps from a
    token in one call give step_logits' records and logits step after step and write the same cache, bit
    for bit, in either arithmetic of the GGUF products; it stops after the step whose top-1 is
    end-of-text, and at the end of the cache. A hook on the token table, LMHEAD_STEP=0 or a head replaced
    on the instance: it runs nothing and says so."""
    from helpers import run_against_steps

    eng = lmhead_cli.load(str(files[name]), device="cpu").loaded.engine
    for arithmetic in ("exact", "llama.cpp"):
        monkeypatch.setenv("LMHEAD_GGUF_ARITHMETIC", arithmetic)
        assert run_against_steps(eng, IDS[:5], 8).top_ids.shape == (8,)  # even: the last logits in the second row
        assert run_against_steps(eng, IDS[:5], 9, eos_at=1).top_ids.shape[0] <= 2  # its top-1, first seen by then
    cache = eng.new_cache(1, 8)
    eng.body(torch.tensor([IDS[:5]]), cache)
    handle = eng.llama.model.embed_tokens.register_forward_hook(lambda *a: None)
    try:
        assert eng.greedy_run(IDS[5], cache, 2, None) is None and cache.length == 5
    finally:
        handle.remove()
    monkeypatch.setenv("LMHEAD_STEP", "0")
    assert eng.greedy_run(IDS[5], cache, 2, None) is None and cache.length == 5
    monkeypatch.delenv("LMHEAD_STEP")
    monkeypatch.setattr(eng, "head", eng.head)
    assert eng.greedy_run(IDS[5], cache, 2, None) is None and cache.length == 5
    monkeypatch.undo()
    assert eng.greedy_run(IDS[5], cache, 9, None).top_ids.shape == (3,) and cache.length == 8  # as far as the cache goes


def test_generate_runs_ahead_to_the_same_tokens_and_figures(files, monkeypatch):
    """lmhead_cli.load(a GGUF).generate(), greedy: with runs ahead (decoder.AHEAD) and one step a round,
    the same tokens and the same figures, and the runs ran (Engine.greedy_run)."""
    from lmhead_cli.decoding import decoder

    m = lmhead_cli.load(str(files["Q4_K"]), device="cpu")
    eng = m.loaded.engine
    runs, real = [], eng.greedy_run
    monkeypatch.setattr(eng, "greedy_run", lambda *a: runs.append(real(*a)) or runs[-1])
    out = {}
    for ahead in (8, 1):
        monkeypatch.setattr(decoder, "AHEAD", ahead)
        g = m.generate("The keys on the table", max_new_tokens=20, ignore_eos=True, greedy=True)
        out[ahead] = [(s.id, s.logit, s.logprob, s.entropy) for s in g.steps]
    assert out[8] == out[1] and len(out[1]) == 20
    assert any(r is not None and r.top_ids.shape[0] > 1 for r in runs)
