"""`lmhead serve` with response_format: a real server on 127.0.0.1 (bundled:tiny, a trained model; and for
any JSON object a tiny model built to close what it opens, since bundled:tiny never writes '"'), the
official `openai` client, and `jsonschema` and `json` as the oracles of every answer."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers import serving, web

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "bounded": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                               "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["colour", "ok"],
             "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    "array": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "integer", "minimum": -999, "maximum": 999}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["person", "tags"],
               "properties": {"person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                                         "properties": {"name": {"type": "string", "maxLength": 8},
                                                        "age": {"type": "integer", "minimum": 1, "maximum": 99}}},
                              "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}},
}


@pytest.fixture(scope="module")
def server():
    with serving("bundled:tiny") as s:
        yield s


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(served, path: str, body) -> httpx.Response:
    return web.post(served.url + path, json=body, timeout=120)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_chat_answers_validate_against_their_schema(server, name, seed):
    schema = SCHEMAS[name]
    r = client(server).chat.completions.create(
        model="bundled:tiny", messages=[{"role": "user", "content": "Describe a person of the Bible."}],
        temperature=1, seed=seed, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content  # ended at end-of-text, the structure complete
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_completions_take_response_format_too(server):
    schema = SCHEMAS["enum"]
    r = post(server, "/v1/completions", {"prompt": "And the LORD said", "max_tokens": 40, "seed": 3,
                                         "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)


def test_an_answer_cut_short_says_length_and_is_not_passed_off_as_whole(server):
    # bundled:tiny learnt the King James Bible, which has no '"': any JSON object opens a key and never
    # closes it, so every json_object answer it gives runs out of tokens inside the structure
    r = client(server).chat.completions.create(
        model="bundled:tiny", messages=[{"role": "user", "content": "hi"}], seed=0, max_tokens=12,
        response_format={"type": "json_object"})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.fixture(scope="module")
def closer(tmp_path_factory):
    """A server on a tiny random GPT-2 built to close what it opens: every position's final vector is one
    direction b (ln_f's gain 0, its bias b), and the head's rows of '":', '"', '}', '1' and ' 1' are 10·b,
    so those tokens hold most of the probability wherever the grammar allows them."""
    import torch

    from helpers import build_checkpoint
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    folder = tmp_path_factory.mktemp("closer")
    model = build_checkpoint(folder, tied=False, seed=4)
    tok = GPT2Tokenizer.bundled()
    with torch.no_grad():
        b = torch.randn(64, generator=torch.Generator().manual_seed(0))
        b /= b.norm()
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(b)
        for text in ('":', '"', "}", "1", " 1"):
            model.lm_head.weight[tok.encode(text)[0]] = 10 * b
    model.save_pretrained(folder)
    with serving(folder) as s:
        yield s


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_object_answers_parse_as_an_object(closer, seed):
    r = client(closer).chat.completions.create(
        model="closer", messages=[{"role": "user", "content": "hi"}], temperature=1, seed=seed, max_tokens=60,
        response_format={"type": "json_object"})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
     "response_format.json_schema.schema is not a schema lmhead can follow: Invalid type: frobnicate"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     'response_format.json_schema.schema is not a schema lmhead can follow: Unimplemented keys: ["uniqueItems"]'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}},
     "response_format.json_schema.schema is not a schema lmhead can follow: Unsatisfiable schema: minimum (3) is "
     "greater than maximum (1)"),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     'response_format.json_schema.schema is required with type json_schema: {"type": "json_schema", "json_schema": '
     '{"name": ..., "schema": {...}}}'),
    ({"type": "xml"}, "response_format.type must be 'text', 'json_object' or 'json_schema' (got 'xml')"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_schema_the_library_rejects_is_a_400_naming_the_problem(server, path, response_format, message):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = post(server, path, {**body, "max_tokens": 4, "response_format": response_format})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {"message": message, "type": "invalid_request_error", "param": "response_format",
                   "code": "invalid_value"}


def test_openapi_declares_response_format_in_both_request_models(server):
    schema = web.get(server.url + "/openapi.json").json()
    models = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatRequest"):
        assert "response_format" in models[name]["properties"], name
    assert set(models["ResponseFormat"]["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}
    assert "schema" in models["JsonSchemaFormat"]["properties"]
