"""The generation loop against transformers (the oracle) on tiny checkpoints.

Greedy ids equal generate(do_sample=False); beam ids equal generate(num_beams=N, do_sample=False),
also when beams finish early at end-of-text; seeded sampling replays; the KV cache feeds one
position per step and the head sees the last position only.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, build_checkpoint, invoke

from lmhead_cli.decoding import generate as generation
from lmhead_cli.errors import BadValue, ModeConflict, NonFiniteLogits, UsageError
from lmhead_cli.decoding.generate import generate, make_settings
from lmhead_cli.readings.inspect import encode_prompt
from lmhead_cli.loading.sources import load_model

EOS = 50256
NEW = 12


def load(folder, engine="lean"):
    return load_model(str(folder), device="cpu", dtype="float32", engine=engine)


def reference(model, ids, **kwargs) -> list[int]:
    """transformers' generate: the new ids only."""
    kwargs.setdefault("pad_token_id", kwargs.get("eos_token_id", EOS))
    out = model.generate(torch.tensor([ids]), do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


# ---- parity with transformers -----------------------------------------------------------------

@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_greedy_is_token_identical_to_transformers(tiny, engine):
    folder, model = tiny
    loaded = load(folder, engine)
    for prompt in (PROMPT, "你好，世界"):
        ids, _ = encode_prompt(loaded, prompt)
        g = generate(loaded, ids, make_settings(greedy=True, max_new_tokens=NEW))
        assert g.generated_ids == reference(model, ids, max_new_tokens=NEW)
        assert g.prompt_ids == ids and g.mode == "greedy" and g.seed is None


def test_greedy_untied(tiny_untied):
    folder, model = tiny_untied
    loaded = load(folder)
    g = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=NEW))
    assert g.generated_ids == reference(model, PROMPT_IDS, max_new_tokens=NEW)


@pytest.mark.parametrize("engine", ["lean", "transformers"])
@pytest.mark.parametrize("beams", [2, 4])
def test_beam_search_is_token_identical_to_transformers(tiny, engine, beams):
    folder, model = tiny
    loaded = load(folder, engine)
    g = generate(loaded, PROMPT_IDS, make_settings(beams=beams, max_new_tokens=8))
    assert g.generated_ids == reference(model, PROMPT_IDS, num_beams=beams, max_new_tokens=8)
    assert g.mode == "beam" and g.beam_score is not None


@pytest.mark.parametrize("prompt", [PROMPT, "A B C", "x"])
def test_beams_that_finish_at_end_of_text_match_transformers(eos_model, prompt):
    folder, model = eos_model
    loaded = load(folder)
    ids, _ = encode_prompt(loaded, prompt)
    lengths = set()
    for beams in (1, 2, 3, 4):
        s = make_settings(greedy=True, beams=beams, max_new_tokens=12)
        g = generate(loaded, ids, s)
        kwargs = {"num_beams": beams} if beams > 1 else {}
        assert g.generated_ids == reference(model, ids, max_new_tokens=12, **kwargs), beams
        assert g.stop == "eos" and g.generated_ids[-1] == EOS
        assert "<|endoftext|>" not in g.text
        lengths.add(len(g.generated_ids))
    assert max(lengths) > 1  # not all trivially one token long


def test_beams_after_a_prompt_longer_than_one_prefill_chunk_match_transformers(tiny):
    """Beams run on the batch's prefill, which reads a long prompt in chunks (decoding.prefill.PREFILL_CHUNK):
    a 700-token prompt is read in two forwards, and the beams are still transformers'."""
    from lmhead_cli.decoding.prefill import PREFILL_CHUNK

    folder, model = tiny
    ids = list(range(1000, 1700))
    assert len(ids) > PREFILL_CHUNK  # the case is live
    g = generate(load(folder), ids, make_settings(beams=3, max_new_tokens=5))
    assert g.generated_ids == reference(model, ids, num_beams=3, max_new_tokens=5)


def test_beams_are_a_group_of_rows_of_the_step_loop(tiny):
    """Beam search over decoding.batch's step function: one prefill of the prompt, then every step one
    position for each of the n beams in one forward, the head on those positions only, and the cache
    reordered to the surviving beams between steps. Mutant: a loop of its own that re-reads the prompt."""
    from lmhead_cli.decoding.batch import Batch

    folder, _ = tiny
    loaded = load(folder)
    eng = loaded.engine
    bodies, heads, reorders, steps = [], [], [], []
    body, head, reorder, distributions = eng.body, eng.head, eng.reorder_cache, Batch.distributions
    eng.body = lambda ids, cache=None, attention_mask=None: bodies.append(tuple(ids.shape)) or body(ids, cache)
    eng.head = lambda h: heads.append(tuple(h.shape)) or head(h)
    eng.reorder_cache = lambda cache, rows: reorders.append(rows.tolist()) or reorder(cache, rows)
    Batch.distributions = lambda self: steps.append(len(self.live)) or distributions(self)
    try:
        g = generate(loaded, PROMPT_IDS, make_settings(beams=3, max_new_tokens=6, ignore_eos=True))
    finally:
        Batch.distributions = distributions
    assert len(g.generated_ids) == 6
    assert bodies == [(1, len(PROMPT_IDS))] + [(3, 1)] * 5
    assert heads == [(1, 64)] + [(3, 1, 64)] * 5
    assert steps == [1] + [3] * 5  # the prompt's one row, then the three beams
    assert len(reorders) == 5 and reorders[0] == [0, 0, 0] and all(len(r) == 3 for r in reorders)


def test_beam_score_is_the_mean_log_probability(tiny):
    folder, model = tiny
    g = generate(load(folder), PROMPT_IDS, make_settings(beams=3, max_new_tokens=6))
    seq = torch.tensor([PROMPT_IDS + g.generated_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0].float(), -1)
    P = len(PROMPT_IDS)
    total = sum(float(lp[P - 1 + i, t]) for i, t in enumerate(g.generated_ids))
    assert math.isclose(g.beam_score, total / len(g.generated_ids), abs_tol=1e-4)


