"""TransformersEngine: any transformers causal LM behind the engine contract (its cache is transformers' own)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lmhead_cli.engine.base import (Components, Engine, LayerTaps, TieNames, capture_components,
                                     linearise_norm)
from lmhead_cli.errors import UnsupportedModel


class TransformersEngine(Engine):
    """Any transformers causal LM behind the same interface (the cache is transformers' own)."""

    def __init__(self, config: dict, model):
        super().__init__(name="transformers", config=config, module=model)
        self.model = model
        self.base = model.base_model
        # transformers 5.x renamed `past_key_values` to `cache`; accept both releases.
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def head_module(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def new_cache(self, batch: int, max_len: int):
        from transformers import DynamicCache

        return DynamicCache()

    def reorder_cache(self, cache, rows: torch.Tensor):
        cache.reorder_cache(rows)
        return cache

    @property
    def tie_names(self) -> TieNames:
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        return TieNames(head=names.get(id(self.head_weight), "lm_head.weight"),
                        embedding=names.get(id(self.embedding_weight), "embed_tokens.weight"))

    @torch.inference_mode()
    def body(self, ids, cache=None, attention_mask=None):
        kwargs = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        kwargs[self._cache_kw] = cache
        out = self.base(input_ids=ids, use_cache=cache is not None, **kwargs)
        return out.last_hidden_state

    @torch.inference_mode()
    def residuals(self, ids, attention_mask=None):
        """The residual stream after the embeddings and each block (GPT-2 layouts: base.h, base.ln_f).

        transformers' last hidden state already has ln_f applied, so the last block's raw output is
        taken with a hook instead.
        """
        captured = {}

        def keep(_module, _inputs, output):
            captured["x"] = output[0] if isinstance(output, tuple) else output

        handle = self.base.h[-1].register_forward_hook(keep)
        try:
            out = self.base(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True)
        finally:
            handle.remove()
        yield from out.hidden_states[:-1]
        yield captured["x"]

    def final_norm(self, x):
        return self._final_norm_module()(x)

    def _final_norm_module(self) -> nn.Module:
        """GPT-2's ln_f, or the `norm` of Llama-like models."""
        return getattr(self.base, "ln_f", None) or self.base.norm

    @torch.inference_mode()
    def head(self, h):
        return self.model.get_output_embeddings()(h)

    def components(self, ids: torch.Tensor) -> Components:
        """The last position's final residual split into parts, read with hooks on transformers' own modules:
        GPT-2 layouts (h.{i}.attn.c_proj, h.{i}.mlp, ln_f, wte + wpe) and Llama-like ones
        (layers.{i}.self_attn.o_proj, layers.{i}.mlp, norm; the embedding is the first layer's input)."""
        kind = self.config.get("model_type", type(self.model).__name__)
        blocks = getattr(self.base, "h", None) or getattr(self.base, "layers", None)
        if blocks is None:
            raise UnsupportedModel(f"cannot find the layers of this {kind} model (no .h or .layers) to split its "
                                   "residual stream")
        post = [n for n in ("post_feedforward_layernorm", "post_attention_norm") if hasattr(blocks[0], n)]
        if post:
            raise UnsupportedModel(f"{kind} layers normalise their outputs before adding them to the residual "
                                   f"stream ({post[0]}), so the stream is not a sum of the layers' outputs")
        taps = [self._taps(block, kind) for block in blocks]
        norm = self._final_norm_module()
        lin = linearise_norm(norm)
        if lin is None:
            raise UnsupportedModel(f"the final norm of this {kind} model ({type(norm).__name__}) is neither a "
                                   "LayerNorm nor an RMSNorm, so it cannot be linearised")
        wte, wpe = getattr(self.base, "wte", None), getattr(self.base, "wpe", None)
        n_head = int(self.config.get("n_head") or self.config.get("num_attention_heads"))
        return capture_components(lambda: self.body(ids), n_head, taps, blocks, lin,
                                  (wte, wpe) if wte is not None and wpe is not None else None)

    @staticmethod
    def _taps(block: nn.Module, kind: str) -> LayerTaps:
        attn = getattr(block, "attn", None) or getattr(block, "self_attn", None)
        proj = next((getattr(attn, n) for n in ("c_proj", "o_proj", "out_proj", "dense") if hasattr(attn, n)), None)
        mlp = getattr(block, "mlp", None)
        if proj is None or mlp is None:
            raise UnsupportedModel(f"{kind} layers have no attention output projection (c_proj, o_proj) or no "
                                   ".mlp to read the residual stream's parts from")
        # transformers' Conv1D stores (in, out); nn.Linear stores (out, in).
        weight = proj.weight.detach() if type(proj).__name__ == "Conv1D" else proj.weight.detach().t()
        bias = proj.bias.detach() if getattr(proj, "bias", None) is not None else None
        return LayerTaps(out_proj=proj, weight=weight, bias=bias, mlp=mlp)
