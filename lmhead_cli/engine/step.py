"""The compiled decoding step: every block of the lean GPT-2 for a few rows of one new position, in one call
(and for a short prompt's positions: a server's lone request reads its prompt the same way).

A decoding step through engine/lean.py's torch modules dispatches about 85 ops a block (norms,
products, views, the cache's writes, attention, GELU, adds): on a 2-core CPU, half of a float32
step's time went to dispatching them. csrc/step.c runs the same blocks in one C call over the same
weights where the engine keeps them (float32 Conv1D (in, out) as the checkpoint maps them, bfloat16
(out, in) rows, int8 rows with their scales: nothing is copied), writing the new keys and values into
the engine's KV cache (`StepPlan.run`, from LeanGPT2.body: the embeddings, the final norm and the
head stay the modules').

`StepPlan.logits` runs the whole step, token to logits, in one call (csrc/step.c lmhead_decode): the
embeddings, the blocks, ln_f and the head's kernel. Between the products, which stream every weight
through the caches, the torch path's twenty-odd ops and Python calls each waited on memory (1.0-1.5 ms
of an 8.5 ms int8 token, measured on an AVX2 Zen 3).

`StepPlan.run` (the blocks) and `StepPlan.logits` take the step only where nothing needs torch's
graph, else return None and the engine runs its torch path (the same figures): the compiled kernels
loaded (engine/kernels.py), the CPU, float32 / bfloat16 / int8 weights, one new position for 1 to
MAX_ROWS rows with a KV cache (`run`: up to MAX_ROWS rows × positions, each position causal over the
ones before it), and no hook on any module they replace or torch's global hooks
(readings that capture components, neurons or layer taps read through hooks: they keep running the
modules). LMHEAD_STEP=0 turns the step off (to compare it with the torch path).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn
from torch.nn.modules import module as _module

from lmhead_cli.engine import kernels
from lmhead_cli.engine.kernels import Layer, Model

ENV = "LMHEAD_STEP"
MAX_ROWS = kernels.STEP_MAX_ROWS
KINDS = {torch.float32: kernels.STEP_KINDS["float32"], torch.bfloat16: kernels.STEP_KINDS["bfloat16"],
         "int8": kernels.STEP_KINDS["int8"]}  # csrc/kernels.h's LMHEAD_STEP_F32, _BF16, _INT8


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


def hook_dicts(modules: list[nn.Module]) -> list[dict]:
    """The dicts that hold `modules`' forward hooks (torch registers a hook by adding to them in place)."""
    return [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


def _tail(gpt: nn.Module, kind: int, D: int, keep: list[torch.Tensor]) -> dict | None:
    """The embeddings', ln_f's and the head's fields of csrc/kernels.h's lmhead_model (their tensors added
    to `keep`); None when one is not in the layout lmhead_decode reads."""
    if kind == KINDS["int8"]:
        wte, head = gpt.wte.table, gpt.lm_head.table
        tensors = {"wte": wte.q, "wte_s": wte.s, "head": head.q, "head_s": head.s}
    else:
        if gpt.lm_head.bias is not None:
            return None
        tensors = {"wte": gpt.wte.weight, "head": gpt.lm_head.weight}
    tensors.update(wpe=gpt.wpe.weight, lnf_w=gpt.ln_f.weight, lnf_b=gpt.ln_f.bias)
    tensors = {k: t.detach() for k, t in tensors.items()}
    V, n_pos = tensors["wte"].shape[0], tensors["wpe"].shape[0]
    if not (all(t.is_contiguous() and t.is_cpu for t in tensors.values())
            and tensors["wte"].shape == tensors["head"].shape == (V, D) and tensors["wpe"].shape == (n_pos, D)):
        return None
    keep += tensors.values()
    return {"V": V, "n_pos": n_pos, **{k: t.data_ptr() for k, t in tensors.items()}}


def fits(cache, B: int, mask: torch.Tensor | None, T: int = 1) -> bool:
    """Whether B rows' cache (L, B, heads, T_max, hd) and mask, for T new positions each, are in the layout
    the compiled steps read (csrc/step.c's both calls, csrc/llama_step.c's): float32 keys and values laid
    out alike, the mask's (past + T) rows evenly spaced."""
    k, v, past = cache.k, cache.v, cache.length
    return (k.dtype == v.dtype == torch.float32 and k.shape == v.shape and k.stride() == v.stride()
            and k.shape[1] == B and past + T <= k.shape[3] and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
            and (mask is None or (mask.dtype == torch.float32 and mask.shape == (B, 1, T, past + T)
                                  and mask.stride(-1) == 1 and (T == 1 or mask.stride(0) == T * mask.stride(2)))))


def greedy_run(fast, model: ctypes.Structure, llama: bool, token: int, cache, n: int, eos: int | None, V: int):
    """n whole steps of one row in one compiled call (csrc/llama_step.c lmhead_greedy_run) over `model`
    (an lmhead_llama where `llama`, else GPT-2's lmhead_model), whose plan has checked that it takes
    them: Engine.greedy_run's GreedyRun, the cache's length not advanced (the caller's), or None where
    the first step was not taken. The caller keeps n within the cache, the context and the positions
    (RoPE's table); fits(cache, n) is checked here."""
    from lmhead_cli.engine.base import GreedyRun

    if not fits(cache, 1, None, n):
        return None
    z = torch.empty(2, V, dtype=torch.float32)  # the steps' logits, in turn
    top_id, top = torch.empty(n, dtype=torch.int64), torch.empty(n, 3, dtype=torch.float32)
    k, v = cache.k, cache.v
    m = fast.lib.lmhead_greedy_run(ctypes.addressof(model), int(llama), token, n, -1 if eos is None else eos,
                                   k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), cache.length,
                                   z.data_ptr(), top_id.data_ptr(), top.data_ptr(), torch.get_num_threads())
    if m == -1:
        raise MemoryError("the compiled decoding step could not allocate its buffers")
    if m < 1:
        return None
    last = (m - 1) % 2
    return GreedyRun(top_id[:m], top[:m].T, z[last:last + 1])