# ---- the loop: cache, head, steps -------------------------------------------------------------

def test_one_position_per_step_and_the_head_on_the_last_position_only(tiny):
    folder, _ = tiny
    loaded = load(folder)
    eng = loaded.engine
    bodies, heads = [], []
    body, head = eng.body, eng.head
    eng.body = lambda ids, cache=None, attention_mask=None: bodies.append((tuple(ids.shape), cache)) or body(ids, cache)
    eng.head = lambda h: heads.append(tuple(h.shape)) or head(h)
    g = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=6))
    assert [shape for shape, _ in bodies] == [(1, len(PROMPT_IDS))] + [(1, 1)] * 5
    assert all(cache is bodies[0][1] and cache is not None for _, cache in bodies)
    assert heads == [(1, 64)] + [(1, 1, 64)] * 5  # the prompt's last position, then each step's one
    assert bodies[0][1].length == len(PROMPT_IDS) + 5
    assert len(g.generated_ids) == 6


def test_steps_match_an_independent_computation(tiny):
    folder, model = tiny
    loaded = load(folder)
    s = make_settings(temperature=0.7, top_k=50, seed=5, max_new_tokens=5, show_steps=4)
    g = generate(loaded, PROMPT_IDS, s)
    seq = torch.tensor([PROMPT_IDS + g.generated_ids])
    with torch.no_grad():
        logits = model(seq).logits[0].float()  # (T, V): every position at once, no cache
    P = len(PROMPT_IDS)
    for i, step in enumerate(g.steps):
        z = logits[P - 1 + i]
        scaled = z / 0.7
        kth = torch.topk(scaled, 50).values[-1]
        p = torch.softmax(scaled.masked_fill(scaled < kth, -float("inf")), -1)
        assert math.isclose(step.logit, float(z[step.id]), abs_tol=1e-4)
        assert math.isclose(step.prob, float(p[step.id]), rel_tol=1e-4)
        assert step.rank == 1 + int((z > z[step.id]).sum())
        nz = p[p > 0]
        assert math.isclose(step.entropy, float(-(nz * nz.log()).sum()), rel_tol=1e-4)
        assert [a.id for a in step.alternatives] == torch.topk(p, 4).indices.tolist()
        assert step.token == loaded.tokenizer.token_text(step.id)
    assert math.isclose(g.mean_entropy, sum(st.entropy for st in g.steps) / 5)


def test_sampling_replays_with_its_seed_and_draws_one_when_none_is_given(tiny):
    folder, _ = tiny
    loaded = load(folder)
    run = lambda seed: generate(loaded, PROMPT_IDS, make_settings(seed=seed, max_new_tokens=8))  # noqa: E731
    first = run(None)
    assert first.seed is not None and first.mode == "sample"
    assert 0 <= first.seed < 2**32  # a drawn seed fits 32 bits: short to type back, and any seed API takes it
    assert run(first.seed).generated_ids == first.generated_ids
    assert run(1).generated_ids == run(1).generated_ids
    assert len({tuple(run(s).generated_ids) for s in range(4)}) > 1


def test_a_drawn_seed_spans_32_bits_and_its_generator_is_made_on_the_model_s_device(tiny, monkeypatch):
    """The seed drawn when none is given is uniform over the 2**32 seeds (the highest drawn here); the
    sampling generator is made on the model's device, since a CPU generator cannot draw for a GPU's
    probabilities. Mutants: 2 * 32 seeds; a generator on the default device."""
    import secrets

    from lmhead_cli.engine import kernels

    loaded = load(tiny[0])
    kernels.load()  # its first load checks the kernels on random numbers of its own generator
    bounds, devices = [], []
    monkeypatch.setattr(secrets, "randbelow", lambda n: bounds.append(n) or n - 1)
    real = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device=None: devices.append(device) or real(device=device))
    g = generate(loaded, PROMPT_IDS, make_settings(max_new_tokens=2))
    assert bounds == [2**32] and g.seed == 2**32 - 1
    assert devices == [loaded.engine.device]


@pytest.mark.parametrize("settled", [False, True])
def test_only_the_one_position_steps_run_under_the_thread_chooser(tiny, settled):
    """The prompt's prefill runs on the model's thread count (execution.scope), untimed; each step, one
    position (the first runs the token chosen from the prompt's logits), goes through loaded.execution.run,
    which times those steps to choose the thread count, each counted as the positions it ran. While the
    count is being chosen (not `settled`), a step a call; once it is, a lone greedy row runs its
    positions ahead, several a call (the tiny model's whole compiled step, where the kernels load).
    Mutants: the prefill too, or none; a run ahead during a trial; units not counted from the call."""
    from dataclasses import replace

    from lmhead_cli.engine import kernels

    loaded = load(tiny[0])
    calls = []

    def run(f, units=1):
        out = f()
        calls.append(units(out) if callable(units) else units)
        return out

    timed = replace(loaded, execution=SimpleNamespace(run=run, scope=contextlib.nullcontext, settled=settled,
                                                      row_kernel=loaded.execution.row_kernel))
    g = generate(timed, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=5))
    assert len(g.steps) == 5 and sum(calls) == 5  # 4 steps that run a token and choose the next, 1 that chooses the last
    # ahead: the positions of the first 4 tokens in one call, then the step that chooses the last
    assert calls == ([4, 1] if settled and kernels.load() is not None else [1] * 5)


def test_greedy_ignores_the_seed_and_beams_agree_with_greedy_at_one(tiny):
    folder, _ = tiny
    loaded = load(folder)
    a = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=6, seed=1))
    b = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=6, softcap=30.0, temperature=0.5))
    assert a.generated_ids == b.generated_ids  # capping and temperature keep the ranking


