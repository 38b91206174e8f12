"""The checkpoint validator: everything lmhead checks in a folder before it builds a model from it.

`checkpoint_engine` decides the engine from the config (a GPT-2 field the lean engine does not
compute sends the model to transformers, with a note); `check_config_for` runs transformers' own
strict validation on a config that transformers will build, and turns its error into one line;
`check_tensors` checks every tensor's dtype and the layer count against the config, from the
safetensors header (or a pickle's names, with --allow-pickle). loading/checks.py holds the rest
(types and ranges of GPT-2's keys, the header's names and shapes, memory); loading/tokenizer.py
checks the tokenizer files. Each problem is one CorruptCheckpoint (or UsageError) line naming the
file and the fact, raised before any model is built.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

from lmhead_cli.engine import gpt2_fields
from lmhead_cli.errors import CorruptCheckpoint, Param, UnsupportedModel, UsageError

FLOATING = ("F16", "BF16", "F32", "F64")
TORCH_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64", "int8": "I8",
               "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL"}
# Buffers a checkpoint may store that are not weights (GPT-2's causal mask, position ids).
BUFFERS = (".attn.bias", ".attn.masked_bias", "position_ids")
# Sizes and counts in any architecture's config that must be whole numbers of at least 1.
POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "n_positions", "n_embd", "n_layer",
            "n_head", "n_ctx", "ffn_dim", "d_model", "num_layers", "num_heads")
ACTIVATIONS = ("hidden_act", "hidden_activation", "activation_function")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_LIST_ITEM = re.compile(r"^(.*?)\.(\d+)\.")


# ---- the engine --------------------------------------------------------------------------------

def checkpoint_engine(engine: str, config: dict, announce) -> str:
    """"lean" or "transformers" for `engine` ("auto", "lean" or "transformers") and this config.
    GPT-2, Llama and Qwen2 run on the lean engines; a config with a field they do not compute
    (gpt2_fields.ROUTED, engine/llama.py lean_cannot_run) runs on transformers, announced;
    `--engine lean` refuses it, naming the fields."""
    from lmhead_cli.engine.llama_fields import ARCHITECTURES, lean_cannot_run

    kind = config.get("model_type")
    is_gpt2, is_llama = kind == "gpt2", kind in ARCHITECTURES
    if engine == "lean" and not (is_gpt2 or is_llama):
        raise UsageError(f"the lean engine runs GPT-2, Llama and Qwen2 checkpoints (this is {kind!r}); use ",
                         Param("engine"), " transformers")
    lacks = gpt2_fields.lean_cannot_run(config) if is_gpt2 else lean_cannot_run(config) if is_llama else []
    if engine == "lean" and lacks:
        raise UsageError(f"the lean engine computes plain {'GPT-2' if is_gpt2 else kind}, and this config asks for "
                         f"{', '.join(lacks)}; use ", Param("engine"), " transformers")
    if engine == "auto":
        if (is_gpt2 or is_llama) and lacks:
            announce(f"running on transformers' {'GPT-2' if is_gpt2 else kind}: the config asks for "
                     f"{', '.join(lacks)}, which the lean engine does not compute")
            return "transformers"
        return "lean" if is_gpt2 or is_llama else "transformers"
    return engine


# ---- the config, as transformers will build it ---------------------------------------------------

def check_config_for(config: dict, path) -> None:
    """Ranges transformers does not check (a size of 0 or -5, an unknown activation, a soft-cap of 0),
    then transformers' own strict validation of the config, its error as one line naming `path`.
    Only for a model transformers builds: it imports transformers."""
    for key in POSITIVE:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise CorruptCheckpoint(f"{path}: {key} must be at least 1, not {value}")
    cap = config.get("final_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or not (math.isfinite(cap) and cap > 0)):
        raise CorruptCheckpoint(f"{path}: final_logit_softcapping must be null or a number above 0 (the logits "
                                f"become c·tanh(z/c)), not {json.dumps(cap)[:40]}")
    from transformers.activations import ACT2FN

    for key in ACTIVATIONS:
        act = config.get(key)
        if act is not None and (not isinstance(act, str) or act not in ACT2FN):
            raise CorruptCheckpoint(f"{path}: {key} {json.dumps(act)[:40].replace(chr(34), chr(39))} is not an "
                                    f"activation transformers knows")
    transformers_config(config, path)


def transformers_config(config: dict, path="config.json"):
    """transformers' config object for a config.json dict (never remote code); an unknown model_type is
    UnsupportedModel, a config its strict validation rejects is CorruptCheckpoint with its reason."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind = config.get("model_type")
    if kind not in CONFIG_MAPPING:
        if config.get("auto_map"):
            raise UnsupportedModel(f"model_type {kind!r} needs the checkpoint's own code (auto_map), which "
                                   "lmhead never runs")
        raise UnsupportedModel(f"transformers does not know model_type {kind!r}")
    try:
        return AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    except Exception as e:  # noqa: BLE001 - strict dataclass errors, ZeroDivisionError, TypeError: one line
        raise CorruptCheckpoint(f"{path}: transformers rejects this {kind} config: {reason(e)}") from None


