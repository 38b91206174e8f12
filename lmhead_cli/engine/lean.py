"""Engines: a forward pass that returns hidden states, and the head applied to them.

The plain-torch engine behind the contract in engine/base.py:

* `LeanGPT2`: the whole GPT-2 in plain torch, nanoGPT-style, with names that mirror the
  checkpoint keys (wte, wpe, h.{i}.attn.c_attn, ln_f, lm_head) so `model.safetensors` loads by
  name, a preallocated KV cache, and no transformers import on the hot path.

Neither knows about rich or typer. Shapes: B batch, T positions, D width, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmhead_cli.engine.base import (Components, Engine, GreedyRun, LayerTaps, TieNames, WholeSteps,
                                    capture_components, linearise_norm, position_ids)
from lmhead_cli.engine import int8, kernels
from lmhead_cli.engine.cache_rows import RowSteps
from lmhead_cli.engine.step import StepPlan

from lmhead_cli.engine.products import Products, few_cpu_rows, few_rows_product, kernel_rows, products_for

# How the few-position products run (BLAS over the weights where they lie, blocked rows, bfloat16 gemv)
# is engine/products.py's; which of them runs is chosen by timing the decoding steps (engine/threads.py).

ROWS_AT_LOAD = (torch.bfloat16,)  # dtypes whose Conv1D weights are stored as (out, in) rows on the CPU
HALF = (torch.bfloat16, torch.float16)


def attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype attention and its KV cache run in: float32 for half dtypes on the CPU, where torch's
    kernels for a few bfloat16 queries take 4x as long as float32's and round the scores besides."""
    return torch.float32 if device.type == "cpu" and dtype in HALF else dtype


