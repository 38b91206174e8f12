"""Shell completion of option values (`lmhead --install-completion`). No torch: completion runs the CLI
on every <Tab>."""

from __future__ import annotations

import os
from pathlib import Path


def _starting(values, incomplete: str) -> list[str]:
    return [v for v in values if v.startswith(incomplete)]


def devices(incomplete: str) -> list[str]:
    return _starting(("auto", "cpu", "cuda", "mps"), incomplete)


def dtypes(incomplete: str) -> list[str]:
    return _starting(("float32", "bfloat16", "float16", "int8"), incomplete)


def engines(incomplete: str) -> list[str]:
    return _starting(("auto", "lean", "transformers"), incomplete)


def formats(incomplete: str) -> list[str]:
    return _starting(("text", "json", "openai"), incomplete)


def logprob_kinds(incomplete: str) -> list[str]:
    return _starting(("raw", "processed"), incomplete)


def cached_hub_ids() -> list[str]:
    """Hub ids in the local Hugging Face cache (models--owner--name folders)."""
    home = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
                / "hub")
    try:
        return sorted(p.name.removeprefix("models--").replace("--", "/") for p in home.iterdir()
                      if p.name.startswith("models--"))
    except OSError:
        return []


def models(incomplete: str) -> list[str]:
    """random:NAME for each bundled config, bundled:NAME for each bundled model, cached hub ids, and
    folders that start with what is typed."""
    from lmhead_cli.api.choices import offline_sources

    found = offline_sources() + cached_hub_ids()
    folder, _, stem = incomplete.rpartition("/")
    try:
        base = Path(os.path.expanduser(folder or "."))
        found += [(f"{folder}/" if folder else "") + p.name + "/" for p in base.iterdir()
                  if p.is_dir() and p.name.startswith(stem) and not p.name.startswith(".")]
    except OSError:
        pass
    return _starting(found, incomplete)
