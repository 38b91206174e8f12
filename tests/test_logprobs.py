"""Raw and processed logprobs per generated token, beam transition scores, and `--format openai`.

Raw figures are held against transformers' own forward over the generated prefix; processed ones
against transformers' logits processors (TemperatureLogitsWarper, TopK, TopP, MinP) applied to
those logits; beam transition scores against `compute_transition_scores` on
generate(num_beams=N, output_scores=True, return_dict_in_generate=True).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, cli

from lmhead_cli.decoding.generate import generate, make_settings
from lmhead_cli.errors import UsageError
from lmhead_cli.loading.sources import load_model
from lmhead_cli.readings.inspect import encode_prompt
from lmhead_cli.render.generate import _pct as pct

EOS = 50256
V = 50257


def load(folder, engine="lean"):
    return load_model(str(folder), device="cpu", dtype="float32", engine=engine)


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits (T, V) for every position of `ids`, in one pass, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def warpers(temperature=None, top_k=None, top_p=None, min_p=None):
    """transformers' own logits processors, in lmhead's (and transformers' generate) order."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    chain = LogitsProcessorList()
    if temperature is not None:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        chain.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        chain.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        chain.append(MinPLogitsWarper(min_p))
    return chain


# ---- raw and processed, per step ----------------------------------------------------------------

@pytest.mark.parametrize("engine, knobs", [("lean", dict(temperature=1.7, top_k=40, top_p=0.9)),
                                           ("transformers", dict(temperature=0.6, min_p=0.3))])
def test_raw_and_processed_logprobs_match_transformers(tiny, engine, knobs):
    folder, model = tiny
    g = generate(load(folder, engine), PROMPT_IDS, make_settings(seed=4, max_new_tokens=6, **knobs))
    logits = forward_logits(model, PROMPT_IDS + g.generated_ids)  # (T, V)
    chain, P = warpers(**knobs), len(PROMPT_IDS)
    for i, step in enumerate(g.steps):
        prefix = torch.tensor([PROMPT_IDS + g.generated_ids[:i]])
        z = logits[P - 1 + i]  # (V,) the raw logits that chose this token
        raw = torch.log_softmax(z, -1)
        processed = torch.log_softmax(chain(prefix, z[None].clone())[0], -1)  # -inf where a warper dropped
        assert step.raw_logprob == pytest.approx(float(raw[step.id]), abs=1e-4)
        assert step.logprob == pytest.approx(float(processed[step.id]), abs=1e-4)
        assert step.prob == pytest.approx(math.exp(step.logprob), rel=1e-9)
        assert step.raw_entropy == pytest.approx(float(-(raw.exp() * raw).sum()), abs=1e-4)
        kept = torch.isfinite(processed)
        p = processed[kept].exp()
        assert step.entropy == pytest.approx(float(-(p * processed[kept]).sum()), abs=1e-4)
        removed = float(raw.exp()[~kept].sum())
        assert 0 < removed < 1 and step.removed_mass == pytest.approx(removed, abs=1e-5)


def test_processed_top_lists_every_kept_token_before_any_dropped_one_however_low_it_is():
    """--top-logprobs from the processed distribution: the tokens the filters kept first, in their
    order, then the dropped ones in raw order. With temperature 1e-6 a kept token one logit below the
    best has log p -1e6: it still comes before every dropped token (before the fix it came after them,
    its key below the dropped ones' raw log p - 1e6)."""
    from lmhead_cli.decoding import stages
    from lmhead_cli.decoding.record import top_tokens as _top

    z = torch.tensor([[5.0, 3.0, 1.0, 0.5, 0.0, 4.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    raw = torch.log_softmax(z, -1)
    for t, want in ((1e-6, [[0, 5, 1, 2, 3, 4], [5, 4, 3, 2, 1, 0]]), (1.0, [[0, 5, 1, 2, 3, 4], [5, 4, 3, 2, 1, 0]])):
        processed = torch.log_softmax(stages.top_k(stages.temperature(z, t), 3), -1)
        ids, lps = _top(raw, processed, "processed", 6)
        assert ids.tolist() == want
        assert torch.isfinite(lps[:, :3]).all() and torch.isinf(lps[:, 3:]).all()
        assert torch.equal(lps, processed.gather(-1, ids))


def test_without_stages_raw_and_processed_are_one_distribution(tiny):
    folder, model = tiny
    g = generate(load(folder), PROMPT_IDS, make_settings(greedy=True, max_new_tokens=4))
    logits = forward_logits(model, PROMPT_IDS + g.generated_ids)
    for i, step in enumerate(g.steps):
        raw = torch.log_softmax(logits[len(PROMPT_IDS) - 1 + i], -1)
        assert step.raw_logprob == step.logprob == pytest.approx(float(raw.max()), abs=1e-4)
        assert step.raw_entropy == step.entropy and step.removed_mass == 0.0


def test_a_token_far_below_min_p_in_raw_terms_is_kept_after_temperature(tiny):
    """llama.cpp #7498: temperature runs before min-p, so min-p 0.05 measures the flattened
    distribution, and a token far below 5 % of the best one's raw probability can still be drawn;
    raw_logprob shows it, logprob (what it was drawn with) does not."""
    folder, model = tiny
    loaded = load(folder)
    head, scale = loaded.engine.head, 20.0  # the random head is nearly flat; sharpen it as trained ones are
    loaded.engine.head = lambda h: head(h) * scale
    g = generate(loaded, PROMPT_IDS, make_settings(temperature=3.0, min_p=0.05, seed=0, max_new_tokens=8))
    logits = forward_logits(model, PROMPT_IDS + g.generated_ids) * scale
    below = 0
    for i, step in enumerate(g.steps):
        raw = torch.log_softmax(logits[len(PROMPT_IDS) - 1 + i], -1)
        assert step.raw_logprob == pytest.approx(float(raw[step.id]), abs=1e-3)
        below += step.raw_logprob < float(raw.max()) + math.log(0.05)
        assert step.removed_mass > 0
    assert below > 0  # at least one drawn token would not have survived min-p 0.05 on the raw logits


# ---- beam search: transition scores and scores ---------------------------------------------------

@pytest.mark.parametrize("which, text, beams", [("tiny", PROMPT, 3), ("eos", "x", 4)])
def test_beam_transition_scores_match_compute_transition_scores(tiny, eos_model, which, text, beams):
    folder, model = tiny if which == "tiny" else eos_model  # eos_model's beams finish early at end-of-text
    loaded = load(folder)
    ids, _ = encode_prompt(loaded, text)
    g = generate(loaded, ids, make_settings(beams=beams, max_new_tokens=7))
    out = model.generate(torch.tensor([ids]), num_beams=beams, num_return_sequences=beams, do_sample=False,
                         max_new_tokens=7, output_scores=True, return_dict_in_generate=True, pad_token_id=EOS)
    ts = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    assert len(g.beams) == beams and g.beam_score == g.beams[0].score and g.generated_ids == g.beams[0].ids
    for b, seq, row, score in zip(g.beams, out.sequences[:, len(ids):], ts, out.sequences_scores):
        n = b.length
        assert b.ids == seq[:n].tolist() and (n == seq.shape[0] or seq[n] == EOS)
        assert b.transition_scores == pytest.approx(row[:n].tolist(), abs=1e-4)
        assert b.score == pytest.approx(float(score), abs=1e-5)
        # the arithmetic of the score: the transition scores sum to the cumulative log p
        assert b.adds_up and b.sum_error < 1e-4
        assert b.score == pytest.approx(math.fsum(b.transition_scores) / n ** 1.0, abs=1e-5)
        assert b.stop == ("eos" if b.ids[-1] == EOS else "max_new_tokens")
    assert [b.score for b in g.beams] == sorted((b.score for b in g.beams), reverse=True)
    if which == "eos":
        assert any(b.stop == "eos" for b in g.beams) and any(b.length < 7 for b in g.beams)


def test_beam_json_and_table_state_the_rule_and_the_check(tiny):
    got = cli("greedy", PROMPT, "--beams", "3", "-n", "5", "--model", str(tiny[0]), "--json")
    assert got.exit_code == 0, got.output
    d = json.loads(got.stdout)
    assert d["length_penalty"]["value"] == 1.0 and "sum(log p) / length ** 1.0" in d["length_penalty"]["rule"]
    assert len(d["beams"]) == 3 and d["beams"][0]["ids"] == d["generated_ids"]
    for b in d["beams"]:
        assert set(b) == {"ids", "text", "stop", "length", "score", "logprob", "transition_scores", "sum_error",
                          "adds_up"}
        assert b["adds_up"] and math.fsum(b["transition_scores"]) == pytest.approx(b["logprob"], abs=1e-4)
        assert b["score"] == pytest.approx(b["logprob"] / b["length"], abs=1e-5)
    # the beam's own steps carry the same transition scores as processed logprobs
    assert [s["logprob"] for s in d["steps"]] == d["beams"][0]["transition_scores"]
    text = cli("greedy", PROMPT, "--beams", "3", "-n", "5", "--model", str(tiny[0]))
    assert text.exit_code == 0 and "finished beams, best first" in text.stdout
    assert "sum(log p) / length ** 1.0" in text.stdout and text.stdout.count("adds up (±") == 3
    assert f"{d['beams'][0]['score']:.4f}" in text.stdout
    plain = cli("greedy", PROMPT, "-n", "3", "--model", str(tiny[0]), "--json")
    assert json.loads(plain.stdout)["beams"] == [] and json.loads(plain.stdout)["length_penalty"] is None


# ---- the steps table -------------------------------------------------------------------------------

def test_steps_table_shows_raw_and_processed(tiny):
    args = ["sample", PROMPT, "--temperature", "1.5", "--top-k", "30", "--seed", "2", "-n", "3", "--show-steps", "2",
            "--model", str(tiny[0])]
    d = json.loads(cli(*args, "--json").stdout)
    got = cli(*args, env={"COLUMNS": "200"})
    assert got.exit_code == 0, got.output
    assert all(h in got.stdout for h in ("raw p", "removed", "H raw"))
    for s in d["steps"]:
        row = next(line for line in got.stdout.splitlines() if line.strip().startswith(str(d["steps"].index(s) + 1)))
        for figure in (pct(math.exp(s['raw_logprob'])), pct(s['prob']), pct(s['removed_mass']),
                       f"{s['raw_entropy']:.2f}", f"{s['entropy']:.2f}"):
            assert figure in row, (figure, row)


# ---- --format openai ----------------------------------------------------------------------------

def openai(tiny, *args) -> dict:
    got = cli(*args, "--model", str(tiny[0]), "--format", "openai")
    assert got.exit_code == 0, got.output
    return json.loads(got.stdout)


def check_shape(d: dict, top: int) -> list[dict]:
    from openai.types.chat import ChatCompletion

    assert list(d) == ["id", "object", "created", "model", "choices", "usage"] and d["object"] == "chat.completion"
    assert d["id"].startswith("chatcmpl-") and isinstance(d["created"], int)
    ChatCompletion.model_validate(d)  # the official openai library's type
    (choice,) = d["choices"]
    assert list(choice) == ["index", "message", "finish_reason", "logprobs"] and choice["index"] == 0
    assert choice["message"]["role"] == "assistant" and list(choice["logprobs"]) == ["content"]
    for e in choice["logprobs"]["content"]:
        assert list(e) == ["token", "logprob", "bytes", "top_logprobs"] and len(e["top_logprobs"]) == top
        assert all(list(t) == ["token", "logprob", "bytes"] for t in e["top_logprobs"])
    u = d["usage"]
    assert list(u) == ["prompt_tokens", "completion_tokens", "total_tokens"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    return choice["logprobs"]["content"]


def test_openai_document_matches_transformers(tiny):
    folder, model = tiny
    d = openai(tiny, "generate", PROMPT, "-n", "4", "--seed", "3", "--top-logprobs", "3")
    content = check_shape(d, 3)
    ids = json.loads(cli("generate", PROMPT, "-n", "4", "--seed", "3", "--model", str(folder),
                                         "--json").stdout)["generated_ids"]
    assert d["model"] == str(folder) and d["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert d["choices"][0]["finish_reason"] == "length" and len(content) == 4
    logits = forward_logits(model, PROMPT_IDS + ids)
    for i, e in enumerate(content):  # raw by default: transformers' own log-softmax
        raw = torch.log_softmax(logits[len(PROMPT_IDS) - 1 + i], -1)
        assert e["logprob"] == pytest.approx(float(raw[ids[i]]), abs=1e-4)
        best = torch.topk(raw, 3)
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-4)
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode("utf-8", "replace") == d["choices"][0]["message"]["content"]


@pytest.mark.parametrize("command", ["greedy", "sample", "softcap"])
def test_openai_document_on_the_named_commands(tiny, command):
    d = openai(tiny, command, PROMPT, "-n", "2", "--seed", "3", "--top-logprobs", "1")
    content = check_shape(d, 1)
    assert len(content) == 2 and d["usage"]["completion_tokens"] == 2
    assert all(e["logprob"] <= e["top_logprobs"][0]["logprob"] for e in content)


def test_openai_top_logprobs_reaches_the_whole_vocabulary_with_exact_bytes(tiny):
    folder, model = tiny
    loaded = load(folder)
    d = openai(tiny, "greedy", "你好", "-n", "2", "--top-logprobs", str(V))
    content = check_shape(d, V)
    ids, _ = encode_prompt(loaded, "你好")
    z = forward_logits(model, ids)[-1]
    first = content[0]["top_logprobs"]
    assert math.fsum(math.exp(t["logprob"]) for t in first) == pytest.approx(1.0, abs=1e-4)
    assert [t["logprob"] for t in first[:50]] == pytest.approx(torch.topk(torch.log_softmax(z, -1), 50).values.tolist(),
                                                               abs=1e-4)
    seen = {bytes(t["bytes"]) for t in first}
    assert len(seen) == V - 1 or len(seen) == V  # every token once (two pieces may share bytes)
    # a lone lead byte of a three-byte character (你 is e4 bd a0) is a token of its own and keeps its byte
    lone = next(t for t in first if t["bytes"] == [0xE4])
    assert lone["token"] == "\\xe4"
    with pytest.raises(UnicodeDecodeError):
        bytes(lone["bytes"]).decode("utf-8")
    by_id = {loaded.tokenizer.token_bytes(i): i for i in range(V)}
    assert all(bytes(t["bytes"]) in by_id for t in first[:200])


def test_openai_processed_logprobs_and_dropped_tokens(tiny):
    folder, model = tiny
    d = openai(tiny, "sample", PROMPT, "-n", "3", "--seed", "1", "--top-k", "5", "--temperature", "0.7",
               "--top-logprobs", "8", "--logprobs", "processed")
    content = check_shape(d, 8)
    ids = json.loads(cli("sample", PROMPT, "-n", "3", "--seed", "1", "--top-k", "5", "--temperature",
                                         "0.7", "--model", str(folder), "--json").stdout)["generated_ids"]
    logits = forward_logits(model, PROMPT_IDS + ids)
    chain = warpers(temperature=0.7, top_k=5)
    for i, e in enumerate(content):
        z = logits[len(PROMPT_IDS) - 1 + i][None].clone()
        processed = torch.log_softmax(chain(torch.tensor([PROMPT_IDS + ids[:i]]), z)[0], -1)
        assert e["logprob"] == pytest.approx(float(processed[ids[i]]), abs=1e-4)
        lps = [t["logprob"] for t in e["top_logprobs"]]
        assert lps[:5] == pytest.approx(torch.topk(processed, 5).values.tolist(), abs=1e-4)
        assert lps[5:] == [-9999.0] * 3  # dropped by top-k: probability 0, OpenAI's stand-in for log 0
        # the dropped ones listed are the next-best by raw logit, not arbitrary ones
        nxt = torch.topk(logits[len(PROMPT_IDS) - 1 + i], 8).indices[5:].tolist()
        tok = load_tokenizer_bytes(folder)
        assert [bytes(t["bytes"]) for t in e["top_logprobs"][5:]] == [tok(j) for j in nxt]


def load_tokenizer_bytes(folder):
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    return GPT2Tokenizer.from_folder(folder).token_bytes


def test_openai_end_of_text_stops_and_is_not_content(eos_model):
    folder, _ = eos_model
    got = cli("greedy", "x", "-n", "12", "--model", str(folder), "--format", "openai")
    d = json.loads(got.stdout)
    content = check_shape(d, 0)
    assert d["choices"][0]["finish_reason"] == "stop"
    assert len(content) == d["usage"]["completion_tokens"] - 1  # the end-of-text is counted, not content
    assert "<|endoftext|>" not in d["choices"][0]["message"]["content"]


def test_top_logprobs_kept_per_step_is_what_was_asked(tiny):
    folder, _ = tiny
    loaded = load(folder)
    g = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=3, top_logprobs=7))
    assert all(s.top.ids.shape == (7,) and s.top.logprobs.dtype == torch.float32 for s in g.steps)
    g = generate(loaded, PROMPT_IDS, make_settings(beams=2, max_new_tokens=3, top_logprobs=4, logprobs="processed"))
    for s in g.steps:  # each beam step keeps its own beam's four best, best first, the chosen one among them
        assert s.top.ids.shape == (4,) and bool((s.top.logprobs[:-1] >= s.top.logprobs[1:]).all())
        assert float(s.top.logprobs[0]) >= s.logprob and s.id in s.top.ids.tolist()
    assert all(s.top is None for s in generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=2)).steps)


# ---- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--format", "openai", "--top-logprobs", "-1"], "--top-logprobs must be 0 or more (got -1)"),
    (["--format", "openai", "--top-logprobs", str(V + 1)],
     f"--top-logprobs must be between 0 and the vocabulary size, {V} (got {V + 1})"),
    (["--format", "openai", "--logprobs", "cooked"], "--logprobs must be raw or processed (got 'cooked')"),
    (["--format", "xml"], "--format must be text, json or openai (got 'xml')"),
    (["--format", "openai", "--json"], "--json and --format openai ask for two different outputs"),
    (["--top-logprobs", "3"], "--top-logprobs is reported by --format openai"),
    (["--logprobs", "raw"], "--logprobs is reported by --format openai"),
])
def test_bad_logprob_options_exit_2_with_one_line(tiny, args, words):
    got = cli("greedy", PROMPT, "-n", "2", "--model", str(tiny[0]), *args)
    assert got.exit_code == 2, got.output
    assert got.stderr.count("\n") == 1 and got.stderr.startswith("lmhead: error: ") and words in got.stderr
    assert "Traceback" not in got.output and got.stdout == ""


