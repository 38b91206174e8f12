"""CPU kernels for the lean engine: a weight matrix times a few positions, in each form it can run.

One position at a time (inspect's last position, every decoding step) the body's and the head's
products are matrix-vector products that do little but stream weights, and how they are laid out and
dispatched decides the speed. Which form is fastest depends on the CPU, its BLAS and how busy the
machine is, so the engine offers each dtype's forms and `engine/threads.py` keeps whichever measures
fastest on the decoding steps themselves, as it does for the thread count:

- "linear": addmm / F.linear (oneDNN's gemm for bfloat16).
- "gemv": one position as addmv (BLAS's gemv for float32, torch's bfloat16 gemv; several positions run
  addmm).
- "blocked" (bfloat16): the rows in 2·threads blocks as one batched matmul over views (`rows_times`).
- "kernel" (bfloat16, float32): the compiled kernel of engine/csrc/kernels.c, where it was built (then the
  dtype's only form): bfloat16 pairs multiplied into float32 sums, the output rounded once; float32 rows
  (the head's W_out) streamed four at a time; float32 Conv1D (in, out) matrices for 2 to 16 rows (a
  short prompt's positions) by the step's own column product (csrc/step.c), 2.4-3.6x as fast as
  BLAS's gemm there, which packs the matrix again on every call. A product it does not take (one row of
  a Conv1D matrix, where BLAS's gemv is faster; a strided view) runs gemv; a decoding step's products
  are the compiled step's (engine/step.py).

Every form reads the weights where they are: no form needs a copy of its own, so choosing one costs
no lay-out step and no memory. GPT-2's float32 matrices stay in the checkpoint's (in, out) layout,
which BLAS streams as fast as rows (its memory-mapped pages are the weights); bfloat16 matrices are
made (out, in) rows when they are converted at load (engine/lean.py `conv1d_weight`), the layout
torch's bfloat16 gemv streams fastest. int8 weights (engine/int8.py) run one form, `int8_times` (the
compiled kernel where it builds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmhead_cli.engine import kernels

BLOCKED_MAX_ROWS = 4  # more positions than this are a GEMM that computes, not streams: plain path
# float32 has no "blocked" form: over the checkpoint's (in, out) layout the blocks are strided, and
# one such step took 3-5x as long as gemm on one thread (rows would take a 340 MB copy per process).
# float32 runs one form: BLAS's gemm and gemv over the same memory measured alike idle and beside a busy
# process (docs/performance.md), so timing both only cost steps.
FORMS = {torch.float32: ("gemv",), torch.bfloat16: ("gemv", "linear", "blocked")}
KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # dtypes with a compiled "kernel" form (engine/csrc/kernels.c)


@dataclass
class Products:
    """How one engine's few-position products run: `form`, one of `forms` (set by the thread chooser)."""

    forms: tuple[str, ...] = ()
    form: str = "linear"

    def use(self, form: str) -> None:
        if form not in self.forms:
            raise ValueError(f"unknown product form {form!r}; one of {self.forms}")
        self.form = form


def products_for(dtype: torch.dtype, device: torch.device) -> Products:
    """The forms a dtype can run in on `device` (a GPU runs one: the plain product). bfloat16 on the CPU
    runs the compiled kernel alone where it loads: it beat torch's forms idle and beside a busy process
    alike (docs/performance.md), so timing the others would only cost steps."""
    forms = FORMS.get(dtype, ()) if device.type == "cpu" else ()
    if dtype in KERNEL_DTYPES and forms and kernels.load() is not None:
        forms = ("kernel",)
    return Products(forms=forms, form=forms[0] if forms else "linear")


def few_cpu_rows(x: torch.Tensor) -> bool:
    return x.is_cpu and x.shape[0] <= BLOCKED_MAX_ROWS


def kernel_rows(x: torch.Tensor, products: Products) -> bool:
    """Whether x's rows go to `products`' form: a few rows, or, for float32 in the kernel form, as many
    as the compiled Conv1D product takes (a short prompt's positions)."""
    columns = products.form == "kernel" and x.dtype == torch.float32
    return x.is_cpu and x.shape[0] <= (kernels.STEP_MAX_ROWS if columns else BLOCKED_MAX_ROWS)


def rows_times(w: torch.Tensor, h: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """h · wᵀ (+ b) for a few positions h (R, D) and w (V, D), rows or the transposed view of an (D, V)
    matrix: (R, V), computed as w's rows in 2·threads blocks times h (one batched matmul over views of
    w, the bias added in the same call) plus any last rows."""
    V, D = w.shape
    R = h.shape[0]
    s = 2 * max(1, torch.get_num_threads())
    n = V // s
    hs = h.t().expand(s, D, R)  # (s, D, R), a view
    out = torch.empty(V, R, dtype=h.dtype, device=h.device)  # written in place: no concatenation
    blocks, last = out[: s * n].view(s, n, R), out[s * n:]
    if b is None:
        torch.bmm(w[: s * n].unflatten(0, (s, n)), hs, out=blocks)
        if s * n < V:
            torch.mm(w[s * n:], h.t(), out=last)
    else:
        torch.baddbmm(b[: s * n].view(s, n, 1), w[: s * n].unflatten(0, (s, n)), hs, out=blocks)
        if s * n < V:
            torch.addmm(b[s * n:, None], w[s * n:], h.t(), out=last)
    return out.t().contiguous()  # (R, V); one row needs no copy


def few_rows_product(form: str, x2: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (R, K) times rows (N, K) (rows, or the transposed view of a (K, N) matrix), plus bias, in
    `form`: (R, N)."""
    if form == "kernel":
        fast = kernels.load()
        times = None if fast is None else fast.f32_times if x2.dtype == torch.float32 else fast.bf16_times
        y = times(x2, rows, bias) if times is not None else None
        if y is None and fast is not None and x2.dtype == torch.float32 and rows.t().is_contiguous():
            y = fast.f32_columns_times(x2, rows.t(), bias)  # a Conv1D's (in, out) matrix, 2 to 16 rows
        if y is not None:
            return y
        form = "gemv"  # a product the kernel does not take (a strided view, say): torch's own
    if form == "blocked":
        return rows_times(rows, x2, bias)
    if form == "gemv" and x2.shape[0] == 1:
        y = torch.mv(rows, x2[0]) if bias is None else torch.addmv(bias, rows, x2[0])
        return y[None]
    if bias is None:
        return torch.mm(x2, rows.t())
    return torch.addmm(bias, x2, rows.t())
