"""Model sources: a hub id, a local folder, `random:NAME` or `bundled:NAME` -> a loaded engine,
tokenizer and tie report.

Weights come from safetensors (memory-mapped) unless --allow-pickle; remote code is never run.
Nothing here prints: progress bars are huggingface_hub's own, on stderr.
"""

from __future__ import annotations

import math
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from lmhead_cli.engine.base import Engine
from lmhead_cli.engine.hf import TransformersEngine, check_head_is_known
from lmhead_cli.engine.lean import GPT2, TIE_NAMES, Conv1D, LeanGPT2, conv1d_weight, init_random_, quantise_gpt2_
from lmhead_cli.engine import pages
from lmhead_cli.engine.execution import Execution
from lmhead_cli.errors import (CorruptCheckpoint, HubUnreachable, LmheadError, ModelNotFound, ModelPathNotFound,
                               Notice, Param, UnsupportedModel, UsageError)
from lmhead_cli.loading import bundled, checks, gguf, validate
from lmhead_cli.loading.model_configs import config_names, load_config
from lmhead_cli.loading.tie import TieReport, file_tie, tie_report  # noqa: F401 - the tie's own module
from lmhead_cli.loading.tokenizer import GPT2Tokenizer
from lmhead_cli.loading.weights import NOT_WEIGHTS as _NOT_WEIGHTS
from lmhead_cli.loading.weights import read_weights, weight_files

DEFAULT_SOURCE = "gpt2"  # what runs when no model is named ...
OFFLINE_SOURCE = "bundled:tiny"  # ... unless gpt2 is neither cached nor reachable: then this, which ships
RANDOM_PREFIX = "random:"
RANDOM_SEED = 0
DEVICES = ("auto", "cpu", "cuda", "mps")
# int8: weight-only, quantised at load from float32 (engine/int8.py); activations stay float32.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
ENGINES = ("auto", "lean", "transformers")
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "vocab.json", "merges.txt", "generation_config.json"]


@dataclass
class Loaded:
    """A model ready to run: what the user asked for, where it came from, and the pieces."""

    source: str
    kind: str  # "hub", "local", "random", "bundled" or "gguf"
    path: str | None
    random_weights: bool
    seed: int | None
    config: dict
    engine: Engine
    tokenizer: GPT2Tokenizer
    tie: TieReport
    execution: Execution  # how its work runs: threads, product forms, compiled kernels, memory (engine/execution.py)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise UsageError("unknown ", Param("device"), f" {name!r}; choose one of: {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LmheadError(Param("device"), " cuda: no CUDA device is available here; use ", Param("device"), " cpu")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise LmheadError(Param("device"), " mps: MPS is not available here; use ", Param("device"), " cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError("unknown ", Param("dtype"), f" {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(source: str | None, *, device: str = "auto", dtype: str = "float32", engine: str = "auto",
               allow_pickle: bool = False, threads: int | None = None, ignore_memory: bool = False,
               announce=lambda line: None) -> Loaded:
    """Load `source` (hub id, local folder, random:NAME or bundled:NAME) onto `device` in `dtype`, on `threads` CPU
    threads (None: chosen by timing the work, see engine/threads.py).

    Before any tensor is allocated the config is checked (types, ranges), a checkpoint's tensor
    header against it, and the memory the model needs against the memory there is (loading/checks.py):
    a large model is announced with `announce(line)`, one that cannot fit is refused unless
    `ignore_memory`. The load runs on the model's thread count, and the caller's is restored after it
    (engine/execution.py).

    `source` None is the default model, DEFAULT_SOURCE (gpt2); when it is not in the Hugging Face cache
    and the hub is offline or cannot be reached, OFFLINE_SOURCE (bundled:tiny) runs instead, and
    `announce` hears why first. A source named, gpt2 included, never falls back."""
    if engine not in ENGINES:
        raise UsageError("unknown ", Param("engine"), f" {engine!r}; choose one of: {', '.join(ENGINES)}")
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    int8 = dt == torch.int8  # built in float32, then quantised: activations, norms and softmax stay float32
    dt = torch.float32 if int8 else dt
    if int8 and engine == "transformers":
        raise UsageError(Param("dtype"), " int8 is the lean engine's (GPT-2 checkpoints); with ", Param("engine"),
                         " transformers use float32, bfloat16 or float16")
    execution = Execution(threads, dev.type)
    with execution.scope():
        if source is not None:
            return _load(source, execution, dev, dt, dtype, int8, engine, allow_pickle, ignore_memory, announce)
        try:
            return _load(DEFAULT_SOURCE, execution, dev, dt, dtype, int8, engine, allow_pickle, ignore_memory,
                         announce)
        except HubUnreachable as e:
            announce(Notice(f"{DEFAULT_SOURCE} (the default model) {e.why}: running on {OFFLINE_SOURCE} instead, a "
                            "small GPT-2 that ships with lmhead; ", Param("source"), f" {DEFAULT_SOURCE} insists"))
            return _load(OFFLINE_SOURCE, execution, dev, dt, dtype, int8, engine, allow_pickle, ignore_memory,
                         announce)


