"""TransformersEngine: any transformers causal LM behind the engine contract (its cache is transformers' own)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lmhead_cli.engine.base import Engine, TieNames


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
        return self.base.ln_f(x)

    @torch.inference_mode()
    def head(self, h):
        return self.model.get_output_embeddings()(h)
