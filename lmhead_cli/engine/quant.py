"""Weights kept as a GGUF file's own quantised blocks, and the products over them.

`Blocks` holds one matrix as the file stores it: a (rows, bytes per row) uint8 tensor, read from the
file (loading/gguf.py: read, not mapped) and then packed with the engine's stacked projections onto
2 MiB pages where Linux gives them (engine/pages.py), with the block type (Q8_0, Q4_0, Q4_K, Q6_K,
... as gguf.GGMLQuantizationType numbers them). The matrix is never dequantised whole on the hot path: `QuantLinear` multiplies a
chunk of rows at a time (at most CHUNK_VALUES float32 values dequantised at once, whatever the
matrix's size), `QuantEmbedding` dequantises only the rows it looks up.

Dequantisation is the compiled kernels' for the types they take (lmhead_gguf_dequantise: ggml's
dequantize_row_* operation for operation; a 2,048-wide Q4_K embedding row in 14 µs against numpy's 95);
where they are not built, the gguf package's (gguf.quants.dequantize, llama.cpp's own numpy port of
ggml's), Q8_0 and Q4_0 here in torch with the same arithmetic (d · q in float32). All give the same bits
(tests/test_quant.py compares them).

Q8_0, Q4_0, Q4_K and Q6_K are multiplied by compiled products over the blocks (csrc/quants.c, their
layouts declared once in csrc/kernels.h and mirrored below), in one of two arithmetics per type (ROUNDED,
or LMHEAD_GGUF_ARITHMETIC=exact / =llama.cpp for every type):
- x unrounded (Q8_0's by default): each block's integers summed against x in float32, then scaled: the
  dequantised matrix's product to float32 rounding, so the figures are transformers' on the file's
  dequantised weights (top 5 equal, KL <= 1e-5 at every position, tests/test_quant.py).
- x rounded per block, llama.cpp's (Q4_0's, Q4_K's, Q6_K's by default): each row of x rounded to 8 bits
  per block (Q8_0 blocks with float scales for Q4_0 and Q8_0, Q8_K super-blocks for the K-quants) and
  integer dot products, 2.5 to 6 times faster for the 4-bit types (docs/performance.md). Its cost, KL
  from transformers on the dequantised weights at the worst position of the tests' random Llama and
  Qwen2: Q4_0 1.6e-4, Q4_K 3.7e-4, Q6_K 3.3e-4 (bound tested: 1e-3); Q8_0 1.6e-4, over its 1e-5 bound,
  so Q8_0 keeps x unrounded. On those flat random models the rounding also reorders near-tied top-5
  tokens (docs/gguf.md).
Where the kernels are not built (or x is not finite where it would be rounded), torch multiplies the
dequantised rows a chunk at a time, as for every other type.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from lmhead_cli.engine import kernels
from lmhead_cli.engine.kernels import GGUF_MAX_ROWS, header_constants

# ---- the blocks' layouts, mirrored from csrc/kernels.h (tests/test_kernel_interface.py checks the fields,
# offsets and sizes against the header and the C compiler, tests/test_quant.py the sizes against gguf's)
_H = header_constants()
QK8_0, QK_K, K_SCALE_SIZE = _H["LMHEAD_QK8_0"], _H["LMHEAD_QK_K"], _H["LMHEAD_K_SCALE_SIZE"]
Q4_0, Q8_0, Q4_K, Q6_K = (_H[f"LMHEAD_TYPE_{t}"] for t in ("Q4_0", "Q8_0", "Q4_K", "Q6_K"))  # GGML's numbers
_u8, _i8, _u16 = ctypes.c_uint8, ctypes.c_int8, ctypes.c_uint16


class BlockQ8_0(ctypes.Structure):
    _fields_ = [("d", _u16), ("qs", _i8 * QK8_0)]


class BlockQ4_0(ctypes.Structure):
    _fields_ = [("d", _u16), ("qs", _u8 * (QK8_0 // 2))]


class BlockQ4_K(ctypes.Structure):
    _fields_ = [("d", _u16), ("dmin", _u16), ("scales", _u8 * K_SCALE_SIZE), ("qs", _u8 * (QK_K // 2))]


class BlockQ6_K(ctypes.Structure):
    _fields_ = [("ql", _u8 * (QK_K // 2)), ("qh", _u8 * (QK_K // 4)), ("scales", _i8 * (QK_K // 16)), ("d", _u16)]


class BlockQ8_K(ctypes.Structure):  # activations, built inside the kernel: mirrored for the layout test
    _fields_ = [("d", ctypes.c_float), ("qs", _i8 * QK_K), ("bsums", ctypes.c_int16 * (QK_K // 16))]


class BlockQ8_0f(ctypes.Structure):  # activations for Q4_0 and Q8_0 weights
    _fields_ = [("d", ctypes.c_float), ("qs", _i8 * QK8_0)]


STRUCTURES = {"lmhead_block_q8_0": BlockQ8_0, "lmhead_block_q4_0": BlockQ4_0, "lmhead_block_q4_K": BlockQ4_K,
              "lmhead_block_q6_K": BlockQ6_K, "lmhead_block_q8_K": BlockQ8_K, "lmhead_block_q8_0f": BlockQ8_0f}
# The types with a compiled product: (values per block, the block's layout)
COMPILED = {Q4_0: (QK8_0, BlockQ4_0), Q8_0: (QK8_0, BlockQ8_0), Q4_K: (QK_K, BlockQ4_K), Q6_K: (QK_K, BlockQ6_K)}
Q8_0_VALUES, Q8_0_BYTES = QK8_0, ctypes.sizeof(BlockQ8_0)

# The most rows of x (a decoding step's few) that a product with x unrounded gives the compiled kernel; more
# (a prompt's) go to torch's matrix product over W dequantised a chunk at a time, the same float32 product
# summed in another order, and faster: a TinyLlama-shaped Q8_0 file read a 512-token prompt at 78 tok/s
# that way against 38.6 in the kernel (one process, this AVX-512 host). Rounded x stays in the kernel at
# any number of rows (integer dots, each super-block unpacked once for 16 rows of x).
KERNEL_ROWS = GGUF_MAX_ROWS
# The arithmetic, per type: True, llama.cpp's (each row of x rounded to 8 bits per block, integer dots:
# fast); False, x unrounded (float32 sums of the blocks' integers: the dequantised matrix's product).
# LMHEAD_GGUF_ARITHMETIC=exact turns rounding off for every type, =llama.cpp on for every type.
ROUNDED = {Q4_0: True, Q8_0: False, Q4_K: True, Q6_K: True}
ARITHMETIC = "LMHEAD_GGUF_ARITHMETIC"
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

    def compiled(self) -> bool:
        """Whether the compiled kernels read these blocks where they lie: a type they take (COMPILED), on the
        CPU, contiguous, whole blocks a row (QuantLinear's products and Llama's compiled step)."""
        layout = COMPILED.get(self.qtype)
        return bool(layout and self.data.is_cpu and self.data.is_contiguous() and self.cols % layout[0] == 0
                    and self.data.shape[1] == self.cols // layout[0] * ctypes.sizeof(layout[1]))

    def same_as(self, other: "Blocks") -> bool:
        """The same type and bytes (a GGUF's output.weight stored equal to token_embd.weight)."""
        return self.qtype == other.qtype and self.shape == other.shape and torch.equal(self.data, other.data)




def dequantise(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """Blocks (n, bytes per row) uint8 -> (n, cols) float32, as gguf.quants.dequantize computes them."""
    fast = kernels.load() if qtype in COMPILED else None
    got = fast.gguf_rows(qtype, data.contiguous(), cols) if fast is not None else None
    if got is not None:
        return got
    n = data.shape[0]
    if qtype == 8:  # Q8_0: 32 values a block: d (float16), 32 int8 q; x = d·q
        b = data.reshape(n, -1, Q8_0_BYTES)
        d = b[..., :2].contiguous().view(torch.float16).float()  # (n, blocks, 1)
        return (d * b[..., 2:].view(torch.int8).float()).reshape(n, cols)
    if qtype == 2:  # Q4_0: 32 values a block: d (float16), 16 bytes of two 4-bit q; x = d·(q − 8)
        b = data.reshape(n, -1, ctypes.sizeof(BlockQ4_0))
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
        self._checked, self._takes = None, False  # the blocks whose layout _compiled checked, and its verdict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = self._compiled(x2)
        if y is not None:
            y = y.view(*x.shape[:-1], y.shape[-1])
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for a, w in self.weight.chunks():  # w (n, in)
            torch.matmul(x2, w.t(), out=out[:, a:a + w.shape[0]])
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], -1).to(x.dtype)

    def _compiled(self, x2: torch.Tensor) -> torch.Tensor | None:
        """x2 (M, in) times the blocks in the compiled kernels: (M, out) float32, in the type's arithmetic
        (`rounded`); None where they do not take it (not built, another type or layout, a row of x not
        finite where x is rounded, more than KERNEL_ROWS rows with x unrounded). Called ~150 times a
        Llama's decoding step: the layout is checked once per weight."""
        w = self.weight
        if self._checked is not w:  # the blocks' layout, once (a weight swapped in is checked again)
            self._takes, self._checked = w.compiled(), w
        if not (self._takes and KERNEL_ROWS and x2.is_cpu):
            return None
        fast = kernels.load()
        if fast is None:
            return None
        round_x = rounded(w.qtype)
        if not round_x and x2.shape[0] > KERNEL_ROWS:
            return None  # a prompt's rows, unrounded: torch's matrix product is faster (KERNEL_ROWS)
        return fast.gguf_times(w.qtype, x2.contiguous(), w.data, self.bias, rounded=round_x)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.weight.kind}"


class QuantEmbedding(nn.Module):
    """A token table held as quantised blocks: the rows looked up are dequantised, no others."""

    def __init__(self, weight: Blocks):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids.reshape(-1)).view(*ids.shape, -1)


def rounded(qtype: int) -> bool:
    """Whether products over `qtype`'s blocks round x per block (llama.cpp's arithmetic): ROUNDED's choice,
    or LMHEAD_GGUF_ARITHMETIC's (exact: never; llama.cpp: always)."""
    asked = os.environ.get(ARITHMETIC, "").strip().lower()
    return {"exact": False, "llama.cpp": True}.get(asked, ROUNDED.get(qtype, False))


def block_types(module: nn.Module) -> list[str]:
    """The block types a module's quantised weights hold, most common first ("Q4_K", "Q6_K")."""
    from collections import Counter

    kinds = Counter(m.weight.kind for m in module.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    return [k for k, _ in kinds.most_common()]