def test_end_of_text_stops_unless_ignored(eos_model):
    folder, _ = eos_model
    loaded = load(folder)
    ids, _ = encode_prompt(loaded, "x")
    stopped = generate(loaded, ids, make_settings(greedy=True, max_new_tokens=10))
    assert stopped.stop == "eos" and stopped.generated_ids[-1] == EOS and len(stopped.generated_ids) < 10
    on = generate(loaded, ids, make_settings(greedy=True, max_new_tokens=10, ignore_eos=True))
    assert on.stop == "max_new_tokens" and len(on.generated_ids) == 10
    assert on.generated_ids[:len(stopped.generated_ids)] == stopped.generated_ids
    assert "<|endoftext|>" in on.text and "<|endoftext|>" not in stopped.text


def test_the_context_limit_stops_generation(tmp_path):
    folder = tmp_path / "short"
    model = build_checkpoint(folder, n_positions=16)
    loaded = load(folder)
    ten = PROMPT_IDS * 2  # 10 tokens
    g = generate(loaded, ten, make_settings(greedy=True, max_new_tokens=40))
    assert g.stop == "context" and len(g.generated_ids) == 16 - 10 + 1  # the last token is never fed back
    assert g.generated_ids == reference(model, ten, max_new_tokens=7)
    assert generation.room(16, 10) == 7
    long_ids, dropped = encode_prompt(loaded, PROMPT * 5)  # 25 tokens: the newest 16 are kept
    assert dropped == 9 and len(long_ids) == 16
    assert len(generate(loaded, long_ids, make_settings(greedy=True)).generated_ids) == 1


def test_non_finite_logits_stop_with_a_clear_error(tmp_path):
    folder = tmp_path / "nan"
    build_checkpoint(folder)
    loaded = load(folder)
    with torch.no_grad():
        loaded.engine.module.ln_f.weight[0] = float("nan")
    with pytest.raises(NonFiniteLogits, match="non-finite"):
        generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=3))


@pytest.mark.parametrize("how", [dict(seed=1), dict(seed=1, temperature=0.7, top_k=50)])
def test_non_finite_logits_are_caught_before_sampling(tmp_path, how):
    """Sampling a NaN distribution is NonFiniteLogits, as greedy's and every reading's, not torch's
    `RuntimeError: probability tensor contains either inf, nan or element < 0`."""
    folder = tmp_path / "nan"
    build_checkpoint(folder)
    loaded = load(folder)
    with torch.no_grad():
        loaded.engine.module.ln_f.weight[0] = float("nan")
    with pytest.raises(NonFiniteLogits, match=r"non-finite logits \(NaN or inf\)"):
        generate(loaded, PROMPT_IDS, make_settings(max_new_tokens=3, **how))


def test_streamed_text_is_the_whole_text_and_splits_no_character(tiny):
    folder, _ = tiny
    loaded = load(folder)
    pieces = []
    g = generate(loaded, PROMPT_IDS, make_settings(seed=3, max_new_tokens=12), on_text=pieces.append)
    assert "".join(pieces) == g.text == loaded.tokenizer.decode(g.generated_ids)
    # a text whose characters span several byte-level tokens arrives whole, never as halves
    text = "你好，世界 🙂 naïve"
    ids = loaded.tokenizer.encode(text)
    assert len(ids) > len(text.split())
    from lmhead_cli.decoding.text import Text

    stream = Text(loaded.tokenizer)
    out = [stream.add(i) or stream.piece() for i in ids] + [stream.piece(final=True, flush=True)]
    assert "".join(out) == text and not any("\ufffd" in piece for piece in out)
    # an answer that stops inside a character (max_new_tokens) ends with U+FFFD for its bytes so far
    emoji = loaded.tokenizer.encode("🙂")
    assert len(emoji) > 1
    stream = Text(loaded.tokenizer)
    assert [stream.add(i) or stream.piece() for i in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert stream.piece(final=True, flush=True) == "\ufffd" and stream.text == "\ufffd"


def test_an_empty_prompt_is_a_usage_error(tiny):
    folder, _ = tiny
    with pytest.raises(UsageError, match="empty"):
        encode_prompt(load(folder), "  ")


def test_resolve_layers_defaults_preset_and_flags():
    from lmhead_cli.api.presets import load_preset

    creative = load_preset("creative").values  # the API reads the file; resolve layers its values
    s = generation.resolve(draws=True, preset=creative, temperature=None, top_p=None)
    assert (s.knobs.temperature, s.knobs.top_p, s.max_new_tokens, s.mode) == (1.1, 0.95, 40, "sample")
    s = generation.resolve(preset=creative, temperature=0.5, max_new_tokens=7)
    assert (s.knobs.temperature, s.knobs.top_p, s.max_new_tokens) == (0.5, 0.95, 7)
    assert generation.resolve(defaults={"softcap": 30.0}).knobs.softcap == 30.0
    assert generation.resolve(defaults={"softcap": 30.0}, softcap=12.0).knobs.softcap == 12.0
    assert generation.resolve(greedy=True).mode == "greedy"
    assert generation.resolve(beams=3).mode == "beam"
    with pytest.raises(ModeConflict) as e:  # the CLI names the command: "use lmhead greedy --beams 2"
        generation.resolve(draws=True, beams=2)
    assert e.value.asked == {"beams": 2}


@pytest.mark.real_weights
def test_real_gpt2_greedy_the_dog(real_gpt2):
    loaded = load(real_gpt2)
    ids, _ = encode_prompt(loaded, "The dog")
    g = generate(loaded, ids, make_settings(greedy=True, max_new_tokens=18))
    assert ids + g.generated_ids == [464, 3290, 373, 1043, 287, 257, 2214, 1474, 262, 16246, 286, 2688, 290, 2688,
                                     27262, 13, 198, 198, 464, 3290]


def test_resolve_without_flags_is_the_default_settings_and_passes_each_flag_on():
    assert generation.resolve() == generation.Settings()  # ignore_eos False, show_steps 0, 40 new tokens
    assert generation.resolve(ignore_eos=True).ignore_eos is True
    with pytest.raises(ModeConflict) as e:  # greedy is named, even with beams asked too
        generation.resolve(draws=True, greedy=True, beams=2)
    assert e.value.asked == {"greedy": True}
    assert str(e.value) == "this mode draws tokens at random, which greedy=True does not"


def test_a_finished_beam_adds_up_within_float32_rounding_per_step():
    """The allowance is 1e-6 × max(1, |log p|) per token: 1e-6 for one token of log p -1, 4e-6 for four."""
    def beam(scores, logprob):
        return generation.FinishedBeam(ids=list(range(len(scores))), text="", transition_scores=scores,
                                       logprob=logprob, score=logprob / len(scores), stop="max_new_tokens")

    assert not beam([-1.0 - 1.5e-6], -1.0).adds_up  # off by 1.5e-6 in one step: more than float32 rounding
    assert beam([-1.0 - 0.5e-6], -1.0).adds_up
    assert beam([-0.25, -0.25, -0.25, -0.25 - 2e-6], -1.0).adds_up  # 2e-6 over four steps: within 4e-6
    assert not beam([-0.25, -0.25, -0.25, -0.25 - 5e-6], -1.0).adds_up


def test_decode_rate_counts_the_tokens_after_the_first():
    def run(n, elapsed, first):
        return generation.Generation(mode="greedy", settings=generation.Settings(), seed=None, prompt_ids=[1],
                                     generated_ids=list(range(n)), text="", steps=[], stop="max_new_tokens",
                                     elapsed_s=elapsed, first_token_s=first)

    assert run(3, 2.0, 0.5).decode_tokens_per_second == 2 / 1.5 and run(3, 2.0, 0.5).tokens_per_second == 1.5
    assert run(2, 2.0, 0.5).decode_tokens_per_second == 1 / 1.5  # one token after the first
    assert run(1, 2.0, 0.5).decode_tokens_per_second == 0.0  # nothing after the first token
    assert run(3, 0.5, 0.5).decode_tokens_per_second == 0.0  # no time after it


@pytest.mark.parametrize("which", ["raw", "processed"])
def test_greedy_top_logprobs_come_from_the_distribution_asked(tiny, which):
    """With a stage active (temperature 2) the two distributions differ; greedy keeps the argmax."""
    folder, model = tiny
    g = generate(load(folder), PROMPT_IDS, make_settings(greedy=True, temperature=2.0, max_new_tokens=3,
                                                         top_logprobs=5, logprobs=which))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS + g.generated_ids])).logits[0].float()
    for i, step in enumerate(g.steps):
        z = logits[len(PROMPT_IDS) - 1 + i]
        best = torch.topk(torch.log_softmax(z if which == "raw" else z / 2.0, -1), 5)
        assert step.top.ids.tolist() == best.indices.tolist()
        torch.testing.assert_close(step.top.logprobs, best.values, atol=1e-4, rtol=0)


