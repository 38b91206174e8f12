"""Every door gives the same error for the same bad decoding value: the registry's (decoding/stages.py,
`checked`: the value's type, then its range, naming the value given and what it must be).

The cases come from the registry itself: for each setting a value below and above its bounds, a value of
the wrong type (text; 1.5 where an integer goes), NaN and infinity where a number goes, and a bool.
The doors: `Model.generate`'s keywords, the command line's options (generate, explore), a presets
file, the OpenAI fields of both endpoints, and explore's :temp, :softcap, :seed and :gen.
"""

from __future__ import annotations

import json
import math

import pytest

from helpers import PROMPT, cli, serving, web

import lmhead_cli
from lmhead_cli.decoding.stages import SETTINGS, STAGES, checked, from_text
from lmhead_cli.errors import BadValue


def bad_values(key: str) -> list[tuple[str, object]]:
    """(kind, value) for each kind of bad value the setting `key` can be given, from its registry entry."""
    s = SETTINGS[key]
    bounds = s.rule.bounds()
    low = bounds.get("ge", bounds.get("gt"))
    high = bounds.get("le", bounds.get("lt"))
    out = [("below", low - 1)] if low is not None else []
    out += [("above", high + 1)] if high is not None else []
    out += [("text", "hot"), ("bool", True)]
    out += [("fraction", 1.5)] if s.type is int else [("nan", math.nan), ("inf", math.inf)]
    return out


def expected(key: str, value) -> BadValue:
    """The registry's own error for `value`."""
    with pytest.raises(BadValue) as e:
        checked(key, value)
    return e.value


def cases(keys, skip=()) -> list:
    return [pytest.param(k, v, id=f"{k}-{kind}") for k in keys for kind, v in bad_values(k) if kind not in skip]


def test_the_cases_are_refused_by_the_registry_naming_the_value_and_the_range():
    for key in SETTINGS:
        for kind, value in bad_values(key):
            e = expected(key, value)
            assert e.key == key and (f"(got {value!r})" in str(e) or f"(got {value})" in str(e)), str(e)
            if kind in ("below", "above", "nan", "inf"):
                assert f"must be {SETTINGS[key].rule.must}" in str(e)


# ---- the API's keywords ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny):
    return lmhead_cli.load(str(tiny[0]), device="cpu")


@pytest.mark.parametrize("key, value", cases(SETTINGS))
def test_the_api_keyword(model, key, value):
    with pytest.raises(BadValue) as e:
        model.generate(PROMPT, **{"max_new_tokens": 1, key: value})
    assert (e.value.key, str(e.value)) == (key, str(expected(key, value)))


# ---- the command line: generate's options, explore's start-up options ------------------------------

def as_text(value) -> str:
    """What a person types for `value`: the text that spells the number (from_text reads it back)."""
    text = value if isinstance(value, str) else repr(value)
    assert type(from_text(text)) is type(value) and (from_text(text) == value or value != value)
    return text


CLI_KEYS = [s.key for s in STAGES] + ["seed", "max_new_tokens", "beams", "show_steps", "top_logprobs"]


@pytest.mark.parametrize("key, value", cases(CLI_KEYS, skip=("bool",)))  # a bool is text on a command line
def test_the_command_line_option(key, value):
    extra = ["--format", "openai"] if key == "top_logprobs" else []
    got = cli("generate", PROMPT, SETTINGS[key].option, as_text(value), *extra, "--model", "random:gpt2")
    assert got.exit_code == 2
    assert got.stderr == f"lmhead: error: {expected(key, value).spelled(SETTINGS[key].option)}\n"


@pytest.mark.parametrize("key, value", cases(["temperature", "softcap"], skip=("bool",)))
def test_explores_start_up_option(key, value):
    got = cli("explore", SETTINGS[key].option, as_text(value), "--model", "random:gpt2", input="")
    assert got.exit_code == 2
    assert got.stderr == f"lmhead: error: {expected(key, value).spelled(SETTINGS[key].option)}\n"


# ---- a presets file ---------------------------------------------------------------------------------

def toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return {math.inf: "inf"}.get(value, "nan" if value != value else repr(value))


@pytest.mark.parametrize("key, value", cases([k for k, s in SETTINGS.items() if s.preset]))
def test_a_presets_file(tmp_path, key, value):
    path = tmp_path / "mine.toml"
    path.write_text(f"{key} = {toml(value)}\n")
    got = cli("generate", PROMPT, "--preset", str(path), "--model", "random:gpt2")
    assert got.exit_code == 2
    assert got.stderr == f"lmhead: error: preset 'mine' in {path}: {expected(key, value)}\n"


