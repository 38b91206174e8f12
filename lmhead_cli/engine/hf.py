"""TransformersEngine: any transformers causal LM behind the engine contract (its cache is transformers' own).

Nothing here knows a layout by name. The decoder layers are the model's one ModuleList of
`num_hidden_layers` blocks; the final norm is the norm registered beside that list (GPT-2's ln_f,
Llama's and Gemma's norm); the head is the model's own output embedding, followed by whatever the
model itself does to its logits (Gemma-2's final_logit_softcapping), declared in `own_stages`.
A model without one of these pieces runs what it can, and a reading that needs the missing piece
stops with UnsupportedModel naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
from torch import nn

from lmhead_cli.engine.base import (Components, Engine, LayerTaps, TieNames, capture_components,
                                     linearise_norm, module_name, position_ids)
from lmhead_cli.errors import UnsupportedModel


class TransformersEngine(Engine):
    """Any transformers causal LM behind the same interface (the cache is transformers' own)."""

    def __init__(self, config: dict, model):
        super().__init__(name="transformers", config=config, module=model, own_stages=own_stages(model.config))
        self.model = model
        self.base = model.base_model
        self.kind = model.config.model_type  # e.g. "llama", for messages
        # transformers 5.x renamed `past_key_values` to `cache`; accept both releases.
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.layers = decoder_layers(self.base, model.config.num_hidden_layers)
        self.norm = final_norm_module(self.base, self.layers)

    # -- weights ----------------------------------------------------------------------------
    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def head_module(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def tie_names(self) -> TieNames:
        """The model's own names: its tie declaration ({head: embedding}, e.g. {"lm_head.weight":
        "model.embed_tokens.weight"}) when it ties, else the paths of its output and input embeddings."""
        declared = getattr(self.model, "all_tied_weights_keys", None) or {}
        head, embedding = _param_name(self.model, self.head_module), _param_name(self.model, self.model.get_input_embeddings())
        if self.tied and declared.get(head):
            embedding = declared[head]
        return TieNames(head=head, embedding=embedding)

    # -- the forward pass -------------------------------------------------------------------
    @torch.inference_mode()
    def body(self, ids, cache=None, attention_mask=None):
        kwargs = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
            kwargs["position_ids"] = position_ids(attention_mask, ids.shape[1])
        kwargs[self._cache_kw] = cache
        out = self.base(input_ids=ids, use_cache=cache is not None, **kwargs)
        return out.last_hidden_state

    @torch.inference_mode()
    def residuals(self, ids, attention_mask=None) -> Iterator[torch.Tensor]:
        """The residual stream entering the first decoder layer (the embeddings, scaled as the model
        scales them) and leaving each layer, before the final norm: L + 1 × (B, T, D).

        Read with hooks on the layers, because transformers' last hidden state has the norm applied.
        """
        layers = self._need(self.layers, "decoder layers (a ModuleList of num_hidden_layers blocks)")
        captured: list[torch.Tensor] = []

        def entering(_module, args, kwargs):
            captured.append(args[0] if args else kwargs["hidden_states"])

        def leaving(_module, _inputs, output):
            captured.append(output[0] if isinstance(output, tuple) else output)

        handles = [layers[0].register_forward_pre_hook(entering, with_kwargs=True)]
        handles += [layer.register_forward_hook(leaving) for layer in layers]
        kwargs = {}
        if attention_mask is not None:
            kwargs = {"attention_mask": attention_mask,
                      "position_ids": position_ids(attention_mask, ids.shape[1])}
        try:
            self.base(input_ids=ids, use_cache=False, **kwargs)
        finally:
            for h in handles:
                h.remove()
        yield from captured

    def final_norm(self, x):
        return self._need(self.norm, "final norm (a norm module beside the decoder layers)")(x)

    @property
    def final_norm_module(self) -> nn.Module | None:
        return self.norm

    @torch.inference_mode()
    def head(self, h):
        """The model's own head, then its own softcap if it has one (Gemma-2: c·tanh(z/c))."""
        logits = self.head_module(h)
        cap = self.own_stages.get("softcap")
        if cap:
            logits = torch.tanh(logits / cap) * cap  # as Gemma2ForCausalLM.forward writes it
        return logits

    def components(self, ids: torch.Tensor) -> Components:
        """The last position's final residual split into parts, read with hooks on transformers' own modules:
        each decoder layer's attention output projection (GPT-2's c_proj, Llama's o_proj) and MLP, the
        final norm; the embeddings are GPT-2's wte + wpe, or else the first layer's input (as scaled)."""
        layers = self._need(self.layers, "decoder layers (a ModuleList of num_hidden_layers blocks)")
        post = [n for n in ("post_feedforward_layernorm", "post_attention_norm") if hasattr(layers[0], n)]
        if post:
            raise UnsupportedModel(f"{self.kind} layers normalise their outputs before adding them to the residual "
                                   f"stream ({post[0]}), so the stream is not a sum of the layers' outputs")
        taps = self.layer_taps()
        norm = self._need(self.norm, "final norm (a norm module beside the decoder layers)")
        lin = linearise_norm(norm)
        if lin is None:
            raise UnsupportedModel(f"the final norm of this {self.kind} model ({type(norm).__name__}) is neither a "
                                   "LayerNorm nor an RMSNorm, so it cannot be linearised")
        wte, wpe = getattr(self.base, "wte", None), getattr(self.base, "wpe", None)
        n_head = int(self.config.get("n_head") or self.config.get("num_attention_heads"))
        return capture_components(lambda: self.body(ids), n_head, taps, layers, lin,
                                  (wte, wpe) if wte is not None and wpe is not None else None)

    def layer_taps(self) -> list[LayerTaps]:
        layers = self._need(self.layers, "decoder layers (a ModuleList of num_hidden_layers blocks)")
        return [self._taps(layer) for layer in layers]

    def _taps(self, block: nn.Module) -> LayerTaps:
        attn = next((getattr(block, n) for n in ("attn", "self_attn", "attention") if hasattr(block, n)), None)
        proj = next((getattr(attn, n) for n in ("c_proj", "o_proj", "out_proj", "dense") if hasattr(attn, n)), None)
        mlp = getattr(block, "mlp", None)
        if proj is None or mlp is None:
            raise UnsupportedModel(f"{self.kind} layers have no attention output projection (c_proj, o_proj) or no "
                                   ".mlp to read the residual stream's parts from")
        # transformers' Conv1D stores (in, out); nn.Linear stores (out, in).
        weight = proj.weight.detach() if type(proj).__name__ == "Conv1D" else proj.weight.detach().t()
        bias = proj.bias.detach() if getattr(proj, "bias", None) is not None else None
        # The MLP's output projection: GPT-2's c_proj (Conv1D, (N, D)), Llama's down_proj, fc2 (Linear, (D, N)).
        down = next((getattr(mlp, n) for n in ("c_proj", "down_proj", "fc2", "dense_4h_to_h", "fc_out")
                     if isinstance(getattr(mlp, n, None), nn.Module) and hasattr(getattr(mlp, n), "weight")), None)
        values = mlp_bias = None
        if down is not None:
            values = down.weight.detach() if type(down).__name__ == "Conv1D" else down.weight.detach().t()
            mlp_bias = down.bias.detach() if getattr(down, "bias", None) is not None else None
        return LayerTaps(out_proj=proj, weight=weight, bias=bias, mlp=mlp, mlp_out=down, values=values,
                         mlp_bias=mlp_bias)

    # -- the KV cache ----------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int):
        from transformers import DynamicCache

        # With the config, layers with a sliding window (Gemma-2's) get a sliding cache, as in generate().
        return DynamicCache(config=self.model.config)

    def reorder_cache(self, cache, rows: torch.Tensor):
        cache.reorder_cache(rows)
        return cache

    def _need(self, part, what: str):
        if part is None:
            raise UnsupportedModel(f"lmhead cannot find the {what} of transformers' {type(self.model).__name__}, "
                                   "and this reading needs them")
        return part


def own_stages(config) -> dict[str, float]:
    """What the model itself does to its logits after the head, from its config: {"softcap": c} for
    final_logit_softcapping (Gemma-2 and kin), else {}."""
    cap = getattr(config, "final_logit_softcapping", None)
    return {"softcap": float(cap)} if cap else {}


# Configs that scale the logits after the head in the model's forward, which lmhead does not
# reproduce: refusing is honest, printing another model's figures is not.
SCALES_LOGITS = ("logit_scale", "logits_scaling")


def check_head_is_known(config) -> None:
    """UnsupportedModel when the model changes its logits after the head in a way lmhead does not apply."""
    for name in SCALES_LOGITS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and value != 1:
            raise UnsupportedModel(f"{config.model_type} models scale their logits after the head "
                                   f"({name} = {value}), which lmhead does not apply; its figures would not "
                                   "be the model's")


def decoder_layers(base: nn.Module, n_layer: int) -> nn.ModuleList | None:
    """The model's decoder layers: the first ModuleList of exactly `n_layer` blocks (GPT-2's h,
    Llama's and Gemma's layers, OPT's decoder.layers), or None."""
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layer:
            return module
    return None


def final_norm_module(base: nn.Module, layers: nn.ModuleList | None) -> nn.Module | None:
    """The final norm: the last norm module registered beside the decoder layers (ln_f, norm,
    final_layer_norm), or None. Norms are told by class name, as transformers' own init does."""
    if layers is None:
        return None
    owner = next((m for m in base.modules() if any(c is layers for c in m.children())), None)
    norms = [c for c in owner.children() if "Norm" in type(c).__name__] if owner is not None else []
    return norms[-1] if norms else None


def _param_name(model: nn.Module, module: nn.Module) -> str:
    """`module`'s weight as the model names it, e.g. "model.embed_tokens.weight"."""
    return f"{module_name(model, module)}.weight"
