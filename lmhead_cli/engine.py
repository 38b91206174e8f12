"""Engines: a forward pass that returns hidden states, and the head applied to them.

Two engines share one small interface (`Engine`):

* `LeanGPT2`: the whole GPT-2 in plain torch, nanoGPT-style, with names that mirror the
  checkpoint keys (wte, wpe, h.{i}.attn.c_attn, ln_f, lm_head) so `model.safetensors` loads by
  name, a preallocated KV cache, and no transformers import on the hot path.
* `TransformersEngine`: any causal LM from transformers, for other architectures and as
  `--engine transformers`, so the tie can be shown on transformers' own object too.

Neither knows about rich or typer. Shapes: B batch, T positions, D width, V vocabulary.

The head's layout (`Engine.set_head_layout`) is a speed trade-off, measured in benchmarks/:
a checkpoint stores W_out = E as [V, D] rows, and F.linear(h, E) on one position is MKL's
dot-product matrix-vector product, which streams it at about half the memory bandwidth the
h @ W form reaches with W laid out [D, V]. "columns" re-lays the one shared matrix out so (a
transpose at load, the tie still holds by object); "copy" gives the head its own [D, V] copy
(V·D more bytes, the tie then holds by value).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HEAD_LAYOUTS = ("rows", "columns", "copy")


class Conv1D(nn.Module):
    """GPT-2's linear layer with the weight stored [in, out] (as in the checkpoints): y = x @ W + b."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class KVCache:
    """Preallocated keys and values for every layer: [L, B, H, T_max, hd]; `length` positions filled."""

    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0
        self._split()

    def _split(self) -> None:
        # One view per layer, made once: indexing [layer, :, :, a:b] twice per layer per token adds up.
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # L × ((B, H, T_max, hd), same)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H, t, hd] after the filled positions; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[2]
        keys, values = self.layers[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (beam search)."""
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self._split()


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x, layer, cache, mask):
        B, T, D = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, D // self.n_head)  # (B, T, 3, H, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 × (B, H, T, hd)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, H, T_past + T, hd)
        if mask is None:
            # No padding: causal within the new positions; a single new position sees everything.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1 and k.shape[2] == T)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.c_fc = Conv1D(d, inner)
        self.c_proj = Conv1D(inner, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # gelu_new


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, inner: int, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = Attention(d, n_head)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(d, inner)

    def forward(self, x, layer, cache, mask):
        x = x + self.attn(self.ln_1(x), layer, cache, mask)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 with checkpoint key names. Tied: `self.lm_head.weight = self.wte.weight`."""

    def __init__(self, config: dict, tied: bool = True):
        super().__init__()
        d, V = config["n_embd"], config["vocab_size"]
        inner = config.get("n_inner") or 4 * d
        eps = config.get("layer_norm_epsilon", 1e-5)
        # Given an (uninitialised) weight, nn.Embedding skips its random init: the weights always come
        # from a checkpoint or random_state, and on the meta device that init would import torch._dynamo (~1.5 s).
        self.wte = nn.Embedding(V, d, _weight=torch.empty(V, d))
        self.wpe = nn.Embedding(config["n_positions"], d, _weight=torch.empty(config["n_positions"], d))
        self.h = nn.ModuleList(Block(d, config["n_head"], inner, eps) for _ in range(config["n_layer"]))
        self.ln_f = nn.LayerNorm(d, eps=eps)
        self.lm_head = nn.Linear(d, V, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight  # weight tying: W_out is E, the very same tensor


def _mask(attention_mask: torch.Tensor, T_new: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T_new, T_all] from a padding mask [B, T_all]: causal and no padded keys."""
    T_all = attention_mask.shape[1]
    causal = torch.ones(T_new, T_all, dtype=torch.bool, device=attention_mask.device).tril(T_all - T_new)
    allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
    # A fully padded query row (left padding) would be all -inf -> NaN; let it see itself only.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same (V, D) matrix stored column by column, strides (1, V): F.linear(h, W) then runs as
    h @ Wᵀ with Wᵀ a contiguous [D, V], the matrix-vector form BLAS streams fastest."""
    return t.t().contiguous().t()


@dataclass
class Engine:
    """What the rest of lmhead needs from a model.

    body(ids, cache, attention_mask) -> hidden states after the final norm, (B, T, D)
    head(h) -> logits, (..., V)
    """

    name: str
    config: dict
    module: nn.Module
    # How the head's matrix is laid out, and the extra bytes that costs (see set_head_layout).
    head_layout = "rows"
    head_extra_bytes = 0

    # -- the pieces every command uses -------------------------------------------------------
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
    def eos_token_id(self) -> int | None:
        eos = self.config.get("eos_token_id")
        return eos[0] if isinstance(eos, list) else eos

    @torch.no_grad()
    def set_head_layout(self, layout: str) -> int:
        """Lay the head's matrix out for speed; returns the extra bytes that costs.

        rows: as the checkpoint stores it, [V, D] row by row (no copy; tied by object).
        columns: the head's matrix re-laid out column by column in place (one transpose, no extra
          memory); when tied, that matrix is E itself, so the tie still holds by object and the
          embedding lookup gathers strided columns instead of rows.
        copy: when tied, the head gets its own column-major copy of E and E keeps its rows: V·D more
          bytes, and the tie holds by value, not by object. Untied, it is the same as columns.
        """
        if layout not in HEAD_LAYOUTS:
            raise ValueError(f"unknown head layout {layout!r}; choose one of: {', '.join(HEAD_LAYOUTS)}")
        if self.head_layout != "rows":
            raise ValueError(f"the head is already laid out as {self.head_layout!r}")
        head = self.head_module  # a Linear holding W_out (V, D)
        tied = head.weight is self.embedding_weight
        if layout == "columns" or (layout == "copy" and not tied):
            head.weight.data = column_major(head.weight.data)
        elif layout == "copy":
            w = head.weight
            head.weight = nn.Parameter(column_major(w.detach()), requires_grad=w.requires_grad)
            self.head_extra_bytes = w.numel() * w.element_size()
        self.head_layout = layout
        return self.head_extra_bytes


class LeanGPT2(Engine):
    """The plain-torch GPT-2 engine."""

    def __init__(self, config: dict, module: GPT2):
        super().__init__(name="lean", config=config, module=module)
        self.gpt = module

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.gpt.wte.weight

    @property
    def head_weight(self) -> torch.Tensor:
        return self.gpt.lm_head.weight

    @property
    def head_module(self) -> nn.Module:
        return self.gpt.lm_head

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c["n_layer"], batch, c["n_head"], min(max_len, self.n_ctx),
                       c["n_embd"] // c["n_head"], self.device, self.dtype)

    def embed(self, ids: torch.Tensor, past: int = 0, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embeddings, (B, T, D). Positions skip left padding when a mask is given."""
        T = ids.shape[1]
        if attention_mask is None:
            pos = torch.arange(past, past + T, device=ids.device)[None]
        else:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        return self.gpt.wte(ids) + self.gpt.wpe(pos)

    def residuals(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Yield the residual stream after the embeddings and after each block, (B, T, D) each."""
        mask = None if attention_mask is None else _mask(attention_mask, ids.shape[1], self.dtype)
        x = self.embed(ids, 0, attention_mask)
        yield x
        for i, block in enumerate(self.gpt.h):
            x = block(x, i, None, mask)
            yield x

    @torch.inference_mode()
    def body(self, ids: torch.Tensor, cache: KVCache | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after ln_f for the new positions `ids` (B, T) -> (B, T, D); fills `cache`."""
        past = cache.length if cache is not None else 0
        if past + ids.shape[1] > self.n_ctx:
            raise ValueError(f"{past + ids.shape[1]} positions exceed the context of {self.n_ctx}")
        mask = None if attention_mask is None else _mask(attention_mask, ids.shape[1], self.dtype)
        x = self.embed(ids, past, attention_mask)
        for i, block in enumerate(self.gpt.h):
            x = block(x, i, cache, mask)
        if cache is not None:
            cache.length += ids.shape[1]
        return self.gpt.ln_f(x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt.ln_f(x)

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits z = h · W_outᵀ: (..., D) -> (..., V)."""
        return self.gpt.lm_head(h)


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


def init_random_(state: dict[str, torch.Tensor], n_layer: int, seed: int) -> None:
    """GPT-2's initialisation, seeded: N(0, 0.02) weights, residual projections scaled by
    1/sqrt(2·n_layer), zero biases, unit layer-norm gains."""
    g = torch.Generator().manual_seed(seed)
    for name in sorted(state):
        t = state[name]
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
            t.normal_(0.0, std, generator=g)