# ---- the server's OpenAI fields ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny):
    with serving(tiny[0]) as s:
        yield s


def body_text(body: dict, key: str, value) -> str:
    """The JSON text of `body` with `value` at `key`: infinity as 1e999 (JSON has no literal for it; a
    number past a double's range reads as inf). NaN has no JSON at all: the door refuses it first."""
    if value == math.inf:
        return json.dumps(body)[:-1] + f', "{key}": 1e999}}'
    return json.dumps({**body, key: value})


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("key, value", cases([s.key for s in STAGES] + ["seed", "n"], skip=("nan",)))
def test_the_openai_field(server, endpoint, key, value):
    body = {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    got = web.post(server.url + endpoint, content=body_text({**body, "max_tokens": 1}, key, value),
                   headers={"content-type": "application/json"}, timeout=60)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (error["param"], error["message"], error["type"]) == (key, str(expected(key, value)), "invalid_request_error")


@pytest.mark.parametrize("endpoint, param", [("/v1/completions", "logprobs"), ("/v1/chat/completions", "top_logprobs")])
@pytest.mark.parametrize("key, value", cases(["top_logprobs"]))
def test_the_openai_top_tokens_field(server, endpoint, param, key, value):
    """Completions' logprobs and chat's top_logprobs are the registry's top_logprobs (its upper bound, the
    vocabulary or --max-logprobs, is the server's)."""
    body = ({"prompt": "x"} if endpoint == "/v1/completions"
            else {"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    got = web.post(server.url + endpoint, json={**body, "max_tokens": 1, param: value}, timeout=60)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (error["param"], error["message"]) == (param, expected(key, value).spelled(param))


def test_openapi_documents_every_registry_field_from_the_registry(server):
    schema = web.get(server.url + "/openapi.json").json()["components"]["schemas"]
    for model in ("CompletionRequest", "ChatRequest"):
        props = schema[model]["properties"]
        top = "logprobs" if model == "CompletionRequest" else "top_logprobs"  # the registry's top_logprobs
        for key, name in [(s.key, s.key) for s in STAGES] + [("seed", "seed"), ("n", "n"), ("top_logprobs", top)]:
            s = SETTINGS[key]
            field = props[name]
            typed = next(t for t in field["anyOf"] if t["type"] != "null")
            assert typed["type"] == ("integer" if s.type is int else "number"), key
            names = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
            # FastAPI's OpenAPI models hold bounds as floats: seed's 2**63 - 1 shows as 9.223372036854776e+18
            assert {k: v for k, v in typed.items() if k != "type"} == {names[k]: float(v) for k, v in s.rule.bounds().items()}
            assert field.get("default") == (None if key == "top_logprobs" else s.default)  # FastAPI leaves null out
            assert (s.help if name == key else "Top tokens per position") in field["description"]
            assert s.rule.must in field["description"]


# ---- explore's :commands ----------------------------------------------------------------------------

EXPLORE = {"temperature": ":temp", "softcap": ":softcap", "seed": ":seed", "max_new_tokens": ":gen"}


@pytest.fixture(scope="module")
def explore_errors(tiny) -> list[str]:
    """One piped session with every bad value of EXPLORE's settings, one line each: its error lines."""
    lines = ["The keys on the table"] + [f"{EXPLORE[k]} {as_text(v)}" for k in EXPLORE
                                         for kind, v in bad_values(k) if kind != "bool"]
    got = cli("explore", "--model", str(tiny[0]), input="\n".join(lines) + "\n:quit\n")
    assert got.exit_code == 0, got.output
    return [line for line in got.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("key, value", cases(EXPLORE, skip=("bool",)))
def test_explores_command(explore_errors, key, value):
    assert f"error: {expected(key, value).spelled(EXPLORE[key])}" in explore_errors


# ---- which distribution the logprobs come from: raw or processed (decoding.settings.make's check) -----

@pytest.mark.parametrize("value", ["cooked", 5])
def test_the_logprobs_distribution_is_refused_alike(model, server, value):
    from lmhead_cli.decoding.settings import make

    with pytest.raises(BadValue) as want:
        make(logprobs=value)
    with pytest.raises(BadValue) as e:
        model.generate(PROMPT, max_new_tokens=1, logprobs=value)
    assert str(e.value) == str(want.value)
    got = web.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs_mode": value},
                   timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == "logprobs_mode"
    assert got.json()["error"]["message"] == want.value.spelled("logprobs_mode")
    if isinstance(value, str):
        got = cli("generate", PROMPT, "--format", "openai", "--logprobs", value, "--model", "random:gpt2")
        assert (got.exit_code, got.stderr) == (2, f"lmhead: error: {want.value.spelled('--logprobs')}\n")
