"""CPU kernels for the lean engine: a weight matrix times a few positions, in each form it can run.

One position at a time (inspect's last position, every decoding step) the body's and the head's
products are matrix-vector products that do little but stream weights, and how they are laid out and
dispatched decides the speed. Which form is fastest depends on the CPU, its BLAS and how busy the
machine is (on one 2-core machine blocked rows beat BLAS's gemv 2×, on another gemv beats them 2×), so
the engine offers each dtype's forms and `engine/threads.py` keeps whichever measures fastest on the
decoding steps themselves, as it does for the thread count:

- "linear": addmm / F.linear over the weight as rows [N, K] (BLAS's gemm, or oneDNN for bfloat16).
- "gemv" (float32): one position as addmv over the rows (BLAS's gemv; several positions run "linear").
- "blocked": the rows in 2·threads blocks as one batched matmul over views (`rows_times`).
- "packed" (bfloat16): oneDNN's linear over a copy of the weight packed once in its own blocked layout.

int8 weights (engine/int8.py) run one form, `int8_times`.

A matrix is laid out (rows; packed) the second time it meets one position, not at load: a single
forward (inspect, lens) never pays for the copy, and the checkpoint's memory-mapped pages of a
transposed matrix are handed back, so decoding holds each matrix once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BLOCKED_MAX_ROWS = 4  # more positions than this are a GEMM that computes, not streams: plain path
FORMS = {torch.float32: ("linear", "gemv", "blocked"), torch.bfloat16: ("packed", "linear", "blocked")}


@dataclass
class Products:
    """How one engine's few-position products run: `form`, one of `forms` (set by the thread chooser)."""

    forms: tuple[str, ...] = ()
    form: str = "linear"
    settled: bool = False  # a form has been chosen by timing: copies the others need can go
    modules: list = field(default_factory=list, repr=False)  # the modules that read `form`

    def use(self, form: str) -> None:
        if form not in self.forms:
            raise ValueError(f"unknown product form {form!r}; one of {self.forms}")
        self.form = form

    def settle(self) -> None:
        """The chosen form stays: drop the packed copies when it is not "packed"."""
        self.settled = True
        if self.form != "packed":
            for m in self.modules:
                m.packed = None


def products_for(dtype: torch.dtype, device: torch.device) -> Products:
    """The forms a dtype can run in on `device` (a GPU runs one: the plain product)."""
    forms = FORMS.get(dtype, ()) if device.type == "cpu" else ()
    if "packed" in forms and not onednn_bf16():
        forms = tuple(f for f in forms if f != "packed")
    return Products(forms=forms, form=forms[0] if forms else "linear")


def few_cpu_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.shape[0] <= BLOCKED_MAX_ROWS


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


def onednn_bf16() -> bool:
    """torch has oneDNN's bfloat16 kernels on this CPU."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


def pack_for_onednn(w: torch.Tensor) -> torch.Tensor | None:
    """w (N, K) in oneDNN's own blocked layout for `packed_linear` (a copy), where that is a bfloat16
    form: a bfloat16 CPU weight and a torch with oneDNN's bfloat16 kernels. None otherwise."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)
    except (RuntimeError, AttributeError):  # a torch built without it: the plain product runs
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) times a packed (N, K) weight, plus b: (M, N), by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def few_rows_product(form: str, x2: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None,
                     packed: torch.Tensor | None) -> torch.Tensor:
    """x2 (R, K) times rows (N, K), plus bias, in `form`: (R, N)."""
    if form == "packed" and packed is not None:
        return packed_linear(x2, packed, bias)
    if form == "blocked":
        return rows_times(rows, x2, bias)
    if form == "gemv" and x2.shape[0] == 1:
        y = torch.mv(rows, x2[0]) if bias is None else torch.addmv(bias, rows, x2[0])
        return y[None]
    if bias is None:
        return torch.mm(x2, rows.t())
    return torch.addmm(bias, x2, rows.t())


# ---- pages of a memory-mapped checkpoint ------------------------------------------------------

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
