"""Llama-family checkpoints (llama, qwen2) onto lmhead's own engine (engine/llama.py): which configs it
computes, and the module built from a state dict whose tensors are float or a GGUF's quantised blocks.

Every tensor's name and shape is checked against the module built on the meta device before any is
assigned: a checkpoint that disagrees with its config is one CorruptCheckpoint line naming both.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lmhead_cli.engine import pages
from lmhead_cli.engine.llama import LeanLlama, Llama
from lmhead_cli.errors import CorruptCheckpoint


def build_llama(config: dict, state: dict, files: list[Path], device: torch.device,
                dtype: torch.dtype) -> LeanLlama:
    """The lean Llama holding `state` (popped from it): float tensors cast to `dtype`; GGUF blocks
    (engine/quant.py Blocks) kept as they are, their modules swapped for QuantLinear / QuantEmbedding
    (activations then float32). Tied as the config says (transformers' default: untied)."""
    from lmhead_cli.engine.quant import Blocks, QuantEmbedding, QuantLinear

    names = ", ".join(str(f) for f in files) or "the weights"
    config = full_config(config, files[0] if files else "config.json")
    tied = bool(config.get("tie_word_embeddings", False))  # transformers' default for llama and qwen2
    if not tied and "lm_head.weight" not in state:
        raise CorruptCheckpoint(f"{names}: the config unties the head (tie_word_embeddings: false, or absent) "
                                "but the weights hold no lm_head.weight")
    with torch.device("meta"):
        model = Llama(config, tied=tied)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    if tied:
        state.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected and not k.endswith("rotary_emb.inv_freq")]
    wrong = [f"{k} is {_dims(expected[k])} in the config but {_dims(state[k].shape)} in the file"
             for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if missing or extra or wrong:
        n_model = sum(math.prod(s) for s in expected.values())
        n_file = sum(math.prod(t.shape) for t in state.values())
        problems = wrong[:2] + ([f"it lacks {_few(missing)}"] if missing else []) + (
            [f"it holds {_few(extra)} that the model has no place for"] if extra else [])
        raise CorruptCheckpoint(f"{names} does not fit its config: the config describes lmhead's "
                                f"{config['model_type']} with {n_model:,} parameters, the file holds {n_file:,}; "
                                + "; ".join(problems))
    quantised = any(isinstance(t, Blocks) for t in state.values())
    if quantised:
        dtype = torch.float32  # blocks are multiplied in float32 (engine/quant.py)
    floats = {}
    for key in expected:
        t = state.pop(key)
        if isinstance(t, Blocks):
            owner, _, _ = key.rpartition(".")
            parent, _, leaf = owner.rpartition(".")
            swap = QuantEmbedding(t) if leaf == "embed_tokens" else QuantLinear(t, None)
            setattr(model.get_submodule(parent), leaf, swap)
        else:
            floats[key] = t.to(dtype)
    model.load_state_dict(floats, strict=False, assign=True)
    for name, m in model.named_modules():  # biases of quantised projections (Qwen2's q, k, v)
        if isinstance(m, QuantLinear) and f"{name}.bias" in expected:
            m.bias = torch.nn.Parameter(floats[f"{name}.bias"], requires_grad=False)
    if tied:
        head = model.model.embed_tokens.weight
        model.lm_head = QuantLinear(head) if isinstance(head, Blocks) else model.lm_head
        if not isinstance(head, Blocks):
            model.lm_head.weight = head  # assign=True replaced embed_tokens' Parameter: tie again
    model.inv_freq = _inv_freq(config)  # built on the meta device with the rest
    engine = LeanLlama(config, model.to(device).eval())  # its projections stacked (fused)
    if files:  # a GGUF's blocks (read, not mapped), and the stacks: onto 2 MiB pages (engine/pages.py)
        pages.pack(engine.llama)
    return engine


def full_config(config: dict, path) -> dict:
    """The config as transformers reads it, every default filled in (a missing hidden_size is Llama's
    4,096, as LlamaForCausalLM would build it) and the rope's parameters in one form."""
    from lmhead_cli.loading.validate import transformers_config

    full = transformers_config(config, path).to_dict()
    return full | {k: config[k] for k in ("rope_freqs",) if k in config}


def _inv_freq(config: dict) -> torch.Tensor:
    from lmhead_cli.engine.llama_fields import LlamaShape, rope_inv_freq

    return rope_inv_freq(config, LlamaShape.of(config).head_dim)


def _dims(shape) -> str:
    return "×".join(str(int(n)) for n in shape) or "a scalar"


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
