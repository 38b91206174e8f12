"""Model.generate's forms (one prompt, n choices, many prompts as one batch) and one request through
every door: the CLI's --json, Model.generate(...).to_dict() and a real `lmhead serve` process give the
same tokens and the same log-probabilities, alone or in a batch of 16 beside rows of other settings.

The oracle for the forms is the call alone: choice j of a batch is what the same settings with seed
+ j give by themselves (decoding.generate.generate_many), and a request's answer is the same through
each door. transformers is the oracle for greedy ids (test_generation.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import PROMPT, cli, serving, web

import lmhead_cli
from lmhead_cli.errors import BadType, BadValue, NoPrompt

NEW = 6
OTHERS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "def main():", "She said that"]

# One request per stage (and temperature 0), as keyword arguments of Model.generate; each is sent to
# every door with the distribution its log-probabilities are read from.
REQUESTS = {
    "temperature 0": dict(temperature=0),
    "temperature": dict(temperature=0.8, seed=3),
    "top_k": dict(top_k=40, seed=5),
    "top_p": dict(top_p=0.9, temperature=1.3, seed=7),
    "min_p": dict(min_p=0.05, seed=11),
    "softcap": dict(softcap=2.0, seed=13),
}
MODES = {"temperature 0": "raw", "temperature": "processed", "top_k": "processed", "top_p": "raw",
         "min_p": "processed", "softcap": "processed"}


@pytest.fixture(scope="module")
def model(tiny):
    return lmhead_cli.load(str(tiny[0]), device="cpu", threads=1)


def flags(values: dict) -> list[str]:
    return [arg for k, v in values.items() for arg in ("--" + k.replace("_", "-"), str(v))]


def tokens(doc: dict, mode: str) -> tuple[list[int], list[float]]:
    """A generation document's ids and each token's log p under `mode` (raw, or processed: the stages')."""
    key = "raw_logprob" if mode == "raw" else "logprob"
    return doc["generated_ids"], [s[key] for s in doc["steps"]]


def same(a: tuple, b: tuple) -> None:
    """The same ids; the same log-probabilities up to float rounding (a padded batch, another thread count)."""
    assert a[0] == b[0]
    assert a[1] == pytest.approx(b[1], abs=2e-5)


# ---- the forms --------------------------------------------------------------------------------------

def test_one_prompt_is_one_result_and_n_or_a_list_of_prompts_a_list(model):
    one = model.generate(PROMPT, max_new_tokens=3, seed=1)
    assert isinstance(one, lmhead_cli.api.results.GenerateResult)
    assert isinstance(model.generate(PROMPT, max_new_tokens=3, seed=1, n=1), lmhead_cli.api.results.GenerateResult)
    many = model.generate(PROMPT, n=3, max_new_tokens=3, seed=1)
    assert isinstance(many, list) and len(many) == 3
    listed = model.generate([PROMPT], max_new_tokens=3, seed=1)
    assert isinstance(listed, list) and len(listed) == 1
    assert listed[0].to_dict()["generated_ids"] == one.to_dict()["generated_ids"]
    grid = model.generate(OTHERS[:2], n=2, max_new_tokens=3, seed=1)
    assert [r.prompt for r in grid] == [OTHERS[0], OTHERS[0], OTHERS[1], OTHERS[1]]
    assert [r.to_dict()["seed"] for r in grid] == [1, 2, 1, 2]


def test_choice_j_of_a_batch_is_the_call_alone_with_seed_plus_j(model):
    """n = 16 choices of one prompt with seed 20: choice j is generate(prompt, seed=20 + j) alone; the same
    prompt among other prompts (one batch, rows of other lengths) too. Mutants: every choice drawn with
    the same seed (all alike), or the rows' generators shared (a choice depends on its neighbours)."""
    settings = dict(max_new_tokens=NEW, temperature=1.2, top_k=100)
    batch = model.generate(PROMPT, n=16, seed=20, **settings)
    for j in (0, 1, 7, 15):
        alone = model.generate(PROMPT, seed=20 + j, **settings).to_dict()
        same(tokens(batch[j].to_dict(), "raw"), tokens(alone, "raw"))
        assert batch[j].to_dict()["seed"] == 20 + j
    assert len({tuple(r.to_dict()["generated_ids"]) for r in batch}) > 8  # the choices differ
    mixed = model.generate([*OTHERS, PROMPT], seed=20, **settings)
    same(tokens(mixed[-1].to_dict(), "raw"), tokens(batch[0].to_dict(), "raw"))
    for text, got in zip(OTHERS, mixed):
        same(tokens(got.to_dict(), "raw"), tokens(model.generate(text, seed=20, **settings).to_dict(), "raw"))


def test_greedy_choices_are_all_the_greedy_answer(model):
    got = model.generate([PROMPT, OTHERS[0]], n=2, temperature=0, max_new_tokens=NEW)
    want = [model.generate(p, greedy=True, max_new_tokens=NEW).to_dict()["generated_ids"] for p in (PROMPT, OTHERS[0])]
    assert [r.to_dict()["generated_ids"] for r in got] == [want[0], want[0], want[1], want[1]]
    assert all(r.to_dict()["seed"] is None and r.to_dict()["mode"] == "greedy" for r in got)


def test_beams_for_many_prompts_are_each_prompt_s_beams(model):
    got = model.generate([PROMPT, OTHERS[1]], beams=2, max_new_tokens=4)
    for text, r in zip([PROMPT, OTHERS[1]], got):
        alone = model.generate(text, beams=2, max_new_tokens=4).to_dict()
        assert r.to_dict()["generated_ids"] == alone["generated_ids"] and r.to_dict()["beams"] == alone["beams"]


@pytest.mark.parametrize("call, key, kind", [
    (lambda m: m.generate([]), "prompt", BadValue),
    (lambda m: m.generate([PROMPT, 3]), "prompt", BadType),
    (lambda m: m.generate(b"abc"), "prompt", BadType),
    (lambda m: m.generate(123), "prompt", BadType),
    (lambda m: m.generate({"a": 1}), "prompt", BadType),
    (lambda m: m.generate(PROMPT, n=0), "n", BadValue),
    (lambda m: m.generate(PROMPT, n=1.5), "n", BadType),
    (lambda m: m.generate(PROMPT, n=True), "n", BadType),
    (lambda m: m.generate(PROMPT, n=2, beams=2), "n", BadValue),
    (lambda m: m.generate(PROMPT, n=2, on_text=print), "on_text", BadValue),
    (lambda m: m.generate([PROMPT], on_start=print), "on_start", BadValue),
])
def test_bad_forms_are_refused_naming_the_parameter(model, call, key, kind):
    with pytest.raises(kind) as e:
        call(model)
    assert e.value.key == key and str(e.value).startswith(f"{key} must ")


def test_an_empty_prompt_in_a_list_is_no_prompt(model):
    with pytest.raises(NoPrompt):
        model.generate([PROMPT, "  "])


def test_many_rows_are_bounded_by_the_memory_they_need(model, monkeypatch):
    from lmhead_cli.loading import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 10**8)
    with pytest.raises(BadValue) as e:
        model.generate(PROMPT, n=100_000, max_new_tokens=3)
    assert e.value.key == "n" and "n of 100,000 choices need about" in str(e.value) and "rows fit" in str(e.value)
    with pytest.raises(BadValue) as e:
        model.generate([PROMPT] * 50_000, max_new_tokens=3)
    assert e.value.key == "prompt" and "50,000 prompts × 1 choices" in str(e.value)


