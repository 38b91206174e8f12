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
    (dict(regex="a\ud800"), "regex is not UTF-8 text: it holds a lone surrogate (U+D800) at character 1"),
    (dict(json_schema={"const": "\ud800"}),
     "json_schema is not UTF-8 text: it holds a lone surrogate (U+D800) at character 11"),
    (dict(regex="a", json_object=True), "json_object and regex were both given; text follows one grammar"),
])
def test_bad_grammars_are_usage_errors_naming_the_problem(kwargs, message):
    with pytest.raises(UsageError) as e:
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


# ---- the grammar as a stage of the step (decoding/batch.py), against transformers --------------------

SMALL = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def model(tiny):
    import lmhead_cli

    return lmhead_cli.load(str(tiny[0]))


def test_each_step_records_what_the_grammar_removed_against_transformers(tiny, model):
    """transformers' logits at every step, the mask replayed on a fresh matcher: the raw log p, the mass the
    grammar removed, the processed log p (temperature, the mask, then top-k, renormalised), what every stage
    removed, and forced exactly where one token was allowed."""
    g = model.generate("The keys on the table", json_schema=SMALL, seed=1, temperature=0.9, top_k=50,
                       max_new_tokens=80).reading
    assert g.stop == "eos" and g.steps[-1].id == EOS
    replay = G.Matcher(G.from_json_schema(SMALL), model.tokenizer, V, EOS)
    ids = list(g.prompt_ids)
    for st in g.steps:
        with torch.no_grad():
            z = tiny[1](torch.tensor([ids])).logits[0, -1].float()
        allowed = replay.allowed()
        raw = torch.log_softmax(z, -1)
        t = (z / 0.9).masked_fill(~allowed, float("-inf"))
        t = t.masked_fill(t < torch.topk(t, 50).values[-1], float("-inf"))
        lp = torch.log_softmax(t, -1)
        assert allowed[st.id]
        assert st.raw_logprob == pytest.approx(float(raw[st.id]), abs=1e-4)
        assert st.grammar_removed == pytest.approx(float(raw.exp()[~allowed].sum()), abs=1e-5)
        assert st.logprob == pytest.approx(float(lp[st.id]), abs=1e-4)
        assert st.removed_mass == pytest.approx(float(raw.exp()[~torch.isfinite(lp)].sum()), abs=1e-5)
        assert st.forced == (int(allowed.sum()) == 1)
        replay.advance(st.id)
        ids.append(st.id)
    assert any(st.forced for st in g.steps) and not all(st.forced for st in g.steps)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(g.text), SMALL)


def test_with_no_filter_the_filters_removed_nothing_to_the_bit(model):
    """A grammar and no filter: what every stage removed is what the grammar removed, to the last bit, so
    `--stages` says 0.00% for the filters, not a summation residue such as 6.0e-08."""
    g = model.generate("The keys", regex="[a-z]{2,6} [0-9]{1,3}", seed=4, max_new_tokens=20).reading
    assert g.steps and all(st.grammar_removed is not None for st in g.steps)
    assert [st.removed_mass - st.grammar_removed for st in g.steps] == [0.0] * len(g.steps)


def test_processed_logprobs_sum_to_one_over_the_allowed_tokens(model):
    g = model.generate("The keys", regex="[a-z]{2,6} [0-9]{1,3}", seed=4, max_new_tokens=20, logprobs="processed",
                       top_logprobs=V).reading
    assert g.stop == "eos" and re.fullmatch("[a-z]{2,6} [0-9]{1,3}", g.text)
    for st in g.steps:
        kept = torch.isfinite(st.top.logprobs)
        assert float(st.top.logprobs[kept].double().exp().sum()) == pytest.approx(1.0, abs=1e-5)
        assert int(kept.sum()) >= 1 and (int(kept.sum()) == 1) == st.forced
        assert st.grammar_removed > 0 and st.raw_prob < 1


def test_temperature_0_is_the_best_allowed_token(tiny, model):
    g = model.generate("The keys", json_schema=SMALL, temperature=0, max_new_tokens=40).reading
    replay = G.Matcher(G.from_json_schema(SMALL), model.tokenizer, V, EOS)
    ids = list(g.prompt_ids)
    for st in g.steps:
        with torch.no_grad():
            z = tiny[1](torch.tensor([ids])).logits[0, -1].float()
        assert st.id == int(z.masked_fill(~replay.allowed(), float("-inf")).argmax())
        replay.advance(st.id)
        ids.append(st.id)


