"""The Python API: `lmhead_cli.load()` and the Model's results. Each result's to_dict() must equal the
CLI's --json document for the same call (parsed), and bad values raise the exception whose text the
CLI prints as its one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import cli

import lmhead_cli
from lmhead_cli.cli import app
from lmhead_cli.errors import BadValue, LmheadError, NoPrompt, UsageError

PROMPT = "The keys on the table"
TIMES = ("elapsed_s", "first_token_s", "tokens_per_second", "decode_tokens_per_second")


@pytest.fixture(scope="module")
def model(tiny):
    return lmhead_cli.load(str(tiny[0]), device="cpu", threads=1)  # one thread: the same sums as the CLI's


def cli_json(tiny, *args) -> dict:
    result = cli(*args, "--model", str(tiny[0]), "--device", "cpu", "--threads", "1", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def fresh(tiny):
    """A model that has run nothing yet, as the CLI's is: a model's first generation can differ from its
    later ones in the last bit of a logprob (the engine's first steps take another path)."""
    return lmhead_cli.load(str(tiny[0]), device="cpu", threads=1)


def untimed(doc: dict) -> dict:
    """A generation document without its wall-clock figures (they differ from run to run)."""
    assert all(k in doc for k in TIMES)
    return {k: v for k, v in doc.items() if k not in TIMES}


def test_inspect_matches_cli(model, tiny):
    got = model.inspect(PROMPT, top_k=5, targets=[" are", " is"]).to_dict()
    assert got == cli_json(tiny, "inspect", PROMPT, "-k", "5", "-t", " are", "-t", " is")
    assert got["top"][0]["rank"] == 1 and len(got["top"]) == 5


def test_inspect_stages_matches_cli(model, tiny):
    from lmhead_cli.decoding.stages import Knobs

    got = model.inspect(PROMPT, top_k=4, stages=Knobs(temperature=0.7, top_k=3)).to_dict()
    assert got == cli_json(tiny, "inspect", PROMPT, "-k", "4", "--stages", "--temperature", "0.7",
                           "--filter-top-k", "3")
    assert "stages" in got


def test_explain_matches_cli(model, tiny):
    assert model.explain(PROMPT, " are", top_k=3).to_dict() == cli_json(tiny, "inspect", PROMPT, "--explain",
                                                                          " are", "-k", "3")


def test_score_matches_cli(model, tiny):
    text = "The keys on the table are on the table."
    got = model.score(text, bos=True).to_dict()
    assert got == cli_json(tiny, "score", text, "--bos")
    assert sum(t["scored"] for t in got["tokens"]) == got["scored_tokens"] == len(got["tokens"])


def test_score_window_and_stride_match_cli(model, tiny):
    text = " ".join(["the keys are on the table"] * 40)
    got = model.score(text, stride=64, chunk=7).to_dict()
    assert got == cli_json(tiny, "score", text, "--stride", "64", "--chunk", "7")
    assert got["stride"] == 64 and got["chunk"] == 7


def test_score_file_runs_through_the_api(model, tiny, tmp_path):
    """api.files.score_file: each line scored as model.score scores it, empty and one-token lines
    skipped and counted, the corpus totals the sum of the lines'."""
    from lmhead_cli.api.files import score_file

    texts = ["The keys on the table.", "", "Hello", "The dog is asleep by the door."]
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    seen = {}

    def write(m, items, corpus, size) -> None:
        seen["items"], seen["corpus"], seen["size"] = list(items), corpus, size  # totals complete after items

    score_file(str(path), lambda device: model, write)
    items, corpus = seen["items"], seen["corpus"]
    assert [(i.line, i.skipped) for i in items] == [(1, None), (2, "empty"), (3, "one token"), (4, None)]
    want = [model.score(texts[0]).reading, model.score(texts[3]).reading]
    assert [i.score.nll for i in items if i.score] == [w.nll for w in want]
    assert (corpus.texts, corpus.skipped_empty, corpus.skipped_short) == (2, 1, 1)
    assert corpus.tokens == sum(w.scored_tokens for w in want)
    assert corpus.nll == pytest.approx(sum(w.nll for w in want), rel=1e-12)
    assert seen["size"] == path.stat().st_size


def test_generate_greedy_matches_cli(tiny):
    got = fresh(tiny).generate(PROMPT, max_new_tokens=6, temperature=0, show_steps=2).to_dict()
    want = cli_json(tiny, "generate", PROMPT, "-n", "6", "--temperature", "0", "--show-steps", "2")
    assert untimed(got) == untimed(want)
    assert got["mode"] == "greedy" and got["settings"]["greedy"] is True
    flag = cli_json(tiny, "generate", PROMPT, "-n", "6", "--greedy", "--show-steps", "2")
    assert untimed(flag)["generated_ids"] == got["generated_ids"] and flag["settings"]["greedy_because"] is None


def test_generate_seeded_sample_matches_cli(tiny):
    got = fresh(tiny).generate(PROMPT, max_new_tokens=6, temperature=0.8, top_p=0.9, seed=7, mode="sample").to_dict()
    want = cli_json(tiny, "sample", PROMPT, "-n", "6", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7")
    assert untimed(got) == untimed(want)
    assert got["seed"] == 7 and got["mode"] == "sample"


def test_generate_beams_match_cli(tiny):
    got = fresh(tiny).generate(PROMPT, max_new_tokens=4, beams=2).to_dict()
    assert untimed(got) == untimed(cli_json(tiny, "generate", PROMPT, "-n", "4", "--beams", "2"))


def test_diff_matches_cli(model, tiny):
    a, b = "The key on the table", PROMPT
    got = model.diff(a, b, top_k=4, targets=[" is", " are"], movers=3).to_dict()
    assert got == cli_json(tiny, "diff", a, b, "-k", "4", "-t", " is", "-t", " are", "--movers", "3")


def test_attribute_matches_cli(model, tiny):
    got = model.attribute(PROMPT, " are", vs=" is").to_dict()
    assert got == cli_json(tiny, "attribute", PROMPT, "-t", " are", "--vs", " is")


@pytest.mark.parametrize("position", [-1, 2])
def test_lens_matches_cli(model, tiny, position):
    got = model.lens(PROMPT, position=position, targets=[" are"]).to_dict()
    assert got == cli_json(tiny, "lens", PROMPT, "-t", " are", "--position", str(position))


def test_lines_take_plain_texts_and_count_what_they_yield(model):
    """Model.score_lines and Model.inspect_lines: plain texts in (numbered from 1), each line's result as
    score / inspect give it, and `totals` counting what was yielded; no reading's type to build first."""
    texts = ["The keys on the table.", " ", "Hello", "The dog is asleep by the door."]
    scored = model.score_lines(texts)
    items = list(scored)
    assert [(i.line, i.skipped) for i in items] == [(1, None), (2, "empty"), (3, "one token"), (4, None)]
    assert [i.score.nll for i in items if i.score] == [model.score(texts[0]).nll, model.score(texts[3]).nll]
    assert (scored.totals.texts, scored.totals.skipped_empty, scored.totals.skipped_short) == (2, 1, 1)

    prompts = [PROMPT, "The dog", "Hello there"]
    inspected = model.inspect_lines(prompts, top_k=3, targets=[" are"], batch_size=2)
    batches = list(inspected)
    assert [len(b) for b in batches] == [2, 1]
    assert [(line.number, line.text) for b in batches for line, _ in b] == [(1, PROMPT), (2, "The dog"),
                                                                         (3, "Hello there")]
    got = [r.to_dict()["top"] for b in batches for _, r in b]  # a padded batch: the same up to float rounding
    want = [model.inspect(p, top_k=3, targets=[" are"]).to_dict()["top"] for p in prompts]
    assert [[t["id"] for t in top] for top in got] == [[t["id"] for t in top] for top in want]
    assert [t["logprob"] for top in got for t in top] == pytest.approx([t["logprob"] for top in want for t in top],
                                                                       abs=1e-5)
    assert (inspected.totals.prompts, inspected.totals.batches) == (3, 2)


def test_params_of_a_model_and_the_toy_are_api_functions(model, tiny):
    """api.model_params (params --model) and api.toy (toy): the CLI's --json documents."""
    from lmhead_cli import api
    from lmhead_cli.render.toy import toy_json

    got = api.model_params(str(tiny[0]), batch=2, seq=16).to_dict()
    assert got == model.params(batch=2, seq=16).to_dict()
    toy = api.toy("0.5,1,2", temperature=0.7, seed=3, draws=9)
    assert toy_json(api.toy([0.5, 1, 2], temperature=0.7, seed=3, draws=9)) == toy_json(toy)
    out = cli("toy", "--hidden", "0.5,1,2", "--temperature", "0.7", "--seed", "3", "--draws", "9", "--json")
    assert out.exit_code == 0 and json.loads(out.stdout) == json.loads(json.dumps(toy_json(toy)))
    with pytest.raises(BadValue, match="draws must be between 1 and"):
        api.toy(draws=0)


def test_tie_matches_cli(model, tiny):
    got = model.tie().to_dict()
    assert got == cli_json(tiny, "tie")
    assert got["tied"] is True


def test_params_match_cli(model, tiny):
    got = model.params(batch=2, seq=16).to_dict()
    out = cli("params", "--model", str(tiny[0]), "--batch", "2", "--seq", "16", "--json")
    assert got == json.loads(out.stdout)
    assert got["counted_from"] == "tensors"
    from lmhead_cli.api import params

    by_config = params("gpt2-xl", batch=8).to_dict()
    out = cli("params", "--config", "gpt2-xl", "--batch", "8", "--json")
    assert out.exit_code == 0
    assert by_config == json.loads(out.stdout)


def cli_error(tiny, *args) -> tuple[int, str]:
    result = cli(*args, "--model", str(tiny[0]), "--device", "cpu")
    return result.exit_code, result.output.strip()


@pytest.mark.parametrize("call, args, error", [
    (lambda m: m.inspect(PROMPT, top_k=0), ["inspect", PROMPT, "-k", "0"], BadValue),
    (lambda m: m.diff(PROMPT, "x", movers=-1), ["diff", PROMPT, "x", "--movers", "-1"], BadValue),
    (lambda m: m.inspect(""), ["inspect", ""], NoPrompt),
    (lambda m: m.inspect(PROMPT, targets=[""]), ["inspect", PROMPT, "-t", ""], BadValue),
    (lambda m: m.score("a b c", stride=5000), ["score", "a b c", "--stride", "5000"], BadValue),
    (lambda m: m.score("The"), ["score", "The"], UsageError),
    (lambda m: m.generate(PROMPT, top_p=2.0), ["generate", PROMPT, "--top-p", "2.0"], BadValue),
    (lambda m: m.generate(PROMPT, greedy=True, mode="sample"), ["sample", PROMPT, "--greedy"], UsageError),
    (lambda m: m.lens("x y", position=9), ["lens", "x y", "--position", "9"], UsageError),
    (lambda m: m.attribute(PROMPT, ""), ["attribute", PROMPT, "-t", ""], BadValue),
])
def test_errors_are_the_clis(model, tiny, call, args, error):
    """The API raises the domain error; the CLI prints that error as its one line, same exit code."""
    from lmhead_cli.cli import message

    with pytest.raises(LmheadError) as e:
        call(model)
    assert isinstance(e.value, error)
    code, line = cli_error(tiny, *args)
    assert code == e.value.exit_code
    assert line == f"lmhead: error: {message(e.value, args[0])}"


def test_top_k_error_names_the_value(model):
    with pytest.raises(BadValue, match=r"top_k must be at least 1 \(got 0\)"):
        model.inspect(PROMPT, top_k=0)


def test_results_render_for_notebooks_and_terminals(model):
    from rich.console import Console

    r = model.inspect("<b>keys</b> on the", top_k=3)
    page = r._repr_html_()  # the notebook view (render/notebook.py): the prompt's tokens shown, escaped
    assert page.startswith("<div class='lmhead-inspect'>") and "<b>keys" not in page and "&lt;" in page
    console = Console(record=True, width=120)
    console.print(r)
    assert "entropy" in console.export_text()
    assert r.entropy == r.to_dict()["entropy"]  # the reading's own fields pass through
    score = model.score("The keys on the table are here.")
    # the coloured view (render/html.py): a whole page from to_html(), the same view as a notebook cell's fragment
    assert score.to_html().startswith("<!DOCTYPE html>") and 'class="lmhead-data"' in score._repr_html_()


def test_model_describes_itself(model, tiny):
    assert model.source == str(tiny[0])
    assert model.vocab_size == 50257 and model.n_ctx == 1024
    assert model.tokenizer.encode(PROMPT) == [464, 8251, 319, 262, 3084]


def test_import_does_not_import_torch():
    code = ("import sys, lmhead_cli, lmhead_cli.api, lmhead_cli.api.choices; assert callable(lmhead_cli.load); "
            "assert lmhead_cli.api.Model and lmhead_cli.api.toy().greedy; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("command, option, typed, expected", [
    ("inspect", "--device", "c", ["cpu", "cuda"]),
    ("score", "--dtype", "b", ["bfloat16"]),
    ("lens", "--engine", "l", ["lean"]),
    ("generate", "--logprobs", "p", ["processed"]),
    ("score", "--format", "", ["text", "json", "openai"]),
    ("inspect", "--model", "random:gpt2-", ["random:gpt2-large", "random:gpt2-medium", "random:gpt2-xl"]),
])
def test_completion_offers_option_values(command, option, typed, expected):
    import click
    from typer.main import get_command

    group = get_command(app)
    cmd = group.commands[command]
    param = next(p for p in cmd.params if option in p.opts)
    ctx = click.Context(cmd, info_name=command)
    assert sorted(c.value for c in param.shell_complete(ctx, typed)) == sorted(expected)


def test_completion_offers_cached_hub_ids_and_folders(tmp_path, monkeypatch):
    from lmhead_cli.cli import complete

    (tmp_path / "hf" / "hub" / "models--openai-community--gpt2").mkdir(parents=True)
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert "openai-community/gpt2" in complete.models("")
    assert complete.models("my-") == ["my-model/"]


# ---- every public parameter checked: its type, then its range (api.checks.typed) ----------------------

def _public_functions():
    """(name, function) for every public Model method (Serving's included) and the API's functions."""
    from lmhead_cli.api import arithmetic, explore, model as api_model

    methods = [(name, fn) for cls in (api_model.Model, *api_model.Model.__mro__[1:-1])
               for name, fn in vars(cls).items() if callable(fn) and not name.startswith("_")]
    return [*dict(methods).items(), ("api.load", api_model.load), ("api.model_params", api_model.model_params),
            ("api.params", arithmetic.params), ("api.toy", arithmetic.toy), ("explore.settings", explore.settings)]


# Parameters checked in the method's body rather than by their declared kind, each with the test below that
# drives it; and the server's own (its request models check what reaches them).
CHECKED_IN_THE_BODY = {("inspect", "stages"), ("compare", "base"), ("score_lines", "lines"),
                       ("inspect_lines", "lines"), ("api.toy", "hidden"), ("explore_reading", "settings"),
                       ("explore_generate", "settings"), ("lens", "tuned"), ("tuned_lens", "where"),
                       ("calibrate", "knobs"), ("neurons", "neurons"),
                       ("generate", "stop"), ("generate", "stages"), ("generate", "prompt"),
                       ("generate", "json_schema"), ("generate", "regex"),  # decoding/grammar.py checks both
                       ("generate", "settings"),  # api.checks.decoding_settings: test_generate_cli
                       # the registry's settings: its one check (decoding.stages.checked), tests/test_setting_doors.py
                       *(("generate", k) for k in ("n", "max_new_tokens", "beams", "seed", "show_steps", "top_logprobs")),
                       ("calibrate", "max_new_tokens"), ("calibrate", "seed"), ("score", "top_logprobs"),
                       ("check_score", "top_logprobs"), ("explore.settings", "temperature"),
                       ("explore.settings", "softcap"), ("generate", "logprobs")}  # make's raw-or-processed
SERVERS_OWN = {"decoder", "chat_prompt", "decode", "prepare_grammar"}


def test_every_public_parameter_has_a_kind_or_a_check_of_its_own():
    import inspect as py_inspect

    missing = []
    for name, fn in _public_functions():
        if name in SERVERS_OWN:
            continue
        declared = getattr(fn, "kinds", {})
        method = "." not in name
        for param in list(py_inspect.signature(fn).parameters)[method:]:  # a method's self left out
            if param not in declared and (name, param) not in CHECKED_IN_THE_BODY:
                missing.append(f"{name}({param})")
    assert missing == []


# A valid call of each function, into which one wrong value at a time is put.
VALID = {
    "inspect": dict(prompt=PROMPT), "explain": dict(prompt=PROMPT, token=" are"), "diff": dict(a=PROMPT, b="x"),
    "attribute": dict(prompt=PROMPT, target=" are"), "lens": dict(prompt=PROMPT), "params": {},
    "explore_reading": dict(prompt=PROMPT), "explore_generate": dict(prompt=PROMPT, n=1, on_text=print),
    "score": dict(text="The keys are"), "check_score": {}, "compare": dict(text="The keys are"),
    "score_lines": dict(lines=["The keys are"]), "inspect_lines": dict(lines=[PROMPT]),
    "generate": dict(prompt=PROMPT, max_new_tokens=1), "scored_positions": dict(n_tokens=5),
    "encode": dict(text=PROMPT), "prompt_ids": dict(text=PROMPT), "wants_bos": {}, "api.load": dict(source="random:gpt2"),
    "api.model_params": dict(source="random:gpt2"), "api.params": dict(config="gpt2"), "api.toy": {},
    "explore.settings": {}, "calibrate": dict(text="The keys are"), "neurons": dict(layer=0),
    "tune_lens": dict(text="The keys are on the table", steps=1, batch=1, seq=4),
}
# Values of the wrong type for each kind (None only where None is not the parameter's "not given").
WRONG = {int: [1.5, True, float("nan"), "3"], float: ["hot", True, b"1"], bool: ["no", 1, 0.0],
         str: [123, b"abc", ["a"]], list: ["abc", None, [1], b"ab", {"a": 1}], callable: [1, "print"]}


def _wrong_calls():
    for name, fn in _public_functions():
        for param, kind in getattr(fn, "kinds", {}).items():
            values = ["bogus", 1] if isinstance(kind, tuple) else WRONG[kind]
            if param not in fn.optional and kind is not list:
                values = [*values, None]
            for value in values:
                yield pytest.param(name, param, value, id=f"{name}-{param}={value!r}")


@pytest.mark.parametrize("name, param, value", list(_wrong_calls()))
def test_every_parameter_refuses_a_wrong_value_naming_itself(model, name, param, value):
    from lmhead_cli.api import explore

    fn = dict(_public_functions())[name]
    args = {**VALID[name], param: value}
    if name in ("explore_reading", "explore_generate"):
        args["settings"] = explore.settings()
    with pytest.raises(BadValue) as e:
        (fn if "." in name else getattr(model, name))(**args)
    assert e.value.key == param and str(e.value).startswith(f"{param} must be ")
    assert isinstance(e.value, (TypeError, ValueError)) and isinstance(e.value, LmheadError)


# What a program may hand any parameter by mistake: a number, bytes, a list of a number, a dict, an object,
# and text no tokenizer takes (a lone surrogate), alone and in a list.
HOSTILE = [123, b"x", [1], {"a": 1}, object(), "\ud800", ["ok", "\ud800"]]


def _hostile_calls():
    import inspect as py_inspect

    for name, fn in _public_functions():
        if name in SERVERS_OWN - {"chat_prompt", "decode"}:
            continue  # the running batch's machinery: rows the server's request models made
        method = "." not in name
        for p in list(py_inspect.signature(fn).parameters.values())[method:]:
            param = "temperature" if p.kind is p.VAR_KEYWORD else p.name  # **stages: a stage's value
            for i, value in enumerate(HOSTILE):
                if value == 123 and getattr(fn, "kinds", {}).get(param) in (int, float):
                    continue  # a fine value there: calibrate(generations=123) would only take its time
                yield pytest.param(name, param, value, id=f"{name}-{param}-{i}")


VALID.update(decode=dict(ids=[464]), chat_prompt=dict(messages=[{"role": "user", "content": "hi"}]), tuned_lens={},
             warm_up={}, tie={})


@pytest.mark.parametrize("name, param, value", list(_hostile_calls()))
def test_every_public_parameter_given_a_hostile_value_answers_with_a_domain_error(model, name, param, value):
    """Issue 50: `lens(tuned=123)` raised a raw TypeError, `score_lines([1])` an AttributeError, a lone
    surrogate a TypeError in the tokenizer or a UnicodeEncodeError. Every public parameter, given each
    value of HOSTILE, either takes it (123 is a fine top_k) or refuses it with lmhead's own error, which
    names the parameter; never a Python error from inside."""
    from lmhead_cli.api import explore

    fn = dict(_public_functions())[name]
    args = {**VALID[name], param: value}
    if name in ("explore_reading", "explore_generate") and param != "settings":
        args["settings"] = explore.settings()
    if name == "tune_lens" and param in ("steps", "warmup"):
        args["steps"] = args["warmup"] = 1  # 123 training steps are a fine value: no need to run them
    try:
        got = (fn if "." in name else getattr(model, name))(**args)
        if name in ("score_lines", "inspect_lines"):
            list(got)  # lazy: the lines are read as the results are
    except BadValue as e:
        assert e.key in (param, "source" if param == "base" else param), (e.key, str(e))
    except LmheadError:
        pass


@pytest.mark.parametrize("call, key", [
    (lambda m: m.inspect(123), "prompt"),
    (lambda m: m.inspect(b"abc"), "prompt"),
    (lambda m: m.inspect(PROMPT, targets=[1]), "targets"),
    (lambda m: m.inspect(PROMPT, targets=None), "targets"),
    (lambda m: m.inspect(PROMPT, targets="abc"), "targets"),  # never the targets a, b and c
    (lambda m: m.inspect(PROMPT, top_k=1.5), "top_k"),
    (lambda m: m.inspect(PROMPT, top_k=float("nan")), "top_k"),
    (lambda m: m.inspect(PROMPT, top_k=True), "top_k"),
    (lambda m: m.inspect(PROMPT, stages="bogus"), "stages"),
    (lambda m: m.inspect(PROMPT, stages={"bogus": 1}), "stages"),
    (lambda m: m.inspect(PROMPT, stages={"temperature": "hot"}), "temperature"),
    (lambda m: m.inspect(PROMPT, stages=3), "stages"),
    (lambda m: m.generate(PROMPT, top_k=1.5), "top_k"),
    (lambda m: m.generate(PROMPT, top_k=float("nan")), "top_k"),
    (lambda m: m.generate(PROMPT, top_k=True), "top_k"),
    (lambda m: m.generate(PROMPT, max_new_tokens=1.5), "max_new_tokens"),
    (lambda m: m.generate(PROMPT, seed=1.5), "seed"),
    (lambda m: m.generate(PROMPT, temperature="hot"), "temperature"),
    (lambda m: m.generate(PROMPT, temperature=float("nan")), "temperature"),
    (lambda m: m.generate(PROMPT, greedy="no"), "greedy"),
    (lambda m: m.generate(PROMPT, mode="bogus"), "mode"),
    (lambda m: m.score("The keys are", chunk=1.5), "chunk"),
    (lambda m: m.score("The keys are", bos="no"), "bos"),
    (lambda m: m.score_lines("The keys are"), "lines"),
    (lambda m: m.inspect_lines(b"The keys"), "lines"),
    (lambda m: m.compare("The keys are", base=3), "base"),
    (lambda m: m.lens(PROMPT, position="-1"), "position"),
    (lambda m: lmhead_cli.load("random:gpt2", threads=1.5), "threads"),
    (lambda m: lmhead_cli.load(123), "source"),  # None is the default: gpt2, or bundled:tiny offline
    (lambda m: lmhead_cli.load("random:gpt2", device=0), "device"),
    (lambda m: lmhead_cli.api.toy(hidden=["a", 1, 2]), "hidden"),
    (lambda m: lmhead_cli.api.toy(hidden=5), "hidden"),
])
def test_the_issues_bad_values_raise_badvalue_naming_the_parameter(model, call, key):
    """Each case of issue 34 (class 7): no AttributeError, KeyError, tokenizer or torch error; a
    string is never split into characters, and no flag is read by its truthiness."""
    with pytest.raises(BadValue) as e:
        call(model)
    assert e.value.key == key


def test_bad_types_are_type_errors_and_bad_ranges_value_errors(model):
    from lmhead_cli.errors import BadType

    with pytest.raises(TypeError) as e:
        model.inspect(PROMPT, top_k=1.5)
    assert isinstance(e.value, BadType) and str(e.value) == "top_k must be an integer (got 1.5)"
    with pytest.raises(ValueError) as e:
        model.inspect(PROMPT, top_k=0)
    assert not isinstance(e.value, TypeError) and str(e.value) == "top_k must be at least 1 (got 0)"


def test_right_values_in_other_shapes_still_work(model):
    """A tuple or a generator of targets, a numpy integer, a preset name or a dict as stages: the same
    answers as the plain forms."""
    import numpy as np

    from lmhead_cli.api import checks

    plain = model.inspect(PROMPT, top_k=3, targets=[" are"]).to_dict()
    assert model.inspect(PROMPT, top_k=np.int64(3), targets=(t for t in [" are"])).to_dict() == plain
    as_dict = model.inspect(PROMPT, top_k=3, stages={"temperature": 0.7, "top_k": 2}).to_dict()
    assert as_dict == model.inspect(PROMPT, top_k=3, stages=checks.stages(temperature=0.7, top_k=2)).to_dict()
    assert model.inspect(PROMPT, stages="precise").to_dict() == model.inspect(PROMPT,
                                                                                stages=checks.stages("precise")).to_dict()
    assert lmhead_cli.api.toy(hidden=(1, 0, 1)) == lmhead_cli.api.toy()
    assert model.lens(PROMPT, position=None).to_dict() == model.lens(PROMPT).to_dict()  # None: the last token