def _load(source: str, execution: Execution, dev: torch.device, dt: torch.dtype, dtype: str, int8: bool, engine: str,
          allow_pickle: bool, ignore_memory: bool, announce) -> Loaded:
    """load_model's work, inside the model's execution scope."""
    if not source or not source.strip():
        raise UsageError(Param("source"), " is empty; pass a hub id (gpt2), a local folder, bundled:tiny or random:gpt2")

    if source.startswith(RANDOM_PREFIX):
        name = source[len(RANDOM_PREFIX):]
        if name not in config_names():
            raise UsageError(f"unknown random model {source!r}; choose one of: "
                             + ", ".join(RANDOM_PREFIX + n for n in config_names()))
        config = load_config(name)
        n = sum(math.prod(shape) for shape in checks.gpt2_shapes(config).values())
        checks.check_memory(checks.plan_memory(n, dtype, 4 * n, dev.type), source, ignore_memory, announce)
        state = random_state(config, RANDOM_SEED)
        kind, folder, files = "random", None, []
        engine_name = validate.checkpoint_engine(engine, config, announce)
        tokenizer = GPT2Tokenizer.bundled()
    elif gguf.is_gguf(source):
        # llama.cpp's file: header checked, memory planned, then read and dequantised (loading/gguf.py)
        folder, kind = None, "gguf"
        files = [Path(source).expanduser()]
        header = gguf.read_header(files[0])
        n = sum(math.prod(t.dims) for t in header.tensors)
        # a Llama's or Qwen2's quantised matrices stay blocks on the lean engine in float32 (engine/quant.py)
        keep = dtype == "float32" and engine != "transformers" and header.meta.get("general.architecture") != "gpt2"
        held = sum(t.nbytes for t in header.tensors)  # the file's blocks as they are (the F32 ones too)
        plan = (checks.MemoryPlan(n, held, held, dev.type, checks.available_memory(dev.type)) if keep
                else checks.plan_memory(n, dtype, 4 * n, dev.type))
        checks.check_memory(plan, source, ignore_memory, announce)
        found = gguf.read_gguf(files[0], header, keep=keep)
        config, state, tokenizer = found.config, found.state, found.tokenizer
        checks.check_config(config, files[0])
        engine_name = validate.checkpoint_engine(engine, config, announce)
        if engine_name != "lean":
            state, found.kept = gguf.materialise(state, config, files[0]), {}
        if engine_name == "transformers" or config.get("model_type") != "gpt2":
            validate.check_config_for(config, files[0])
        if int8 and not (engine_name == "lean" and config["model_type"] == "gpt2"):
            raise UsageError(Param("dtype"), f" int8 runs on the lean engine, which takes GPT-2 only (this GGUF is "
                             f"{config['model_type']!r}); use float32, which keeps its quantised blocks as they are")
        announce(found.describe(files[0], dtype))
        for note in found.notes:
            announce(note)
    else:
        folder, kind = _find_folder(source, allow_pickle)
        config = _read_config(folder)
        # Every check before any tensor is read or any model built (loading/validate.py): the engine
        # (refused, or routed with a note), the config as transformers will build it, the files' dtypes,
        # names, shapes and layer count, the memory.
        gpt2 = config.get("model_type") == "gpt2"
        if not gpt2:  # before a note on the engine, which reads the config
            validate.check_config_for(config, folder / "config.json")
        engine_name = validate.checkpoint_engine(engine, config, announce)
        if engine_name == "transformers" and gpt2:
            validate.check_config_for(config, folder / "config.json")
        tokenizer = GPT2Tokenizer.from_folder(folder) or GPT2Tokenizer.bundled()
        if int8 and not (engine_name == "lean" and gpt2):
            raise UsageError(Param("dtype"), " int8 is lean GPT-2's (this is "
                             f"{config.get('model_type')!r}, run on {engine_name}); use float32, bfloat16 or float16")
        files = weight_files(folder, allow_pickle)
        if all(f.suffix == ".safetensors" for f in files):
            header = checks.read_header(files)
            validate.check_tensors(config, validate.header_tensors(header), folder / "config.json")
            if engine_name == "lean" and config.get("model_type") == "gpt2":  # the others against their skeletons
                checks.check_gpt2_header(config, header, files, folder / "config.json", _NOT_WEIGHTS)
            weights = {k: t for k, t in header.items() if not k.endswith(_NOT_WEIGHTS)}
            n, size = sum(math.prod(t.shape) for t in weights.values()), sum(t.nbytes for t in weights.values())
        else:  # a pickle has no header: its size on disk is the estimate, its tensors are checked once read
            size = sum(f.stat().st_size for f in files)
            n = size // 4
        checks.check_memory(checks.plan_memory(n, dtype, size, dev.type), source, ignore_memory, announce)
        state = read_weights(files)
        if not all(f.suffix == ".safetensors" for f in files):
            validate.check_tensors(config, validate.state_tensors(state, files[0]), folder / "config.json")

    if engine_name == "lean" and config.get("model_type") != "gpt2":  # Llama, Qwen2 (loading/llama.py)
        from lmhead_cli.engine.llama import TIE_NAMES as LLAMA_TIE_NAMES
        from lmhead_cli.loading.llama import build_llama

        stored = file_tie(state, LLAMA_TIE_NAMES) if files else None
        eng = build_llama(config, state, files, dev, dt)
        config_tied = bool(config.get("tie_word_embeddings", False))
    elif engine_name == "lean":
        config_tied = bool(config.get("tie_word_embeddings", True))
        stored = file_tie(state, TIE_NAMES) if files else None  # before build_lean consumes the state
        eng: Engine = LeanGPT2(config, build_lean(config, state, config_tied, files, dev, dt, int8, announce))
    else:
        eng, config_tied = build_transformers(config, state, files, dev, dt)
        stored = file_tie(state, eng.tie_names) if files else None
    state.clear()  # the model holds what it needs
    tie = tie_report(eng, stored, config_tied)
    execution.offer(eng)  # the product forms the engine can run in are timed with the thread counts
    line = execution.kernels_notice(eng.weight_format) if eng.name == "lean" else None
    if line:
        announce(line)
    # After the build, whose own checks name an unsupported model first; before any prompt is read.
    checks.check_vocabularies(tokenizer.vocab_size, eng.vocab_size, tokenizer.origin,
                              (folder / "config.json") if folder else source)
    return Loaded(source=source, kind=kind, path=str(folder) if folder else str(files[0]) if kind == "gguf" else None,
                  random_weights=kind == "random", seed=RANDOM_SEED if kind == "random" else None,
                  config=config, engine=eng, tokenizer=tokenizer, tie=tie, execution=execution)