def stub_engine(config: dict, device: str = "cpu"):
    return SimpleNamespace(config=config, dtype=torch.float16, vocab_size=50_000, device=torch.device(device))


@pytest.mark.parametrize("config", [{"n_layer": 3, "n_embd": 800}, {"num_hidden_layers": 3, "hidden_size": 800},
                                    {"num_layers": 3, "hidden_size": 800}], ids=["gpt2", "llama", "gpt-neo"])
def test_beam_memory_is_the_kv_cache_and_the_logits_rows(config):
    """Per beam: keys and values (2) × 3 layers × width 800 × 1,000 positions × 2 bytes (float16), plus
    8 float32 rows of the 50,000-token vocabulary, whichever way the config names its sizes."""
    per_beam = 2 * 3 * 800 * 1000 * 2 + 8 * 50_000 * 4
    assert generation.beam_memory(stub_engine(config), 5, 1000) == (5 * per_beam, per_beam)


def test_beam_memory_of_a_config_naming_no_sizes_counts_one_layer_of_width_one():
    per_beam = 2 * 1 * 1 * 1000 * 2 + 8 * 50_000 * 4
    assert generation.beam_memory(stub_engine({}), 2, 1000) == (2 * per_beam, per_beam)


def test_settings_show_no_alternatives_unless_asked(tiny):
    """make_settings' defaults: no step alternatives, no top log-probs (a library caller pays for none).
    Mutant: one alternative by default."""
    s = make_settings()
    assert (s.show_steps, s.top_logprobs) == (0, 0)
    g = generate(load(tiny[0]), PROMPT_IDS, make_settings(greedy=True, max_new_tokens=2))
    assert all(step.alternatives == [] and step.top is None for step in g.steps)


def test_beams_are_checked_for_the_prompt_and_the_tokens_that_fit_after_it(monkeypatch):
    """check_fits asks check_beam_memory for the prompt's positions plus the new tokens, as many as
    asked or as the context leaves. Mutant: the new tokens subtracted."""
    asked = []
    monkeypatch.setattr(generation, "check_beam_memory", lambda eng, beams, positions: asked.append((beams, positions)))
    eng = SimpleNamespace(vocab_size=50_000, n_ctx=64)
    generation.check_fits(eng, 10, make_settings(beams=3, max_new_tokens=5))
    generation.check_fits(eng, 60, make_settings(beams=3, max_new_tokens=20))  # the context leaves room for 5
    generation.check_fits(eng, 10, make_settings(greedy=True, max_new_tokens=5))  # no beams, no check
    assert asked == [(3, 15), (3, 60 + generation.room(64, 60))] and generation.room(64, 60) < 20


