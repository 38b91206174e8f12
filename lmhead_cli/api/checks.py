"""Every check of a value the API is given, in one place, raised as lmhead_cli.errors before any work.

The front ends call these before loading a model (so a bad value fails in an instant) and the Model
methods call them again (so a program gets the same errors): each is cheap and idempotent. They name
a setting by its key (`top_k`, `batch_size`); the CLI spells it as its flag (cli/boundary.py).
Nothing here imports torch at module level.
"""

from __future__ import annotations

from lmhead_cli.errors import BadValue, Param, UsageError


def at_least_one(key: str, value: int) -> int:
    """BadValue unless `value` >= 1 (top_k, batch_size, stride, chunk...)."""
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


def settings(values: dict) -> None:
    """Decoding settings (stages and loop) against their rules (decoding.stages.SETTINGS)."""
    from lmhead_cli.decoding.stages import check

    check(values)


def stages(preset: str | None = None, **given):
    """The stage settings (decoding.stages.Knobs) of a preset (a bundled name or a .toml file) and the
    values given (None: not given; they override the preset), checked against the stages' rules;
    what Model.inspect(stages=...) takes."""
    from lmhead_cli.decoding.presets import knobs

    return knobs(preset, **given)


def generation(*, mode: str = "generate", preset: str | None = None, **values):
    """The decoding Settings of one generate call (decoding.settings.Settings, checked once there): `mode`
    is generate, greedy, sample or softcap (what each fixes: MODES); `values` are the settings by key
    (greedy, beams, seed, stop, max_new_tokens, ..., and each stage's key), None = not given."""
    from lmhead_cli.decoding.settings import resolve

    fixed = MODES[mode]
    if fixed.get("greedy"):
        values["greedy"] = True
    return resolve(defaults=fixed.get("defaults"), draws=fixed.get("draws", False), preset=preset, **values)


def generation_fits(loaded, n_prompt: int, settings) -> None:
    """The checks of generate's Settings that need the loaded model (top_logprobs <= its vocabulary,
    the beams' memory for a prompt of `n_prompt` tokens): run before anything is printed."""
    from lmhead_cli.decoding.generate import check_fits

    check_fits(loaded.engine, n_prompt, settings)


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
