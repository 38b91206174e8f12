"""Model sources: a hub id, a local folder or `random:NAME` -> a loaded engine, tokenizer and tie report.

Weights come from safetensors (memory-mapped) unless --allow-pickle; remote code is never run.
Nothing here prints: progress bars are huggingface_hub's own, on stderr.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from lmhead_cli.engine.base import Engine
from lmhead_cli.engine.hf import TransformersEngine
from lmhead_cli.engine.lean import GPT2, LeanGPT2, init_random_
from lmhead_cli.engine.threads import ThreadChooser
from lmhead_cli.errors import (CorruptCheckpoint, LmheadError, ModelNotFound, UnsafeCheckpoint,
                               UsageError)
from lmhead_cli.loading.model_configs import config_names, load_config
from lmhead_cli.loading.tokenizer import GPT2Tokenizer

RANDOM_PREFIX = "random:"
RANDOM_SEED = 0
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINES = ("auto", "lean", "transformers")
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "vocab.json", "merges.txt", "generation_config.json"]
# Buffers some GPT-2 checkpoints store that are not weights (the causal mask).
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class TieReport:
    """Whether the output matrix W_out is the embedding table E, and the evidence."""

    tied: bool  # the head's weight is the embedding's weight object
    same_object: bool  # lm_head.weight is wte.weight
    same_data_ptr: bool
    config_tie_word_embeddings: bool
    file_has_lm_head: bool | None  # None: no file (random weights)
    file_lm_head_equals_wte: bool | None
    head_name: str
    embedding_name: str
    shape: tuple[int, int]  # (V, D)


@dataclass
class Loaded:
    """A model ready to run: what the user asked for, where it came from, and the pieces."""

    source: str
    kind: str  # "hub", "local" or "random"
    path: str | None
    random_weights: bool
    seed: int | None
    config: dict
    engine: Engine
    tokenizer: GPT2Tokenizer
    tie: TieReport
    threads: ThreadChooser  # torch's CPU thread count for this model's work, fixed or chosen by timing it

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise UsageError(f"unknown --device {name!r}; choose one of: {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LmheadError("--device cuda: no CUDA device is available here; use --device cpu")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise LmheadError("--device mps: MPS is not available here; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError(f"unknown --dtype {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(source: str, *, device: str = "auto", dtype: str = "float32", engine: str = "auto",
               allow_pickle: bool = False, threads: int | None = None) -> Loaded:
    """Load `source` (hub id, local folder or random:NAME) onto `device` in `dtype`, on `threads` CPU
    threads (None: chosen by timing the work, see engine/threads.py)."""
    if engine not in ENGINES:
        raise UsageError(f"unknown --engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    pace = ThreadChooser(threads, dev.type)  # a fixed count is set before the load, which uses it too
    if not source or not source.strip():
        raise UsageError("--model is empty; pass a hub id (gpt2), a local folder, or random:gpt2")

    if source.startswith(RANDOM_PREFIX):
        name = source[len(RANDOM_PREFIX):]
        if name not in config_names():
            raise UsageError(f"unknown random model {source!r}; choose one of: "
                             + ", ".join(RANDOM_PREFIX + n for n in config_names()))
        config = load_config(name)
        state = random_state(config, RANDOM_SEED)
        kind, folder, files = "random", None, []
    else:
        folder, kind = _find_folder(source, allow_pickle)
        config = _read_config(folder)
        _choose_engine(engine, config)  # refuse a wrong engine before reading any weights
        state, files = read_weights(folder, allow_pickle)

    engine_name = _choose_engine(engine, config)
    tokenizer = (GPT2Tokenizer.from_folder(folder) if folder else None) or GPT2Tokenizer.bundled()
    tied = bool(config.get("tie_word_embeddings", True))
    raw_has_head = "lm_head.weight" in state if files else None
    head_equals = (torch.equal(state["lm_head.weight"], state["wte.weight"])
                   if raw_has_head and "wte.weight" in state else None)
    if not tied and "lm_head.weight" not in state:
        raise CorruptCheckpoint(f"{_names(files)}: the config unties the head (tie_word_embeddings: false) "
                                "but the weights hold no lm_head.weight")
    if tied:
        state.pop("lm_head.weight", None)  # tied: the head *is* wte; a stored copy is not used

    if engine_name == "lean":
        eng: Engine = LeanGPT2(config, build_lean(config, state, tied, files, dev, dt))
        head_name, emb_name = "lm_head.weight", "wte.weight"
    else:
        eng = TransformersEngine(config, build_transformers(config, state, tied, dev, dt))
        head_name, emb_name = "lm_head.weight", "transformer.wte.weight"

    head_w, emb_w = eng.head_weight, eng.embedding_weight
    tie = TieReport(
        tied=head_w is emb_w,
        same_object=head_w is emb_w,
        same_data_ptr=head_w.data_ptr() == emb_w.data_ptr(),
        config_tie_word_embeddings=tied,
        file_has_lm_head=raw_has_head,
        file_lm_head_equals_wte=head_equals,
        head_name=head_name,
        embedding_name=emb_name,
        shape=tuple(head_w.shape),
    )
    return Loaded(source=source, kind=kind, path=str(folder) if folder else None,
                  random_weights=kind == "random", seed=RANDOM_SEED if kind == "random" else None,
                  config=config, engine=eng, tokenizer=tokenizer, tie=tie, threads=pace)


# ---- where the files are ---------------------------------------------------------------------

def _find_folder(source: str, allow_pickle: bool) -> tuple[Path, str]:
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"{source!r} is a file; --model takes a folder holding config.json and "
                                "model.safetensors")
        return path, "local"
    if source.startswith((".", "/", "~")) or source.count("/") > 1:  # a path, not "org/name"
        raise ModelNotFound(f"no such folder: {source}")
    return _hub_folder(source, allow_pickle), "hub"


def _hub_folder(repo_id: str, allow_pickle: bool) -> Path:
    """The cached snapshot of `repo_id`, downloading it once (with a progress bar) if the hub is reachable."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = HUB_FILES + (["pytorch_model.bin"] if allow_pickle else [])
    advice = ("connect once to download it, pass a local folder (--model ./my-gpt2), or use "
              "--model random:gpt2 for random weights offline")
    cache_dir = _hub_cache()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True, cache_dir=cache_dir))
    except HFValidationError:
        raise ModelNotFound(f"{repo_id!r} is neither a local folder nor a valid hub id") from None
    except Exception:  # noqa: BLE001 - not cached: fall through to the network
        pass
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ModelNotFound(f"{repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {advice}")
    if not _reachable(constants.ENDPOINT):
        raise ModelNotFound(f"{repo_id!r} is not in the Hugging Face cache and the hub can't be reached; {advice}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir))
    except Exception as e:  # noqa: BLE001 - RepositoryNotFound, gated, network drop: one line
        raise ModelNotFound(f"could not download {repo_id!r} ({type(e).__name__}); {advice}") from None


def _hub_cache() -> str:
    """The HF hub cache, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return constants.HF_HUB_CACHE


def _reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """A quick TCP connect to the hub, so an offline machine fails in seconds, not after retries.

    Name resolution has no timeout of its own, so the probe runs in a daemon thread we stop waiting for.
    """
    url = urlparse(endpoint)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFound(f"{folder} holds no config.json (expected config.json and model.safetensors)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{path} is not valid JSON: {e}") from None


def _choose_engine(engine: str, config: dict) -> str:
    is_gpt2 = config.get("model_type") == "gpt2"
    if engine == "lean" and not is_gpt2:
        raise UsageError(f"the lean engine runs GPT-2-family checkpoints only (this is "
                         f"{config.get('model_type')!r}); use --engine transformers")
    if engine == "auto":
        return "lean" if is_gpt2 else "transformers"
    return engine


# ---- weights ---------------------------------------------------------------------------------

def read_weights(folder: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """All tensors of a checkpoint folder, names normalised to GPT-2's (no `transformer.` prefix)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [folder / f for f in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif (folder / "pytorch_model.bin").is_file():
        if not allow_pickle:
            raise UnsafeCheckpoint(
                f"{folder / 'pytorch_model.bin'} is a pickle file, and unpickling can run arbitrary code; "
                "convert it to safetensors, or pass --allow-pickle to load it with torch.load(weights_only=True)")
        return _normalise(_read_pickle(folder / "pytorch_model.bin")), [folder / "pytorch_model.bin"]
    else:
        raise ModelNotFound(f"{folder} holds no weights (looked for model.safetensors, "
                            "model.safetensors.index.json and pytorch_model.bin)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(_read_safetensors(f))
    return _normalise(state), files


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CorruptCheckpoint(f"{path} is listed in the index but missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CorruptCheckpoint(f"{path} cannot be read (truncated or corrupt?): {e}") from None


def _read_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise CorruptCheckpoint(f"{path} cannot be read with weights_only=True: {e}") from None


def _normalise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        name = name.removeprefix("transformer.")
        if not name.endswith(_NOT_WEIGHTS):
            out[name] = t
    return out


def _names(files: list[Path]) -> str:
    return ", ".join(str(f) for f in files) or "the weights"


def random_state(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded GPT-2 weights for `config` (the same for every engine), names as in the checkpoints."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT2(config, tied=True).state_dict().items() if k != "lm_head.weight"}
    state = {k: torch.empty(s) for k, s in shapes.items()}
    init_random_(state, config["n_layer"], seed)
    return state


def build_lean(config: dict, state: dict[str, torch.Tensor], tied: bool, files: list[Path],
               device: torch.device, dtype: torch.dtype) -> GPT2:
    """The lean GPT-2 module holding `state`; tied means lm_head.weight *is* wte.weight."""
    with torch.device("meta"):
        model = GPT2(config, tied=tied)
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CorruptCheckpoint(f"{_names(files)} lacks {', '.join(missing[:3])}{more}")
    # Popped from `state`: once lay_out_ has put a matrix in its own layout, nothing holds the old one,
    # so loading peaks at one matrix above the model, not at two models.
    weights = {k: state.pop(k).to(dtype) for k in expected}
    try:
        model.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1].strip()
        raise CorruptCheckpoint(f"{_names(files)} does not fit the config: {first}") from None
    del weights
    if tied:
        model.lm_head.weight = model.wte.weight  # assign=True replaced wte's Parameter: tie again
    return model.to(device).eval().lay_out_()


def build_transformers(config: dict, state: dict[str, torch.Tensor], tied: bool,
                       device: torch.device, dtype: torch.dtype):
    """transformers' own model for `config`, holding the same tensors (tied by transformers itself)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures",)})
    cfg.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    prefix = model.base_model_prefix + "."
    named = {k.removeprefix(prefix): k for k in model.state_dict()}
    mapped = {named.get(k, k): v.to(dtype) for k, v in state.items() if named.get(k, k) in named.values()}
    missing = [k for k in model.state_dict() if k not in mapped and not (tied and k.startswith("lm_head."))
               and not k.endswith(_NOT_WEIGHTS)]
    if missing:
        raise CorruptCheckpoint(f"the weights lack {', '.join(missing[:3])} for transformers' "
                                f"{type(model).__name__}")
    model.load_state_dict(mapped, strict=False)
    if tied:
        model.tie_weights()
    return model.to(device).eval()