def reason(e: Exception) -> str:
    """The last line of a (possibly multi-line) library error, without its "TypeError: " label."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    last = lines[-1] if lines else type(e).__name__
    return re.sub(r"^\w+(Error|Exception): ", "", last)[:240]


# ---- the tensors, against the config -------------------------------------------------------------

def check_tensors(config: dict, tensors: Iterable[tuple[str, str, Path]], config_path) -> None:
    """(name, safetensors dtype, file) of every tensor: each weight must be floating point, and the
    file must hold the config's number of layers. Read from the header (or a pickle's tensors)."""
    names, files = [], []
    for name, dtype, file in tensors:
        if file not in files:
            files.append(file)
        if dtype not in FLOATING and not name.endswith(BUFFERS):
            raise CorruptCheckpoint(f"{file}: {name} holds {dtype} values; lmhead reads floating-point weights "
                                    f"only ({', '.join(FLOATING)})")
        names.append(name)
    check_layer_count(config, names, config_path, ", ".join(map(str, files)) or "the weights")


def check_layer_count(config: dict, names: list[str], config_path, where: str = "the weights") -> None:
    """The config's layer count against the layers the tensors' names hold (model.layers.0 … N-1), so
    that a config claiming 100,000 layers over a small file is one line, before any skeleton."""
    key = next((k for k in LAYER_KEYS if isinstance(config.get(k), int) and not isinstance(config.get(k), bool)), None)
    if key is None:
        return
    L = config[key]
    lists: dict[str, set[int]] = {}
    for n in names:
        m = _LIST_ITEM.match(n.removeprefix("transformer."))
        if m and not re.search(r"\.\d+(\.|$)", m.group(1)):  # a top-level list, not the experts inside a layer
            lists.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not lists or any(idx == set(range(L)) for idx in lists.values()):
        return
    prefix, idx = max(lists.items(), key=lambda kv: len(kv[1]))
    raise CorruptCheckpoint(f"{config_path} says {key} {L:,}, but {where} holds {len(idx):,} layers "
                            f"({prefix}.{min(idx)} … {prefix}.{max(idx)})")


def header_tensors(header) -> list[tuple[str, str, Path]]:
    """check_tensors' input from loading/checks.read_header's {name: TensorInfo}."""
    return [(name, info.dtype, info.file) for name, info in header.items()]


def state_tensors(state: dict, file: Path) -> list[tuple[str, str, Path]]:
    """check_tensors' input from a pickle's tensors (torch dtypes under safetensors' names)."""
    return [(name, TORCH_NAMES.get(str(t.dtype).removeprefix("torch."), str(t.dtype)), file)
            for name, t in state.items()]
