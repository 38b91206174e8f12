"""The one path for weight files: which files a checkpoint's weights are in, and reading them.

A weight file is safetensors (memory-mapped, a header of names, dtypes and shapes before any
tensor), whether it is the folder's model.safetensors or a shard named by
model.safetensors.index.json. Anything else is a pickle, and a pickle is read only with
--allow-pickle, by torch's weights-only unpickler, whichever way it was reached: as
pytorch_model.bin or as a shard of the index. Every file is checked to be a regular file before
it is opened (a FIFO would block).
"""

from __future__ import annotations

import os
from pathlib import Path

from lmhead_cli.engine import pages
from lmhead_cli.errors import CorruptCheckpoint, ModelNotFound, Param, UnsafeCheckpoint
from lmhead_cli.loading import checks

# Buffers some GPT-2 checkpoints store that are not weights (the causal mask).
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")
PICKLE_ADVICE = ("convert it to safetensors, or pass ", Param("allow_pickle"),
                 " to load it with torch's weights-only unpickler")


def is_safetensors(path: Path) -> bool:
    return path.suffix == ".safetensors"


def weight_files(folder: Path, allow_pickle: bool) -> list[Path]:
    """The weight files of a checkpoint folder: the shards its index names (confined to the folder),
    its one model.safetensors, or its pytorch_model.bin; a pickle among them only with --allow-pickle."""
    index = folder / "model.safetensors.index.json"
    if index.is_file() or index.exists():
        files = checks.shard_files(index)
    elif (folder / "model.safetensors").is_symlink() and not (folder / "model.safetensors").exists():
        raise CorruptCheckpoint(f"{folder / 'model.safetensors'} is a link to "
                                f"{os.readlink(folder / 'model.safetensors')}, which does not exist (an interrupted "
                                "download?)")
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    elif (folder / "pytorch_model.bin").exists():
        files = [folder / "pytorch_model.bin"]
    else:
        raise ModelNotFound(f"{folder} holds no weights (looked for model.safetensors, "
                            "model.safetensors.index.json and pytorch_model.bin)")
    for f in files:
        checks.regular_file(f)
        if not is_safetensors(f) and not allow_pickle:
            via = f" (named by {index.name})" if len(files) > 1 or f.name != "pytorch_model.bin" else ""
            raise UnsafeCheckpoint(f"{f}{via} is not a .safetensors file but a pickle, and unpickling can run "
                                   "arbitrary code; ", *PICKLE_ADVICE)
    return files


def read_weights(files: list[Path]):
    """All tensors of `files` (weight_files), names normalised to GPT-2's (no `transformer.` prefix)."""
    state: dict = {}
    for f in files:
        part = _read_safetensors(f) if is_safetensors(f) else _read_pickle(f)
        for name in part:
            if name in state:
                raise CorruptCheckpoint(f"{f} holds {name} again (another shard holds it too)")
        state.update(part)
    return normalise(state)


def _read_safetensors(path: Path):
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CorruptCheckpoint(f"{path} is listed in the index but missing")
    pages.read_file_in_huge_pages(path)  # pages not cached yet enter the cache as 2 MiB folios (engine/pages.py)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except PermissionError as e:
        raise CorruptCheckpoint(f"{path} cannot be read: {e.strerror}") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CorruptCheckpoint(f"{path} cannot be read (truncated or corrupt?): {e}") from None


def _read_pickle(path: Path):
    """A pickle of tensors, with torch's weights-only unpickler. What it refuses is reported as the
    refusal itself, never with torch's advice (weights_only=False "will likely succeed"), which
    would run the code."""
    import warnings

    import torch

    if not path.is_file():
        raise CorruptCheckpoint(f"{path} is listed in the index but missing")
    try:
        with warnings.catch_warnings():  # torch's protocol warnings are noise next to the one line below
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise UnsafeCheckpoint(f"{path} holds more than tensors, which lmhead never unpickles ({refused(e)}); "
                               "convert the weights to safetensors from a trusted copy") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CorruptCheckpoint(f"{path} does not hold a dict of named tensors")
    return state


def refused(e: Exception) -> str:
    """What torch's weights-only unpickler refused, in its own words but without its advice: "the
    unsupported global posix.system" for a pickle that calls a function, else its first line."""
    import re

    text = str(e)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"unsupported global ([\w.]+)",
                                                                                  text, re.I)
    if found:
        return f"refused the unsupported global {found.group(1)}"
    why = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
    lines = [ln.strip() for ln in why.strip().splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    for advice in ("Please file an issue", "weights_only", "Check the documentation", "(1)", "In PyTorch"):
        first = first.split(advice, 1)[0].strip()
    return f"refused: {first[:200] or type(e).__name__}"


def normalise(state: dict) -> dict:
    out = {}
    for name, t in state.items():
        name = name.removeprefix("transformer.")
        if not name.endswith(NOT_WEIGHTS):
            out[name] = t
    return out
