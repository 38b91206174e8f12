"""The benchmark's checkpoint: full-size GPT-2 small (124M) with seeded random weights, saved by
transformers as safetensors with the bundled GPT-2 tokenizer files, in benchmarks/.cache/.

Random weights have the same shapes, bytes and therefore the same speed as the real ones, and
need no network.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
SEED = 0


def gpt2_small(folder: Path | None = None) -> Path:
    """The folder holding the checkpoint, built (about 10 s) if it is not there yet."""
    folder = folder or CACHE / "gpt2-small-random"
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    src = resources.files("lmhead_cli.data") / "gpt2-tokenizer"
    for name in ("vocab.json", "merges.txt"):
        with resources.as_file(src / name) as p:
            shutil.copy(p, tmp / name)
    tmp.rename(folder)  # complete or absent: an interrupted build is never mistaken for a checkpoint
    return folder


if __name__ == "__main__":
    print(gpt2_small())
