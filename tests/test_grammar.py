"""decoding/grammar.py: grammars checked and compiled with llguidance, one matcher per row, the mask as a
(V,) bool tensor. The oracles are independent of llguidance: `jsonschema` and `json` for schemas,
Python's `re` for patterns, and the tokenizer's own bytes for what a mask lets through."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lmhead_cli.decoding import grammar as G
from lmhead_cli.errors import BadValue, UsageError

EOS = 50256
V = 50257


@pytest.fixture(scope="module")
def tok():
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    return GPT2Tokenizer.bundled()


def walk(m: G.Matcher, tok, seed: int, steps: int = 200, vocab: int = V) -> tuple[str, bool]:
    """Draw uniformly among the allowed tokens until end-of-text: (the text, whether it ended)."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(steps):
        allowed = m.allowed()
        assert allowed.shape == (vocab,) and allowed.dtype == torch.bool
        choices = allowed.nonzero()[:, 0]
        assert len(choices) > 0
        t = int(choices[torch.randint(len(choices), (1,), generator=g)])
        if t == EOS:
            assert m.accepting
            return tok.decode(ids), True
        m.advance(t)
        ids.append(t)
    return tok.decode(ids), False


BOUNDED = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
           "properties": {"name": {"type": "string", "maxLength": 6},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["a", "b", True]}}}}


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_inside_a_schema_validate(tok, seed):
    jsonschema = pytest.importorskip("jsonschema")
    text, ended = walk(G.Matcher(G.from_json_schema(BOUNDED), tok, V, EOS), tok, seed)
    assert ended, text
    jsonschema.validate(json.loads(text), BOUNDED)


@pytest.mark.parametrize("seed", range(4))
def test_random_walks_inside_a_pattern_match_it_whole(tok, seed):
    pattern = r"(cat|dog)s? [0-9]{2,4}(, [a-z]{1,5}){0,3}\."
    text, ended = walk(G.Matcher(G.from_regex(pattern), tok, V, EOS), tok, seed)
    assert ended and re.fullmatch(pattern, text), text


def test_any_json_object_parses_as_an_object(tok):
    m = G.Matcher(G.from_json_object(), tok, V, EOS)
    first = m.allowed().nonzero()[:, 0].tolist()
    assert first and all(tok.decode([t]).startswith("{") for t in first)  # an object, nothing else
    text = ""
    for t in tok.encode('{"a": [1, {"b": null}], "c": "x"}'):
        assert m.allowed()[t], text
        m.advance(t)
        text += tok.decode([t])
    assert m.accepting and m.stopped and m.allowed().nonzero()[:, 0].tolist() == [EOS]
    assert isinstance(json.loads(text), dict)


def test_the_mask_holds_exactly_the_tokens_that_keep_the_text_a_prefix(tok):
    # after '{"n": ' only digits (and a minus) can follow; a token is allowed iff its bytes are some of them
    m = G.Matcher(G.from_json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                      "required": ["n"], "additionalProperties": False}), tok, V, EOS)
    for t in tok.encode('{"n": '):
        m.advance(t)
    allowed = set(m.allowed().nonzero()[:, 0].tolist())
    # by the tokenizer's bytes: a leading 0 ends the integer (JSON has no 01), then "}" may follow
    expect = {t for t in range(V) if re.fullmatch(rb"-?(0|[1-9][0-9]*)\}?|-", tok.token_bytes(t))}
    assert allowed and allowed <= expect
    assert {t for t in expect if re.fullmatch(rb"[1-9][0-9]*", tok.token_bytes(t))} <= allowed


def test_a_single_allowed_token_is_forced(tok):
    m = G.Matcher(G.from_json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                                      "required": ["name"], "additionalProperties": False}), tok, V, EOS)
    masks = []
    for t in tok.encode('{"name": "x"}'):
        masks.append(m.allowed())
        m.advance(t)
    masks.append(m.allowed())  # complete: only end-of-text
    both = torch.stack(masks)
    assert G.forced(both).tolist() == [int(x.sum()) == 1 for x in masks]
    assert G.forced(both)[0] and G.forced(both)[-1]  # '{"' opens the only object there is; EOS ends it
    assert masks[-1].nonzero()[:, 0].tolist() == [EOS]


