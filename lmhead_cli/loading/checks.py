"""A checkpoint checked before anything is allocated: its config's types and ranges, its shard
index (confined to its folder), its tensor header against the config, and the memory the model
will take against the memory there is.

Everything here reads text and safetensors headers only (names, dtypes, shapes: a few kB), never a
tensor. Each problem is one CorruptCheckpoint (or UsageError) line naming the file and the fact, so
no malformed folder reaches a KeyError, an IndexError or an allocation that cannot succeed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lmhead_cli.errors import CorruptCheckpoint, LmheadError, Param

GPT2_INTS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
# Bytes per element of the safetensors dtypes a checkpoint may hold.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
TORCH_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
LARGE_BYTES = 2 * 1024**3  # a model estimated above this is announced before it is built
_BLOCK = re.compile(r"^h\.(\d+)\.")


# ---- the config ------------------------------------------------------------------------------

def _int(config: dict, key: str, path, low: int = 1, required: bool = True) -> int | None:
    value = config.get(key)
    if value is None and not required:
        return None
    if value is None:
        raise CorruptCheckpoint(f"{path}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptCheckpoint(f"{path}: {key} must be a whole number, not {json.dumps(value)[:40]}")
    if value < low:
        raise CorruptCheckpoint(f"{path}: {key} must be at least {low}, not {value}")
    return value


def check_config(config, path) -> None:
    """Types and ranges of the config keys lmhead reads. GPT-2 configs are checked in full (what the
    lean engine builds from); any config's token ids must lie inside its vocabulary."""
    if not isinstance(config, dict):
        raise CorruptCheckpoint(f"{path} must hold a JSON object, not {type(config).__name__}")
    kind = config.get("model_type")
    if kind is not None and not isinstance(kind, str):
        raise CorruptCheckpoint(f"{path}: model_type must be a string, not {json.dumps(kind)[:40]}")
    if kind == "gpt2":
        V, _, d, _, heads = (_int(config, k, path) for k in GPT2_INTS)
        if d % heads:
            raise CorruptCheckpoint(f"{path}: n_embd {d} is not divisible by n_head {heads}")
        _int(config, "n_inner", path, required=False)
        eps = config.get("layer_norm_epsilon", 1e-5)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise CorruptCheckpoint(f"{path}: layer_norm_epsilon must be a finite number above 0, not {eps!r}")
        tie = config.get("tie_word_embeddings", True)
        if not isinstance(tie, bool):
            raise CorruptCheckpoint(f"{path}: tie_word_embeddings must be true or false, not {json.dumps(tie)[:40]}")
    else:
        V = config.get("vocab_size")
        V = V if isinstance(V, int) and not isinstance(V, bool) and V > 0 else None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        for i in ids:
            if i is None:
                continue
            if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (V is not None and i >= V):
                raise CorruptCheckpoint(f"{path}: {key} {json.dumps(value)[:40]} is not a token id of its "
                                        f"vocabulary (0 to {V - 1 if V else '?'})")
    check_rope(config, path)


# RoPE's settings (transformers' RopeParameters) by the type each must have.
ROPE_KINDS = {
    "a number": ("rope_theta", "partial_rotary_factor", "factor", "attention_factor", "beta_fast", "beta_slow",
                 "low_freq_factor", "high_freq_factor", "mscale", "mscale_all_dim"),
    "an integer": ("original_max_position_embeddings",),
    "a list of numbers": ("short_factor", "long_factor"),
    "a list of integers": ("mrope_section",),
    "a string": ("rope_type", "type"),
    "true or false": ("truncate",),
}


def check_rope(config: dict, path) -> None:
    """rope_scaling and rope_parameters (one table, or one per layer type: {"full_attention": {...}}), each
    setting of the type transformers computes with, before transformers reads them: a factor given as a
    string makes it warn (twice: the config is built twice) and then fail in a tensor division, far from
    the config. Ranges are transformers' own to judge."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CorruptCheckpoint(f"{path}: {key} must be an object of RoPE settings, not {json.dumps(value)[:40]}")
        nested = value and all(v is None or isinstance(v, dict) for v in value.values())
        for layer, table in (value.items() if nested else [(None, value)]):
            for name, v in (table or {}).items():
                kind = next((k for k, names in ROPE_KINDS.items() if name in names), None)
                if kind is not None and not _rope_value_is(kind, v):
                    where = f"{key}.{layer}" if layer is not None else key
                    raise CorruptCheckpoint(f"{path}: {where}'s {name} must be {kind}, not {json.dumps(v)[:40]}")


def _rope_value_is(kind: str, v) -> bool:
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def integer(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    return {"a number": lambda: v is None or number(v),
            "an integer": lambda: v is None or integer(v),
            "a list of numbers": lambda: v is None or isinstance(v, list) and all(map(number, v)),
            "a list of integers": lambda: v is None or isinstance(v, list) and all(map(integer, v)),
            "a string": lambda: isinstance(v, str),
            "true or false": lambda: v is None or isinstance(v, bool)}[kind]()


def check_vocabularies(tokenizer_size: int, vocab_size: int, origin: str, path) -> None:
    """A tokenizer whose ids reach past the model's embedding rows would index out of the table."""
    if tokenizer_size > vocab_size:
        raise CorruptCheckpoint(f"{path}: vocab_size is {vocab_size:,} but the tokenizer ({origin}) has "
                                f"{tokenizer_size:,} tokens; ids from {vocab_size:,} on would have no embedding row")


