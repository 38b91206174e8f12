"""Decoding presets' rules: a preset is a table of settings, each checked by the registry's one check
(decoding.stages.checked: type, off values, range), as every door's values are. Reading the files (configs/presets.toml, a
user's .toml) is the API's (api/presets.py): decoding does no I/O. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmhead_cli.decoding.stages import SETTINGS, check
from lmhead_cli.errors import BadValue, UsageError

# the keys a preset may hold: its description and the registry's settings that presets take
KEYS: tuple[str, ...] = ("description", *(s.key for s in SETTINGS.values() if s.preset))


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
    description = table.get("description", "")
    if not isinstance(description, str):
        raise UsageError(f"{where}: description must be a string (got {description!r})")
    try:
        values = check({k: v for k, v in table.items() if k != "description"})
    except BadValue as e:  # the key as the file spells it
        raise UsageError(f"{where}: {e}") from None
    return Preset(name=name, path=str(path), description=description, values=values)
