"""Structured output: a JSON schema, any JSON object or a regular expression as a mask over the vocabulary.

llguidance (the library llama.cpp and vLLM use for this) compiles the grammar and walks it; lmhead
only asks it, at each step of a row, which tokens may come next, and tells it the token chosen:

    Grammar   what was asked (kind and source), checked and compiled once, with no model: frozen and
              hashable, so it rides in the decoding settings and a row like any other setting
    Matcher   one row's place in its grammar: `allowed()` the tokens that may come next, a (V,) bool
              tensor over the model's vocabulary; `advance(token)` after the choice; `forced` where
              a single token is allowed

A row without a grammar has no Matcher and pays nothing. The tokenizer bridge is llguidance's own
reading of a `tokenizers` JSON (what llguidance.hf does with a transformers tokenizer, without
transformers), built once per tokenizer, vocabulary size and end-of-text token.

JSON is written without optional white space (`{"a": 1, "b": [2, 3]}`: ", " and ": " as Python's
json.dumps, nothing else), so a model cannot spend its tokens on blanks and every step that has
only one way to go is a forced one. Compile time is bounded twice: llguidance's own fuel limits
(LIMITS) and a wall-clock bound (COMPILE_SECONDS) past which the grammar is refused; the source is
at most MAX_SOURCE_BYTES. Nothing here prints (llguidance's log is off: its warnings would go to stderr).
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmhead_cli.errors import BadValue, Param, UsageError

if TYPE_CHECKING:
    import torch

KINDS = ("json_schema", "json_object", "regex")
MAX_SOURCE_BYTES = 1 << 17  # 128 KiB of schema or pattern: ~3,000 properties, compiled in ~0.4 s here
COMPILE_SECONDS = 5.0  # a grammar whose checks take longer is refused (the thread is left to end by itself)
SEPARATORS = (", ", ": ")  # JSON's item and key separators, as json.dumps writes them; no other white space
_TOKENIZERS_KEPT = 4  # llguidance tokenizers kept (one per tokenizer, vocabulary size and end-of-text)
_TEMPLATES_KEPT = 16  # compiled matchers kept, each a row's starting point (a deep copy is cheaper than a compile)


def _limits():
    """llguidance's resource limits (its defaults, named here so the bound is visible): fuel for the
    lexer's construction (~50k a ms) and each step's (~14k a ms), Earley items a step, lexer states,
    grammar symbols."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                                     max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)


@dataclass(frozen=True)
class Grammar:
    """A checked grammar: `kind` (json_schema, json_object or regex), `source` (the schema as JSON
    text, the pattern, or "" for any object) and llguidance's compiled form (what a Matcher starts from)."""

    kind: str
    source: str
    compiled: str = field(repr=False, compare=False)

    def describe(self) -> str:
        """For people: 'JSON schema (212 bytes)', 'any JSON object', "regex '[0-9]+'"."""
        if self.kind == "json_object":
            return "any JSON object"
        if self.kind == "regex":
            shown = self.source if len(self.source) <= 60 else self.source[:59] + "…"
            return f"regex {shown!r}"
        return f"JSON schema ({len(self.source.encode()):,} bytes)"

    def to_dict(self) -> dict:
        """The JSON document's form: {"kind": ..., "schema": {...}} / {"regex": "..."} / {}."""
        if self.kind == "json_schema":
            return {"kind": self.kind, "schema": json.loads(self.source)}
        if self.kind == "regex":
            return {"kind": self.kind, "regex": self.source}
        return {"kind": self.kind}


def from_json_schema(schema: Any, key: str = "json_schema") -> Grammar:
    """A Grammar for JSON that `schema` (a dict, or JSON text of one) validates. BadValue(key) names
    what is wrong: not a JSON object, too large, a feature llguidance does not implement, a schema no
    value satisfies, or one that takes longer than COMPILE_SECONDS to check."""
    if isinstance(schema, (str, bytes)):
        if len(schema) > MAX_SOURCE_BYTES:
            raise _too_large(key, len(schema))
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise BadValue(key, f"is not JSON: {_first_line(e)}") from None
    if not isinstance(schema, dict):
        raise BadValue(key, f"must be a JSON object (a schema such as {{\"type\": \"object\"}}), not "
                            f"{_json_type(schema)}")
    try:
        source = json.dumps(schema, allow_nan=False, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError) as e:
        raise BadValue(key, f"is not JSON: {_first_line(e)}") from None
    if len(_utf8(source, key)) > MAX_SOURCE_BYTES:
        raise _too_large(key, len(_utf8(source, key)))
    return _compiled("json_schema", source, key)


