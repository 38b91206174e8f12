"""One decoding request's settings: the stages (Knobs, one field per entry of the registry) and the
loop's own settings beside them, checked once, in `make`, with the registry's rules and advice.

Every door converts into it in one function:

    the command line and the API's keywords  resolve(mode=..., preset=..., **values)
    a preset (read by api/presets.py)         its values, a layer of resolve
    an OpenAI request body (lmhead serve)     from_openai(values)
    explore's :gen                            make(...) with the session's stages

and every door means the same by the same value: `temperature 0` is greedy (the temperature stage
off, the most likely token every step; the settings say `greedy`), and a stage's `off` values (top-k
0 or -1, as vLLM) turn it off. No torch here: the command line checks values before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmhead_cli.decoding import stages
from lmhead_cli.decoding.stages import SETTINGS, STAGES, Knobs
from lmhead_cli.errors import BadType, BadValue, ModeConflict

if TYPE_CHECKING:
    from lmhead_cli.decoding.grammar import Grammar

DEFAULT_MAX_NEW_TOKENS = SETTINGS["max_new_tokens"].default
DISTRIBUTIONS = ("raw", "processed")  # which one top_logprobs (and the OpenAI document) reports
MAX_STOPS = 16  # stop strings in one request


@dataclass(frozen=True)
class Settings:
    """Everything that decides the tokens (with the model, the prompt and the device)."""

    knobs: Knobs = field(default_factory=Knobs)  # the stages, one field per entry of STAGES
    greedy: bool = False
    # the loop's settings: their defaults are the registry's (decoding/stages.py LOOP)
    beams: int = SETTINGS["beams"].default
    n: int = SETTINGS["n"].default  # choices per prompt, one row each (choice j draws with seed + j)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    ignore_eos: bool = False
    seed: int | None = None  # drawn when sampling without one
    stop: tuple[str, ...] = ()  # text that ends the generation (not included in its text)
    show_steps: int = SETTINGS["show_steps"].default  # how many alternatives to record per step
    top_logprobs: int = SETTINGS["top_logprobs"].default  # the most probable tokens kept per step, 0..V
    logprobs: str = "raw"  # the distribution those come from: raw or processed
    zero_temperature: bool = False  # greedy because temperature 0 was asked for (said once, in the output)
    grammar: Grammar | None = None  # a JSON schema, any JSON object or a regex the text must follow (decoding/grammar.py)

    @property
    def mode(self) -> str:
        return "beam" if self.beams > 1 else "greedy" if self.greedy else "sample"

    def choice_seeds(self) -> list[int | None]:
        """The seed of each of the n choices of one prompt: choice j draws with seed + j (modulo 2**63), from
        a drawn seed when sampling without one; greedy and beams draw nothing (None, or the seed given)."""
        import secrets

        base = self.seed if self.seed is not None or self.mode != "sample" else secrets.randbelow(2**32)
        return [None if base is None else (base + j) % 2**63 for j in range(self.n)]


def make(*, greedy: bool = False, beams: int | None = None, n: int | None = None, max_new_tokens: int | None = None,
         ignore_eos: bool = False, seed: int | None = None, stop=(), show_steps: int | None = None,
         top_logprobs: int | None = None,
         logprobs: str = "raw", draws: bool = False, json_schema=None, regex=None, json_object: bool = False,
         grammar: Grammar | None = None, **knobs) -> Settings:
    """The one place decoding settings are checked: BadValue names the first value out of range, with
    the registry's advice (top_logprobs' upper bound, the vocabulary size, needs the model: check_fits).
    `knobs`: a value per stage key (None = off); an unknown key is a TypeError, as for any keyword. The
    loop's settings left None take the registry's default.
    temperature 0 is greedy (the temperature stage off); with `draws` (sample, softcap: the tokens must be
    drawn) greedy, temperature 0 or beams are a ModeConflict. `json_schema` (a dict or its JSON text),
    `regex` or `json_object`: the grammar the text follows (decoding/grammar.py), at most one; or `grammar`,
    one compiled already (explore's :schema)."""
    unknown = sorted(set(knobs) - {s.key for s in STAGES})
    if unknown:
        raise BadType(unknown[0], f"is not a decoding setting; the stages are {', '.join(s.key for s in STAGES)}")
    loop = stages.check({"beams": beams, "n": n, "max_new_tokens": max_new_tokens, "seed": seed,
                         "show_steps": show_steps, "top_logprobs": top_logprobs})
    beams, n, max_new_tokens, seed, show_steps, top_logprobs = (  # None: the registry's default
        SETTINGS[k].default if v is None else v for k, v in loop.items())
    values = stages.check({s.key: knobs.get(s.key) for s in STAGES})
    zero = values["temperature"] == 0
    if zero:
        values["temperature"] = None
        greedy = True
    if draws and (greedy or beams > 1):
        raise ModeConflict({"temperature": 0} if zero else {"greedy": True} if greedy else {"beams": beams})
    if logprobs not in DISTRIBUTIONS:
        raise BadValue("logprobs", f"must be raw or processed (got {logprobs!r})")
    stop = check_stop(stop)
    if stop and beams > 1:
        raise BadValue("stop", "strings end greedy and sampled text; beam search runs to end-of-text or max_new_tokens")
    if n > 1 and beams > 1:
        raise BadValue("n", f"must be 1 with beam search (got {n}): beams give one answer per prompt, the best "
                            "of the finished beams, which the result lists")
    grammar = _grammar(json_schema, regex, json_object, beams, ignore_eos) if grammar is None else grammar
    return Settings(knobs=Knobs(**values), greedy=greedy, beams=beams, n=n, max_new_tokens=max_new_tokens,
                    ignore_eos=ignore_eos, seed=seed, stop=stop, show_steps=show_steps,
                    top_logprobs=top_logprobs, logprobs=logprobs, zero_temperature=zero, grammar=grammar)


def _grammar(json_schema, regex, json_object: bool, beams: int, ignore_eos: bool):
    """The grammar asked for (decoding/grammar.py, checked and compiled there), or None."""
    if json_schema is None and regex is None and not json_object:
        return None
    from lmhead_cli.decoding import grammar

    g = grammar.make(json_schema=json_schema, regex=regex, json_object=json_object)
    key = "regex" if regex is not None else "json_schema"
    if beams > 1:
        raise BadValue(key, f"is followed by greedy and sampled text; beam search (beams {beams}) does not follow "
                            "a grammar")
    if ignore_eos:
        raise BadValue("ignore_eos", "cannot go with a grammar: its text ends at end-of-text once it is complete")
    return g


def check_stop(stop) -> tuple[str, ...]:
    """Stop strings: a string or a sequence of at most MAX_STOPS non-empty strings."""
    from collections.abc import Iterable, Mapping

    from lmhead_cli.inputs import surrogate_problem

    if not isinstance(stop, str) and stop and (not isinstance(stop, Iterable) or isinstance(stop, (bytes, Mapping))):
        raise BadType("stop", f"must be a string or a list of strings (got {type(stop).__name__})")
    items = [stop] if isinstance(stop, str) else list(stop or ())
    if not all(isinstance(s, str) for s in items):
        raise BadType("stop", "must be a string or a list of strings")
    wrong = next((p for p in map(surrogate_problem, items) if p is not None), None)
    if wrong is not None:
        raise BadValue("stop", f"strings {wrong}")
    if len(items) > MAX_STOPS:
        raise BadValue("stop", f"holds at most {MAX_STOPS} strings (got {len(items)})")
    if any(s == "" for s in items):
        raise BadValue("stop", "strings must not be empty")
    return tuple(items)


def resolve(*, defaults: dict | None = None, draws: bool = False, preset: dict | None = None, **given) -> Settings:
    """The command line's and the API's door: three layers, the caller's `defaults` (e.g. softcap 30) < the
    preset's values (`preset`: read and checked by api/presets.py) < the values given (None = not given),
    then `make`."""
    loop = {k: given.pop(k) for k in ("greedy", "beams", "n", "ignore_eos", "seed", "stop", "show_steps", "top_logprobs",
                                      "logprobs", "json_schema", "regex", "json_object") if k in given}
    values = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **(defaults or {}), **(preset or {}),
              **{k: v for k, v in given.items() if v is not None}}
    return make(draws=draws, **{k: v for k, v in loop.items() if v is not None}, **values)


def from_openai(values: dict) -> Settings:
    """An OpenAI request body's decoding fields (each already of its JSON type: serve/requests.py) as
    Settings: every stage by its key (temperature, top_p, top_k, min_p, softcap and any stage added to
    the registry), seed, n, stop, logprobs_mode, each checked here with the registry's rules, and the
    grammar of response_format (json_schema: the schema; json_object: True). An absent temperature is 1
    (the stage off) and 0 is greedy, as OpenAI's; an absent n is 1; max_tokens is the server's to check
    (0 scores without generating)."""
    n = values.get("n")
    return make(seed=values.get("seed"), n=1 if n is None else n, stop=values.get("stop") or (),
                logprobs="raw" if values.get("logprobs_mode") is None else values["logprobs_mode"], json_schema=values.get("json_schema"),
                json_object=bool(values.get("json_object")), **{s.key: values.get(s.key) for s in STAGES})