def model_type(source: str, allow_pickle: bool = False) -> str | None:
    """The config's model_type of `source` ("gpt2" for random:NAME), read without any weights."""
    if source.startswith(RANDOM_PREFIX):
        return "gpt2"
    if gguf.is_gguf(source):
        return gguf.architecture(Path(source).expanduser())
    return _read_config(_find_folder(source, allow_pickle)[0]).get("model_type")


# ---- where the files are ---------------------------------------------------------------------

def _find_folder(source: str, allow_pickle: bool) -> tuple[Path, str]:
    if bundled.is_bundled(source):
        return bundled.folder(source), "bundled"
    path = Path(source).expanduser()
    if not path.exists() and path.is_symlink():  # a loop, or a link to nothing: exists() says only False
        raise ModelPathNotFound(f"{source} cannot be read: {checks.not_a_file(path)}")
    if path.exists():
        if not path.is_dir():
            raise ModelPathNotFound(f"{source!r} is a file; ", Param("source"), " takes a folder holding config.json and "
                                "model.safetensors")
        return path, "local"
    if source.startswith((".", "/", "~")) or source.count("/") > 1:  # a path, not "org/name"
        raise ModelPathNotFound(f"no such folder: {source}")
    return _hub_folder(source, allow_pickle), "hub"