def from_json_object() -> Grammar:
    """Any JSON object (OpenAI's response_format json_object): the schema {"type": "object"}."""
    return _compiled("json_object", "", "response_format")


def from_regex(pattern: Any, key: str = "regex") -> Grammar:
    """A Grammar for text that `pattern` matches whole (Rust's regex syntax: no look-around, no
    back-references). BadValue(key) names what is wrong."""
    if not isinstance(pattern, str):
        raise BadValue(key, f"must be a string (got {_json_type(pattern)})")
    if not pattern:
        raise BadValue(key, "is empty: it would allow only the empty text")
    if len(_utf8(pattern, key)) > MAX_SOURCE_BYTES:
        raise _too_large(key, len(_utf8(pattern, key)))
    return _compiled("regex", pattern, key)


def make(*, json_schema: Any = None, regex: Any = None, json_object: bool = False) -> Grammar | None:
    """The Grammar asked for by keyword, or None; at most one of the three (BadValue otherwise)."""
    asked = [k for k, v in (("json_schema", json_schema), ("regex", regex), ("json_object", json_object or None))
             if v is not None]
    if len(asked) > 1:
        e = UsageError(Param(asked[1]), " and ", Param(asked[0]), " were both given; text follows one grammar")
        e.key = asked[1]
        raise e
    if not asked:
        return None
    return from_json_object() if asked[0] == "json_object" else \
        from_json_schema(json_schema) if asked[0] == "json_schema" else from_regex(regex)


def _compiled(kind: str, source: str, key: str) -> Grammar:
    """Compile with llguidance and check the result with no tokenizer, in at most COMPILE_SECONDS."""
    import llguidance

    if kind == "regex":
        compiled = llguidance.LLMatcher.grammar_from_regex(source)
    else:
        options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(source or '{"type": "object"}',
                                                                     overrides=options)
        except (ValueError, TypeError) as e:
            raise BadValue(key, f"is not a schema lmhead can follow: {_first_line(e)}") from None
    problem = _bounded(lambda: llguidance.LLMatcher.validate_grammar(compiled, None, limits=_limits()), key)
    if problem:
        raise BadValue(key, f"is not a {'regular expression' if kind == 'regex' else 'schema'} lmhead can follow: "
                            f"{_reason(problem)}")
    return Grammar(kind, source, compiled)


