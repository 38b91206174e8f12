"""Decoding presets' rules: a preset is a table of settings, checked against the registry (its keys,
types and ranges, with the same ranges as the flags). Reading the files (configs/presets.toml, a
user's .toml) is the API's (api/presets.py): decoding does no I/O. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmhead_cli.decoding.stages import SETTINGS, check
from lmhead_cli.errors import BadValue, UsageError

# key: the type its value must have (an int is fine where a float is asked for); from the registry
KEYS: dict[str, type] = {"description": str, **{s.key: s.type for s in SETTINGS.values() if s.preset}}


@dataclass(frozen=True)
class Preset:
    name: str
    path: str  # the file it was read from
    description: str
    values: dict  # the settings it holds, without the description


def validate(name: str, path, table: dict) -> Preset:
    """Check a preset's keys, types and ranges; raise UsageError naming the file and the key."""
    where = f"preset {name!r} in {path}"
    if not isinstance(table, dict):
        raise UsageError(f"{where}: must be a table of settings, not {type(table).__name__}")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
    for key, value in table.items():
        want = KEYS[key]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if want is float
              else isinstance(value, want) and not isinstance(value, bool) if want is int
              else isinstance(value, want))
        if not ok:
            raise UsageError(f"{where}: {key} must be {'a number' if want is float else want.__name__}"
                             f" (got {value!r})")
    values = {k: (float(v) if KEYS[k] is float else v) for k, v in table.items() if k != "description"}
    try:
        check(values)
    except BadValue as e:  # the key as the file spells it
        raise UsageError(f"{where}: {e}") from None
    return Preset(name=name, path=str(path), description=table.get("description", ""), values=values)