# ---- one request, every door ------------------------------------------------------------------------

def cli_doc(tiny, values: dict) -> dict:
    result = cli("generate", PROMPT, "-n", str(NEW), *flags(values), "--model", str(tiny[0]), "--device", "cpu",
                 "--threads", "1", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def server_answer(served, values: dict, mode: str, prompt: str = PROMPT, n: int = 1) -> list[tuple]:
    """(ids, log p) of each choice of one /v1/completions request: logprobs 0 lists the chosen id with its
    log p at each position."""
    body = {"prompt": prompt, "max_tokens": NEW, "logprobs": 0, "logprobs_mode": mode, "n": n, **values}
    r = web.post(served.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = []
    for c in sorted(r.json()["choices"], key=lambda c: c["index"]):
        pairs = c["logprobs"]["top_ids"]
        out.append(([p[0][0] for p in pairs], c["logprobs"]["token_logprobs"]))
    return out


@pytest.mark.slow
def test_the_same_request_is_the_same_answer_at_every_door(tiny, model):
    """Each stage's request (and temperature 0) gives the same tokens and log p from the CLI's --json, from
    Model.generate(...).to_dict() and from a real server: alone, in the API's batch of 16 (the request
    among 15 rows of other prompts and seeds) and on the server both as choice 0 of n = 16 and sent at
    once with 15 other requests of other settings, all in its running batch."""
    want = {}
    for name, values in REQUESTS.items():
        mode = MODES[name]
        cli_answer = tokens(cli_doc(tiny, values), mode)
        api = model.generate(PROMPT, max_new_tokens=NEW, **values).to_dict()
        same(tokens(api, mode), cli_answer)
        assert api["mode"] == ("greedy" if name == "temperature 0" else "sample")
        prompts = [*OTHERS, *OTHERS, *OTHERS][:15]
        batch = model.generate([*prompts[:7], PROMPT, *prompts[7:]], max_new_tokens=NEW, **values)
        same(tokens(batch[7].to_dict(), mode), cli_answer)
        want[name] = cli_answer
    assert len({tuple(ids) for ids, _ in want.values()}) == len(REQUESTS)  # the stages do differ

    fillers = [(dict(temperature=0.7 + 0.05 * i, top_k=10 + i, seed=100 + i), "raw", OTHERS[i % len(OTHERS)])
               for i in range(16 - len(REQUESTS))]
    with serving(tiny[0]) as served:
        for name, values in REQUESTS.items():
            (alone,) = server_answer(served, values, MODES[name])
            same(alone, want[name])
            if "seed" in values:  # choice 0 of 16 draws with the seed itself
                same(server_answer(served, values, MODES[name], n=16)[0], want[name])
        jobs = [(values, MODES[name], PROMPT) for name, values in REQUESTS.items()] + fillers
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: server_answer(served, *job)[0], jobs))
        for name, got in zip(REQUESTS, answers):
            same(got, want[name])
        for (values, mode, prompt), got in zip(fillers, answers[len(REQUESTS):]):
            same(got, tokens(model.generate(prompt, max_new_tokens=NEW, **values).to_dict(), mode))
