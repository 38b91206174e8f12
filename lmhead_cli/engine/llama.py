"""LeanLlama: Llama and Qwen2 in plain torch, llama2.c's run.c in modules.

RMSNorm, rotary position embeddings (RoPE, with Llama 3's frequency scaling), grouped-query attention
over a preallocated KV cache, a SwiGLU MLP, the head on the positions asked for. Mistral, TinyLlama
and SmolLM2 are Llama; Qwen2 is Llama with biases on q, k and v. Module names mirror the Hugging Face
checkpoint keys (model.embed_tokens, model.layers.{i}.self_attn.q_proj, model.norm, lm_head), so
`model.safetensors` loads by name and transformers' LlamaForCausalLM / Qwen2ForCausalLM are the
parity reference (tests/test_llama_engine.py).

A projection holds either a float weight (nn.Linear) or a GGUF file's quantised blocks
(engine/quant.py `QuantLinear`, multiplied a bounded chunk of rows at a time); the engine does not
care which. Shapes: B batch, T positions, D width, H query heads, K key/value heads, hd head width.

How a step runs (a decoding step at TinyLlama's sizes spent more time between the products than in
them): q, k and v are one product, and so are the MLP's gate and up (`fuse`: the weights' rows stacked
in one tensor, or one GGUF matrix of blocks where their types agree, each projection's weight a view
of its rows, so nothing is held twice); RoPE turns q and k together, its cos and sin read from a table
made once; one new position attends over the cache in the compiled kernel that lean GPT-2 uses, each
key head read once by its G query heads (a stride of 0, no repeated keys); casts to the dtype a tensor
already has are not dispatched. Where a projection carries a hook, its own module runs, so that the
hook sees what it would see in transformers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmhead_cli.engine.base import (Components, Engine, GreedyRun, LayerTaps, TieNames, WholeSteps,
                                    capture_components, linearise_norm, position_ids)
from lmhead_cli.engine.cache_rows import RowSteps
from lmhead_cli.engine.lean import HALF, KVCache, _mask, join_kv_caches
from lmhead_cli.engine.llama_fields import LlamaShape, rope_inv_freq
from lmhead_cli.engine.lean import attend_one as attend_heads
from lmhead_cli.engine.llama_step import LlamaStepPlan, attend_grouped, cast, fuse, hooked
from lmhead_cli.engine.step import hook_dicts

TIE_NAMES = TieNames(head="lm_head.weight", embedding="model.embed_tokens.weight")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """γ ⊙ x / √(mean x² + eps), computed in float32 as transformers' LlamaRMSNorm."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.variance_epsilon = eps  # the name engine/base.py's linearise_norm reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = cast(x, torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(self.variance_epsilon))
        return self.weight * cast(h, x.dtype)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.H, self.K, self.hd = s.heads, s.kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.width, s.heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.width, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.width, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.width, bias=s.o_bias)
        self.qkv = None  # q_proj, k_proj and v_proj as one product (`fuse`), set once the weights are in
        self.hooks: list[dict] = []

    def fuse(self) -> None:
        self.qkv = fuse([self.q_proj, self.k_proj, self.v_proj])
        self.hooks = hook_dicts([self.q_proj, self.k_proj, self.v_proj])

    def _qkv(self, x: torch.Tensor, adt: torch.dtype) -> torch.Tensor:
        """q, k and v of x (B, T, D) side by side, in the attention dtype: (B, T, H + 2K, hd)."""
        B, T, _ = x.shape
        if self.qkv is not None and not hooked(self.hooks):
            y = self.qkv(x)
        else:
            y = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        return cast(y, adt).view(B, T, self.H + 2 * self.K, self.hd)

    def forward(self, x, layer, cache, mask, rope):
        B, T, _ = x.shape
        cos, sin = rope  # (B, T, 1, hd) each
        adt = cos.dtype  # attention (and the cache) run in this dtype: float32 for half weights on the CPU
        qkv = self._qkv(x, adt)
        qk = qkv[:, :, :self.H + self.K]  # q and k turned together: (B, T, H + K, hd)
        qk = qk * cos + rotate_half(qk) * sin
        q = qk[:, :, :self.H].transpose(1, 2)  # (B, H, T, hd)
        k = qk[:, :, self.H:].transpose(1, 2)  # (B, K, T, hd)
        v = qkv[:, :, self.H + self.K:].transpose(1, 2)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, K, T_past + T, hd)
        if T == 1:
            y = attend_one(q, k, v, mask)  # a decoding step
        else:
            causal = mask is None and k.shape[2] == T
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                               enable_gqa=self.K != self.H)
            y = y.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(y.to(x.dtype))


