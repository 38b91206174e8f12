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

from lmhead_cli.engine.base import (Components, Engine, LayerTaps, TieNames, capture_components, linearise_norm,
                                    position_ids)

# One position at a time (inspect's last position, every decoding step) the body's and the head's
# products are matrix-vector products that do nothing but stream weights, and how they are laid out
# and dispatched decides the speed (benchmarks/run.py measures each form):
# - float32: every matrix is kept as rows [N, K] (the head's E already is; Conv1D's [K, N] checkpoint
#   weights are transposed once at load, the parameter staying a [K, N] view of them), and the product
#   runs as one batched matmul over 2·threads row blocks of it (views: nothing is copied, the tie stays
#   one object). BLAS's gemv over the same rows reads them at about half that speed on the 2-core
#   benchmark machine; the [K, N] layout, blocked by columns, at about two thirds.
# - bfloat16: those forms run no faster than F.linear; oneDNN's linear over a weight packed once into
#   its own blocked layout does (a second, packed copy of each matrix: bfloat16 then holds about the
#   memory float32 would, for about 1.6× the speed).
# A matrix is laid out the second time it meets one position (the second decoding step), not at load:
# a single forward (inspect, lens) never pays for the copy, and the checkpoint's memory-mapped pages
# of a transposed matrix are handed back, so decoding holds each matrix once.
BLOCKED_MAX_ROWS = 4  # more positions than this are a GEMM that computes, not streams: plain path


def _few_cpu_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.shape[0] <= BLOCKED_MAX_ROWS


def _streams(x: torch.Tensor) -> bool:
    """A few float32 rows on the CPU: the blocked row products apply."""
    return x.dtype == torch.float32 and _few_cpu_rows(x)


def release_mapped_pages(t: torch.Tensor) -> bool:
    """Give back the pages of `t` when they are a read-only use of a memory-mapped .safetensors file
    (t has been copied into another layout and nothing reads it any more): the whole pages inside
    its bytes, with madvise(MADV_DONTNEED), which for a private file mapping just drops them (they
    would be read from the file again if touched). Anything else is left alone. True if released."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    start, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
    try:
        with open("/proc/self/maps") as f:
            mapped = any(_maps_file(line, start, nbytes) for line in f)
    except OSError:
        return False
    page = 4096
    first, last = -(-start // page) * page, (start + nbytes) // page * page
    if not mapped or last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4) == 0  # MADV_DONTNEED


def _maps_file(line: str, start: int, nbytes: int) -> bool:
    """A /proc/self/maps line: a private mapping of a .safetensors file holding [start, start + nbytes)."""
    fields = line.split()
    if len(fields) < 6 or not fields[5].endswith(".safetensors") or "p" not in fields[1]:
        return False
    lo, hi = (int(v, 16) for v in fields[0].split("-"))
    return lo <= start and start + nbytes <= hi


class _LaysOut:
    """A module whose weight is laid out for one-position products on the second such call."""

    packed: torch.Tensor | None = None
    _one_row_calls = 0

    def _maybe_lay_out(self, x2: torch.Tensor) -> None:
        if self._one_row_calls < 2 and _few_cpu_rows(x2):
            self._one_row_calls += 1
            if self._one_row_calls == 2:
                with torch.inference_mode(False):
                    self.lay_out_()


def rows_times(w: torch.Tensor, h: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """h · wᵀ (+ b) for a few positions h (R, D) and a row-major w (V, D): (R, V), computed as w's rows
    in 2·threads blocks times h (one batched matmul over views of w, the bias added in the same
    call) plus any last rows."""
    V, D = w.shape
    R = h.shape[0]
    s = 2 * max(1, torch.get_num_threads())
    n = V // s
    hs = h.t().expand(s, D, R)  # (s, D, R), a view
    out = torch.empty(V, R, dtype=h.dtype, device=h.device)  # written in place: no concatenation
    blocks, last = out[: s * n].view(s, n, R), out[s * n:]
    if b is None:
        torch.bmm(w[: s * n].view(s, n, D), hs, out=blocks)
        if s * n < V:
            torch.mm(w[s * n:], h.t(), out=last)
    else:
        torch.baddbmm(b[: s * n].view(s, n, 1), w[: s * n].view(s, n, D), hs, out=blocks)
        if s * n < V:
            torch.addmm(b[s * n:, None], w[s * n:], h.t(), out=last)
    return out.t().contiguous()  # (R, V); one row needs no copy


def pack_for_onednn(w: torch.Tensor) -> torch.Tensor | None:
    """w (N, K) in oneDNN's own blocked layout for `packed_linear` (a copy), where that is the fast
    bfloat16 path: a bfloat16 CPU weight and a torch with oneDNN's bfloat16 kernels. None otherwise."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)
    except (RuntimeError, AttributeError):  # a torch built without it: the plain product runs
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) times a packed (N, K) weight, plus b: (M, N), by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


