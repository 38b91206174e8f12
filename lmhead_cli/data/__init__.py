"""The models and files that ship inside the package, and what each bundled model is.

The catalogue of `bundled:NAME` models lives here, beside their folders (bundled-NAME/), as plain
data: the loader (loading/bundled.py) checks and reads the folders, and the renderers and the CLI's
completion read the names and descriptions without importing the loader. Torch-free.
"""

from __future__ import annotations

BUNDLED_PREFIX = "bundled:"

# name -> what it is and what it was trained on (the one line its outputs carry instead of the
# random-weights banner); the figures are documented, with the training script, in docs/bundled-model.md
BUNDLED = {
    "tiny": "a small GPT-2 trained on the King James Bible (public domain)",
}


def is_bundled(source: str) -> bool:
    return source.startswith(BUNDLED_PREFIX)


def names() -> list[str]:
    return [BUNDLED_PREFIX + n for n in BUNDLED]


def describe(source: str) -> str | None:
    """The one-line description of a bundled source, None for any other source."""
    return BUNDLED.get(source[len(BUNDLED_PREFIX):]) if is_bundled(source) else None