def test_rows_without_a_grammar_are_what_they_are_alone(model):
    """Two requests in one decoder (the server's path), one with a grammar and one without: the free
    row's tokens and figures are those it has alone, and its steps carry no grammar figure."""
    from lmhead_cli.api.serving import Request
    from lmhead_cli.decoding.settings import make

    def steps(requests: dict) -> dict:
        decoder = model.decoder()
        for key, request in requests.items():
            decoder.submit(key, request)
        out: dict = {}
        for e in decoder.events():
            if e.kind == "token":
                out.setdefault(e.key, []).append(e.token.step)
        return out

    ids = [model.encode("The keys on the table")]
    free = Request.of(make(seed=5), ids, 12, eos=EOS)
    ruled = Request.of(make(seed=5, json_schema=SMALL), ids, 12, eos=EOS)
    both, alone = steps({"ruled": ruled, "free": free}), steps({"free": free})
    assert [s.id for s in both["free"]] == [s.id for s in alone["free"]]
    assert [s.logprob for s in both["free"]] == pytest.approx([s.logprob for s in alone["free"]], abs=1e-5)
    assert all(s.grammar_removed is None and not s.forced for s in both["free"])
    assert all(s.grammar_removed is not None for s in both["ruled"])


def test_a_grammar_refuses_beams_and_ignore_eos(model):
    with pytest.raises(BadValue, match=r"json_schema is followed by greedy and sampled text; beam search \(beams 2\)"):
        model.generate("x", json_schema=SMALL, beams=2)
    with pytest.raises(BadValue, match="ignore_eos cannot go with a grammar"):
        model.generate("x", regex="a+", ignore_eos=True)


def test_a_text_cut_short_is_not_called_complete(model):
    result = model.generate("x", json_schema=SMALL, seed=0, max_new_tokens=3)
    doc = result.to_dict()
    assert doc["stop"] == "max_new_tokens" and doc["grammar_complete"] is False
    assert doc["settings"]["grammar"] == {"kind": "json_schema", "schema": SMALL}
    assert {"grammar_removed", "forced"} <= set(doc["steps"][0])
    done = model.generate("x", json_schema=SMALL, seed=0, max_new_tokens=60).to_dict()
    assert done["stop"] == "eos" and done["grammar_complete"] is True
    free = model.generate("x", seed=0, max_new_tokens=2).to_dict()
    assert free["grammar_complete"] is None and "forced" not in free["steps"][0]


# ---- the command line ---------------------------------------------------------------------------------

def test_generate_json_schema_stages_shows_the_grammar_stage(tiny, tmp_path):
    from helpers import cli

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SMALL))
    got = cli("generate", "x", "--json-schema", str(path), "--stages", "--seed", "2", "-n", "60", "--model", str(tiny[0]))
    assert got.exit_code == 0, got.output
    d = cli("generate", "x", "--json-schema", str(path), "--seed", "2", "-n", "60", "--json", "--model", str(tiny[0]))
    steps = json.loads(d.stdout)["steps"]
    out = got.stdout
    assert "grammar removed" in out and "forced" in out and "grammar: JSON schema (" in out
    rows = [ln for ln in out.splitlines() if re.match(r"\s+\d+ │", ln)]
    assert len(rows) == len(steps)
    for line, st in zip(rows, steps):  # the column holds each step's removed mass, as the JSON has it
        cells = [c.strip() for c in line.split("│")]
        p = st["grammar_removed"]
        assert cells[3] == (f"{p:.2%}" if p >= 1e-4 or p == 0 else f"{p:.1e}")
        assert (cells[4] == "forced") == st["forced"]
    mean = sum(st["grammar_removed"] for st in steps) / len(steps)
    assert f"the grammar removed {mean:.2%} of the raw probability per step on average; it forced " \
           f"{sum(st['forced'] for st in steps)} of {len(steps)} tokens" in out