# ---- the files -------------------------------------------------------------------------------

MAX_JSON_BYTES = 256 * 1024**2  # a config, a shard index or a tokenizer.json larger than this is not one


def regular_file(path: Path) -> Path:
    """`path` itself, when it is a regular file (or a link to one): a FIFO, a device or a socket is a
    CorruptCheckpoint naming it, found by stat() without opening it (opening a FIFO blocks until a
    writer comes). A missing path or a folder passes through, for the caller's own message."""
    from lmhead_cli.inputs import special_kind

    try:
        kind = special_kind(os.stat(path).st_mode)
    except OSError:
        return path
    if kind is not None:
        raise CorruptCheckpoint(f"{path} is {kind}, not a regular file; lmhead reads checkpoint files only from "
                                "regular files (reading a FIFO would wait for a writer)")
    return path


def not_a_file(path) -> str | None:
    """Why `path` is not a regular file lmhead can open (stat() only: a FIFO is never opened), or None:
    "no such file", "it is a symbolic link loop" (stat's ELOOP, which Path.exists() reports as no
    file), "it is a folder", "it is a FIFO (named pipe), not a regular file", ..."""
    import errno
    import stat

    from lmhead_cli.inputs import special_kind

    if not os.fspath(path):
        return "the path is empty"
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "it is a symbolic link loop (its links lead back to themselves)"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "no such file" + (" (a symbolic link to nothing)" if os.path.islink(path) else "")
        return e.strerror or type(e).__name__
    if stat.S_ISDIR(mode):
        return "it is a folder, not a file"
    kind = special_kind(mode)
    return f"it is {kind}, not a regular file (reading it could wait for ever)" if kind else None


def existing_file(path: Path) -> Path:
    """`path` (a model given as a file), when it is a regular file (or a link to one); otherwise
    ModelPathNotFound (a usage error, as every bad path is) naming the path and why (not_a_file)."""
    from lmhead_cli.errors import ModelPathNotFound

    why = not_a_file(path)
    if why is None:
        return path
    raise ModelPathNotFound(f"{why}: {path}" if why.startswith("no such file") else f"{path} cannot be read: {why}")


