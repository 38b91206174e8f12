"""The bundled GPT-2 family configs (configs/*.json, shipped as lmhead_cli.configs). No torch here."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from lmhead_cli.errors import UnknownConfig


def _folder():
    return resources.files("lmhead_cli.configs")


@lru_cache(maxsize=None)
def config_names() -> tuple[str, ...]:
    """Names of the bundled model configs, e.g. ('distilgpt2', 'gpt2', ...)."""
    return tuple(sorted(p.name[: -len(".json")] for p in _folder().iterdir() if p.name.endswith(".json")))


def load_config(name: str) -> dict:
    """The bundled config ``name`` as a dict in Hugging Face's config.json format."""
    if name not in config_names():
        raise UnknownConfig(f"unknown config {name!r}; choose one of: {', '.join(config_names())}")
    return json.loads((_folder() / f"{name}.json").read_text(encoding="utf-8"))
