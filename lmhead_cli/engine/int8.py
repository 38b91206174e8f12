"""int8 weights for the lean engine: each matrix quantised at load, symmetric, one scale per output row.

    W ≈ q · s,   q = round(W / s) ∈ [-127, 127] (int8, [N, K] rows),   s = max|W_row| / 127 (float32, [N])

A tied model keeps ONE table for the embedding and the head: `wte` looks rows up in it and `lm_head`
multiplies by it (`GPT2.wte.table is GPT2.lm_head.table`). Activations, norms, attention and the
softmax stay float32.

The product x · qᵀ runs on int8 kernels without rounding x to 8 bits: each row of x (float32) is split
exactly into three int8 digits of its own scale, x ≈ σ (a₀ + a₁/128 + a₂/128²) with σ = max|x| / 127 —
21 bits of the row's largest value, the error of float32 rounding at that size — and one int8 × int8 →
int32 matrix product (torch._int_mm, oneDNN with AMX or VNNI where the CPU has them) takes all three
digit rows through the weights in one pass. The int32 sums are exact; they are recombined in float32
and scaled by σ and s. The weights are read once, as int8: a quarter of float32's bytes.

Where torch has no int8 kernel for the device (a GPU here), each product dequantises its weight to
float32 first: the same figures, none of the speed (`kernel_for` says which, and load_model names it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIGIT = 128.0  # the base of the activation digits: |a₁|, |a₂| ≤ 64 fit int8 with room
QMAX = 127
_POWERS = torch.tensor([1.0, 1 / DIGIT, 1 / DIGIT**2])  # the digits' weights


def kernel_for(device: torch.device) -> bool:
    """Whether torch's int8 matrix product runs on `device` for these shapes (a one-off tiny call)."""
    if device.type != "cpu":
        return False
    try:
        a = torch.ones(3, 8, dtype=torch.int8)
        return bool(torch._int_mm(torch.ones(4, 8, dtype=torch.int8), a.t()).sum() == 96)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def forms_for(device: torch.device) -> tuple[str, ...]:
    """The int8 product forms on `device`: torch._int_mm ("int_mm"), and oneDNN's quantised linear over
    packed copies of the body's tables ("packed") where torch has it; none without an int8 kernel."""
    if not kernel_for(device):
        return ()
    try:
        q = torch.ones(8, 16, dtype=torch.int8)
        y = int8_times(torch.ones(1, 16), q, torch.ones(8), packed=pack_for_qlinear(q))
        return ("int_mm", "packed") if bool((y == 16).all()) else ("int_mm",)
    except (RuntimeError, AttributeError, NotImplementedError, TypeError):
        return ("int_mm",)


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q int8 (N, K), s float32 (N,)), symmetric per row; an all-zero row gets s = 1."""
    w = w.detach().float()
    s = w.abs().amax(1) / QMAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (w / s[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), s.contiguous()


def digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (a (K, 3M) int8: columns [a₀ rows, a₁ rows, a₂ rows], σ (M, 1)) with
    x = σ (a₀ + a₁/128 + a₂/128²) to 2⁻²¹ of max|x| per row."""
    sigma = x.abs().amax(-1, keepdim=True).div_(QMAX).clamp_(min=torch.finfo(torch.float32).tiny)
    r = x / sigma  # (M, K) in [-127, 127]
    a0 = r.round()
    r = r.sub_(a0).mul_(DIGIT)
    a1 = r.round()
    a2 = r.sub_(a1).mul_(DIGIT).round_()
    if x.shape[0] == 1:  # a decoding step: (K, 3) in one op, no transpose
        return torch.stack([a0[0], a1[0], a2[0]], 1).to(torch.int8), sigma
    return torch.cat([a0, a1, a2]).to(torch.int8).t().contiguous(), sigma