def conv1d_weight(w: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A checkpoint's Conv1D weight (in, out) as the engine keeps it in `dtype`: for ROWS_AT_LOAD dtypes
    on the CPU, the (in, out) view of (out, in) rows, made by the copy that converts it (torch's
    bfloat16 gemv streams rows about twice as fast as the checkpoint's layout); otherwise as stored
    (float32 stays the checkpoint's memory-mapped pages: BLAS streams that layout as fast as rows)."""
    if dtype in ROWS_AT_LOAD and device.type == "cpu":
        return torch.empty(w.shape[1], w.shape[0], dtype=dtype).copy_(w.t()).t()
    return w.to(dtype)


class Conv1D(nn.Module):
    """GPT-2's linear layer, y = x @ W + b, W (in, out) as the checkpoints name and shape it (its memory
    may be (out, in) rows: `conv1d_weight`)."""

    products = Products()  # the engine's, set when it is built

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        if self.products.forms and kernel_rows(x2, self.products):
            y = few_rows_product(self.products.form, x2, self.weight.t(), self.bias)
        else:
            y = torch.addmm(self.bias, x2, self.weight)
        return y.view(*x.shape[:-1], -1)


class LMHead(nn.Linear):
    """The head z = h · W_outᵀ, W_out (V, D), no bias; a few positions run in the engine's product
    form over W_out's rows as they are (E's, when tied)."""

    products = Products()  # the engine's, set when it is built

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h2 = h.reshape(-1, h.shape[-1])  # (R, D)
        if self.products.forms and (few_cpu_rows(h2) or self._kernel_rows(h2)):
            return few_rows_product(self.products.form, h2, self.weight, self.bias).view(*h.shape[:-1], -1)
        return super().forward(h)

    def _kernel_rows(self, h2: torch.Tensor) -> bool:
        """5 to the kernel's f32_max_rows rows, float32 (a batched decoding step, or a short text's positions
        in score and lens): the compiled kernel reads E once for all of them, where torch's GEMM took 2-3x
        as long for 16 rows on 2 threads; and each of its sums is one thread's, in one order, whatever the
        thread count, where MKL's GEMM gives 5 to 11 rows other last bits on 2 threads than on 1 (more
        rows are one GEMM, whose bits measured the same at any thread count)."""
        if not (self.products.form == "kernel" and h2.is_cpu and h2.dtype == torch.float32):
            return False
        fast = kernels.load()
        return fast is not None and h2.shape[0] <= fast.f32_max_rows


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

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H, t, hd] after the filled positions; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[2]
        keys, values = self.layers[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows start … stop - 1 as a cache of their own over the same storage (a step on it writes their
        keys and values in place), at this one's length; its length moves on by itself."""
        part = object.__new__(KVCache)
        part.k, part.v, part.length = self.k[:, start:stop], self.v[:, start:stop], self.length
        part._split()
        return part

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (beam search)."""
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self._split()


def join_kv_caches(parts: list[tuple[KVCache, int]], max_len: int, new_cache) -> KVCache:
    """Engine.join_caches for a KVCache: `new_cache(rows, max_len)` makes the joined one."""
    length = max(c.length - first for c, first in parts)
    joined = new_cache(sum(c.k.shape[1] for c, _ in parts), max(length, max_len))
    joined.k.zero_()  # padding: an attention mask hides it, and zeros keep q·k finite under it
    joined.v.zero_()
    b = 0
    for c, first in parts:
        n, rows = c.length - first, c.k.shape[1]  # (L, rows, H, n, hd) copied to the right end
        joined.k[:, b:b + rows, :, length - n:length] = c.k[:, :, :, first:c.length]
        joined.v[:, b:b + rows, :, length - n:length] = c.v[:, :, :, first:c.length]
        b += rows
    joined.length = length
    return joined


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x, layer, cache, mask):
        B, T, D = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, D // self.n_head)  # (B, T, 3, H, hd)
        qkv = qkv.to(attention_dtype(x.device, x.dtype))  # the cache's dtype too (LeanGPT2.new_cache)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 × (B, H, T, hd)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, H, T_past + T, hd)
        if T == 1 and x.is_cpu:
            y = attend_one(q, k, v, mask)  # a decoding step
        else:
            # Causal within the new positions when no padding mask says otherwise (one new position sees all).
            y = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None and T > 1 and k.shape[2] == T,
                                               attn_mask=mask)
            y = y.transpose(1, 2).reshape(B, T, D)
        return self.c_proj(y.to(x.dtype))


def attend_one(q, k, v, mask) -> torch.Tensor:
    """One new position's attention on the CPU (a decoding step): q (B, H, 1, hd), k, v (B, H, T, hd),
    mask (B, 1, 1, T) or None -> (B, 1, D). The compiled kernel where it loads and takes them, else
    three small products: SDPA's CPU kernels set up blocks for long queries, which for one query cost
    more than the attention itself, and the products' separate dispatches (a matmul, a scaling, the
    mask, a softmax, a matmul, each layer, each step) cost several times the kernel's one call."""
    fast = kernels.load()
    y = fast.attend(q, k, v, mask) if fast is not None else None
    if y is not None:
        return y
    att = torch.matmul(q, k.transpose(-1, -2)).mul_(1 / math.sqrt(q.shape[-1]))  # (B, H, 1, T_all)
    if mask is not None:
        att = att.add_(mask)
    y = torch.matmul(att.softmax(-1), v)  # (B, H, 1, hd)
    return y.transpose(1, 2).reshape(q.shape[0], 1, -1)


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
        self.lm_head = LMHead(d, V, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight  # weight tying: W_out is E, the very same tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden states after ln_f, (B, T) -> (B, T, D), with autograd and no cache: what
        training/train_bundled.py trains (the engine's `LeanGPT2.body` is the inference path)."""
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))[None]  # (B, T, D)
        for i, block in enumerate(self.h):
            x = block(x, i, None, None)
        return self.ln_f(x)


def _mask(attention_mask: torch.Tensor, T_new: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T_new, T_all] from a padding mask [B, T_all]: causal and no padded keys."""
    T_all = attention_mask.shape[1]
    causal = torch.ones(T_new, T_all, dtype=torch.bool, device=attention_mask.device).tril(T_all - T_new)
    allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
    # A query that is itself padding (left padding) has no real key up to it: a row of -inf makes NaN,
    # so it sees every position instead (its output is never read).
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


TIE_NAMES = TieNames(head="lm_head.weight", embedding="wte.weight")  # the checkpoint keys, as nanoGPT names them


class LeanGPT2(RowSteps, WholeSteps, Engine):
    """The plain-torch GPT-2 engine."""

    def __init__(self, config: dict, module: GPT2):
        super().__init__(name="lean", config=config, module=module)
        self.gpt = module
        self.int8 = isinstance(module.lm_head, int8.Int8Head)  # quantised at load (engine/int8.py)
        # int8 runs one form (engine/int8.py); the float dtypes' forms are chosen by timing.
        self.products = Products() if self.int8 else products_for(self.dtype, self.device)
        for m in module.modules():
            if isinstance(m, (Conv1D, LMHead)):
                m.products = self.products
        # A decoding step's blocks in one compiled call where nothing needs the modules (engine/step.py)
        self.step = StepPlan.for_engine(module, config, self.int8, self.dtype)

    @property
    def embedding_weight(self) -> torch.Tensor:
        """E (V, D); int8: the table's q, the one tensor that the lookups and the tied head share."""
        return self.gpt.wte.table.q if self.int8 else self.gpt.wte.weight

    @property
    def head_weight(self) -> torch.Tensor:
        return self.gpt.lm_head.table.q if self.int8 else self.gpt.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the activations (and the KV cache) are in: float32 for int8 weights."""
        return self.gpt.ln_f.weight.dtype

    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype attention (and the KV cache) run in (`attention_dtype`)."""
        return attention_dtype(self.device, self.dtype)

    @property
    def weight_format(self) -> str:
        return "int8" if self.int8 else super().weight_format

    def head_rows(self, ids) -> torch.Tensor:
        if self.int8:
            return self.gpt.lm_head.table.dequantise(torch.as_tensor(ids, device=self.device))
        return super().head_rows(ids)

    @property
    def forms(self) -> tuple[str, ...]:
        return self.products.forms

    def use_form(self, form: str) -> None:
        self.products.use(form)

    @property
    def head_module(self) -> nn.Module:
        return self.gpt.lm_head

    @property
    def tie_names(self) -> TieNames:
        return TIE_NAMES

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c["n_layer"], batch, c["n_head"], min(max_len, self.n_ctx),
                       c["n_embd"] // c["n_head"], self.device, self.attention_dtype)

    def reorder_cache(self, cache: KVCache, rows: torch.Tensor) -> KVCache:
        cache.reorder(rows)
        return cache

    def join_caches(self, parts: list[tuple[KVCache, int]], max_len: int) -> KVCache:
        return join_kv_caches(parts, max_len, self.new_cache)

    def embed(self, ids: torch.Tensor, past: int = 0, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embeddings, (B, T, D). Positions skip left padding when a mask is given."""
        T = ids.shape[1]
        if attention_mask is None:
            pos = torch.arange(past, past + T, device=ids.device)[None]
        else:
            pos = position_ids(attention_mask, T)
        return self.gpt.wte(ids) + self.gpt.wpe(pos)

    def residuals(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Yield the residual stream after the embeddings and after each block, (B, T, D) each."""
        mask = None if attention_mask is None else _mask(attention_mask, ids.shape[1], self.attention_dtype)
        x = self.embed(ids, 0, attention_mask)
        yield x
        for i, block in enumerate(self.gpt.h):
            x = block(x, i, None, mask)
            yield x

    @torch.inference_mode()
    def body(self, ids: torch.Tensor, cache: KVCache | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after ln_f for the new positions `ids` (B, T) -> (B, T, D); fills `cache`. With a
        cache, up to 16 rows × positions (a decoding step's rows, or a short prompt's positions) run
        every block in one compiled call where nothing needs the modules (engine/step.py); everything
        else runs the blocks."""
        past = cache.length if cache is not None else 0
        if past + ids.shape[1] > self.n_ctx:
            raise ValueError(f"{past + ids.shape[1]} positions exceed the context of {self.n_ctx}")
        mask = None if attention_mask is None else _mask(attention_mask, ids.shape[1], self.attention_dtype)
        x = self.embed(ids, past, attention_mask)
        stepped = self.step.run(x, cache, mask) if self.step is not None else None
        if stepped is not None:  # the compiled step ran every block
            x = stepped
        else:
            for i, block in enumerate(self.gpt.h):
                x = block(x, i, cache, mask)
        if cache is not None:
            cache.length += ids.shape[1]
        return self.gpt.ln_f(x)

    def step_logits(self, ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                    record: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """Engine.step_logits: token to logits (and each row's greedy record) in one compiled call
        (engine/step.py StepPlan.logits) where the engine is as built: its products in the kernels'
        form, and neither `body` nor `head` replaced on the instance (a caller that wraps them sees every
        step); else the modules, and no record."""
        out = self._whole_step(ids, cache, attention_mask, record) if self.step is not None else None
        return out if out is not None else (Engine.last_logits(self, ids, cache, attention_mask), None)

    @torch.inference_mode()
    def _greedy_run(self, token: int, cache: KVCache, n: int, eos: int | None) -> GreedyRun | None:
        """WholeSteps._greedy_run: StepPlan.greedy_run, where step_logits would run the whole step (`_whole`)."""
        return self.step.greedy_run(token, cache, n, eos) if self.step is not None and self._whole() else None

    def _whole(self) -> bool:
        """Whether the whole step may run compiled: the products in the kernels' form (int8, or the form
        chosen), and the engine as built (WholeSteps._as_built)."""
        return (self.int8 or self.products.form == "kernel") and self._as_built()

    @torch.inference_mode()
    def _whole_step(self, ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None,
                    record: bool) -> tuple[torch.Tensor, tuple | None] | None:
        if cache.length + 1 > self.n_ctx or not self._whole():
            return None
        mask = pos = None
        if attention_mask is not None:
            mask = _mask(attention_mask, 1, self.attention_dtype)
            pos = position_ids(attention_mask, 1)[:, -1]
        out = self.step.logits(ids, cache, mask, pos, record)
        if out is not None:
            cache.length += 1
        return out

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt.ln_f(x)

    @property
    def final_norm_module(self) -> nn.Module:
        return self.gpt.ln_f

    def components(self, ids: torch.Tensor) -> Components:
        """The last position's final residual as wte + wpe + each head of each layer + c_proj biases + MLPs."""
        return capture_components(lambda: self.body(ids), self.config["n_head"], self.layer_taps(), self.gpt.h,
                                  linearise_norm(self.gpt.ln_f), (self.gpt.wte, self.gpt.wpe))

    def layer_taps(self) -> list[LayerTaps]:
        """Each block's c_proj (attention) and MLP; the MLP's c_proj weight (4D, D) holds its value vectors as rows."""
        return [LayerTaps(out_proj=b.attn.c_proj, weight=b.attn.c_proj.weight.detach(),
                          bias=b.attn.c_proj.bias.detach(), mlp=b.mlp, mlp_out=b.mlp.c_proj,
                          values=b.mlp.c_proj.weight.detach(), mlp_bias=b.mlp.c_proj.bias.detach())
                for b in self.gpt.h]

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits z = h · W_outᵀ: (..., D) -> (..., V)."""
        return self.gpt.lm_head(h)


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


def quantise_gpt2_(gpt: nn.Module, tied: bool, device: torch.device, announce=lambda line: None) -> None:
    """Replace every matrix of a lean GPT2 by its int8 table (engine/int8.py), in place: each block's
    Conv1Ds, and wte with lm_head (one table when tied). wpe, norms and biases stay float32. Where
    `device` has no int8 kernel, `announce(line)` names the fallback."""
    kernel = int8.kernel_for(device)
    if not kernel:
        announce(f"int8 weights on {device.type}: torch has no int8 product kernel there; each product "
                 "dequantises its weights to float32 instead (the same figures, none of the speed)")

    for block in gpt.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, Conv1D):
                    setattr(parent, name, int8.Int8Conv1D(child.weight, child.bias, kernel))
    table = int8.Int8Table(gpt.wte.weight, kernel)
    head = table if tied else int8.Int8Table(gpt.lm_head.weight, kernel)
    gpt.wte, gpt.lm_head = int8.Int8Embedding(table), int8.Int8Head(head)
