"""The engine contract: everything the rest of lmhead may ask of a model, and nothing else.

Two engines implement it in full: `LeanGPT2` (engine/lean.py, plain torch, GPT-2 checkpoints) and
`TransformersEngine` (engine/hf.py, any transformers causal LM). Callers hold an `Engine` and never
check which one it is. Neither knows about rich or typer.

Shapes: B batch, T positions, D width, V vocabulary, L layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TieNames:
    """The parameter names of the head's and the embedding's weights, as the model itself names them."""

    head: str  # e.g. "lm_head.weight"
    embedding: str  # e.g. "transformer.wte.weight" or "model.embed_tokens.weight"


def module_name(root: nn.Module, module: nn.Module) -> str:
    """`module`'s path inside `root` as the model names it, e.g. "model.norm" or "lm_head"."""
    return next(name for name, m in root.named_modules() if m is module)


@dataclass
class Engine(ABC):
    """What the rest of lmhead needs from a model.

    body(ids, cache, attention_mask) -> hidden states after the final norm, (B, T, D)
    residuals(ids) -> the residual stream after the embeddings and after each block, L + 1 × (B, T, D)
    final_norm(x) -> the model's own final norm (LayerNorm, RMSNorm, ...), (..., D); final_norm_module, its module
    head(h) -> logits, (..., V), with whatever the model itself does after its head (own_stages)
    new_cache(B, T_max) / reorder_cache(cache, rows) -> the KV cache, and beam search's reordering
    """

    name: str
    config: dict
    module: nn.Module
    # Stages the model applies to its own logits before anyone sees them, e.g. Gemma-2's
    # {"softcap": 30.0}. Empty for GPT-2.
    own_stages: dict[str, Any] = field(default_factory=dict)

    # -- weights ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def embedding_weight(self) -> torch.Tensor:
        """The input embedding table E, (V, D)."""

    @property
    @abstractmethod
    def head_weight(self) -> torch.Tensor:
        """The output matrix W_out, (V, D); the very same object as E when the model is tied."""

    @property
    @abstractmethod
    def head_module(self) -> nn.Module:
        """The module that computes the head (lmhead's LMHead, or the model's own lm_head)."""

    @property
    @abstractmethod
    def tie_names(self) -> TieNames:
        """The head's and the embedding's parameter names in this model."""

    # -- the forward pass -------------------------------------------------------------------
    @abstractmethod
    def body(self, ids: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm for the new positions `ids` (B, T) -> (B, T, D); fills `cache`."""

    @abstractmethod
    def residuals(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """The residual stream after the embeddings and after each block, before the final norm: L + 1 × (B, T, D)."""

    @abstractmethod
    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's own final norm, (..., D) -> (..., D)."""

    @property
    @abstractmethod
    def final_norm_module(self) -> nn.Module | None:
        """The module behind `final_norm` (nn.LayerNorm, LlamaRMSNorm, ...), or None if the model has none."""

    @abstractmethod
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits z = h · W_outᵀ (plus whatever the model's own head adds): (..., D) -> (..., V)."""

    # -- the KV cache ----------------------------------------------------------------------
    @abstractmethod
    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty KV cache for `batch` rows and up to `max_len` positions."""

    @abstractmethod
    def reorder_cache(self, cache: Any, rows: torch.Tensor) -> Any:
        """Keep batch rows `rows` of `cache` (beam search); returns the cache to use from now on."""

    # -- derived: the same for every engine -------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head_weight.dtype

    @property
    def n_ctx(self) -> int:
        return int(self.config.get("n_positions") or self.config.get("max_position_embeddings") or 1024)

    @property
    def vocab_size(self) -> int:
        return int(self.head_weight.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.config.get("n_layer") or self.config.get("num_hidden_layers"))

    @property
    def eos_token_id(self) -> int | None:
        eos = self.config.get("eos_token_id")
        return eos[0] if isinstance(eos, list) else eos

    @property
    def tied(self) -> bool:
        """The head's weight is the embedding's weight object."""
        return self.head_weight is self.embedding_weight
