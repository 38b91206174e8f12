"""A Llama-family config.json as lmhead's own Llama engine reads it (engine/llama.py): the sizes
(LlamaShape), the rope's parameters and inverse frequencies (Llama 3's scaling, a GGUF's rope_freqs),
and what in a config the engine does not compute (lean_cannot_run: such a model runs on transformers,
announced), as engine/gpt2_fields.py is GPT-2's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")  # the rope scalings LeanLlama computes


@dataclass(frozen=True)
class LlamaShape:
    """The sizes and options of a Llama-family config.json, read once."""

    vocab: int
    width: int  # D
    inner: int  # the MLP's width
    layers: int
    heads: int  # H
    kv_heads: int  # K, a divisor of H
    head_dim: int
    eps: float
    qkv_bias: bool  # Qwen2, or Llama's attention_bias
    o_bias: bool  # Llama's attention_bias
    mlp_bias: bool
    positions: int

    @classmethod
    def of(cls, config: dict) -> "LlamaShape":
        D, H = config["hidden_size"], config["num_attention_heads"]
        qwen = config.get("model_type") == "qwen2"
        bias = bool(config.get("attention_bias", False))
        return cls(vocab=config["vocab_size"], width=D, inner=config["intermediate_size"],
                   layers=config["num_hidden_layers"], heads=H, kv_heads=config.get("num_key_value_heads") or H,
                   head_dim=config.get("head_dim") or D // H, eps=float(config.get("rms_norm_eps", 1e-6)),
                   qkv_bias=qwen or bias, o_bias=bias and not qwen, mlp_bias=bool(config.get("mlp_bias", False)),
                   positions=config.get("max_position_embeddings") or 2048)


def rope_parameters(config: dict) -> dict:
    """The rope's parameters in transformers 5's form ({"rope_type", "rope_theta", ...}), from either
    `rope_parameters` or the older `rope_theta` + `rope_scaling` ("type" or "rope_type")."""
    p = config.get("rope_scaling") or config.get("rope_parameters")  # rope_scaling first, as transformers
    p = dict(p) if isinstance(p, dict) else {}
    p["rope_type"] = p.get("rope_type", p.get("type")) or "default"
    p.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return p


def rope_inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    """The rotary inverse frequencies (hd/2,) float32, as transformers computes them for rope types
    default, linear (divided by the factor) and llama3 (Llama 3.1's wavelength-banded scaling), and as
    llama.cpp does for a GGUF's rope_freqs (each divided by its own factor)."""
    p = rope_parameters(config)
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if config.get("rope_freqs"):  # a GGUF's rope_freqs.weight: llama.cpp divides each frequency by it
        inv = inv / torch.tensor(config["rope_freqs"], dtype=torch.float32)
    if p["rope_type"] == "linear":
        return inv / p["factor"]
    if p["rope_type"] == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    return inv


def lean_cannot_run(config: dict) -> list[str]:
    """What in a llama / qwen2 config the lean engine does not compute (empty: it runs it)."""
    lacks = []
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_TYPES:
        lacks.append(f"rope type {rope['rope_type']!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        lacks.append("partial rotary embeddings")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        lacks.append(f"hidden_act {act!r}")
    if (config.get("model_type") == "qwen2" and config.get("use_sliding_window")) or (
            config.get("model_type") == "mistral" and config.get("sliding_window", 4096) is not None):
        lacks.append("sliding-window attention")
    if (config.get("pretraining_tp") or 1) != 1:
        lacks.append(f"pretraining_tp {config['pretraining_tp']}")
    return lacks