def test_rows_move_on_their_own(tok):
    a = G.Matcher(G.from_regex("[0-9]+x"), tok, V, EOS)
    b = a.copy()
    one = tok.encode("1")[0]
    a.advance(one)
    assert not torch.equal(a.allowed(), b.allowed())
    b.advance(one)
    assert torch.equal(a.allowed(), b.allowed())
    c = G.Matcher(G.from_regex("[0-9]+x"), tok, V, EOS)  # a new row starts at the start
    assert not c.allowed()[tok.encode("x")[0]] and b.allowed()[tok.encode("x")[0]]


def test_rows_past_the_tokenizer_are_never_allowed(tok):
    m = G.Matcher(G.from_regex("[a-z ]+"), tok, 50304, EOS)
    allowed = m.allowed()
    assert allowed.shape == (50304,) and not allowed[V:].any() and allowed[:V].any()


def test_a_token_outside_the_mask_is_lmheads_error_not_the_users(tok):
    m = G.Matcher(G.from_regex("[0-9]+"), tok, V, EOS)
    with pytest.raises(RuntimeError, match="refused token"):
        m.advance(tok.encode("a")[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(json_schema={"type": "frobnicate"}), "json_schema is not a schema lmhead can follow: Invalid type: frobnicate"),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 2}),
     "json_schema is not a schema lmhead can follow: Unsatisfiable schema: minimum (5) is greater than maximum (2)"),
    (dict(json_schema={"type": "array", "uniqueItems": True}),
     'json_schema is not a schema lmhead can follow: Unimplemented keys: ["uniqueItems"]'),
    (dict(json_schema='{"type": '), "json_schema is not JSON: Expecting value: line 1 column 10 (char 9)"),
    (dict(json_schema=[1]), 'json_schema must be a JSON object (a schema such as {"type": "object"}), not an array'),
    (dict(json_schema={"type": "number", "maximum": float("nan")}),
     "json_schema is not JSON: Out of range float values are not JSON compliant"),
    (dict(regex="[a-z"), "regex is not a regular expression lmhead can follow: unclosed character class"),
    (dict(regex=r"(a)\1"), "regex is not a regular expression lmhead can follow: backreferences are not supported"),
    (dict(regex=""), "regex is empty: it would allow only the empty text"),
    (dict(regex=5), "regex must be a string (got a number)"),
    (dict(regex="a", json_object=True), "json_object and regex were both given; text follows one grammar"),
])
def test_bad_grammars_are_usage_errors_naming_the_problem(kwargs, message):
    with pytest.raises(BadValue) as e:
        G.make(**kwargs)
    assert str(e.value) == message and isinstance(e.value, UsageError) and e.value.exit_code == 2


def test_size_and_compile_time_are_bounded():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}}
    with pytest.raises(BadValue, match=r"json_schema is [\d,]+ bytes; lmhead compiles grammars of at most 131,072"):
        G.from_json_schema(big)
    with pytest.raises(BadValue, match="regex is 131,073 bytes"):
        G.from_regex("a" * (G.MAX_SOURCE_BYTES + 1))
    # a schema that takes ~0.1 s to check, against a bound of a millisecond
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{3,{i % 40 + 5}}}"}
                                             for i in range(1500)}}
    compiled = G.from_json_schema(slow).compiled
    import llguidance

    with pytest.raises(BadValue, match=r"json_schema took more than 0.001 s to compile, lmhead's bound"):
        G._bounded(lambda: llguidance.LLMatcher.validate_grammar(compiled, None), "json_schema", seconds=0.001)


def test_nothing_asked_is_no_grammar_and_an_empty_schema_is_one():
    assert G.make() is None
    g = G.make(json_schema={})
    assert g is not None and g.kind == "json_schema" and g.to_dict() == {"kind": "json_schema", "schema": {}}


def test_grammars_are_settings_values():
    a, b = G.from_json_schema({"type": "object"}), G.from_json_schema('{"type": "object"}')
    assert a == b and hash(a) == hash(b)  # the same schema, however given
    assert a != G.from_json_object() and G.from_regex("x").describe() == "regex 'x'"
    assert a.describe() == "JSON schema (18 bytes)" and G.from_json_object().describe() == "any JSON object"


def test_a_model_without_end_of_text_cannot_follow_a_grammar(tok):
    with pytest.raises(BadValue, match="needs the model's end-of-text token"):
        G.Matcher(G.from_regex("a"), tok, V, None)