def _hub_folder(repo_id: str, allow_pickle: bool) -> Path:
    """The cached snapshot of `repo_id`, downloading it once (with a progress bar) if the hub is reachable."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = HUB_FILES + (["pytorch_model.bin"] if allow_pickle else [])
    name = repo_id.rsplit("/", 1)[-1]  # openai-community/gpt2-medium -> the bundled gpt2-medium
    stand_in = RANDOM_PREFIX + (name if name in config_names() else "gpt2")
    source = Param("source")
    advice = ("connect once to download it, pass a local folder (", source, " ./my-gpt2), or use ",
              source, f" {stand_in} for {'its architecture with ' if name in config_names() else ''}random weights "
              "offline, or ", source, " bundled:tiny for a small trained model that ships with lmhead")
    cache_dir = _hub_cache()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True, cache_dir=cache_dir))
    except HFValidationError:
        raise ModelNotFound(f"{repo_id!r} is neither a local folder nor a valid hub id") from None
    except Exception:  # noqa: BLE001 - not cached: fall through to the network
        pass
    for why, offline in (("is not in the Hugging Face cache and HF_HUB_OFFLINE is set", _offline),
                         ("is not in the Hugging Face cache and the hub can't be reached",
                          lambda: not _reachable(constants.ENDPOINT))):
        if offline():
            e = HubUnreachable(f"{repo_id!r} {why}; ", *advice)
            e.why = why
            raise e
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir))
    except Exception as e:  # noqa: BLE001 - RepositoryNotFound, gated, network drop: one line
        raise ModelNotFound(f"could not download {repo_id!r} ({type(e).__name__}); ", *advice) from None


def _offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub read it at import or as the environment says now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


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
    if not path.exists():
        raise ModelNotFound(f"{folder} holds no config.json (expected config.json and model.safetensors)")
    config = checks.read_json(path)
    checks.check_config(config, path)
    return config



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
               device: torch.device, dtype: torch.dtype, int8: bool = False, announce=lambda line: None) -> GPT2:
    """The lean GPT-2 module holding `state`; tied means lm_head.weight *is* wte.weight. int8: every
    matrix quantised (engine/int8.py; `announce` hears of a device without an int8 kernel)."""
    if not tied and "lm_head.weight" not in state:
        raise CorruptCheckpoint(f"{_names(files)}: the config unties the head (tie_word_embeddings: false) "
                                "but the weights hold no lm_head.weight")
    with torch.device("meta"):
        model = GPT2(config, tied=tied)
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CorruptCheckpoint(f"{_names(files)} lacks {', '.join(missing[:3])}{more}")
    # Popped from `state`: the caller's dict does not keep a tensor alive that the model lets go of.
    convs = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Conv1D)}
    # weights made here from a file's (converted, quantised): random draws (tests) stay where torch put them
    made = bool(files) and (int8 or any(state[k].dtype != dtype for k in convs))
    weights = {k: conv1d_weight(state.pop(k), dtype, device) if k in convs else state.pop(k).to(dtype)
               for k in expected}
    try:
        model.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1].strip()
        raise CorruptCheckpoint(f"{_names(files)} does not fit the config: {first}") from None
    del weights
    if tied:
        model.lm_head.weight = model.wte.weight  # assign=True replaced wte's Parameter: tie again
    if int8:
        quantise_gpt2_(model, tied, device, announce)
    model = model.to(device).eval()
    if made:
        pages.pack(model)  # the weights converted or quantised here onto 2 MiB pages (engine/pages.py)
    return model


def build_transformers(config: dict, state: dict[str, torch.Tensor], files: list[Path],
                       device: torch.device, dtype: torch.dtype) -> tuple[TransformersEngine, bool]:
    """transformers' own model for `config` holding `state`, and whether its config ties the head.

    The model is first built on the meta device (no memory) and its tensors' names and shapes are
    checked against the checkpoint's, so a config that disagrees with the weights (a wrong
    model_type, another width) is an error naming both, never an allocation. Only then does
    transformers load the tensors (from_pretrained with the state dict: its own buffers, its own tie).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    cfg = validate.transformers_config(config)
    check_head_is_known(cfg)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(cfg)
    except ValueError:
        raise UnsupportedModel(f"transformers has no causal LM for model_type {cfg.model_type!r}") from None
    state = fit_state(skeleton, state, files)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar is noise for a checked state dict
    try:
        model = type(skeleton).from_pretrained(None, config=cfg, state_dict=state, dtype=dtype)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    return TransformersEngine(config, model.to(device).eval()), bool(cfg.tie_word_embeddings)


