"""The generation loop against transformers (the oracle) on tiny checkpoints.

Greedy ids equal generate(do_sample=False); beam ids equal generate(num_beams=N, do_sample=False),
also when beams finish early at end-of-text; seeded sampling replays; the KV cache feeds one
position per step and the head sees the last position only.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, build_checkpoint

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


def test_only_the_one_position_steps_run_under_the_thread_chooser(tiny):
    """The first step (the prompt's prefill) runs as it is; each later step, one position, goes through
    loaded.threads.run, which times those steps to choose the thread count. Mutants: every step, or none."""
    from dataclasses import replace

    loaded = load(tiny[0])
    calls = []
    timed = replace(loaded, threads=SimpleNamespace(run=lambda f: calls.append(1) or f()))
    g = generate(timed, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=5))
    assert len(g.steps) == 5 and len(calls) == 4  # the 4 later steps


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
    from lmhead_cli.decoding.loop import Text

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
    s = generation.resolve(draws=True, preset="creative", temperature=None, top_p=None)
    assert (s.knobs.temperature, s.knobs.top_p, s.max_new_tokens, s.mode) == (1.1, 0.95, 40, "sample")
    s = generation.resolve(preset="creative", temperature=0.5, max_new_tokens=7)
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
