"""`bundled:NAME`: small trained models that ship inside the package (lmhead_cli/data/bundled-NAME/),
so real predictions need no network, no Hugging Face cache and no environment variable.

Each is an ordinary GPT-2 checkpoint folder (config.json + model.safetensors, float16) that the
loader reads like a local folder. The files' SHA-256 sums are written beside them (SHA256SUMS, in
`sha256sum -c` form) by training/train_bundled.py and checked at every load (about 10 ms), so a
broken or partial install is one line that names the file and how to reinstall, never a traceback
from deep in a reader.

The catalogue (names and descriptions) is lmhead_cli.data's, so that renderers read it without this
loader.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

from lmhead_cli.data import BUNDLED, BUNDLED_PREFIX, describe, is_bundled, names  # noqa: F401 - the loader's names
from lmhead_cli.errors import CorruptCheckpoint, UsageError

REINSTALL = "pip install --force-reinstall lmhead"
FILES = ("config.json", "model.safetensors")


def data_root() -> Path:
    """The folder holding the bundled-NAME folders (tests point this at a copy)."""
    return Path(str(resources.files("lmhead_cli.data")))


def folder(source: str) -> Path:
    """The checked folder of `source` ("bundled:tiny"): both files present and the weights' SHA-256
    equal to the one recorded at training time."""
    name = source[len(BUNDLED_PREFIX):]
    if name not in BUNDLED:
        raise UsageError(f"unknown bundled model {source!r}; choose one of: {', '.join(names())}")
    path = data_root() / f"bundled-{name}"
    sums = _recorded(path / "SHA256SUMS")
    for file in FILES:
        f = path / file
        if not f.is_file():
            raise CorruptCheckpoint(f"the bundled model file {f} is missing (a broken install?); "
                                    f"reinstall lmhead: {REINSTALL}")
        try:
            digest = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
        except OSError as e:
            raise CorruptCheckpoint(f"the bundled model file {f} cannot be read ({type(e).__name__}); "
                                    f"reinstall lmhead: {REINSTALL}") from None
        if digest.hexdigest() != sums.get(file):
            raise CorruptCheckpoint(f"the bundled model file {f} is damaged (its SHA-256 is not the one in "
                                    f"{path / 'SHA256SUMS'}); reinstall lmhead: {REINSTALL}")
    return path


def _recorded(path: Path) -> dict[str, str]:
    """file name -> SHA-256, from a `sha256sum` listing."""
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        what = "missing" if isinstance(e, FileNotFoundError) else f"unreadable ({type(e).__name__})"
        raise CorruptCheckpoint(f"the bundled model file {path} is {what} (a broken install?); "
                                f"reinstall lmhead: {REINSTALL}") from None
    return {parts[1].lstrip("*"): parts[0] for parts in (line.split() for line in lines) if len(parts) == 2}