def int8_times(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None,
               kernel: bool = True, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32 times (q · s)ᵀ, plus bias: (M, N) float32. `packed`: q packed for oneDNN's
    quantised linear (`pack_for_qlinear`), which then runs instead of torch._int_mm."""
    if not kernel:  # no int8 kernel here: dequantise, then the plain product
        w = q.to(x.dtype) * s[:, None].to(x.dtype)
        return F.linear(x, w, bias)
    M = x.shape[0]
    a, sigma = digits(x.float())
    if packed is not None:  # (3M, N) float32 = Σ a·q · s, each row's int32 sum exact before the scale
        zero = torch.zeros(q.shape[0], dtype=torch.int64)
        part = torch.ops.onednn.qlinear_pointwise(a.t(), 1.0, 0, packed, s, zero, None, 1.0, 0, torch.float32,
                                                  "none", [], "")
        y = torch.add(part[:M], part[M:2 * M], alpha=1 / DIGIT).add_(part[2 * M:], alpha=1 / DIGIT ** 2).mul_(sigma)
        return y if bias is None else y.add_(bias)
    acc = torch._int_mm(q, a).float()  # (N, 3M): exact int32 sums, then float32
    if M == 1:  # Σ_d acc[:, d] σ/128^d as one (N, 3) × (3,) product, then · s + bias in one op
        y = torch.mv(acc, sigma[0] * _POWERS.to(x.device))[None]  # (1, N)
        return y.mul_(s) if bias is None else torch.addcmul(bias, y, s)
    y = torch.add(acc[:, :M], acc[:, M:2 * M], alpha=1 / DIGIT).add_(acc[:, 2 * M:], alpha=1 / DIGIT ** 2)  # (N, M)
    y = y.t() * (sigma * s)  # (M, N)
    return y if bias is None else y.add_(bias)


def pack_for_qlinear(q: torch.Tensor) -> torch.Tensor | None:
    """q (N, K) int8 in oneDNN's layout for its quantised linear (a copy), or None where torch lacks it."""
    try:
        return torch.ops.onednn.qlinear_prepack(q, [3, q.shape[1]])
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class Int8Table(nn.Module):
    """One quantised matrix: q (N, K) int8 rows and s (N,) float32, W ≈ q · s. `kernel`: torch's int8
    product runs on its device (else products dequantise)."""

    def __init__(self, w: torch.Tensor, kernel: bool = True):
        super().__init__()
        q, s = quantise(w)
        self.q = nn.Parameter(q, requires_grad=False)
        self.s = nn.Parameter(s, requires_grad=False)
        self.kernel = kernel

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantise(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """q · s as float32: all rows, or `rows` (ids): (n, K)."""
        return self.q[rows].float() * self.s[rows, None]

    def times(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) -> x · Wᵀ + bias (..., N) float32."""
        y = int8_times(x.reshape(-1, x.shape[-1]), self.q, self.s, bias, self.kernel)
        return y.view(*x.shape[:-1], -1)


class Int8Conv1D(nn.Module):
    """GPT-2's Conv1D (y = x @ W + b, W (in, out)) over an int8 table of W's rows (out, in). In the
    engine's "packed" form (engine/products.py) a few positions run over a copy of the table packed for
    oneDNN's quantised linear, made at the second one-position call."""

    products = None  # the engine's Products, set when it is built
    packed: torch.Tensor | None = None
    _one_row_calls = 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, kernel: bool):
        super().__init__()
        self.table = Int8Table(weight.detach().t(), kernel)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        few = x2.shape[0] <= 4 and x2.device.type == "cpu"
        if few and self._one_row_calls < 2 and self.products is not None and "packed" in self.products.forms:
            self._one_row_calls += 1
            if self._one_row_calls == 2 and not (self.products.settled and self.products.form != "packed"):
                self.packed = pack_for_qlinear(self.table.q)
        packed = self.packed if few and self.products is not None and self.products.form == "packed" else None
        t = self.table
        return int8_times(x2, t.q, t.s, self.bias, t.kernel, packed).view(*x.shape[:-1], -1)

    @property
    def weight(self) -> torch.Tensor:
        """W (in, out) dequantised, float32: for readings that split the layer (components)."""
        return self.table.dequantise().t()



class Int8Embedding(nn.Module):
    """Rows of an int8 table, dequantised: the token embedding (the very table the tied head multiplies by)."""

    def __init__(self, table: Int8Table):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table.q).float() * F.embedding(ids, self.table.s[:, None])


class Int8Head(nn.Module):
    """The head z = h · W_outᵀ over an int8 table (no bias)."""

    bias = None

    def __init__(self, table: Int8Table):
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.table.times(h)


def quantise_gpt2_(gpt: nn.Module, tied: bool, device: torch.device, announce=lambda line: None) -> None:
    """Replace every matrix of a lean GPT2 (engine/lean.py) by its int8 table, in place: each block's
    Conv1Ds, and wte with lm_head (one table when tied). wpe, norms and biases stay float32. Where
    `device` has no int8 kernel, `announce(line)` names the fallback."""
    from lmhead_cli.engine.lean import Conv1D

    kernel = kernel_for(device)
    if not kernel:
        announce(f"--dtype int8 on {device.type}: torch has no int8 product kernel there; each product "
                 "dequantises its weights to float32 instead (the same figures, none of the speed)")

    for block in gpt.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, Conv1D):
                    setattr(parent, name, Int8Conv1D(child.weight, child.bias, kernel))
    table = Int8Table(gpt.wte.weight, kernel)
    head = table if tied else Int8Table(gpt.lm_head.weight, kernel)
    gpt.wte, gpt.lm_head = Int8Embedding(table), Int8Head(head)