def test_beams_on_cuda_are_checked_against_the_gpus_free_memory(monkeypatch):
    """available_memory("cuda") is torch.cuda.mem_get_info's free figure, not the host's."""
    eng = stub_engine({"n_layer": 3, "n_embd": 800}, "cuda")
    per_beam = 2 * 3 * 800 * 1000 * 2 + 8 * 50_000 * 4  # 11.2 MB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * per_beam + 1, 1 << 40))
    generation.check_beam_memory(eng, 10, 1000)
    with pytest.raises(BadValue) as e:
        generation.check_beam_memory(eng, 11, 1000)
    assert e.value.problem == ("of 11 need about 123 MB (11 MB of cache and logits per beam), but 112 MB is "
                               "available; at most 10 beams fit")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * per_beam, 1 << 40))
    generation.check_beam_memory(eng, 10, 1000)  # exactly what 10 beams need: they fit
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (per_beam // 2, 1 << 40))
    with pytest.raises(BadValue) as e:
        generation.check_beam_memory(eng, 2, 1000)
    assert e.value.problem.endswith("at most 1 beams fit")  # below one beam's need: 1, never 0 (greedy runs)


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_settings_refuse_a_seed_torch_cannot_take(seed):
    with pytest.raises(BadValue) as e:
        make_settings(seed=seed)
    assert str(e.value) == f"seed must be between 0 and 2**63 - 1 (got {seed})"


def test_beams_are_bounded_by_the_memory_they_need(tiny, monkeypatch):
    from lmhead_cli.loading import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 10**9)
    got = invoke(["generate", "x", "--beams", "1000000", "-n", "3", "--model", str(tiny[0])])
    assert got.exit_code == 2 and "--beams of 1,000,000 need about" in got.stderr
    assert "but 1.0 GB is available; at most " in got.stderr


STUB_V, STUB_EOS, STUB_PROMPT = 16, 15, 14


def bigram_table() -> torch.Tensor:
    """(V, V) logits of the next token given the last one. After the prompt token: 0 (p .4), 1 (.3),
    end-of-text (.2), 2 (.06), 3 (.04), so with 2 beams end-of-text is the 3rd of the 4 candidates.
    After 0 or 1: nearly flat, the best about 0.09, so any two-token beam averages below log .2 and
    a one-token [end-of-text] (score log .2) would beat them all if it were allowed to finish."""
    table = torch.full((STUB_V, STUB_V), -30.0)
    for t, p in {0: 0.4, 1: 0.3, STUB_EOS: 0.2, 2: 0.06, 3: 0.04}.items():
        table[STUB_PROMPT, t] = math.log(p)
    table[0] = torch.linspace(0.0, -0.6, STUB_V)
    table[1] = table[0].roll(3)
    return table


class BigramEngine:
    """The parts of the engine contract that generate() uses, over a bigram table: the hidden state is
    the one-hot last token and the head multiplies it by the table. No cache is needed."""

    name, n_ctx, device, dtype = "bigram", 64, torch.device("cpu"), torch.float32
    vocab_size, eos_token_id, config = STUB_V, STUB_EOS, {"n_layer": 1, "n_embd": STUB_V}

    def __init__(self, table: torch.Tensor):
        self.table = table

    def new_cache(self, batch, max_len):
        return None

    def reorder_cache(self, cache, rows):
        return cache

    def body(self, ids, cache=None):
        return torch.nn.functional.one_hot(ids, STUB_V).float()  # (R, T, V)

    def head(self, h):
        return h @ self.table  # (R, T, V)

    def last_logits(self, ids, cache=None):
        return self.head(self.body(ids, cache))[:, -1].float()  # (R, V)

    def step_logits(self, ids, cache, attention_mask=None, record=False):
        return self.last_logits(ids, cache), None  # no record of its own: the loop makes it

    def greedy_run(self, token, cache, n, eos):
        return None  # no run of its own: the loop steps


def bigram_loaded(table: torch.Tensor):
    text = lambda i: f"<{i}>"  # noqa: E731
    tokenizer = SimpleNamespace(token_text=text, token_bytes=lambda i: text(i).encode(),
                                decode=lambda ids: "".join(map(text, ids)))
    execution = SimpleNamespace(run=lambda f, units=1: f(), scope=contextlib.nullcontext, row_kernel=lambda: None,
                                settled=True)
    return SimpleNamespace(engine=BigramEngine(table), tokenizer=tokenizer, execution=execution)


def transformers_bigram_beams(table: torch.Tensor, beams: int, new: int):
    """transformers' own beam search over the same bigram table: (sequences without the prompt, scores)."""
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class BigramConfig(PretrainedConfig):
        model_type = "lmhead_test_bigram"

    class Bigram(PreTrainedModel, GenerationMixin):
        config_class = BigramConfig

        def __init__(self, config):
            super().__init__(config)
            self.table = torch.nn.Parameter(table.clone())

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return CausalLMOutputWithPast(logits=self.table[input_ids])

    model = Bigram(BigramConfig(vocab_size=STUB_V, eos_token_id=STUB_EOS, pad_token_id=STUB_EOS)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([[STUB_PROMPT]]), num_beams=beams, num_return_sequences=beams,
                             do_sample=False, max_new_tokens=new, use_cache=False, eos_token_id=STUB_EOS,
                             pad_token_id=STUB_EOS, return_dict_in_generate=True, output_scores=True)
    return [s[1:].tolist() for s in out.sequences], out.sequences_scores.tolist()


def test_end_of_text_ranked_below_the_best_n_candidates_does_not_finish():
    """End-of-text is the 3rd of 2 × 2 candidates at the first step: transformers lets only the best 2
    finish, so it never becomes a one-token beam; the two-token beams win, in transformers' order.
    Mutant: the finishing loop over `cands` instead of `cands[:n]` returns [end-of-text] first."""
    table = bigram_table()
    expected, scores = transformers_bigram_beams(table, beams=2, new=2)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=2))
    assert [b.ids for b in g.beams] == expected and all(len(ids) == 2 for ids in expected)
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.generated_ids == expected[0] and STUB_EOS not in g.generated_ids
    assert max(scores) < math.log(0.2)  # so a finished [end-of-text] would have won: the case is live