def read_json(path: Path, limit: int = MAX_JSON_BYTES):
    """A checkpoint's JSON file (config.json, the shard index, tokenizer.json), or a CorruptCheckpoint
    naming it: not a regular file, too large, not UTF-8, not JSON, nested too deeply. A UTF-8
    byte-order mark is allowed (some editors write one)."""
    regular_file(path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise CorruptCheckpoint(f"{path} cannot be read: {e.strerror or e}") from None
    if len(data) > limit:
        raise CorruptCheckpoint(f"{path} is larger than {limit:,} bytes, more than any such file holds")
    try:
        return json.loads(data.decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise CorruptCheckpoint(f"{path} is not a config lmhead can read: its JSON is nested too deeply") from None


def shard_files(index: Path) -> list[Path]:
    """The shard files named by `model.safetensors.index.json`, each confined to the index's folder:
    a plain file name or a relative path below it, never absolute, never through `..`."""
    doc = read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpoint(f"{index} has no weight_map (tensor name -> shard file)")
    names = set()
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CorruptCheckpoint(f"{index}: the shard of {tensor!r} is not a file name: {json.dumps(name)[:40]}")
        parts = Path(name).parts
        if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or "\\" in name:
            raise CorruptCheckpoint(f"{index} names {name!r} as a shard, outside its folder; shards must be "
                                    "files in the checkpoint's own folder")
        names.add(os.path.normpath(name))
    return [index.parent / n for n in sorted(names)]


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors' name, e.g. "F32"
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 4)


def read_header(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor's name, dtype and shape from the safetensors headers (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    header: dict[str, TensorInfo] = {}
    for path in files:
        if not path.exists():
            raise CorruptCheckpoint(f"{path} is listed in the index but missing")
        regular_file(path)
        if not os.access(path, os.R_OK):
            raise CorruptCheckpoint(f"{path} cannot be read: permission denied")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    if name in header:
                        raise CorruptCheckpoint(f"{path} and {header[name].file} both hold {name}")
                    header[name] = TensorInfo(part.get_dtype(), tuple(part.get_shape()), path)
        except CorruptCheckpoint:
            raise
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CorruptCheckpoint(f"{path} cannot be read as safetensors (truncated or corrupt?): "
                                    f"{str(e).splitlines()[0][:200]}") from None
    return header


def gpt2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a GPT-2 checkpoint holds for `config`, names without `transformer.`; lm_head.weight
    only when the head is untied. (GPT-2's Conv1D stores its weights [in, out].)"""
    V, P, d, L = (config[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer"))
    inner = config.get("n_inner") or 4 * d
    shapes = {"wte.weight": (V, d), "wpe.weight": (P, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(L):
        for name, shape in (("ln_1.weight", (d,)), ("ln_1.bias", (d,)), ("attn.c_attn.weight", (d, 3 * d)),
                            ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.weight", (d, d)),
                            ("attn.c_proj.bias", (d,)), ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
                            ("mlp.c_fc.weight", (d, inner)), ("mlp.c_fc.bias", (inner,)),
                            ("mlp.c_proj.weight", (inner, d)), ("mlp.c_proj.bias", (d,))):
            shapes[f"h.{i}.{name}"] = shape
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (V, d)
    return shapes


def _dims(shape) -> str:
    return " × ".join(f"{n:,}" for n in shape) or "a scalar"


def check_gpt2_header(config: dict, header: dict[str, TensorInfo], files: list[Path], config_path,
                      buffers: tuple[str, ...]) -> None:
    """The header against a GPT-2 config: the layer count first (cheap, and what a wrong n_layer
    breaks), then every tensor's name and shape; stored buffers (the causal mask) and a stored copy
    of a tied head are allowed. One line per fact, naming the files and the config."""
    where = ", ".join(str(f) for f in files)
    names = {n.removeprefix("transformer."): info for n, info in header.items()}
    layers = sorted({int(m.group(1)) for n in names if (m := _BLOCK.match(n))})
    L = config["n_layer"]
    if layers != list(range(L)):
        held = f"{len(layers)} blocks (h.{layers[0]} … h.{layers[-1]})" if layers else "no blocks"
        raise CorruptCheckpoint(f"{config_path} says n_layer {L:,}, but {where} holds {held}")
    expected = gpt2_shapes(config)
    missing = [n for n in expected if n not in names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CorruptCheckpoint(f"{where} lacks {', '.join(missing[:3])}{more} (config {config_path})")
    for name, shape in expected.items():
        if tuple(names[name].shape) != shape:
            raise CorruptCheckpoint(f"{names[name].file}: {name} is {_dims(names[name].shape)}, but {config_path} "
                                    f"makes it {_dims(shape)}")
    extra = [n for n in names if n not in expected and not n.endswith(buffers)
             and not (n == "lm_head.weight" and names[n].shape == expected["wte.weight"])]
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise CorruptCheckpoint(f"{where} holds {', '.join(extra[:3])}{more}, which a GPT-2 of this config "
                                f"has no place for ({config_path})")


# ---- memory ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryPlan:
    parameters: int
    model_bytes: int  # the model's tensors in the dtype asked for
    peak_bytes: int  # with the source tensors still held while they are converted
    device: str
    available: int | None  # bytes free on that device, None when it cannot be told

    def describe(self) -> str:
        return (f"about {gb(self.peak_bytes)} at its peak ({self.parameters / 1e9:.2f} B parameters, "
                f"{gb(self.model_bytes)} once loaded)")


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def plan_memory(parameters: int, dtype: str, source_bytes: int, device: str) -> MemoryPlan:
    """What loading takes: the model in `dtype`, plus the source tensors (a file's, or random float32
    weights) while they are converted when their dtype differs."""
    model_bytes = parameters * TORCH_BYTES[dtype]
    peak = model_bytes + (source_bytes if source_bytes != model_bytes else 0)
    return MemoryPlan(parameters, model_bytes, peak, device, available_memory(device))


def available_memory(device: str) -> int | None:
    """Free memory on `device` (bytes): CUDA's own figure, else the host's MemAvailable."""
    if device == "cuda":
        import torch

        try:
            return int(torch.cuda.mem_get_info()[0])
        except RuntimeError:
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class NotEnoughMemory(LmheadError):
    """The model would not fit in the memory there is."""


def check_memory(plan: MemoryPlan, source: str, insist: bool, say) -> None:
    """Announce a large model (`say(line)`), and refuse one above the memory available unless `insist`."""
    if plan.available is not None and plan.peak_bytes > plan.available and not insist:
        raise NotEnoughMemory(f"{source} needs {plan.describe()}, but {gb(plan.available)} is available on "
                              f"{plan.device}; ", Param("ignore_memory"), " tries anyway")
    if plan.peak_bytes >= LARGE_BYTES:
        say(f"{source}: loading needs {plan.describe()}")
