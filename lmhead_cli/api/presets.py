"""Decoding presets read: configs/presets.toml (shipped as lmhead_cli.configs) and a user's own .toml files,
checked by decoding/presets.py's rules (the registry's ranges, the same as the flags').

`--preset NAME` picks a table from that file; `--preset path/to/file.toml` reads your own (its
top-level keys are one preset). Flags given on the command line override a preset. The API reads the
files (for the command line and Python callers alike); decoding does no I/O. No torch here.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from importlib import resources
from pathlib import Path

from lmhead_cli.decoding.presets import KEYS, Preset, validate  # noqa: F401 - the rules, with the reading
from lmhead_cli.decoding.stages import Knobs, STAGES, check
from lmhead_cli.errors import UsageError

BUNDLED = "presets.toml"
MAX_PRESET_BYTES = 1 << 20  # a preset is a few lines


def _bundled_file():
    return resources.files("lmhead_cli.configs") / BUNDLED


def _read(path, text: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path} is not valid TOML: {e}") from None
    except RecursionError:
        raise UsageError(f"{path} is not a preset lmhead can read: its TOML is nested too deeply") from None


def bundled() -> dict[str, dict]:
    """Every bundled preset's raw table, by name."""
    f = _bundled_file()
    return _read(f, f.read_text(encoding="utf-8"))


def preset_names() -> list[str]:
    return sorted(bundled())


def load_preset(name: str) -> Preset:
    """A bundled preset by name, or your own from a .toml file."""
    if name.endswith(".toml"):
        from lmhead_cli.inputs import read_small_file

        path = Path(name).expanduser()
        return validate(path.stem, path, _read(path, read_small_file(str(path), "preset file", MAX_PRESET_BYTES)))
    presets = bundled()
    if name not in presets:
        raise UsageError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(presets))} "
                         "(or give a .toml file)")
    return validate(name, _bundled_file(), presets[name])


def merge(preset: str | None, defaults: dict, flags: dict) -> dict:
    """Settings from three layers: defaults < the preset < the flags given (None = not given)."""
    values = dict(defaults)
    if preset is not None:
        values.update(load_preset(preset).values)
    values.update({k: v for k, v in flags.items() if v is not None})
    return values


def knobs(preset: str | None, **flags) -> Knobs:
    """Checked stage settings from a preset and flags (a preset's max_new_tokens is not a stage)."""
    values = check(merge(preset, {}, flags))
    return Knobs(**{s.key: values.get(s.key) for s in STAGES})  # not max_new_tokens



