"""LeanLlama's step between the products (engine/llama.py): the parts that a decoding step at TinyLlama's
sizes spent more time in than in the products themselves, made cheap.

* `fuse`: projections of one input (q, k and v; the MLP's gate and up) as one product, their weights'
  rows stacked once (float rows, or GGUF blocks of one type), each projection's weight a view of its rows.
* `attend_grouped`: one new position's grouped-query attention in lean GPT-2's compiled kernel, each key
  head read by its G query heads through a stride of 0.
* `cast` and `hooked`: a cast not dispatched when the tensor has the dtype; whether a hook asks for the
  projections' own modules.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from lmhead_cli.engine import kernels


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, without dispatching a cast when it is in it already (hundreds a step)."""
    return x if x.dtype == dtype else x.to(dtype)


def hooked(hooks: list[dict]) -> bool:
    """Whether a forward hook is registered on the modules whose hook dicts these are, or globally."""
    return any(hooks) or bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def fuse(linears: list[nn.Module]) -> nn.Module | None:
    """One projection computing `linears`' outputs side by side (they share their input): their weights'
    rows (and biases) stacked in one tensor, or one matrix of GGUF blocks when all are quantised to the
    same type, and each linear's weight rebound to a view of its rows (the same values, held once).
    None where they cannot be stacked (float beside blocks, blocks of different types, mixed biases)."""
    from lmhead_cli.engine.quant import Blocks, QuantLinear

    ws = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    rows = [w.shape[0] for w in ws]
    if all(isinstance(w, Blocks) for w in ws):
        if len({(w.qtype, w.cols, w.data.shape[1], w.data.dtype) for w in ws}) != 1:
            return None
        stacked = Blocks(torch.cat([w.data for w in ws]), ws[0].qtype, ws[0].cols)
        fused = QuantLinear(stacked, bias)
        for m, (a, b) in zip(linears, _spans(rows)):
            m.weight = Blocks(stacked.data[a:b], stacked.qtype, stacked.cols)
    elif all(isinstance(m, nn.Linear) and isinstance(w, torch.Tensor) and w.is_floating_point() for m, w in zip(linears, ws)):
        if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
            return None
        stacked = torch.cat([w.detach() for w in ws])
        fused = nn.Linear(stacked.shape[1], stacked.shape[0], bias=bias is not None, device="meta")
        fused.weight = nn.Parameter(stacked, requires_grad=False)
        for m, (a, b) in zip(linears, _spans(rows)):
            m.weight = nn.Parameter(stacked[a:b], requires_grad=False)
    else:
        return None
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
        for m, (a, b) in zip(linears, _spans(rows)):
            m.bias = nn.Parameter(bias[a:b], requires_grad=False)
    return fused


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [(e - n, e) for n, e in zip(sizes, ends)]


def attend_grouped(q, k, v, mask) -> torch.Tensor | None:
    """attend_one in the compiled kernel (engine/kernels.py attend, lean GPT-2's), grouped: the B·K key
    heads as the kernel's rows, each with its G = H/K query heads as the kernel's heads, reading one key
    head G times through a stride of 0. None where the kernel is not loaded or the layout is not the
    cache's (rows K key heads apart)."""
    fast = kernels.load()
    B, H, _, hd = q.shape
    K, T = k.shape[1], k.shape[2]
    if fast is None or (B > 1 and k.stride(0) != K * k.stride(1)) or k.stride() != v.stride():
        return None
    G = H // K
    qg = q.reshape(B * K, G, 1, hd)  # query heads h = kh·G + g, as transformers' repeat_kv pairs them
    kg = k.as_strided((B * K, G, T, hd), (k.stride(1), 0, k.stride(2), k.stride(3)))
    vg = v.as_strided((B * K, G, T, hd), (v.stride(1), 0, v.stride(2), v.stride(3)))
    mg = None if mask is None else mask.repeat_interleave(K, dim=0)  # (B·K, 1, 1, T)
    y = fast.attend(qg, kg, vg, mg)  # (B·K, 1, G·hd)
    return None if y is None else y.view(B, 1, H * hd)
