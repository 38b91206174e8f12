"""Weights kept as a GGUF file's own quantised blocks, and the products over them.

`Blocks` holds one matrix as the file stores it: a (rows, bytes per row) uint8 tensor, a view of the
file mapped copy-on-write (so its pages are the page cache's until something writes them, and
nothing does), with the block type (Q8_0, Q4_0, Q4_K, Q6_K, ... as gguf.GGMLQuantizationType
numbers them). The matrix is never dequantised whole on the hot path: `QuantLinear` multiplies a
chunk of rows at a time (at most CHUNK_VALUES float32 values dequantised at once, whatever the
matrix's size), `QuantEmbedding` dequantises only the rows it looks up.

Dequantisation is the gguf package's (gguf.quants.dequantize, llama.cpp's own numpy port of ggml's),
so lmhead's figures are those of transformers on the file's dequantised weights (the parity tests'
oracle), except for Q8_0 and Q4_0, dequantised here in torch with the same arithmetic (d · q in
float32: the same bits; tests/test_quant.py compares them). A Q8_0 product of a few rows (a decoding
step) runs in the compiled kernel (csrc/kernels.c lmhead_q8_0_matvec): each block's 32 products summed
in float32 and scaled by its d, the activations unrounded, without dequantising anything.
"""

from __future__ import annotations

import torch
from torch import nn

# The blocks' layouts as csrc/kernels.h declares them (tests/test_quant.py checks them against it)
from lmhead_cli.engine.kernels import Q8_0_BYTES, Q8_0_VALUES

# The most rows of activations the compiled Q8_0 product takes (a decoding step's few; more rows read
# each weight block once per row, where torch's chunked product reads it once).
KERNEL_ROWS = 16
CHUNK_VALUES = 1 << 20  # float32 values dequantised at once: 4 MiB, whatever the matrix


def type_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


class Blocks:
    """One quantised matrix (rows, cols) held as its GGUF blocks: `data` (rows, bytes per row) uint8.

    Duck-typed where the engine contract hands out a weight (head_weight, embedding_weight): `shape`
    is the matrix's, `is_floating_point()` is False (callers then ask the engine for rows), `rows(ids)`
    dequantises rows, `dequantise()` the whole matrix (what a reading of every value vector asks for).
    """

    def __init__(self, data: torch.Tensor, qtype: int, cols: int):
        self.data, self.qtype, self.cols = data, int(qtype), int(cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def kind(self) -> str:
        return type_name(self.qtype)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def numel(self) -> int:
        return self.data.shape[0] * self.cols

    def dim(self) -> int:
        return 2

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def is_floating_point(self) -> bool:
        return False

    def detach(self) -> "Blocks":
        return self

    def take(self, index: torch.Tensor) -> "Blocks":
        """Rows `index` as new blocks (a copy: llama.cpp's q/k row order undone)."""
        return Blocks(self.data.index_select(0, index.to(torch.int64)).contiguous(), self.qtype, self.cols)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (n,) dequantised: (n, cols) float32."""
        return dequantise(self.data.index_select(0, torch.as_tensor(ids, dtype=torch.int64).reshape(-1)),
                          self.qtype, self.cols)

    def chunks(self):
        """(first row, rows (n, cols) float32) over the whole matrix, CHUNK_VALUES values at a time."""
        step = max(1, CHUNK_VALUES // self.cols)
        for a in range(0, self.data.shape[0], step):
            yield a, dequantise(self.data[a:a + step], self.qtype, self.cols)

    def dequantise(self) -> torch.Tensor:
        """The whole matrix (rows, cols) float32."""
        out = torch.empty(self.shape, dtype=torch.float32)
        for a, rows in self.chunks():
            out[a:a + rows.shape[0]] = rows
        return out

    def same_as(self, other: "Blocks") -> bool:
        """The same type and bytes (a GGUF's output.weight stored equal to token_embd.weight)."""
        return self.qtype == other.qtype and self.shape == other.shape and torch.equal(self.data, other.data)




def dequantise(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """Blocks (n, bytes per row) uint8 -> (n, cols) float32, as gguf.quants.dequantize computes them."""
    n = data.shape[0]
    if qtype == 8:  # Q8_0: 32 values a block: d (float16), 32 int8 q; x = d·q
        b = data.reshape(n, -1, Q8_0_BYTES)
        d = b[..., :2].contiguous().view(torch.float16).float()  # (n, blocks, 1)
        return (d * b[..., 2:].view(torch.int8).float()).reshape(n, cols)
    if qtype == 2:  # Q4_0: 32 values a block: d (float16), 16 bytes of two 4-bit q; x = d·(q − 8)
        b = data.reshape(n, -1, 18)
        d = b[..., :2].contiguous().view(torch.float16).float()
        qs = b[..., 2:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(torch.int8) - 8  # low nibbles first, as ggml
        return (d * q.float()).reshape(n, cols)
    from gguf.quants import dequantize

    values = dequantize(data.numpy(), qtype)  # (n, cols) float32
    return torch.from_numpy(values.reshape(n, cols))


class QuantLinear(nn.Module):
    """y = x · Wᵀ (+ b) with W held as quantised blocks, multiplied a chunk of W's rows at a time."""

    def __init__(self, weight: Blocks, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.cols, weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()  # (M, in)
        if self.weight.qtype == 8 and x2.shape[0] <= KERNEL_ROWS and x2.is_cpu:  # a few rows: compiled, Q8_0
            from lmhead_cli.engine import kernels

            fast = kernels.load()
            y = fast.q8_0_times(x2.contiguous(), self.weight.data, self.bias) if fast is not None else None
            if y is not None:
                return y.view(*x.shape[:-1], -1).to(x.dtype)
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for a, w in self.weight.chunks():  # w (n, in)
            torch.matmul(x2, w.t(), out=out[:, a:a + w.shape[0]])
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], -1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.weight.kind}"


class QuantEmbedding(nn.Module):
    """A token table held as quantised blocks: the rows looked up are dequantised, no others."""

    def __init__(self, weight: Blocks):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids.reshape(-1)).view(*ids.shape, -1)


def block_types(module: nn.Module) -> list[str]:
    """The block types a module's quantised weights hold, most common first ("Q4_K", "Q6_K")."""
    from collections import Counter

    kinds = Counter(m.weight.kind for m in module.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    return [k for k, _ in kinds.most_common()]