def bigram_table_of(rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """(V, V) bigram logits: log p for the probabilities given after each token, the rest of the mass
    (if any) spread evenly over the other tokens."""
    table = torch.full((STUB_V, STUB_V), -30.0)
    for r, probs in rows.items():
        others = [i for i in range(STUB_V) if i not in probs]
        rest = 1 - sum(probs.values())
        if rest > 1e-9:
            table[r, others] = math.log(rest / len(others))
        for i, p in probs.items():
            table[r, i] = math.log(p)
    return table


def up_to_end_of_text(ids: list[int]) -> list[int]:
    """transformers pads a beam that finished early with the pad token (end-of-text here)."""
    return ids[:ids.index(STUB_EOS) + 1] if STUB_EOS in ids else ids


A, A2, B, C = 4, 7, 5, 6


# After the prompt: end-of-text .5, A .45; after A: A2 .55, end-of-text .44; after A2: end-of-text .9.
RUNNER_UP_TABLE = {STUB_PROMPT: {STUB_EOS: .5, A: .45, B: .03, C: .02}, A: {A2: .55, STUB_EOS: .44}, A2: {STUB_EOS: .9}}


def test_beam_search_runs_on_while_its_best_running_beam_can_still_win():
    """After 2 steps, [end-of-text] (log .5) and [A, end-of-text] have finished; the best running beam
    [A, A2] scores above the worse of them per token, the 2nd running beam far below. transformers runs
    on, and [A, A2, end-of-text] wins. Mutant: judging by the 2nd running beam stops at 2 steps."""
    table = bigram_table_of(RUNNER_UP_TABLE)
    expected, scores = transformers_bigram_beams(table, beams=2, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=3))
    assert [b.ids for b in g.beams] == [up_to_end_of_text(ids) for ids in expected] == [[A, A2, STUB_EOS], [STUB_EOS]]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.generated_ids == [A, A2, STUB_EOS] and g.stop == "eos"
    assert [b.text for b in g.beams] == [f"<{A}><{A2}>", ""]  # a beam's text leaves out its end-of-text


def test_beam_search_stops_as_its_best_beam_did():
    """One step: the best beam is [end-of-text] (stop "eos"), the 2nd [A] ran out of tokens. The
    generation's stop is the best beam's. Mutant: the 2nd beam's."""
    table = bigram_table_of(RUNNER_UP_TABLE)
    expected, scores = transformers_bigram_beams(table, beams=2, new=1)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=1))
    assert [b.ids for b in g.beams] == expected == [[STUB_EOS], [A]]
    assert [b.stop for b in g.beams] == ["eos", "max_new_tokens"] and g.stop == "eos"
    assert [b.text for b in g.beams] == ["", f"<{A}>"]  # only a beam that ended on end-of-text drops it
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)


def test_finished_beams_with_equal_scores_keep_transformers_order():
    """Two tokens of exactly equal probability finish together. Mutant: sorting the (score, beam)
    pairs without a key compares the beams themselves at the tie (a TypeError)."""
    table = bigram_table_of({STUB_PROMPT: {0: .4, 1: .4}})
    expected, scores = transformers_bigram_beams(table, beams=2, new=1)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=1))
    assert [b.ids for b in g.beams] == expected and scores[0] == scores[1]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)


def test_as_many_beams_as_tokens_never_continue_a_finished_one():
    """16 beams over 16 tokens: at the first step every token is a candidate, so the finished
    [end-of-text] is among the beams that run on, its score sunk by transformers' -1e9. Mutant: raised
    by 1e9, its continuations take every beam."""
    table = bigram_table()
    expected, scores = transformers_bigram_beams(table, beams=16, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=16, max_new_tokens=3))
    # the table's rows 0 and 1 tie (one is the other rolled), so beams of equal score may come in either order
    assert sorted(b.ids for b in g.beams) == sorted(up_to_end_of_text(ids) for ids in expected)
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.beams[0].ids == [STUB_EOS] and all(STUB_EOS not in b.ids for b in g.beams[1:])


X, Y, Z = 0, 1, 2


def exact_table(rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """(V, V) bigram logits: the given ones, -1000 elsewhere (exp(-1000) is 0 in float32, so a row of
    k zeros gives each of them log p = -log k exactly, the same bits in every row)."""
    table = torch.full((STUB_V, STUB_V), -1000.0)
    for r, logits in rows.items():
        for i, z in logits.items():
            table[r, i] = z
    return table


def test_beam_search_stops_when_its_best_running_beam_only_ties_the_worst_finished():
    """After 2 steps: [end-of-text] and [X, end-of-text] have finished; the best running beam [Y, Z] has
    exactly [X, end-of-text]'s score (X and Y tie, each continues with p = 1), so it cannot beat it: the
    search stops, as transformers' does (worst finished >= best attainable). Mutant: `<` for `<=` runs
    on, and [Y, Z, end-of-text], scored over 3 tokens, wins."""
    table = exact_table({STUB_PROMPT: {STUB_EOS: 1.0, X: 0.0, Y: 0.0}, X: {STUB_EOS: 0.0}, Y: {Z: 0.0},
                         Z: {STUB_EOS: 0.0}})
    expected, scores = transformers_bigram_beams(table, beams=2, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=3))
    assert [b.ids for b in g.beams] == [up_to_end_of_text(ids) for ids in expected] == [[STUB_EOS], [X, STUB_EOS]]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)


def test_beam_search_judges_the_best_running_beam_against_the_worst_finished_of_three():
    """3 beams. After 2 steps the finished are [end-of-text], [B, end-of-text] and [C, end-of-text]; the
    best running beam [A, A2] scores per token between the 2nd and the 3rd of them, so it can still win,
    and [A, A2, end-of-text] does. Mutant: judging it against the 2nd finished (`finished[1]`) stops."""
    B_, C_ = 5, 6
    table = bigram_table_of({STUB_PROMPT: {STUB_EOS: .5, A: .2, B_: .15, C_: .1}, A: {A2: .64, STUB_EOS: .35},
                             B_: {STUB_EOS: .9}, C_: {STUB_EOS: .9}, A2: {STUB_EOS: .95}})
    expected, scores = transformers_bigram_beams(table, beams=3, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=3, max_new_tokens=3))
    assert [b.ids for b in g.beams] == [up_to_end_of_text(ids) for ids in expected]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.beams[1].ids == [A, A2, STUB_EOS]  # the case is live: the beam that ran on is among them


