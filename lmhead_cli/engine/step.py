"""The compiled decoding step: every block of the lean GPT-2 for a few rows of one new position, in one call.

A decoding step through engine/lean.py's torch modules dispatches about 85 ops a block (norms,
products, views, the cache's writes, attention, GELU, adds): on a 2-core CPU, half of a float32
step's time went to dispatching them. csrc/step.c runs the same blocks in one C call over the same
weights where the engine keeps them (float32 Conv1D (in, out) as the checkpoint maps them, bfloat16
(out, in) rows, int8 rows with their scales: nothing is copied), writing the new keys and values into
the engine's KV cache. The embeddings, the final norm and the head stay torch's and the head's.

`StepPlan.run` takes the step only where nothing needs torch's graph, else returns None and the
engine runs its torch path (the same figures): the compiled kernels loaded (engine/kernels.py), the
CPU, float32 / bfloat16 / int8 weights, one new position for 1 to MAX_ROWS rows with a KV cache, and
no hook on any module of the body or torch's global hooks (readings that capture components, neurons
or layer taps read through hooks: they keep running the modules). LMHEAD_STEP=0 turns the step off
(to compare it with the torch path).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn
from torch.nn.modules import module as _module

from lmhead_cli.engine import kernels
from lmhead_cli.engine.kernels import Layer

ENV = "LMHEAD_STEP"
MAX_ROWS = kernels.STEP_MAX_ROWS
KINDS = {torch.float32: 0, torch.bfloat16: 1, "int8": 2}  # csrc/step.c's STEP_F32, STEP_BF16, STEP_INT8


def turned_off() -> bool:
    return kernels.switched_off(ENV)


def _products(block: nn.Module) -> list[nn.Module]:
    return [block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj]


def _layer(block: nn.Module, kind: int) -> tuple[Layer, list[torch.Tensor]] | None:
    """One block's pointers, and the tensors they point into (kept alive with the plan); None when a
    weight is not in the layout csrc/step.c reads."""
    layer, keep = Layer(), []
    for i, p in enumerate(_products(block)):
        if kind == KINDS["int8"]:
            table = getattr(p, "table", None)
            if table is None:
                return None
            w, s = table.q.detach(), table.s.detach()
        else:
            w, s = p.weight.detach(), None
            w = w.t() if kind == KINDS[torch.bfloat16] else w  # bfloat16: (out, in) rows; float32: (in, out)
        b = p.bias.detach()
        if not (w.is_contiguous() and b.is_contiguous() and (s is None or s.is_contiguous())):
            return None
        layer.w[i], layer.b[i] = w.data_ptr(), b.data_ptr()
        if s is not None:
            layer.s[i] = s.data_ptr()
        keep += [w, b] + ([s] if s is not None else [])
    for name in ("ln_1", "ln_2"):
        norm = getattr(block, name)
        w, b = norm.weight.detach(), norm.bias.detach()
        if not (w.is_contiguous() and b.is_contiguous()):
            return None
        setattr(layer, name.replace("_", "") + "_w", w.data_ptr())
        setattr(layer, name.replace("_", "") + "_b", b.data_ptr())
        keep += [w, b]
    return layer, keep


class StepPlan:
    """The blocks' weight pointers for csrc/step.c, made once per engine (a few hundred pointers), and
    the modules whose hooks send a step back to torch."""

    def __init__(self, blocks: nn.ModuleList, config: dict, kind: int, dtype: torch.dtype):
        self.kind, self.dtype = kind, dtype
        self.D, self.H = config["n_embd"], config["n_head"]
        self.inner = config.get("n_inner") or 4 * self.D
        self.eps = config.get("layer_norm_epsilon", 1e-5)
        self.modules = [m for block in blocks for m in block.modules()]
        layers = [_layer(block, kind) for block in blocks]
        self.ready = all(layer is not None for layer in layers)
        self.layers = (Layer * len(layers))(*[layer for layer, _ in layers]) if self.ready else None
        self.keep = [t for _, keep in layers for t in keep] if self.ready else []
        self.L = len(layers)

    @classmethod
    def for_engine(cls, gpt: nn.Module, config: dict, int8: bool, dtype: torch.dtype) -> StepPlan | None:
        """The plan for a lean GPT2 on the CPU in a dtype the step takes; None otherwise."""
        kind = KINDS["int8"] if int8 else KINDS.get(dtype)
        if kind is None or gpt.ln_f.weight.device.type != "cpu":
            return None
        plan = cls(gpt.h, config, kind, dtype)
        return plan if plan.ready else None

    def hooked(self) -> bool:
        """Whether any hook would see the blocks run (a reading's taps, or torch's global hooks)."""
        return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                    or any(m._forward_hooks or m._forward_pre_hooks for m in self.modules))

    def run(self, x: torch.Tensor, cache, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The residual stream x (B, 1, D) of one new position through every block, writing each layer's
        key and value at the cache's next position (the caller advances cache.length): (B, 1, D) in x's
        dtype; mask (B, 1, 1, past + 1) additive float32 or None. None (nothing done) where the step does
        not apply: the caller runs the torch path."""
        fast = kernels.load()
        B, T, D = x.shape
        if (fast is None or turned_off() or cache is None or T != 1 or not 1 <= B <= MAX_ROWS or not x.is_cpu
                or self.hooked()):
            return None
        k, v, past = cache.k, cache.v, cache.length
        if not (k.dtype == v.dtype == torch.float32 and k.shape == v.shape and k.stride() == v.stride()
                and k.shape[1] == B and past < k.shape[3] and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]):
            return None
        if mask is not None and not (mask.dtype == torch.float32 and mask.shape == (B, 1, 1, past + 1)
                                     and mask.stride(-1) == 1):
            return None
        h = x.reshape(B, D).to(torch.float32, copy=True).contiguous()  # (B, D), updated in place
        status = fast.lib.lmhead_step(ctypes.addressof(self.layers), self.L, self.kind, h.data_ptr(), B, D, self.H,
                                      self.inner, self.eps, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                                      k.stride(2), past, None if mask is None else mask.data_ptr(),
                                      0 if mask is None else mask.stride(0), torch.get_num_threads())
        if status:
            raise MemoryError("the compiled decoding step could not allocate its buffers")
        return h.view(B, 1, D).to(x.dtype)