def fit_state(skeleton, state: dict[str, torch.Tensor], files: list[Path]) -> dict[str, torch.Tensor]:
    """`state` under the meta-device `skeleton`'s names, checked against its tensors: every tensor there,
    each of the right shape, nothing left over. A tied head stored in the file is dropped (the head
    *is* the embedding). CorruptCheckpoint names the model's and the file's parameter counts and the
    first few disagreements."""
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items() if not k.endswith(_NOT_WEIGHTS)}
    tied_heads = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    prefix = skeleton.base_model_prefix + "."
    fitted = {}
    for name, t in state.items():
        key = name if name in expected or prefix + name not in expected else prefix + name
        if key not in tied_heads:
            fitted[key] = t
    ignore = [re.compile(p) for p in getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or []]
    missing = [k for k in expected if k not in fitted and k not in tied_heads]
    extra = [k for k in fitted if k not in expected and not any(p.search(k) for p in ignore)]
    wrong = [f"{k} is {_dims(expected[k])} in the config but {_dims(fitted[k].shape)} in the file"
             for k in expected if k in fitted and tuple(fitted[k].shape) != expected[k]]
    if missing or extra or wrong:
        n_model = sum(p.numel() for p in skeleton.parameters())
        n_file = sum(t.numel() for t in state.values())
        problems = wrong[:2] + ([f"it lacks {_few(missing)}"] if missing else []) + (
            [f"it holds {_few(extra)} that the model has no place for"] if extra else [])
        raise CorruptCheckpoint(
            f"{_names(files)} does not fit its config.json: the config describes transformers' "
            f"{type(skeleton).__name__} ({skeleton.config.model_type}) with {n_model:,} parameters, the file "
            f"holds {n_file:,}; " + "; ".join(problems))
    return {k: t for k, t in fitted.items() if k in expected}


def _dims(shape) -> str:
    return "×".join(str(int(n)) for n in shape) or "a scalar"


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