def test_each_beam_step_shows_its_own_alternatives_and_the_raw_figures_before_the_temperature():
    """Beam search with a temperature and --show-steps: each step's log p is its beam's processed one
    (the table's row / T), its raw log p the table row's own, and its alternatives the best 3 of the
    processed row. Mutants: no alternatives passed on (`None` for show_steps); the raw figures taken
    from the processed ones (the stage flag lost)."""
    table = bigram_table_of(RUNNER_UP_TABLE)
    temperature = 0.5
    g = generate(bigram_loaded(table), [STUB_PROMPT],
                 make_settings(beams=2, max_new_tokens=3, show_steps=3, temperature=temperature))
    prev, moved = STUB_PROMPT, []
    for step in g.steps:
        raw = torch.log_softmax(table[prev].double(), -1)
        processed = torch.log_softmax(table[prev].double() / temperature, -1)
        assert step.raw_logprob == pytest.approx(float(raw[step.id]), abs=1e-5)
        assert step.logprob == pytest.approx(float(processed[step.id]), abs=1e-5)
        moved.append(abs(step.raw_logprob - step.logprob))
        best = torch.topk(processed, 3)
        assert [c.id for c in step.alternatives] == best.indices.tolist()
        assert [c.prob for c in step.alternatives] == pytest.approx(best.values.exp().tolist(), abs=1e-6)
        prev = step.id
    assert max(moved) > 0.1  # the temperature shows


def test_beam_search_on_non_finite_logits_says_so():
    """A NaN logit: beam search raises NonFiniteLogits with the count, as greedy does. Mutant: the
    logits not passed to the step, which then fails on None."""
    from lmhead_cli.errors import NonFiniteLogits

    table = bigram_table()
    table[STUB_PROMPT, 3] = float("nan")
    with pytest.raises(NonFiniteLogits, match="1 non-finite"):
        generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=2))


def test_the_streamed_pieces_are_the_text_without_end_of_text_and_end_with_a_cut_character():
    """on_text sees each piece that became printable, never an empty one and never end-of-text; an
    answer cut inside a character (max_new_tokens) ends with U+FFFD, streamed last. The timings are
    within the call's own wall time. Mutants: end-of-text streamed as text, the last piece dropped,
    sent empty or as None, or sent when nobody listens; the elapsed time counted from 0."""
    import time

    CUT, A_ = 3, 4  # CUT: the first 2 of the 3 bytes of "€"; A_: "a"
    pieces = {CUT: b"\xe2\x82", A_: b"a", STUB_EOS: b"<|endoftext|>"}
    loaded = bigram_loaded(exact_table({STUB_PROMPT: {CUT: 0.0, A_: 1.0}, A_: {STUB_EOS: 0.0}, CUT: {A_: 0.0}}))
    loaded.tokenizer.token_bytes = lambda i: pieces.get(i, b"?")
    for new, want_ids, want in ((2, [A_, STUB_EOS], ["a"]), (1, [A_], ["a"])):
        got = []
        t0 = time.perf_counter()
        g = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=new), on_text=got.append)
        wall = time.perf_counter() - t0
        assert g.generated_ids == want_ids and got == want and g.text == "a"
        assert 0 < g.first_token_s <= g.elapsed_s <= wall
    loaded.engine.table = exact_table({STUB_PROMPT: {CUT: 0.0}, CUT: {A_: 0.0}})
    got = []
    g = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=1), on_text=got.append)
    assert g.generated_ids == [CUT] and got == ["\ufffd"] and g.text == "\ufffd"
    assert generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=1)).text == "\ufffd"


def test_a_finished_beam_adds_up_up_to_its_tolerance_inclusive():
    """FinishedBeam.adds_up allows float32 rounding: |Σ transition scores − log p| up to 1e-6 per token of
    the total's size, the bound itself included (mutant: `<`)."""
    from lmhead_cli.decoding.generate import FinishedBeam

    def beam(logprob: float) -> FinishedBeam:  # two tokens of log p 0 each, said to add up to `logprob`
        return FinishedBeam(ids=[1, 2], text="", transition_scores=[0.0, 0.0], logprob=logprob, score=logprob / 2,
                            stop="eos")

    bound = 1e-6 * 1.0 * 2  # |log p| below 1 counts as 1; 2 tokens
    assert beam(-bound).sum_error == bound and beam(-bound).adds_up
    assert not beam(-math.nextafter(bound, 1.0)).adds_up


class DeviceCheckingEngine(BigramEngine):
    """A bigram engine that refuses ids and cache rows on any device but its own."""

    def __init__(self, table):
        super().__init__(table)
        self.seen = []

    def _check(self, t):
        self.seen.append(t.device)
        assert t.device == self.device, f"handed a tensor on {t.device}, the engine is on {self.device}"

    def reorder_cache(self, cache, rows):
        self._check(rows)
        return cache

    def last_logits(self, ids, cache=None):
        self._check(ids)
        return super().last_logits(ids, cache)


@pytest.mark.parametrize("settings", [dict(greedy=True, max_new_tokens=3), dict(beams=2, max_new_tokens=3)],
                         ids=["one sequence", "beams"])
def test_generate_hands_the_engine_tensors_on_its_own_device(settings):
    """The prompt, each step's ids and the beams' cache rows are made on the engine's device, not on
    torch's default one: here the default is the meta device (as a GPU would differ from the CPU)."""
    loaded = bigram_loaded(bigram_table())
    loaded.engine = DeviceCheckingEngine(bigram_table())
    with torch.device("meta"):
        g = generate(loaded, [STUB_PROMPT], make_settings(**settings))
    assert g.generated_ids and set(loaded.engine.seen) == {torch.device("cpu")}
    if "beams" in settings:
        assert len(loaded.engine.seen) > 3  # the reorders were checked too