def attend_one(q, k, v, mask) -> torch.Tensor:
    """One new position's grouped-query attention: q (B, H, 1, hd), k, v (B, K, T, hd), mask (B, 1, 1, T)
    or None -> (B, 1, H·hd). Each key head serves H/K query heads, read as G = H/K rows of one product,
    so the keys are never repeated in memory (as llama2.c's run.c indexes them)."""
    B, H, _, hd = q.shape
    K, T = k.shape[1], k.shape[2]
    if K == H:
        return attend_heads(q.contiguous() if q.stride(-1) != 1 else q, k, v, mask)
    y = attend_grouped(q, k, v, mask)
    if y is not None:
        return y
    qg = q.reshape(B, K, H // K, hd)  # (B, K, G, hd)
    att = torch.matmul(qg, k.transpose(-1, -2)).mul_(1 / math.sqrt(hd))  # (B, K, G, T)
    if mask is not None:
        att = att.add_(mask.view(B, 1, 1, T))
    y = torch.matmul(att.softmax(-1), v)  # (B, K, G, hd)
    return y.reshape(B, 1, H * hd)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) ⊙ up(x))."""

    def __init__(self, s: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.width, s.inner, bias=s.mlp_bias)
        self.up_proj = nn.Linear(s.width, s.inner, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.inner, s.width, bias=s.mlp_bias)
        self.gate_up = None  # gate_proj and up_proj as one product (`fuse`)
        self.hooks: list[dict] = []

    def fuse(self) -> None:
        self.gate_up = fuse([self.gate_proj, self.up_proj])
        self.hooks = hook_dicts([self.gate_proj, self.up_proj])

    def forward(self, x):
        if self.gate_up is not None and not hooked(self.hooks):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.width, s.eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.width, s.eps)
        self.mlp = MLP(s)

    def forward(self, x, layer, cache, mask, rope):
        x = x + self.self_attn(self.input_layernorm(x), layer, cache, mask, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.width, _weight=torch.empty(s.vocab, s.width))
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.width, s.eps)


class Llama(nn.Module):
    """Llama with checkpoint key names. Tied: `self.lm_head.weight = self.model.embed_tokens.weight`."""

    def __init__(self, config: dict, tied: bool):
        super().__init__()
        s = LlamaShape.of(config)
        self.model = Body(s)
        self.lm_head = nn.Linear(s.width, s.vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight  # W_out is E, the very same tensor
        self.register_buffer("inv_freq", rope_inv_freq(config, s.head_dim), persistent=False)


class LeanLlama(RowSteps, WholeSteps, Engine):
    """lmhead's own Llama / Qwen2 engine (see the module's docstring)."""

    def __init__(self, config: dict, module: Llama):
        super().__init__(name="lean", config=config, module=module)
        self.llama = module
        self.shape = LlamaShape.of(config)
        self._rope_table: torch.Tensor | None = None  # (2, n, hd): cos and sin of the first n positions
        for layer in module.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self._plan: LlamaStepPlan | None = None  # the compiled step's pointers, made at the first step

    # -- weights ----------------------------------------------------------------------------
    @property
    def embedding_weight(self):
        return self.llama.model.embed_tokens.weight

    @property
    def head_weight(self):
        return self.llama.lm_head.weight

    @property
    def head_module(self) -> nn.Module:
        return self.llama.lm_head

    @property
    def tie_names(self) -> TieNames:
        return TIE_NAMES

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights'): float32 for quantised weights."""
        return self.llama.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.llama.model.norm.weight.device

    @property
    def attention_dtype(self) -> torch.dtype:
        return torch.float32 if self.device.type == "cpu" and self.dtype in HALF else self.dtype

    @property
    def weight_format(self) -> str:
        """The weights' dtype, or the GGUF block types held quantised ("Q8_0", "Q4_K+Q6_K")."""
        from lmhead_cli.engine.quant import block_types

        types = block_types(self.llama)
        return "+".join(types) if types else super().weight_format

    def head_rows(self, ids) -> torch.Tensor:
        """Rows `ids` of W_out (n, D) in the activations' dtype (quantised rows dequantised)."""
        w = self.head_weight
        rows = torch.as_tensor(ids, device=self.device)
        return w.rows(rows) if hasattr(w, "rows") else w[rows]

    # -- the forward pass -------------------------------------------------------------------
    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, T, 1, hd) for positions (B, T), in the attention dtype: rows of a table made
        for the first positions (as transformers computes them: position × inverse frequency in float32,
        then cos and sin), doubled when a position passes its end."""
        cs = self._rope_rows(int(pos.max()) + 1 if pos.numel() else 0, pos.device)[:, pos][:, :, :, None]
        return cs[0], cs[1]  # (B, T, 1, hd) each

    def _rope_rows(self, end: int, device: torch.device) -> torch.Tensor:
        """The table (2, n, hd) of cos and sin, made (or doubled) to cover positions 0 … end - 1."""
        if self._rope_table is None or end > self._rope_table.shape[1]:
            n = max(end, 2 * (0 if self._rope_table is None else self._rope_table.shape[1]), 256)
            freqs = torch.arange(n, device=device).float()[:, None] * self.llama.inv_freq.to(device)
            emb = torch.cat((freqs, freqs), dim=-1)  # (n, hd)
            self._rope_table = torch.stack((emb.cos(), emb.sin())).to(self.attention_dtype).contiguous()
        return self._rope_table

    def _start(self, ids, past: int, attention_mask):
        """The embeddings (B, T, D), the additive mask or None, and the rope for the new positions."""
        T = ids.shape[1]
        if attention_mask is None:
            pos = torch.arange(past, past + T, device=ids.device)[None].expand(ids.shape[0], -1)
            mask = None
        else:
            pos = position_ids(attention_mask, T)
            mask = _mask(attention_mask, T, self.attention_dtype)
        return self.llama.model.embed_tokens(ids).to(self.dtype), mask, self._rope(pos)

    @torch.inference_mode()
    def body(self, ids: torch.Tensor, cache: KVCache | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final RMSNorm for the new positions `ids` (B, T) -> (B, T, D); fills `cache`."""
        past = cache.length if cache is not None else 0
        if past + ids.shape[1] > self.n_ctx:
            raise ValueError(f"{past + ids.shape[1]} positions exceed the context of {self.n_ctx}")
        x = self._compiled_step(ids, cache, attention_mask) if ids.shape[1] == 1 and cache is not None else None
        if x is None:
            x, mask, rope = self._start(ids, past, attention_mask)
            for i, layer in enumerate(self.llama.model.layers):
                x = layer(x, i, cache, mask, rope)
        if cache is not None:
            cache.length += ids.shape[1]
        return self.llama.model.norm(x)

    def _step_plan(self) -> LlamaStepPlan | None:
        """The compiled step's plan (made at the first step), None where it cannot run this engine's steps."""
        if self._plan is None:
            m = self.llama
            self._plan = LlamaStepPlan(m.model.layers, self.shape, m.model.norm, m.lm_head, m.model.embed_tokens)
        if not self._plan.ready or self.dtype != torch.float32 or self.device.type != "cpu":
            return None
        return self._plan

    def _compiled_step(self, ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None,
                       whole: bool = False, record: bool = False):
        """One new position's pass through every layer in the compiled step (engine/llama_step.py), the
        residual stream (B, 1, D) before the final norm; with `whole`, on to the logits and records
        (LlamaStepPlan.logits). None where it does not apply."""
        if self._step_plan() is None:
            return None
        past = cache.length
        if attention_mask is None:
            pos, mask, end = None, None, past + 1
        else:
            pos = position_ids(attention_mask, 1)[:, 0]
            mask, end = _mask(attention_mask, 1, torch.float32), int(pos.max()) + 1
        rope = self._rope_rows(end, ids.device)
        if whole and self._plan.embeds and not hooked(self._plan.embed_hooks):  # the C call looks the tokens up
            return self._plan.logits(None, cache, mask, pos, rope, record, ids=ids)
        x = self.llama.model.embed_tokens(ids).to(torch.float32)
        return self._plan.logits(x, cache, mask, pos, rope, record) if whole else self._plan.run(x, cache, mask, pos, rope)

    @torch.inference_mode()
    def step_logits(self, ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                    record: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """Engine.step_logits: the layers, the final norm, the head and each row's greedy record in one
        compiled call (LlamaStepPlan.logits) where the engine is as built (neither `body` nor `head`
        replaced on the instance: a caller that wraps them sees every step); else the modules, and no
        record."""
        out = None
        if ids.shape[1] == 1 and cache.length + 1 <= self.n_ctx and self._as_built():
            out = self._compiled_step(ids, cache, attention_mask, whole=True, record=record)
        if out is None:
            return Engine.last_logits(self, ids, cache, attention_mask), None
        cache.length += 1
        return out

    @torch.inference_mode()
    def _greedy_run(self, token: int, cache: KVCache, n: int, eos: int | None) -> GreedyRun | None:
        """WholeSteps._greedy_run: LlamaStepPlan.greedy_run, RoPE's table covering the run's positions."""
        plan = self._step_plan()
        if plan is None:
            return None
        return plan.greedy_run(token, cache, n, eos, self._rope_rows(cache.length + n, self.device))

    @torch.inference_mode()
    def residuals(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """The residual stream after the embeddings and after each layer, before the final norm."""
        x, mask, rope = self._start(ids, 0, attention_mask)
        yield x
        for i, layer in enumerate(self.llama.model.layers):
            x = layer(x, i, None, mask, rope)
            yield x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.llama.model.norm(x)

    @property
    def final_norm_module(self) -> nn.Module:
        return self.llama.model.norm

    def components(self, ids: torch.Tensor) -> Components:
        """The last position's final residual as the token embedding + each head of each layer (o_proj's
        rows per head) + o_proj's bias + each MLP; RMSNorm linearised."""
        return capture_components(lambda: self.body(ids), self.shape.heads, self.layer_taps(),
                                  self.llama.model.layers, linearise_norm(self.llama.model.norm), None)

    def layer_taps(self) -> list[LayerTaps]:
        """Each layer's o_proj (its weight as (H·hd, D)) and MLP, down_proj's columns as the value vectors
        (N, D). Quantised weights are dequantised when a tap's weight or values are read, one matrix at a
        time (readers go layer by layer), never every layer's at once."""
        return [_Taps(layer.self_attn.o_proj, layer.mlp, layer.mlp.down_proj) for layer in self.llama.model.layers]

    def runs_on(self, kernels) -> str:
        """Engine.runs_on, per weight type: GGUF blocks in the compiled kernels where they take the type
        (engine/quant.py COMPILED; with x rounded per block or not, quant.rounded), float weights in
        torch's products; one new position's attention in the compiled kernel."""
        from lmhead_cli.engine import quant

        if kernels is None:
            return "torch's products"
        compiled = f"compiled kernels ({kernels.variant})"
        kinds = quant.block_types(self.llama)
        if not kinds:
            return f"torch's products ({self.weight_format}), attention in {compiled}"
        ids = {t: _qtype(t) for t in kinds}
        done = [t for t in kinds if ids[t] in quant.COMPILED]
        parts = [f"{' and '.join(ts)} with x {how}" for how, ts in (
            ("rounded per block", [t for t in done if quant.rounded(ids[t])]),
            ("unrounded", [t for t in done if not quant.rounded(ids[t])])) if ts]
        rest = [t for t in kinds if t not in done]
        return (f"{compiled}: {'; '.join(parts)}" if parts else "") + (
            f"{'; ' if parts else ''}torch's products over dequantised rows: {' and '.join(rest)}" if rest else "")

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits z = h · W_outᵀ: (..., D) -> (..., V)."""
        return self.llama.lm_head(h)

    # -- the KV cache ----------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        s = self.shape
        return KVCache(s.layers, batch, s.kv_heads, min(max_len, self.n_ctx), s.head_dim, self.device,
                       self.attention_dtype)

    def reorder_cache(self, cache: KVCache, rows: torch.Tensor) -> KVCache:
        cache.reorder(rows)
        return cache

    def join_caches(self, parts: list[tuple[KVCache, int]], max_len: int) -> KVCache:
        return join_kv_caches(parts, max_len, self.new_cache)


class _Taps(LayerTaps):
    """LayerTaps whose o_proj weight and down_proj value vectors are made when read: a quantised matrix
    is dequantised then (its float32 copy held only as long as the reader holds it)."""

    def __init__(self, o: nn.Module, mlp: nn.Module, down: nn.Module):
        for name, value in (("out_proj", o), ("bias", _bias(o)), ("mlp", mlp), ("mlp_out", down),
                            ("mlp_bias", _bias(down))):
            object.__setattr__(self, name, value)  # LayerTaps is frozen

    @property
    def weight(self) -> torch.Tensor:  # (H·hd, D)
        return _matrix(self.out_proj).t()

    @property
    def values(self) -> torch.Tensor:  # (N, D)
        return _matrix(self.mlp_out).t()


def _qtype(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def _matrix(linear: nn.Module) -> torch.Tensor:
    """A projection's weight (out, in) as float numbers (quantised blocks dequantised)."""
    w = linear.weight
    return w.dequantise() if hasattr(w, "dequantise") else w.detach()


def _bias(linear: nn.Module) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()
