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

import ctypes

import torch
from torch import nn
from torch.nn.modules import module as _module

from lmhead_cli.engine import kernels
from lmhead_cli.engine.step import MAX_ROWS, fits, greedy_run, hook_dicts, turned_off


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


class LlamaStepPlan:
    """Every layer of a LeanLlama for a few rows of one new position in one C call (csrc/llama_step.c
    lmhead_llama_step), or the whole step from the embedded tokens to the logits and each row's greedy
    record (lmhead_llama_decode: the layers, the final norm and the head): the weights' pointers where the
    engine keeps them (GGUF blocks of the kernels' types, float32 rows; nothing copied), made once.
    Between the products, the torch path dispatched some thirty ops and Python calls a layer: at
    TinyLlama's sizes, 7 ms of a 43 ms Q4_K_M token, and about 1 ms more around the layers' call.

    `run` and `logits` take the step only where nothing needs torch's graph, else return None and the
    engine runs its torch path (the same figures, the sums in another order): the kernels loaded, every
    projection in a layout the C step reads, one new position for 1 to MAX_ROWS rows with a float32 KV
    cache, and no hook on any module the call replaces nor torch's global hooks. LMHEAD_STEP=0 turns
    both off, as GPT-2's."""

    def __init__(self, layers: nn.ModuleList, shape, norm: nn.Module, head: nn.Module, embed: nn.Module | None = None):
        self.shape, self.keep, self.types = shape, [], set()
        self.hooks = hook_dicts([m for layer in layers for m in layer.modules()])
        self.whole = self.hooks + hook_dicts([*norm.modules(), *head.modules()])  # what `logits` replaces too
        self.embed_hooks = hook_dicts([*embed.modules()]) if embed is not None else []
        self.whole_ids = self.whole + self.embed_hooks  # what `logits` from token ids replaces
        built = [self._layer(layer) for layer in layers]
        self.ready = all(b is not None for b in built)
        self.layers = (kernels.LlamaLayer * len(built))(*built) if self.ready else None
        s = shape
        self.model = kernels.Llama(layers=ctypes.addressof(self.layers) if self.ready else None, L=len(built), D=s.width,
                                   H=s.heads, K=s.kv_heads, hd=s.head_dim, inner=s.inner, eps=s.eps, V=s.vocab)
        weight = self._weight(head.weight) if getattr(head, "bias", None) is None else None
        norm_w = norm.weight.detach()
        self.has_head = bool(weight and norm_w.dtype == torch.float32 and norm_w.is_contiguous() and norm_w.is_cpu)
        if self.has_head:
            data, self.model.head_type, self.model.head_row_bytes = weight
            self.model.head, self.model.norm = data.data_ptr(), norm_w.data_ptr()
            self.keep += [data, norm_w]
        w = getattr(embed, "weight", None)
        table = self._weight(w) if w is not None and self.has_head and w.shape[-1] == s.width else None
        self.embeds = table is not None  # `logits` takes token ids: the C call looks their rows up
        if self.embeds:
            data, self.model.embed_type, self.model.embed_row_bytes = table
            self.model.embed, self.model.embed_rows = data.data_ptr(), data.shape[0]
            self.keep.append(data)
        self.arithmetic: dict[int, bool] | None = None  # the products' `rounded` fields, set at the first run

    def _weight(self, w) -> tuple[torch.Tensor, int, int] | None:
        """A product's weight as the C step reads it: (the tensor, its type, its row bytes), or None."""
        from lmhead_cli.engine.quant import Blocks

        if isinstance(w, Blocks):
            if not w.compiled():
                return None
            self.types.add(w.qtype)
            return w.data, w.qtype, w.data.shape[1]
        if (isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.is_cpu and w.dim() == 2
                and w.is_contiguous()):
            return w.detach(), kernels.GGUF_TYPE_F32, 0
        return None

    def _product(self, layer, i: int, module: nn.Module | None) -> bool:
        """Product i of `layer` from `module` (None: carried by the product before it); False where its
        weight is in no layout the C step reads."""
        if module is None:
            return True
        weight, b = self._weight(module.weight), module.bias
        if weight is None:
            return False
        if b is not None:
            b = b.detach()
            if not (b.dtype == torch.float32 and b.is_contiguous() and b.is_cpu):
                return False
            layer.b[i] = b.data_ptr()
            self.keep.append(b)
        data, layer.type[i], layer.row_bytes[i] = weight
        layer.w[i] = data.data_ptr()
        self.keep.append(data)
        return True

    def _layer(self, layer: nn.Module):
        """One layer's fields (kernels.LlamaLayer), or None."""
        a, m = layer.self_attn, layer.mlp
        qkv = [a.qkv, None, None] if a.qkv is not None else [a.q_proj, a.k_proj, a.v_proj]
        gate_up = [m.gate_up, None] if m.gate_up is not None else [m.gate_proj, m.up_proj]
        fields = kernels.LlamaLayer()
        if not all(self._product(fields, i, p) for i, p in enumerate([*qkv, a.o_proj, *gate_up, m.down_proj])):
            return None
        for name, norm in (("norm1", layer.input_layernorm), ("norm2", layer.post_attention_layernorm)):
            w = norm.weight.detach()
            if not (w.dtype == torch.float32 and w.is_contiguous() and w.is_cpu):
                return None
            setattr(fields, name, w.data_ptr())
            self.keep.append(w)
        return fields

    def _round(self) -> None:
        """Each product's `rounded` field from its type's arithmetic (quant.rounded, which
        LMHEAD_GGUF_ARITHMETIC may change between steps), rewritten when that changed."""
        from lmhead_cli.engine.quant import rounded

        now = {t: rounded(t) for t in self.types}
        if now != self.arithmetic:
            for fields in self.layers:
                for i in range(7):
                    fields.rounded[i] = int(now.get(fields.type[i], False))
            self.model.head_rounded = int(now.get(self.model.head_type, False))
            self.arithmetic = now

    def _takes(self, B: int, cache, mask: torch.Tensor | None, rope: torch.Tensor, hooks: list[dict]):
        """The kernels where the step applies to B rows of one new position (see the class), else None."""
        fast = kernels.load()
        if (not self.ready or fast is None or turned_off() or cache is None or not 1 <= B <= MAX_ROWS
                or hooked(hooks) or not fits(cache, B, mask) or rope.dtype != torch.float32 or not rope.is_contiguous()):
            return None
        self._round()
        self.model.rope, self.model.rope_len = rope.data_ptr(), rope.shape[1]
        return fast

    def _call(self, function: str, x: torch.Tensor | None, cache, mask: torch.Tensor | None, pos: torch.Tensor | None,
              rope: torch.Tensor, hooks: list[dict], *out, ids: torch.Tensor | None = None
              ) -> tuple[int, torch.Tensor | None] | None:
        """`function` (lmhead_llama_step or _decode) on a copy h (B, D) of x (B, 1, D), or (_decode) on
        token ids (B, 1) looked up in the call, rows at positions pos (B,) or None (the cache's length),
        then `out`'s pointers: (its status, h or None); None where the step does not apply (`_takes`).
        MemoryError where the C call could not allocate its buffers."""
        rows = x if ids is None else ids
        B = rows.shape[0]
        if rows.shape[1] != 1 or rows.dtype != (torch.float32 if ids is None else torch.int64) or not rows.is_cpu:
            return None
        fast = self._takes(B, cache, mask, rope, hooks)
        if fast is None:
            return None
        if ids is None:
            h = x.reshape(B, x.shape[-1]).contiguous().clone()
            lead = (h.data_ptr(),) if function == "lmhead_llama_step" else (h.data_ptr(), None)
        else:
            h, ids = None, ids.reshape(B).contiguous()  # held across the call
            lead = (None, ids.data_ptr())
        pos = None if pos is None else pos.reshape(B).to(torch.int64).contiguous()  # held across the call
        k, v = cache.k, cache.v
        status = getattr(fast.lib, function)(ctypes.addressof(self.model), *lead, B,
                                             None if pos is None else pos.data_ptr(), k.data_ptr(), v.data_ptr(),
                                             k.stride(0), k.stride(1), k.stride(2), cache.length,
                                             None if mask is None else mask.data_ptr(),
                                             0 if mask is None else mask.stride(0), *out, torch.get_num_threads())
        if status == -1:
            raise MemoryError("the compiled decoding step could not allocate its buffers")
        return status, h

    def run(self, x: torch.Tensor, cache, mask: torch.Tensor | None, pos: torch.Tensor | None,
            rope: torch.Tensor) -> torch.Tensor | None:
        """The residual stream x (B, 1, D) of one new position of B rows through every layer, writing each
        layer's key and value at the cache's next position (the caller advances cache.length): (B, 1, D)
        float32. pos (B,) int64 or None (every row at the cache's length); mask (B, 1, 1, past + 1)
        additive float32 or None; rope the engine's table (2, n, hd) float32, covering every position.
        None (nothing done, or the cache's next position partly written, which the torch path writes
        again) where the step does not apply."""
        done = self._call("lmhead_llama_step", x, cache, mask, pos, rope, self.hooks)
        return done[1].view(x.shape) if done is not None and done[0] == 0 else None

    def greedy_run(self, token: int, cache, n: int, eos: int | None, rope: torch.Tensor):
        """Engine.greedy_run over the whole step from token ids (`logits`'s with ids, one row, no mask),
        rope covering the run's positions; the cache's length not advanced. None where it does not apply."""
        if not (self.has_head and self.embeds):
            return None
        fast = self._takes(1, cache, None, rope, self.whole_ids)
        return None if fast is None else greedy_run(fast, self.model, True, token, cache, n, eos, self.model.V)

    def logits(self, x: torch.Tensor | None, cache, mask: torch.Tensor | None, pos: torch.Tensor | None,
               rope: torch.Tensor, record: bool = False, ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, tuple | None] | None:
        """The whole step from the embedded tokens x (B, 1, D), or where the plan `embeds`, from x None and
        the token ids (B, 1) int64 (their rows looked up in the C call, unless a hook asks for the table's
        module), as `run` and then the final norm and the head: logits (B, V) float32, and with `record`
        each row's greedy record (top_id (B,) int64, (3, B) float32: the top-1's log p, the entropy, the
        top-1's logit), None where a logit is not finite. None where the step does not apply (a hook on
        the norm or the head too, a head the C step does not read, an id out of the table)."""
        if not self.has_head or (x is None and not self.embeds):
            return None
        B = (x if x is not None else ids).shape[0]
        z = torch.empty(B, self.model.V, dtype=torch.float32)
        top_id, top = (torch.empty(B, dtype=torch.int64), torch.empty(3, B, dtype=torch.float32)) if record else (None, None)
        done = self._call("lmhead_llama_decode", x, cache, mask, pos, rope,
                          self.whole if x is not None else self.whole_ids, z.data_ptr(),
                          None if top_id is None else top_id.data_ptr(), None if top is None else top.data_ptr(),
                          ids=None if x is not None else ids)
        if done is None or done[0] < 0:
            return None
        return z, ((top_id, top) if record and done[0] == 0 else None)