def test_an_end_of_text_id_given_to_generate_is_the_one_it_stops_at():
    """generate(eos_token_id=…) overrides the engine's own: greedy's first pick from the stub prompt is
    token 0, so asking to stop at 0 ends the answer there, while the engine's end-of-text would not."""
    loaded = bigram_loaded(bigram_table())
    own = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=4))
    assert own.generated_ids[0] == 0 and own.stop == "max_new_tokens"
    g = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=4), eos_token_id=0)
    assert g.generated_ids == [0] and g.stop == "eos"


def test_a_generation_of_no_steps_reports_zero_rates_and_entropy():
    """No steps (nothing generated) and no time: mean entropy and tokens/s are 0, not a made-up 1.
    Mutants: either fallback changed."""
    from lmhead_cli.decoding.generate import Generation

    g = Generation(mode="greedy", settings=make_settings(greedy=True), seed=None, prompt_ids=[1], generated_ids=[],
                   text="", steps=[], stop="max_new_tokens", elapsed_s=0.0, first_token_s=0.0)
    assert g.mean_entropy == 0.0 and g.tokens_per_second == 0.0 and g.decode_tokens_per_second == 0.0


def test_beam_search_top_logprobs_come_from_the_distribution_asked_for(tiny):
    """Beams with top_k = 2 and 4 top logprobs per step: raw ones are all finite (log softmax of the
    logits), processed ones -inf beyond the two the filter kept. Mutant: the beams' alternatives always
    taken from the processed distribution."""
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    for which in ("raw", "processed"):
        g = generate(loaded, PROMPT_IDS, make_settings(beams=2, max_new_tokens=3, top_k=2, top_logprobs=4,
                                                       logprobs=which))
        tops = [s.top.logprobs for s in g.steps]
        assert tops and all(t.shape == (4,) for t in tops)
        finite = [int(torch.isfinite(t).sum()) for t in tops]
        assert finite == ([4] * len(tops) if which == "raw" else [2] * len(tops)), (which, finite)


def test_f32_rounds_to_float32_whatever_torch_s_default_dtype():
    """A notebook may set torch's default dtype to float64; generate's scores still round as float32 does.
    Mutant: torch.tensor(v) in the default dtype."""
    import numpy as np

    from lmhead_cli.decoding.beams import _f32

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _f32(0.1) == float(np.float32(0.1)) != 0.1
    finally:
        torch.set_default_dtype(before)


def test_plain_greedy_figures_from_the_compiled_kernel_match_torchs_record():
    """record.greedy_record (the row kernel's two passes) against record.record (torch's log-softmax, argmax,
    entropy and rank): the same choice, the first of equal maxima, rank 1, figures within float32's reach;
    rows it does not take (a NaN, no kernel) are left to record.record."""
    from lmhead_cli.decoding import record
    from lmhead_cli.engine import kernels
    from lmhead_cli.head import log_softmax

    fast = kernels.load()
    if fast is None:
        pytest.skip(f"the compiled kernels are not loaded: {kernels.unavailable()}")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 50257, generator=g) * torch.tensor([[0.1], [1.0], [3.0], [10.0], [1.0]])
    z[4, 7] = z[4, 9] = z[4].max() + 1.0  # a tie at the top: the first wins, as argmax
    chosen, rows = record.greedy_record(z, fast.score_rows)
    raw = log_softmax(z)
    want = record.record(z, raw, raw, raw.argmax(-1), 0, False).tolist()
    assert chosen.tolist() == raw.argmax(-1).tolist() and chosen[4] == 7
    for got, ref in zip(rows, want):
        assert got[record.ID] == ref[record.ID] and got[record.RANK] == ref[record.RANK] == 1
        assert got[record.FINITE] == ref[record.FINITE] == 1.0 and got[record.REMOVED] == 0.0
        assert got[record.LOGIT] == ref[record.LOGIT]
        for col in (record.LOGPROB, record.RAW_LOGPROB, record.ENTROPY, record.RAW_ENTROPY):
            assert got[col] == pytest.approx(ref[col], rel=1e-5, abs=1e-5)
    bad = z.clone()
    bad[2, 3] = float("nan")
    assert record.greedy_record(bad, fast.score_rows) is None
    bad[2, 3] = float("-inf")  # a filtered-looking logit: torch's record counts it as not finite
    assert record.greedy_record(bad, fast.score_rows) is None
    assert record.greedy_record(z, None) is None


def test_plain_greedy_decoding_is_the_same_with_and_without_the_compiled_figures(tiny, monkeypatch):
    """The loop's fast path changes no token and no figure beyond float32's reach (LMHEAD_KERNELS=0:
    torch's record), whether the record is the loop's kernel call or the one the engine made with the
    step's logits (every step after the prompt's, where the whole step runs in one call). One step a
    round (AHEAD 1): a run ahead makes its records in the engine (test_batch.py compares it with this)."""
    from lmhead_cli.decoding import batch as loop
    from lmhead_cli.decoding import decoder
    from lmhead_cli.engine import kernels

    monkeypatch.setattr(decoder, "AHEAD", 1)
    loaded = load(tiny[0])
    used, made_by_engine = [], []
    original = loop.greedy_record

    def seen(z, k, made=None):
        used.append(k is not None)
        made_by_engine.append(made is not None)
        return original(z, k, made)

    monkeypatch.setattr(loop, "greedy_record", seen)
    a = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=8))
    assert used and all(used)
    if kernels.load() is not None:
        assert made_by_engine == [False] + [True] * 7  # the prompt's step is the loop's own call
    monkeypatch.setattr(loop, "greedy_record", lambda z, k, made=None: original(z, k))
    c = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=8))
    monkeypatch.setattr(loop, "greedy_record", lambda z, k, made=None: None)
    b = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=8))
    assert a.generated_ids == b.generated_ids == c.generated_ids
    for x, y, w in zip(a.steps, b.steps, c.steps):
        assert (x.id, x.rank, x.logit, x.removed_mass) == (y.id, y.rank, y.logit, y.removed_mass)
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5) and x.entropy == pytest.approx(y.entropy, abs=1e-5)
        assert (x.id, x.logprob, x.logit, x.entropy) == (w.id, w.logprob, w.logit, w.entropy)  # the same kernel