class Conv1D(_LaysOut, nn.Module):
    """GPT-2's linear layer, y = x @ W + b, W (in, out) as the checkpoints name and shape it; stored
    as rows (out, in) once `lay_out_` has run, `weight` staying the (in, out) view of them."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def lay_out_(self) -> None:
        """float32: rows for the streaming products; bfloat16: a oneDNN-packed copy (see above)."""
        self.packed = pack_for_onednn(self.weight.t())
        rows = self.weight.detach().t()  # (out, in)
        if self.packed is None and self.weight.device.type == "cpu" and not rows.is_contiguous():
            old = self.weight
            self.weight = nn.Parameter(rows.contiguous().t(), requires_grad=old.requires_grad)
            release_mapped_pages(old)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        self._maybe_lay_out(x2)
        rows = self.weight.t()  # (out, in), a view
        if self.packed is not None:
            y = packed_linear(x2, self.packed, self.bias)
        elif _streams(x2) and rows.is_contiguous():
            y = rows_times(rows, x2, self.bias)
        else:
            y = torch.addmm(self.bias, x2, self.weight)
        return y.view(*x.shape[:-1], -1)


class LMHead(_LaysOut, nn.Linear):
    """The head z = h · W_outᵀ, W_out (V, D), no bias; a few positions stream W_out in row blocks
    (float32: E's rows as they are) or run over a packed copy (bfloat16)."""

    def lay_out_(self) -> None:
        self.packed = pack_for_onednn(self.weight) if self.bias is None else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h2 = h.reshape(-1, h.shape[-1])  # (R, D)
        self._maybe_lay_out(h2)
        if self.packed is not None:
            return packed_linear(h2, self.packed, None).view(*h.shape[:-1], -1)
        if _streams(h2) and self.bias is None and self.weight.is_contiguous():
            return rows_times(self.weight, h2).view(*h.shape[:-1], -1)
        return super().forward(h)


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
        self.lm_head = LMHead(d, V, bias=False)
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


TIE_NAMES = TieNames(head="lm_head.weight", embedding="wte.weight")  # the checkpoint keys, as nanoGPT names them


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

    @property
    def tie_names(self) -> TieNames:
        return TIE_NAMES

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c["n_layer"], batch, c["n_head"], min(max_len, self.n_ctx),
                       c["n_embd"] // c["n_head"], self.device, self.dtype)

    def reorder_cache(self, cache: KVCache, rows: torch.Tensor) -> KVCache:
        cache.reorder(rows)
        return cache

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

    @property
    def final_norm_module(self) -> nn.Module:
        return self.gpt.ln_f

    def components(self, ids: torch.Tensor) -> Components:
        """The last position's final residual as wte + wpe + each head of each layer + c_proj biases + MLPs."""
        taps = [LayerTaps(out_proj=b.attn.c_proj, weight=b.attn.c_proj.weight.detach(),
                          bias=b.attn.c_proj.bias.detach(), mlp=b.mlp) for b in self.gpt.h]
        return capture_components(lambda: self.body(ids), self.config["n_head"], taps, self.gpt.h,
                                  linearise_norm(self.gpt.ln_f), (self.gpt.wte, self.gpt.wpe))

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