@pytest.mark.parametrize("args, code, needle", [
    (["--regex", "[a-z"], 2, "--regex is not a regular expression lmhead can follow: unclosed character class"),
    (["--json-schema", "SCHEMA", "--regex", "a"], 2, "--regex and --json-schema were both given"),
    (["--json-schema", "BAD"], 2, "--json-schema is not a schema lmhead can follow: Invalid type: frobnicate"),
    (["--json-schema", "NOPE"], 2, "no such JSON schema file: "),
    (["--json-schema", "SCHEMA", "--beams", "2"], 2, "beam search (beams 2) does not follow a grammar"),
])
def test_bad_grammar_options_exit_2_with_one_line(tmp_path, args, code, needle):
    from helpers import invoke, one_line

    (tmp_path / "s.json").write_text(json.dumps(SMALL))
    (tmp_path / "bad.json").write_text('{"type": "frobnicate"}')
    paths = {"SCHEMA": str(tmp_path / "s.json"), "BAD": str(tmp_path / "bad.json"), "NOPE": str(tmp_path / "nope.json")}
    got = invoke(["generate", "x", *[paths.get(a, a) for a in args], "--model", "random:gpt2"])
    one_line(got, code, needle)


def test_a_cut_short_text_says_so_on_stderr(tiny, tmp_path):
    from helpers import cli

    got = cli("generate", "x", "--regex", "[a-z]{20}", "-n", "3", "--seed", "0", "--model", str(tiny[0]))
    assert got.exit_code == 0, got.output
    assert "the text ended at --max-new-tokens before the regex '[a-z]{20}' was complete: it does not follow it" \
        in got.stderr


# ---- explore's :schema and :regex ----------------------------------------------------------------

def test_explore_schema_rules_gen_and_off_frees_it(tiny, tmp_path):
    from helpers import cli

    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    script = f"The keys\n:schema {path}\n:seed 2\n:gen 60\n:schema off\n:gen 3\n:regex [0-9]+\n:gen 2\n"
    got = cli("explore", "--model", str(tiny[0]), input=script)
    assert got.exit_code == 0, got.output
    said = " ".join(got.output.split())  # the settings and :gen's summary, however wrapped
    assert ":gen follows the JSON schema (" in said
    lines = got.stdout.splitlines()
    ruled = next(ln for ln in lines if ln.startswith("The keys{"))
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(ruled[len("The keys"):]), SMALL)
    assert re.search(r"stop: eos, the JSON schema \(\d+ bytes\) complete", said)
    assert "cut short: it does not follow the regex '[0-9]+'" in said
    digits = [ln for ln in lines if ln.startswith("The keys") and ln != ruled][-1]
    assert re.fullmatch(r"The keys[0-9]+", digits), digits


def test_explore_bad_grammars_are_one_line_and_the_session_goes_on(tiny, tmp_path):
    from helpers import cli

    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "frobnicate"}')
    got = cli("explore", "--model", str(tiny[0]), input=f"The keys\n:schema {bad}\n:regex '(a)\\1'\n:schema nope.json\n:gen 2\n")
    assert got.exit_code == 0, got.output
    said = " ".join(got.output.split())
    assert ":schema is not a schema lmhead can follow: Invalid type: frobnicate" in said
    assert ":regex is not a regular expression lmhead can follow: backreferences are not supported" in said
    assert "no such JSON schema file: nope.json" in said and "2 tokens sampled" in said


# ---- what docs/serve.md says llguidance does not implement -------------------------------------------

UNSUPPORTED = {
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "minContains": {"type": "array", "contains": {"type": "integer"}, "minContains": 2},
    "maxContains": {"type": "array", "contains": {"type": "integer"}, "maxContains": 2},
    "if": {"if": {"type": "string"}, "then": {"maxLength": 3}, "else": {"type": "integer"}},
    "dependentSchemas": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 3}},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
    "unevaluatedItems": {"type": "array", "unevaluatedItems": False},
    "not": {"not": {"type": "string"}},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "$ref": {"$ref": "https://example.com/schema.json"},
    "pattern": {"type": "string", "pattern": "(?=a)a"},
    "format": {"type": "string", "format": "frobnicate"},
}
FOLLOWED = {
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "$ref": {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"},
    "format": {"type": "string", "format": "email"},
}


@pytest.mark.parametrize("keyword", list(UNSUPPORTED))
def test_the_unsupported_schema_features_docs_serve_lists_are_refused(keyword):
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "serve.md").read_text(encoding="utf-8")
    table = page[page.index("## Structured output"):page.index("## Extension fields")]
    assert f"`{keyword}`" in table
    with pytest.raises(BadValue, match="is not a schema lmhead can follow"):
        G.from_json_schema(UNSUPPORTED[keyword])
    if keyword in FOLLOWED:  # the row's other half: what is followed
        G.from_json_schema(FOLLOWED[keyword])
    if keyword == "format":
        for name in ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"):
            assert f"`{name}`" in table
            G.from_json_schema({"type": "string", "format": name})
