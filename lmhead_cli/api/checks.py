"""Every check of a value the API is given, in one place, raised as lmhead_cli.errors before any work.

The front ends call these before loading a model (so a bad value fails in an instant) and the Model
methods call them again (so a program gets the same errors): each is cheap and idempotent. They name
a setting by its key (`top_k`, `batch_size`); the CLI spells it as its flag (cli/boundary.py).
Nothing here imports torch at module level.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Callable

from lmhead_cli.errors import BadType, BadValue, Param, UsageError

# What each kind of parameter must be, in words ("top_k must be an integer (got 1.5)").
KIND_NAMES = {bool: "True or False", int: "an integer", float: "a number", str: "a string",
              list: "a list of strings", callable: "a function"}


def typed(key: str, value, kind, rule=None, *, optional: bool = False):
    """`value` as the parameter `key` takes it, checked once: its type, then its range; returns it (a
    list for `list`). The one check of an API parameter's value; decoding's settings have their own, the
    registry's (decoding.stages.checked), which `settings` and decoding.settings.make call.

    `kind`: bool (True or False only: "no" is not False), int (not a bool, not a float, even 2.0),
    float (any real number but a bool; NaN is a float, which every range refuses), str, list (a list or tuple of strings, or an
    iterable of them, materialised once; a bare string is refused, not split into characters),
    callable, or a tuple of names the value must be one of. `rule`: the range, an object with
    `check(key, value)` (decoding.stages.Rule) or a function (key, value) that raises BadValue.
    `optional`: None passes (the parameter's "not given"). A wrong type is BadType (a BadValue that is
    also a TypeError); a value out of range is BadValue (also a ValueError).
    """
    if value is None:
        if optional:
            return None
    elif isinstance(kind, tuple):
        if isinstance(value, str):
            if value not in kind:
                raise BadValue(key, f"must be one of: {', '.join(kind)} (got {_shown(value)})")
            return value
    elif kind is list:
        if isinstance(value, Iterable) and not isinstance(value, (str, bytes, bytearray, Mapping)):
            value = list(value)
            wrong = next((v for v in value if not isinstance(v, str)), value)
            if wrong is value:
                for v in value:
                    unicode(key, v)
                return value
            raise BadType(key, f"must be {KIND_NAMES[list]} (got {_shown(wrong)} in it)")
    elif kind is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return _ranged(key, value, rule)  # NaN is a float: every range refuses it
    elif kind is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return _ranged(key, value, rule)
    elif kind is callable:
        if callable(value):
            return value
    elif kind is str:
        if isinstance(value, str):
            return _ranged(key, unicode(key, value), rule)
    elif isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return _ranged(key, value, rule)
    names = f"one of: {', '.join(kind)}" if isinstance(kind, tuple) else KIND_NAMES[kind]
    raise BadType(key, f"must be {names} (got {_shown(value)})")


def unicode(key: str, value: str) -> str:
    """`value`, or BadValue when it holds a lone surrogate (no tokenizer takes it: a TypeError or a
    UnicodeEncodeError deep inside one otherwise)."""
    from lmhead_cli.inputs import surrogate_problem

    problem = surrogate_problem(value)
    if problem is not None:
        raise BadValue(key, problem)
    return value


def text_item(key: str, value, n: int) -> str:
    """Item `n` (from 1) of an iterable of texts (score_lines', inspect_lines' `lines`), checked as it
    is reached: a string that is valid Unicode, else BadValue naming `key` and the item."""
    if not isinstance(value, str):
        raise BadType(key, f"must hold texts (got {_shown(value)} as item {n:,})")
    from lmhead_cli.inputs import surrogate_problem

    problem = surrogate_problem(value)
    if problem is not None:
        raise BadValue(key, f"item {n:,} {problem}")
    return value


def token_ids(key: str, values, vocab: int) -> list[int]:
    """Token ids (Model.decode's): integers from 0 to vocab - 1, materialised once."""
    ids = indices(key, values)
    wrong = next((i for i in ids if not 0 <= i < vocab), None)
    if wrong is not None:
        raise BadValue(key, f"must be token ids from 0 to {vocab - 1:,} (got {wrong:,})")
    return ids


def chat_messages(value) -> list[dict]:
    """Chat messages (Model.chat_prompt's): a list of {"role": text, "content": text}, materialised once."""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, bytearray, Mapping)):
        value = list(value)
        for n, m in enumerate(value, 1):
            if not (isinstance(m, Mapping) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
                raise BadType("messages", f"must be a list of {{\"role\": text, \"content\": text}} (got "
                                          f"{_shown(m)} as message {n:,})")
            for k in ("role", "content"):
                unicode("messages", m[k])
        return value
    raise BadType("messages", f"must be a list of {{\"role\": text, \"content\": text}} (got {_shown(value)})")


def explore_settings(value):
    """An explore session's settings (Model.explore_reading's, explore_generate's): what
    lmhead_cli.api.explore.settings() returns, else BadType naming `settings`."""
    from lmhead_cli.readings.explore import State

    if not isinstance(value, State):
        raise BadType("settings", f"must be lmhead_cli.api.explore.settings(...) (got {_shown(value)})")
    return value


def lens_file(key: str, value):
    """A tuned-lens file as a program names it (Model.lens `tuned`, Model.tuned_lens `where`; a TunedLens
    object is the caller's to pass on): a path (a str or an os.PathLike of str) or "bundled"; anything
    else is BadType naming `key`."""
    import os

    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if isinstance(path, str):
        unicode(key, path)
        return value
    raise BadType(key, f"must be a path (a string or os.PathLike), \"bundled\" or a TunedLens (got {_shown(value)})")


def _ranged(key: str, value, rule):
    if rule is not None:
        rule.check(key, value) if hasattr(rule, "check") else rule(key, value)
    return value


def _shown(value) -> str:
    """A wrong value as a message shows it: its repr (control characters escaped), cut to 40 characters,
    and its type when that is not plain from the repr."""
    text = repr(value)
    text = text if len(text) <= 40 else text[:39] + "…"
    plain = isinstance(value, (bool, int, float, str)) or value is None
    return text if plain else f"{type(value).__name__} {text}"


def kinds(**declared) -> Callable:
    """Decorate an API function: each parameter named here is checked by `typed` against its kind before
    the body runs (None passes where None is the parameter's default, or where the kind says so: `int |
    None`; a default is never checked). The kinds are kept as the function's `kinds` and the parameters
    that take None as its `optional`, for tests that hold every public parameter to one."""

    def wrap(fn):
        sig = inspect.signature(fn)
        assert set(declared) <= set(sig.parameters), f"{fn.__name__} has no {set(declared) - set(sig.parameters)}"
        union = {name for name, kind in declared.items() if isinstance(kind, types.UnionType)}
        plain = {name: next(k for k in typing.get_args(kind) if k is not type(None)) if name in union else kind
                 for name, kind in declared.items()}
        optional = union | {name for name in declared if sig.parameters[name].default is None}

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            for name, kind in plain.items():
                if name in bound.arguments:
                    bound.arguments[name] = typed(name, bound.arguments[name], kind, optional=name in optional)
            return fn(*bound.args, **bound.kwargs)

        checked.kinds, checked.optional = plain, optional
        return checked

    return wrap


def at_least_one(key: str, value: int) -> int:
    """BadValue unless `value` is an integer >= 1 (top_k, batch_size, stride, chunk...)."""
    typed(key, value, int)
    if value < 1:
        raise BadValue(key, f"must be at least 1 (got {value})")
    return value


def one_prompt(prompt: str | None, targets=None, top_k: int = 10) -> None:
    """A one-prompt reading (inspect, lens, explain, diff's each side): a prompt, targets that are
    tokens, top_k >= 1."""
    from lmhead_cli.readings.inspect import check_request

    check_request(prompt, list(targets or ()), top_k)


def prompt(value: str | None) -> str:
    """A prompt: given, and not only white space (NoPrompt otherwise); returned as given."""
    from lmhead_cli.readings.inspect import check_prompt

    return check_prompt(value)


def targets(values) -> list[str]:
    """Targets (--target): each a non-empty text; returned as a list."""
    from lmhead_cli.readings.inspect import check_targets

    return check_targets(list(values or ()))


def threads(value: int | None) -> int | None:
    """torch's CPU thread count: None (chosen by timing the work) or 1 to engine.threads.MAX_THREADS."""
    from lmhead_cli.engine.threads import check

    return check(value)


def prompt_or_file(prompt: str | None, file: str | None, noun: str = "a prompt") -> None:
    """Commands that read one input or a file of them take one or the other."""
    if prompt is not None and file is not None:
        raise UsageError(f"give {noun} or ", Param("file"), ", not both")


def prompt_file(top_k: int, batch_size: int, asked=None) -> list[str]:
    """`inspect --file`'s values; returns the targets `asked` as a list."""
    from lmhead_cli.readings.batch import check_batch_size

    at_least_one("top_k", top_k)
    check_batch_size(batch_size)
    return targets(asked)


def attribution(prompt: str | None, target: str | None, vs: str | None) -> None:
    """attribute's values: a prompt, a target (and vs) that are tokens."""
    from lmhead_cli.readings.attribute import check_attribute

    check_attribute(prompt, target, vs)


def indices(key: str, values) -> list[int]:
    """A list of whole numbers (neuron indices): an iterable of integers, materialised once; BadType for a
    string, a bool, a float or anything else."""
    if isinstance(values, Iterable) and not isinstance(values, (str, bytes, bytearray, Mapping)):
        values = list(values)
        wrong = next((v for v in values if not isinstance(v, numbers.Integral) or isinstance(v, bool)), values)
        if wrong is values:
            return [int(v) for v in values]
        raise BadType(key, f"must be a list of integers (got {_shown(wrong)} in it)")
    raise BadType(key, f"must be a list of integers (got {_shown(values)})")


def neurons(prompt: str | None, layer: int | None, token: str | None, target: str | None,
            top: int | None) -> None:
    """`neurons`' values: a prompt needs a target (and then no token); without one, a layer or a token."""
    if top is not None:
        at_least_one("top", top)
    if prompt is not None:
        if target is None:
            raise UsageError("with a prompt, give ", Param("target"), ": the token whose logit the neurons' "
                             "shares add up to")
        if token is not None:
            raise UsageError("give a prompt with ", Param("target"), ", or ", Param("token"), " alone, not both")
        attribution(prompt, target, None)
    elif target is not None:
        raise UsageError(Param("target"), " needs a prompt: the text whose next-token logit to take apart")
    elif layer is None and token is None:
        raise UsageError("give ", Param("layer"), " (a layer's neurons), ", Param("token"),
                         " (the neurons that write it) or a prompt and ", Param("target"))
    if token is not None and not token:
        raise BadValue("token", "must be a non-empty text (it has no token)")
    if layer is not None and layer < 0:
        raise BadValue("layer", f"must be at least 0 (got {layer})")


def text(value: str) -> str:
    """score's text: not empty, valid Unicode."""
    from lmhead_cli.readings.score import check_text

    return check_text(value)


def stride(value: int | None, n_ctx: int) -> None:
    """score's stride: 1 <= stride <= n_ctx (checked once the model, and so n_ctx, is known)."""
    if value is not None:
        from lmhead_cli.readings.score import check_stride

        check_stride(value, n_ctx)


def chunk(value: int | None) -> None:
    """score's chunk: at least 1 position."""
    from lmhead_cli.readings.score import check_chunk

    check_chunk(value)


def settings(values: dict) -> dict:
    """Decoding settings (stages and loop) by the registry's one check (decoding.stages.checked: type, off
    values, range): `top_k=1.5`, NaN or True, `seed=1.5`, `temperature="hot"` are BadValue naming the key.
    None = not given; unknown keys pass. Returns the values as the settings hold them."""
    from lmhead_cli.decoding.stages import check

    return check(values)


def stages(preset: str | None = None, **given):
    """The stage settings (decoding.stages.Knobs) of a preset (a bundled name or a .toml file) and the
    values given (None: not given; they override the preset), checked against the stages' rules;
    what Model.inspect(stages=...) takes."""
    from lmhead_cli.api.presets import knobs

    return knobs(preset, **given)


def stage_knobs(value):
    """Model.inspect's `stages`: None (no stage table), decoding.stages.Knobs (from `stages()`), a preset
    (a bundled name or a .toml file) or a dict of stage settings ({"temperature": 0.7}); returns Knobs
    or None. Anything else is BadValue naming `stages`, with what it may be."""
    from lmhead_cli.api.presets import preset_names
    from lmhead_cli.decoding.stages import STAGES, Knobs

    if value is None or isinstance(value, Knobs):
        return value
    may = (f"must be a preset ({', '.join(preset_names())}), a .toml preset file, a dict of stage settings "
           f"({', '.join(s.key for s in STAGES)}) or lmhead_cli.api.checks.stages(...)")
    if isinstance(value, str):
        if value.endswith(".toml") or value in preset_names():
            return stages(value)
        raise BadValue("stages", f"{may} (got {_shown(value)})")
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in Knobs.__dataclass_fields__]
        if unknown:
            raise BadValue("stages", f"{may}: {_shown(unknown[0])} is not a stage")
        return stages(**value)
    raise BadType("stages", f"{may} (got {_shown(value)})")