def test_settings_check_top_logprobs_and_distribution():
    with pytest.raises(UsageError, match="0 or more"):
        make_settings(top_logprobs=-2)
    with pytest.raises(UsageError, match="raw or processed"):
        make_settings(logprobs="both")
    assert make_settings(top_logprobs=V, logprobs="processed").top_logprobs == V


def test_help_states_the_default_distribution():
    got = cli("generate", "--help", env={"COLUMNS": "200"})
    assert "raw (the default" in got.stdout and "no cap at 20" in got.stdout


# ---- score --format openai -------------------------------------------------------------------------

def echo_logprobs(d: dict, n: int) -> dict:
    """The text_completion `score --format openai` writes: the text echoed, n positions of legacy logprobs."""
    assert list(d) == ["id", "object", "created", "model", "choices", "usage"] and d["object"] == "text_completion"
    (choice,) = d["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert list(lp) == ["tokens", "token_logprobs", "top_logprobs", "text_offset", "top_ids"]
    assert all(len(column) == n for column in lp.values())
    for i, (tok, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"])):
        assert top is None or tok in top  # the chosen token is always in its top dict
    return lp


def test_score_openai_matches_transformers(tiny):
    folder, model = tiny
    text = "你好 🙂, the keys"  # characters split across byte-level tokens
    d = openai(tiny, "score", text, "--bos", "--top-logprobs", "3")
    tok = load(folder).tokenizer
    ids = tok.encode(text)
    lp = echo_logprobs(d, len(ids))
    assert d["choices"][0]["text"] == text and lp["tokens"] == [tok.token_text(i) for i in ids]
    assert d["usage"] == {"prompt_tokens": len(ids) + 1, "completion_tokens": 0, "total_tokens": len(ids) + 1}
    ref = torch.log_softmax(forward_logits(model, [EOS] + ids), -1)  # position i predicts token i + 1
    for i, pairs in enumerate(lp["top_ids"]):  # with --bos every token is scored
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[i, ids[i]]), abs=1e-4)
        best = torch.topk(ref[i], 3)
        assert [p[0] for p in pairs[:3]] == best.indices.tolist()
        assert [p[1] for p in pairs[:3]] == pytest.approx(best.values.tolist(), abs=1e-4)
    plain = echo_logprobs(openai(tiny, "score", text), len(ids))  # without --bos the first token has null
    assert plain["token_logprobs"][0] is None and None not in plain["token_logprobs"][1:]
    assert openai(tiny, "score", text)["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                                     "total_tokens": len(ids)}


def test_score_openai_streams_chunk_by_chunk_through_windows(tmp_path):
    from helpers import build_checkpoint

    from lmhead_cli.readings.score import score_text

    folder = tmp_path / "short"
    build_checkpoint(folder, n_positions=16)
    text = "The keys on the table are here, and the dog is in the garden by the old red door."
    args = ["score", text, "--stride", "16", "--chunk", "3", "--model", str(folder)]  # no overlap: gaps
    ref = json.loads(cli(*args, "--json").stdout)
    got = cli(*args, "--format", "openai", "--top-logprobs", "5")
    d = json.loads(got.stdout)
    lp = echo_logprobs(d, len(ref["tokens"]))
    scored = [t["scored"] for t in ref["tokens"]]
    assert len(ref["tokens"]) > 16 and sum(scored) < len(ref["tokens"]) - 1  # two windows, a gap at the second
    assert lp["tokens"] == [t["token"] for t in ref["tokens"]]
    assert [x is not None for x in lp["token_logprobs"]] == scored  # unscored tokens have null
    assert [x for x in lp["token_logprobs"] if x is not None] == pytest.approx(
        [t["logprob"] for t in ref["tokens"] if t["scored"]], abs=1e-6)
    assert [math.exp(p[0][1]) for p in lp["top_ids"] if p] == pytest.approx(
        [t["top_prob"] for t in ref["tokens"] if t["scored"]], rel=1e-5)
    assert d["usage"]["prompt_tokens"] == len(ref["tokens"]) and d["choices"][0]["text"] == text
    # each chunk is handed over as it is scored, with only its own top tokens: (at most 3, 5)
    shapes = []
    score_text(load(folder), text, stride=16, chunk=3, top_logprobs=5,
               on_rows=lambda ids, lp, top_ids, top_lp: shapes.append((len(ids), tuple(top_ids.shape))))
    assert sum(n for n, _ in shapes) == sum(scored) and all(n <= 3 and s == (n, 5) for n, s in shapes)


@pytest.mark.parametrize("args, words", [
    (["--format", "openai", "--top-logprobs", "-1"], "--top-logprobs must be 0 or more (got -1)"),
    (["--format", "openai", "--top-logprobs", str(V + 1)],
     f"--top-logprobs must be between 0 and the vocabulary size, {V} (got {V + 1})"),
    (["--top-logprobs", "2"], "--top-logprobs is reported by --format openai only"),
    (["--format", "openai", "--json"], "--json and --format openai ask for two different outputs"),
])
def test_score_openai_bad_input_exits_2_with_one_line(tiny, args, words):
    got = cli("score", PROMPT, "--model", str(tiny[0]), *args)
    assert got.exit_code == 2, got.output
    assert got.stderr.count("\n") == 1 and words in got.stderr and got.stdout == ""


def test_score_openai_refuses_file(tiny, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("one line\n")
    got = cli("score", "--file", str(path), "--format", "openai", "--model", str(tiny[0]))
    assert got.exit_code == 2 and "--format openai scores one text" in got.stderr


@pytest.mark.parametrize("k", [0, 3])
def test_a_step_with_no_stage_records_what_the_full_computation_records(k):
    """With no stage, a step's record takes the raw distribution's figures once (processed=False):
    bit for bit what computing them twice gives, ties, -inf logits and all."""
    from lmhead_cli.decoding.record import record as _record
    from lmhead_cli.head import log_softmax

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 1000, generator=g) * 4
    logits[0, :10] = logits[0].max() + 1  # a tie at the top
    logits[1, 50:900] = float("-inf")  # logits that are -inf themselves (not filtered)
    raw = log_softmax(logits)
    chosen = torch.tensor([0, 3, int(raw[2].argmax())])
    full = _record(logits, raw, log_softmax(logits), chosen, k)
    once = _record(logits, raw, raw, chosen, k, processed=False)
    assert torch.equal(once, full)
