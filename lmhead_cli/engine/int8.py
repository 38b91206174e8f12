"""int8 weights for the lean engine: each matrix quantised at load, symmetric, one scale per output row.

    W ≈ q · s,   q = round(W / s) ∈ [-127, 127] (int8, [N, K] rows),   s = max|W_row| / 127 (float32, [N])

A tied model keeps ONE table for the embedding and the head: `wte` looks rows up in it and `lm_head`
multiplies by it (`GPT2.wte.table is GPT2.lm_head.table`). Activations, norms, attention and the
softmax stay float32.

The product x · qᵀ runs on int8 kernels without rounding x to 8 bits: each row of x (float32) becomes
integers v = round(c·x) with c = STEPS / max|x| (23 bits of the row's largest value, about float32's
rounding at that size), and v is written exactly as three int8 digits of base 256, v = a₀ + 256 a₁ +
65536 a₂: its own three low bytes, each read as a signed byte after 128 is added to it (`digits`, a
handful of whole-row ops). One int8 × int8 → int32 matrix product (torch._int_mm, oneDNN with AMX or
VNNI where the CPU has them) takes the digit columns through the weights in one pass; the int32 sums
are exact, and are recombined, divided by c and scaled by s in float32. The weights are read once, as
int8: a quarter of float32's bytes.

Where torch has no int8 kernel for the device (a GPU here), each product dequantises its weight to
float32 first: the same figures, none of the speed (`kernel_for` says which, and load_model names it).
On a CPU without VNNI or AMX torch._int_mm runs a reference loop (measured on an AVX2 Zen 3: 19.7 ms
for a 5-row product of GPT-2's c_attn, 3.8 s for 512 rows, where the float32 product took 0.6 and
15 ms): there the products of more rows than the compiled kernel takes dequantise too, DEQUANT_ROWS
rows of the weight at a time (`int_mm_pays` measures which, once per process).
"""

from __future__ import annotations

import functools
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from lmhead_cli.engine import kernels

QMAX = 127
STEPS = 8_000_000  # |v| ≤ STEPS: v + OFFSET stays within [0, 2^24) with room for the rounding of c·x
OFFSET = 0x808080  # 128 in each of v's three low bytes
# What each byte of an int32 is worth, in memory order: (1, 256, 65536) and the top byte (always 0 here).
_BYTES = torch.tensor([1.0, 256.0, 65536.0, 0.0] if sys.byteorder == "little" else [0.0, 65536.0, 256.0, 1.0])


def kernel_for(device: torch.device) -> bool:
    """Whether torch's int8 matrix product runs on `device` for these shapes (a one-off tiny call)."""
    if device.type != "cpu":
        return False
    try:
        a = torch.ones(3, 8, dtype=torch.int8)
        return bool(torch._int_mm(torch.ones(4, 8, dtype=torch.int8), a.t()).sum() == 96)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


# A product that dequantises does so this many rows of the weight at a time (3 MB of GPT-2's float32
# rows): the head's whole table at once would be 154 MB for every product.
DEQUANT_ROWS = 1024
# torch._int_mm pays where it is no more than this many times slower than the float32 product of the
# same shape (with VNNI or AMX it is faster; without, 15x slower at the probe's shape and 250x at 512 rows).
INT_MM_SLACK = 4.0


@functools.cache
def int_mm_pays() -> bool:
    """Whether torch's CPU int8 product is a real kernel here rather than a reference loop: its best of
    3 calls on a (128, 128) × (128, 32) product against the float32 product of the same shape, once per
    process (about a millisecond; a reference loop takes some 15 times the float32 product there)."""
    q = torch.ones(128, 128, dtype=torch.int8)
    a = torch.ones(128, 32, dtype=torch.int8)
    qf, af = q.float(), a.float()

    def best(fn) -> float:
        fn()  # first-call set-up (oneDNN's primitive) is not what is compared
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    try:
        return best(lambda: torch._int_mm(q, a)) <= INT_MM_SLACK * best(lambda: qf @ af)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def dequantised_times(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) times (q · s)ᵀ plus bias, in x's dtype, the weight dequantised DEQUANT_ROWS rows at a time."""
    N = q.shape[0]
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    for r in range(0, N, DEQUANT_ROWS):
        rows = slice(r, min(r + DEQUANT_ROWS, N))
        w = q[rows].to(x.dtype).mul_(s[rows, None].to(x.dtype))
        if bias is None:
            torch.mm(x, w.t(), out=y[:, rows])
        else:
            torch.addmm(bias[rows].to(x.dtype), x, w.t(), out=y[:, rows])
    return y


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q int8 (N, K), s float32 (N,)), symmetric per row; an all-zero row gets s = 1."""
    w = w.detach().float()
    s = w.abs().amax(1) / QMAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (w / s[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), s.contiguous()


def digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (a (K, 4M) int8, c (M, 1)): each row as integers v = round(c·x), |v| ≤ STEPS,
    c = STEPS / max|x|, with v = Σ_i a[:, 4m + i] · _BYTES[i] exactly. The digits are v's bytes: adding
    OFFSET makes v + OFFSET ∈ [0, 2^24), whose low three bytes b_i, each with its top bit flipped, read
    as int8 are b_i − 128, so Σ (b_i − 128) 256^i = v; the top byte is 0. A row with a NaN or an
    infinity gets c NaN or 0, which the recombination carries into its outputs."""
    M, K = x.shape
    c = x.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny).reciprocal_().mul_(STEPS)
    v = x.mul(c).round_().to(torch.int32, memory_format=torch.contiguous_format)
    v = v.add_(OFFSET).bitwise_xor_(OFFSET)  # (M, K)
    a = v.view(torch.int8).view(M, K, 4)  # each int32's bytes, in memory order
    return (a[0] if M == 1 else a.permute(1, 0, 2).reshape(K, 4 * M)), c


def int8_times(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None,
               kernel: bool = True) -> torch.Tensor:
    """x (M, K) float32 times (q · s)ᵀ, plus bias: (M, N) float32. A few rows on the CPU run the compiled
    kernel where it loads (engine/kernels.py: the weights widened in registers); more rows, or no
    compiled kernel, run torch._int_mm over the digits; `kernel` False (no int8 kernel on the device), or
    a CPU where torch._int_mm is a reference loop (`int_mm_pays`), dequantises."""
    fast = kernels.load() if x.is_cpu else None
    y = fast.int8_times(x, q, s, bias) if fast is not None else None
    if y is not None:
        return y
    if not kernel or (x.is_cpu and not int_mm_pays()):  # dequantise, then the plain product
        return dequantised_times(x, q, s, bias)
    M, N = x.shape[0], q.shape[0]
    a, c = digits(x.float())
    acc = torch._int_mm(q, a).float()  # (N, 4M): exact int32 sums, then float32
    if M == 1:  # Σ_i acc[:, i] · byte i's worth / c as one (N, 4) × (4,) product, then · s + bias in one op
        y = torch.mv(acc, _BYTES / c[0])[None]  # (1, N)
        return y.mul_(s) if bias is None else torch.addcmul(bias, y, s)
    y = (acc.view(N, M, 4) @ _BYTES).t().div_(c).mul_(s)  # (M, N)
    return y if bias is None else y.add_(bias)


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
    """GPT-2's Conv1D (y = x @ W + b, W (in, out)) over an int8 table of W's rows (out, in)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, kernel: bool):
        super().__init__()
        self.table = Int8Table(weight.detach().t(), kernel)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table.times(x, self.bias)

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