class StepPlan:
    """The blocks' weight pointers for csrc/step.c, made once per engine (a few hundred pointers), and
    the modules whose hooks send a step back to torch; with the embeddings, ln_f and the head (`model`,
    None where they are not in the layout lmhead_decode reads), the whole step."""

    def __init__(self, blocks: nn.ModuleList, config: dict, kind: int, dtype: torch.dtype, gpt: nn.Module | None = None):
        self.kind, self.dtype = kind, dtype
        self.D, self.H = config["n_embd"], config["n_head"]
        self.inner = config.get("n_inner") or 4 * self.D
        self.eps = config.get("layer_norm_epsilon", 1e-5)
        self.modules = [m for block in blocks for m in block.modules()]
        self.hooks = hook_dicts(self.modules)
        layers = [_layer(block, kind) for block in blocks]
        self.ready = all(layer is not None for layer in layers)
        self.layers = (Layer * len(layers))(*[layer for layer, _ in layers]) if self.ready else None
        self.keep = [t for _, keep in layers for t in keep] if self.ready else []
        self.L = len(layers)
        self.model = None
        tail = _tail(gpt, kind, self.D, self.keep) if self.ready and gpt is not None else None
        if tail is not None:
            self.V = tail["V"]
            self.model = Model(layers=ctypes.addressof(self.layers), L=self.L, D=self.D, H=self.H,
                               inner=self.inner, kind=kind, eps=self.eps, **tail)
            tail_modules = [m for part in (gpt.wte, gpt.wpe, gpt.ln_f, gpt.lm_head) for m in part.modules()]
            self.whole = self.hooks + hook_dicts(tail_modules)  # every module the whole step replaces

    @classmethod
    def for_engine(cls, gpt: nn.Module, config: dict, int8: bool, dtype: torch.dtype) -> StepPlan | None:
        """The plan for a lean GPT2 on the CPU in a dtype the step takes; None otherwise."""
        kind = KINDS["int8"] if int8 else KINDS.get(dtype)
        if kind is None or gpt.ln_f.weight.device.type != "cpu":
            return None
        plan = cls(gpt.h, config, kind, dtype, gpt)
        return plan if plan.ready else None

    def hooked(self, hooks: list[dict] | None = None) -> bool:
        """Whether any hook would see the blocks (or the modules whose `hooks` dicts are given) run: a
        reading's taps, or torch's global hooks. One look at each dict: a step's products evict the
        modules from every cache, and asking each module for its hooks by name took 0.1-0.16 ms a step."""
        return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                    or any(self.hooks if hooks is None else hooks))

    def logits(self, ids: torch.Tensor, cache, mask: torch.Tensor | None, pos: torch.Tensor | None,
               record: bool = False) -> tuple[torch.Tensor, tuple | None] | None:
        """The whole step for tokens ids (B, 1) at positions pos (B,) int64 (None: every row at the
        cache's length), writing each layer's key and value at the cache's next position (the caller
        advances cache.length): logits (B, V) float32, what the embeddings, `run`, ln_f and the head give,
        and with `record` each row's greedy record from score's row kernel while the logits are fresh:
        (top_id (B,) int64, (3, B) float32: the top-1's log p, the entropy, the top-1's logit), None
        where a logit is not finite (the caller records them itself, as it does without `record`).
        mask as `run`'s; at most as many rows as the head's kernel takes (float32's f32_max_rows, the
        others' max_rows); more than MAX_ROWS run in groups of MAX_ROWS, a call each (`_groups`). None
        (nothing done) where the step does not apply, or a token or position is out of range: the caller
        runs the torch path."""
        fast = kernels.load()
        B = ids.shape[0]
        if self.model is None or fast is None:
            return None
        if B > MAX_ROWS and cache is not None and ids.shape[1] == 1:
            return self._groups(ids, cache, mask, pos, record)
        most = fast.f32_max_rows if self.kind == KINDS[torch.float32] else fast.max_rows  # the head kernel's
        if (turned_off() or cache is None or ids.shape[1] != 1 or not 1 <= B <= min(MAX_ROWS, most)
                or not ids.is_cpu or ids.dtype != torch.int64 or self.hooked(self.whole) or not fits(cache, B, mask)):
            return None
        ids = ids.contiguous()
        if pos is not None:
            pos = pos.to(torch.int64).contiguous()
        k, v = cache.k, cache.v
        z = torch.empty(B, self.V, dtype=torch.float32)
        top_id, top = (torch.empty(B, dtype=torch.int64), torch.empty(3, B, dtype=torch.float32)) if record else (None, None)
        status = fast.lib.lmhead_decode(ctypes.addressof(self.model), ids.data_ptr(),
                                        None if pos is None else pos.data_ptr(), B, k.data_ptr(), v.data_ptr(),
                                        k.stride(0), k.stride(1), k.stride(2), cache.length,
                                        None if mask is None else mask.data_ptr(),
                                        0 if mask is None else mask.stride(0), z.data_ptr(),
                                        None if top_id is None else top_id.data_ptr(),
                                        None if top is None else top.data_ptr(), torch.get_num_threads())
        if status == -2:
            return None
        if status < 0:
            raise MemoryError("the compiled decoding step could not allocate its buffers")
        return z, ((top_id, top) if record and status == 0 else None)

    def greedy_run(self, token: int, cache, n: int, eos: int | None):
        """Engine.greedy_run over this plan's whole step (`logits`'s, for one row and no mask: the same
        conditions), the cache's length not advanced; None where it does not apply."""
        fast = kernels.load()
        if self.model is None or fast is None or turned_off() or self.hooked(self.whole):
            return None
        return greedy_run(fast, self.model, False, token, cache, n, eos, self.V)

    def _groups(self, ids: torch.Tensor, cache, mask: torch.Tensor | None, pos: torch.Tensor | None,
                record: bool) -> tuple[torch.Tensor, tuple | None] | None:
        """`logits` for B > MAX_ROWS rows (a server's batch past them): a call per group of MAX_ROWS rows,
        each on its rows' view of the cache (rows are the cache's dimension 1: a view keeps its strides) and of the mask; the logits
        (B, V) and records joined in row order (a record only where every group made one)."""
        from types import SimpleNamespace

        zs, records = [], []
        for a in range(0, ids.shape[0], MAX_ROWS):
            b = min(a + MAX_ROWS, ids.shape[0])
            part = SimpleNamespace(k=cache.k[:, a:b], v=cache.v[:, a:b], length=cache.length)
            out = self.logits(ids[a:b], part, None if mask is None else mask[a:b], None if pos is None else pos[a:b],
                              record)
            if out is None:
                return None
            zs.append(out[0])
            records.append(out[1])
        made = None
        if record and all(r is not None for r in records):
            made = (torch.cat([r[0] for r in records]), torch.cat([r[1] for r in records], dim=1))
        return torch.cat(zs), made

    def run(self, x: torch.Tensor, cache, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The residual stream x (B, T, D) of T new positions of B rows (B · T at most MAX_ROWS: a
        decoding step's rows, or a short prompt's positions) through every block, writing each layer's
        keys and values at the cache's next T positions (the caller advances cache.length): (B, T, D) in
        x's dtype. mask (B, 1, T, past + T) additive float32, or None: none for one position, causal
        among the new positions for more when the cache is empty (the torch path's reading; more
        positions after cached ones with no mask are the torch path's). None (nothing done) where the
        step does not apply: the caller runs the torch path."""
        fast = kernels.load()
        B, T, D = x.shape
        if (fast is None or turned_off() or cache is None or not 1 <= B * T <= MAX_ROWS or not x.is_cpu
                or (T > 1 and mask is None and cache.length) or self.hooked() or not fits(cache, B, mask, T)):
            return None
        k, v, past = cache.k, cache.v, cache.length
        h = x.reshape(B * T, D).to(torch.float32, copy=True).contiguous()  # (B·T, D), updated in place
        # the mask's rows: one a row of the batch (one position), or one a position (several)
        msb = 0 if mask is None else mask.stride(0) if T == 1 else mask.stride(2)
        status = fast.lib.lmhead_step(ctypes.addressof(self.layers), self.L, self.kind, h.data_ptr(), B, T, D, self.H,
                                      self.inner, self.eps, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                                      k.stride(2), past, None if mask is None else mask.data_ptr(), msb,
                                      torch.get_num_threads())
        if status == -2:
            return None
        if status:
            raise MemoryError("the compiled decoding step could not allocate its buffers")
        return h.view(B, T, D).to(x.dtype)