def generation(*, mode: str = "generate", preset: str | None = None, **values):
    """The decoding Settings of one generate call (decoding.settings.Settings, checked once there): `mode`
    is generate, greedy, sample or softcap (what each fixes: MODES); `values` are the settings by key
    (greedy, beams, seed, stop, max_new_tokens, ..., and each stage's key), None = not given; `preset` a
    preset's name or .toml file (read here: api/presets.py)."""
    from lmhead_cli.api.presets import load_preset
    from lmhead_cli.decoding.settings import resolve

    fixed = MODES[mode]
    if fixed.get("greedy"):
        values["greedy"] = True
    return resolve(defaults=fixed.get("defaults"), draws=fixed.get("draws", False),
                   preset=None if preset is None else load_preset(preset).values, **values)


def decoding_settings(value):
    """Settings that api.checks.generation made (decoding.settings.Settings), else BadType naming `settings`."""
    from lmhead_cli.decoding.settings import Settings

    if not isinstance(value, Settings):
        raise BadType("settings", f"must be lmhead_cli.api.checks.generation(...) (got {_shown(value)})")
    return value


def generation_fits(loaded, n_prompt: int, settings, prompts: int = 1) -> None:
    """The checks of generate's Settings that need the loaded model (top_logprobs <= its vocabulary,
    the memory of the beams, or of `prompts` × n rows, for prompts of up to `n_prompt` tokens): run
    before anything is printed."""
    from lmhead_cli.decoding.generate import check_fits

    check_fits(loaded.engine, n_prompt, settings, prompts)