def _bounded(work, key: str, seconds: float | None = None):
    """work() on a thread of its own (llguidance drops the GIL while it compiles), its result, or
    BadValue(key) once it has taken `seconds` (COMPILE_SECONDS): the thread is left to end by itself,
    its result dropped, as llguidance's fuel limits bound it too."""
    seconds = COMPILE_SECONDS if seconds is None else seconds
    box: list = []

    def run() -> None:
        try:
            box.append((True, work()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box.append((False, e))

    worker = threading.Thread(target=run, name="lmhead-grammar", daemon=True)
    worker.start()
    worker.join(seconds)
    if not box:
        raise BadValue(key, f"took more than {seconds:g} s to compile, lmhead's bound; a smaller schema "
                            "(fewer properties, shorter patterns, fewer alternatives) compiles faster")
    ok, value = box[0]
    if not ok:
        raise value
    return value


# ---- the tokenizer bridge and the per-row matcher ---------------------------------------------

_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple, tuple] = {}  # (id(tok), V, eos) -> (tok, LLTokenizer): tok held so its id stays its own
_TEMPLATES: dict[tuple, Any] = {}  # (compiled, id(LLTokenizer)) -> LLMatcher at the grammar's start


def ll_tokenizer(tokenizer, vocab_size: int, eos: int):
    """llguidance's tokenizer for lmhead's `tokenizer` (loading.tokenizer, its `tokenizers` Tokenizer in
    `.tok`), over the model's `vocab_size` rows (ids past the tokenizer's are never allowed), ending at
    `eos`. Built once (~0.2 s for GPT-2) and kept."""
    import llguidance

    tok = tokenizer.tok
    key = (id(tok), vocab_size, eos)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
    if hit is not None:
        return hit[1]
    ll = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    with _LOCK:
        while len(_TOKENIZERS) >= _TOKENIZERS_KEPT:
            del _TOKENIZERS[next(iter(_TOKENIZERS))]
        _TOKENIZERS[key] = (tok, ll)
    return ll


def _template(grammar: Grammar, ll, key: str):
    """The grammar's matcher at its start for `ll`, compiled once (rows take deep copies)."""
    import llguidance

    k = (grammar.compiled, id(ll))
    with _LOCK:
        m = _TEMPLATES.get(k)
    if m is None:
        m = _bounded(lambda: llguidance.LLMatcher(ll, grammar.compiled, log_level=0, limits=_limits()), key)
        if m.is_error():
            raise BadValue(key, f"cannot be followed with this model's tokenizer: {_reason(m.get_error())}")
        with _LOCK:
            while len(_TEMPLATES) >= _TEMPLATES_KEPT:
                del _TEMPLATES[next(iter(_TEMPLATES))]
            _TEMPLATES[k] = (m, ll)
    else:
        m = m[0]
    return m


class Matcher:
    """One row's place in its grammar.

    `allowed()` gives the tokens that may come next, (V,) bool; `advance(token)` moves past the token
    chosen. Once the structure is complete the grammar allows only end-of-text (`stopped`);
    `accepting` says whether the text so far is whole (a valid document, a full match)."""

    __slots__ = ("grammar", "vocab_size", "_m", "_words")

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int, eos: int | None, key: str = "grammar"):
        import torch

        if eos is None:
            raise BadValue(key, "needs the model's end-of-text token to end the text, and this model has none")
        self.grammar, self.vocab_size = grammar, vocab_size
        self._m = _template(grammar, ll_tokenizer(tokenizer, vocab_size, eos), key).deep_copy()
        self._words = torch.empty(((vocab_size + 31) // 32,), dtype=torch.int32)  # llguidance's bitmask

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: (V,) bool on the CPU (~20 µs for GPT-2's 50,257)."""
        import torch

        self._m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        bits = (self._words[:, None] >> _shifts()) & 1  # (V/32, 32): bit b of word w is token 32w + b
        return bits.view(-1)[:self.vocab_size].bool()

    def advance(self, token: int) -> None:
        """Move past `token` (one the mask allowed). A token it did not allow is a RuntimeError: the
        caller chose outside the mask, which is lmhead's error, not the user's."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token} after allowing it: {_reason(self._m.get_error())}")

    @property
    def accepting(self) -> bool:
        """The text so far is complete under the grammar (a whole document, a full match)."""
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing more can follow but end-of-text."""
        return self._m.is_stopped()

    def copy(self) -> Matcher:
        twin = object.__new__(Matcher)
        twin.grammar, twin.vocab_size = self.grammar, self.vocab_size
        twin._m, twin._words = self._m.deep_copy(), self._words.clone()
        return twin


def forced(allowed: torch.Tensor) -> torch.Tensor:
    """(R, V) bool -> (R,) bool: rows where the grammar allows exactly one token."""
    return allowed.sum(-1) == 1


@functools.cache
def _shifts() -> torch.Tensor:
    """(32,) int32: the bit positions of a mask word."""
    import torch

    return torch.arange(32, dtype=torch.int32)


# ---- messages ---------------------------------------------------------------------------------

def _utf8(text: str, key: str) -> bytes:
    """The text's UTF-8 bytes; BadValue(key) for a lone surrogate (no UTF-8 text holds one)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadValue(key, f"is not UTF-8 text: it holds a lone surrogate (U+{ord(text[e.start]):04X}) at "
                            f"character {e.start:,}") from None


def _too_large(key: str, n: int) -> BadValue:
    return BadValue(key, f"is {n:,} bytes; lmhead compiles grammars of at most {MAX_SOURCE_BYTES:,} bytes")


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def _reason(message: str) -> str:
    """llguidance's message, made one line: a regex parse error spans lines (where, the pattern, a caret,
    `error: ...`); its `error:` line says what is wrong."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines:
        return "llguidance gave no reason"
    error = next((ln for ln in lines if ln.startswith("error:")), None)
    return (error[len("error:"):].strip() if error else lines[0])[:300]