def generations_fit(loaded, count: int, settings) -> None:
    """calibrate's `generations`: `count` rows sampled after the one beginning-of-text token, each
    settings.max_new_tokens long or what the context holds, must fit in memory (BadValue naming
    `generations`), checked before the text is scored."""
    from lmhead_cli.decoding.generate import check_rows_memory, room

    eng = loaded.engine
    check_rows_memory(eng, "generations", count, f"{count:,} continuations",
                      1 + min(settings.max_new_tokens, room(eng.n_ctx, 1)))


def prompts(value) -> tuple[list[str], bool]:
    """generate's `prompt`: one prompt (a string) or several (a list, tuple or other iterable of strings,
    materialised once, at least one); returns (the prompts, whether one string was given). Each must
    hold more than white space (NoPrompt)."""
    from lmhead_cli.readings.inspect import check_prompt

    if isinstance(value, str):
        return [check_prompt(unicode("prompt", value))], True
    if isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, Mapping)):
        value = list(value)
        wrong = next((v for v in value if not isinstance(v, str)), value)
        if wrong is not value:
            raise BadType("prompt", f"must be a string or a list of strings (got {_shown(wrong)} in it)")
        if not value:
            raise BadValue("prompt", "must be a string or a list of at least one string (got an empty list)")
        return [check_prompt(unicode("prompt", v)) for v in value], False
    raise BadType("prompt", f"must be a string or a list of strings (got {_shown(value)})")


def _modes() -> dict[str, dict]:
    from lmhead_cli.decoding.stages import GEMMA2_CAP

    return {
        "generate": {},
        "greedy": {"greedy": True},
        "sample": {"draws": True},
        "softcap": {"draws": True, "defaults": {"softcap": GEMMA2_CAP}},
    }


# What each decoding mode fixes before the preset and the values given (decoding.generate.resolve).
MODES: dict[str, dict] = _modes()
