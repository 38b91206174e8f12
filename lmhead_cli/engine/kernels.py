"""The compiled CPU kernels (engine/csrc): an extension module built by `pip install`, opened with ctypes.

torch's own products read int8 weights at about half of float32 BLAS's speed (the activations must
be split into int8 digits for torch._int_mm) and bfloat16 rows at 11-14 GB/s against float32's 20, so
a decoding step in a cheaper dtype saved less than its bytes promised. csrc/kernels.c streams the
weights at their own width in one pass, no activation rounded; it also computes score's per-row
figures (head.score_rows) in two passes where torch takes eight, and each decoding step's attention
of one query over the KV cache in one call per layer where torch dispatches five ops (every dtype:
the cache is float32 on the CPU). csrc/step.c runs a whole decoding step's blocks in one call, or
the whole step from token to logits (engine/step.py), and float32's head streams E's rows through
`f32_times`.

`pip install` compiles them (setup.py) into lmhead_cli/engine/_kernels*.so, beside this file, with a
variant per x86-64 level (AVX-512 with BF16, with VNNI, plain; AVX2; portable C), and `load()` binds
the best variant this CPU runs. Nothing is compiled, and nothing is loaded from a cache folder, while
lmhead runs. The module links to the OpenMP runtime torch has loaded (libgomp.so.1 by soname), so its
threads are torch's threads, counted by torch.get_num_threads().

Where the module was not built (no C compiler at install time), cannot be imported (built for another
Python, damaged), lacks a symbol or fails its self-check, `load()` returns None once per process and
`unavailable()` says why, naming the file; the engine then runs torch's products, the same figures
slower. LMHEAD_KERNELS=0 turns the kernels off (to compare, or to rule them out); LMHEAD_KERNELS=NAME
(avx2, base, ...) picks a variant this CPU runs, to compare them.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import math
import os
import re
from pathlib import Path

import torch

from lmhead_cli.engine.interface import (FUNCTIONS, KERNEL_FUNCTIONS, MODULE_FUNCTIONS, Layer,  # noqa: F401
                                         Llama, LlamaLayer, Model)

ENV = "LMHEAD_KERNELS"
MODULE = "lmhead_cli.engine._kernels"
HEADER = Path(__file__).parent / "csrc" / "kernels.h"  # the interface, declared once (shipped in the package)


def header_constants(text: str | None = None) -> dict[str, int]:
    """The interface's numbers where csrc/kernels.h writes them, their one place: each `#define LMHEAD_X N`
    and the step's kinds (the enum of LMHEAD_STEP_F32, _BF16 and _INT8)."""
    text = HEADER.read_text(encoding="utf-8") if text is None else text
    found = {m[1]: int(m[2]) for m in re.finditer(r"^#define (LMHEAD_\w+) (\d+)\b", text, re.M)}
    return found | {m[1]: int(m[2]) for m in re.finditer(r"\b(LMHEAD_STEP_[A-Z0-9]+) = (\d+)", text)}


_HEADER = header_constants()
ABI = _HEADER["LMHEAD_KERNELS_ABI"]  # the module must report the same (lmhead_kernels_abi)
STEP_MAX_ROWS = _HEADER["LMHEAD_STEP_MAX_ROWS"]  # the most rows of a compiled step (engine/step.py), and of f32_columns_times
STEP_KINDS = {kind: _HEADER[f"LMHEAD_STEP_{name}"] for kind, name in
              (("float32", "F32"), ("bfloat16", "BF16"), ("int8", "INT8"))}  # lmhead_model's `kind`
GGUF_MAX_ROWS = _HEADER["LMHEAD_GGUF_MAX_ROWS"]  # a step's most rows of x: gguf_times takes more in tiles of this (engine/quant.py mirrors the blocks)
GGUF_TYPE_F32 = _HEADER["LMHEAD_TYPE_F32"]  # a Llama step's float32 rows (lmhead_llama_layer `type`)
Q8_0_VALUES = _HEADER["LMHEAD_QK8_0"]  # kernels.h lmhead_block_q8_0: a half d, then LMHEAD_QK8_0 int8 q
OFF = ("0", "off", "no", "false")  # LMHEAD_KERNELS values that turn the kernels off
_why: list[str] = []  # why load() returned None, once it has


def _bound(function, signature):
    """A ctypes function given its header's types (restype, argtypes)."""
    function.restype, function.argtypes = signature
    return function


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the module's own functions (MODULE_FUNCTIONS) given their header's types."""
    for name, signature in MODULE_FUNCTIONS.items():
        _bound(getattr(lib, name), signature)
    return lib


class _Variant:
    """One variant's functions (ctypes function pointers), under their unsuffixed names."""

    def __init__(self, **functions):
        self.__dict__.update(functions)


class Kernels:
    """The loaded library: products of a few float32 or bfloat16 rows with int8 or bfloat16 weights."""

    def __init__(self, lib: ctypes.CDLL, variant: str = "base"):
        self.variant = variant
        self.max_rows = _typed(lib).lmhead_kernels_max_rows()
        self.f32_max_rows = lib.lmhead_kernels_f32_max_rows()  # float32's head product takes more rows
        self._release_thread_pool = lib.lmhead_release_thread_pool  # the module's own, not a variant's
        # The chosen variant's functions under their plain names: self.lib.lmhead_int8_matvec, ...
        self.lib = _Variant(**{name: _bound(getattr(lib, f"{name}_{variant}"), signature)
                               for name, signature in KERNEL_FUNCTIONS.items()})

    def release_thread_pool(self) -> bool:
        """End the calling thread's OpenMP helper threads (engine/execution.release_thread_pool); whether
        they were (False inside a parallel region, or with an OpenMP older than 5.0)."""
        return self._release_thread_pool() == 0

    def fits(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None = None,
             columns: bool = False) -> bool:
        """Whether x (M, K), weight rows w (N, K) (`columns`: w (K, N), GPT-2's Conv1D layout) and bias
        (N,) are a product these kernels take: on the CPU, contiguous, a few rows (at most `max_rows`, by
        default `self.max_rows`; the dtypes are checked by each product)."""
        # is_cpu, not device.type: these checks run before each of a step's ~50 products (device.type
        # builds a device object, four times the check's own cost)
        k, n = (0, 1) if columns else (1, 0)
        return (x.is_cpu and w.is_cpu and x.dim() == 2 == w.dim()
                and 0 < x.shape[0] <= (max_rows or self.max_rows) and x.shape[1] == w.shape[k]
                and x.is_contiguous() and w.is_contiguous()
                and (bias is None or (bias.is_cpu and bias.is_contiguous() and bias.shape == (w.shape[n],))))

    def int8_times(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
        """x (M, K) float32 times (q · s)ᵀ, q (N, K) int8, s (N,) float32, plus bias (N,) float32: (M, N);
        None for a product the kernel does not take (other dtypes, or not `fits`), left to the caller."""
        if not (x.dtype == s.dtype == torch.float32 and q.dtype == torch.int8 and self.fits(x, q, bias)
                and (bias is None or bias.dtype == torch.float32)
                and s.is_cpu and s.is_contiguous() and s.shape == (q.shape[0],)):
            return None
        (M, K), N = x.shape, q.shape[0]
        y = torch.empty(M, N, dtype=torch.float32, device="cpu")
        if self.lib.lmhead_int8_matvec(q.data_ptr(), s.data_ptr(), x.data_ptr(),
                                       None if bias is None else bias.data_ptr(), y.data_ptr(),
                                       N, K, M, torch.get_num_threads()):
            raise MemoryError("the int8 kernel could not allocate its activation buffer")
        return y

    def q8_0_times(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x (M, K) float32 times Wᵀ, W (N, K) held as GGUF Q8_0 blocks (N, bytes per row) uint8 (their layout
        engine/quant.py's to check), plus bias (N,) float32: (M, N), the activations unrounded; None for what
        the kernel does not take."""
        return self._blocks(None, x, blocks, bias)

    def gguf_times(self, qtype: int, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None,
                   rounded: bool = True) -> torch.Tensor | None:
        """The same for W held as GGUF blocks of `qtype` (Q4_0, Q8_0, Q4_K, Q6_K as GGML numbers them), any M
        (GGUF_MAX_ROWS rows at a time): `rounded`, llama.cpp's arithmetic (each row of x rounded to 8 bits
        per block, integer dots), else x unrounded (float32 sums of the blocks' integers); None for what the
        kernel does not take (another type, a row of x not finite when rounded)."""
        return self._blocks(int(qtype), x, blocks, bias, rounded)

    def gguf_rows(self, qtype: int, blocks: torch.Tensor, cols: int) -> torch.Tensor | None:
        """Rows held as GGUF blocks of `qtype`, (n, bytes per row) uint8, dequantised: (n, cols) float32 with
        gguf.quants.dequantize's bits; None for what the kernel does not take (another type or layout)."""
        if not (blocks.dim() == 2 and blocks.dtype == torch.uint8 and blocks.is_cpu and blocks.is_contiguous()):
            return None
        out = torch.empty(blocks.shape[0], cols, dtype=torch.float32)
        status = self.lib.lmhead_gguf_dequantise(int(qtype), blocks.data_ptr(), blocks.shape[1], out.data_ptr(),
                                                 blocks.shape[0], cols, torch.get_num_threads())
        return out if status == 0 else None

    def _blocks(self, qtype: int | None, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None,
                rounded: bool = False) -> torch.Tensor | None:
        if not (x.dim() == 2 == blocks.dim()):
            return None
        M, K = x.shape
        N = blocks.shape[0]
        if not (x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and blocks.dtype == torch.uint8
                and blocks.is_cpu and blocks.is_contiguous() and M > 0
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (N,)))):
            return None
        y = torch.empty(M, N, dtype=torch.float32, device="cpu")
        args = (x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), N, K, M, torch.get_num_threads())
        if qtype is None:  # the layout checked here: Q8_0's kernel reads K / 32 blocks of 34 bytes a row
            if K % Q8_0_VALUES or blocks.shape[1] != K // Q8_0_VALUES * (2 + Q8_0_VALUES):
                return None
            self.lib.lmhead_q8_0_matvec(blocks.data_ptr(), *args)
            return y
        status = self.lib.lmhead_gguf_matvec(qtype, int(rounded), blocks.data_ptr(), blocks.shape[1], *args)
        if status < 0 and status != -2:
            raise MemoryError("the GGUF kernel could not allocate its activation blocks")
        return y if status == 0 else None

    def bf16_times(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x (M, K) bfloat16 times w (N, K) bfloat16 rows, plus bias (N,) bfloat16: (M, N) bfloat16,
        summed in float32 and rounded once, as torch's bfloat16 addmv; None for a product the kernel does
        not take (other dtypes, or not `fits`), left to the caller."""
        if not (x.dtype == w.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
                and self.fits(x, w, bias)):
            return None
        (M, K), N = x.shape, w.shape[0]
        y = torch.empty(M, N, dtype=torch.bfloat16, device="cpu")
        if self.lib.lmhead_bf16_matvec(w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                       y.data_ptr(), N, K, M, torch.get_num_threads()):
            raise MemoryError("the bfloat16 kernel could not allocate its activation buffer")
        return y

    def f32_times(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x (M, K) float32 times w (N, K) float32 rows, plus bias (N,) float32: (M, N) float32 (the head's
        product over E's rows), M up to `f32_max_rows`; None for a product the kernel does not take (other
        dtypes, a transposed view, or not `fits`), left to the caller."""
        return self._float32(self.lib.lmhead_f32_matvec, x, w, bias, self.f32_max_rows, columns=False)

    def f32_columns_times(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x (M, K) float32 times w (K, N) float32 in GPT-2's Conv1D layout (in, out), plus bias (N,)
        float32: (M, N) float32, for 2 to STEP_MAX_ROWS rows (a prompt's few positions; the decoding step
        runs its own); None for a product the kernel does not take, left to the caller (one row: BLAS's
        gemv streams this layout faster than the kernel's column split)."""
        if x.shape[0] < 2:
            return None
        return self._float32(self.lib.lmhead_f32_kn_matvec, x, w, bias, STEP_MAX_ROWS, columns=True)

    def _float32(self, product, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
                 columns: bool) -> torch.Tensor | None:
        """`product`(w, x, bias, y, N, K, M, threads) into a new (M, N) float32 y (with K, N swapped for
        `columns`), where every tensor is float32 and `fits`; else None (also where the C side refuses
        the call, so that y's unwritten memory is never returned)."""
        if not (x.dtype == w.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
                and self.fits(x, w, bias, max_rows, columns)):
            return None
        (M, K), N = x.shape, w.shape[1 if columns else 0]
        y = torch.empty(M, N, dtype=torch.float32, device="cpu")
        dims = (K, N) if columns else (N, K)
        if product(w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), *dims, M,
                   torch.get_num_threads()):
            return None
        return y

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """One new position's attention (a decoding step): q (B, H, 1, hd), keys and values (B, H, T, hd)
        (views of the KV cache: each head's positions hd floats apart, k and v alike), mask (B, 1, 1, T)
        additive or None, all float32 on the CPU: softmax(q·kᵀ/√hd + mask)·v as (B, 1, H·hd), the
        layout the output projection takes. None for what the kernel does not take (left to torch)."""
        B, H, T, hd = k.shape
        tensors = (q, k, v) if mask is None else (q, k, v, mask)
        if not (all(t.dtype == torch.float32 and t.is_cpu for t in tensors)
                and q.shape == (B, H, 1, hd) and v.shape == k.shape and v.stride() == k.stride()
                and q.stride(-1) == 1 and k.stride(-1) == 1 and k.stride(-2) == hd
                and (mask is None or (mask.shape == (B, 1, 1, T) and mask.stride(-1) == 1))):
            return None
        out = torch.empty(B, 1, H * hd, dtype=torch.float32, device="cpu")
        if self.lib.lmhead_attend(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0),
                                  k.stride(1), None if mask is None else mask.data_ptr(),
                                  0 if mask is None else mask.stride(0), out.data_ptr(), B, H, T, hd,
                                  1 / math.sqrt(hd), torch.get_num_threads()):
            raise MemoryError("the attention kernel could not allocate its scores")
        return out

    def score_rows(self, z: torch.Tensor, ids: torch.Tensor, strict: bool = False):
        """Each row of z (N, V) float32 (CPU, contiguous) with its id (N,): (logprob, rank, entropy,
        top_id, top_logprob, varentropy, margin, bad), the figures head.score_rows computes, in two passes;
        `bad` counts the rows whose max is not finite (their figures NaN), and with `strict` the rows with
        any logit not finite (-inf too: a decoding step's record). ValueError for an id outside [0, V)."""
        N, V = z.shape
        ids = ids.to(torch.int64).contiguous()
        # two allocations, not seven (each a dispatched op that a decoding step's record pays for)
        logprob, entropy, top_logprob, varentropy, margin = torch.empty(5, N, dtype=torch.float32, device="cpu")
        rank, top_id = torch.empty(2, N, dtype=torch.int64, device="cpu")
        bad = self.lib.lmhead_score_rows(z.data_ptr(), ids.data_ptr(), N, V, logprob.data_ptr(), rank.data_ptr(),
                                         entropy.data_ptr(), top_id.data_ptr(), top_logprob.data_ptr(),
                                         varentropy.data_ptr(), margin.data_ptr(), int(strict), torch.get_num_threads())
        if bad < 0:
            raise ValueError(f"a token id outside the vocabulary of {V}")
        return logprob, rank, entropy, top_id, top_logprob, varentropy, margin, bad


def module_path() -> Path | None:
    """The extension module's file beside this one (the first name this Python's import system would
    take), or None when `pip install` did not build it."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.exists():
            return path
    return None


def switched_off(env: str) -> bool:
    """Whether the environment variable `env` turns its part off (0, off, no, false): LMHEAD_KERNELS,
    LMHEAD_STEP, LMHEAD_HUGE_PAGES."""
    return os.environ.get(env, "1").strip().lower() in OFF


def _turned_off() -> bool:
    return switched_off(ENV)


def _self_check(k: Kernels) -> bool:
    """The loaded kernels against torch on a small product with ragged sizes (the vector loops' tails)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, generator=g)
    w = torch.randn(11, 37, generator=g)
    q = torch.randint(-127, 128, (11, 37), generator=g, dtype=torch.int8)
    s, b = torch.rand(11, generator=g), torch.randn(11, generator=g)
    want8 = x @ (q.float() * s[:, None]).t() + b
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    want16 = (xb.float() @ wb.float().t() + bb.float())
    return (torch.allclose(k.int8_times(x, q, s, b), want8, rtol=1e-4, atol=1e-4)
            and torch.allclose(k.bf16_times(xb, wb, bb).float(), want16, rtol=1e-2, atol=1e-2)
            and torch.allclose(k.f32_times(x, w, b), x @ w.t() + b, rtol=1e-4, atol=1e-4))


def _step_check(k: Kernels) -> bool:
    """The compiled decoding step (csrc/step.c) against torch on one float32 block with ragged sizes (D 36,
    two heads of 18, 72 inner): two rows of one new position after three cached ones, with a mask that
    hides one of them, and one row of three new positions after two (a prompt's chunk, causal)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    D, H, inner = 36, 2, 72
    shapes = [(D, 3 * D), (D, D), (D, inner), (inner, D)]
    w = [torch.randn(s, generator=g) * 0.3 for s in shapes]  # Conv1D (in, out)
    b = [torch.randn(s[1], generator=g) * 0.1 for s in shapes]
    ln = [torch.rand(D, generator=g) + 0.5 for _ in range(4)]  # ln_1 w, b, ln_2 w, b
    layer = Layer()
    for i in range(4):
        layer.w[i], layer.b[i] = w[i].data_ptr(), b[i].data_ptr()
    layer.ln1_w, layer.ln1_b, layer.ln2_w, layer.ln2_b = (t.data_ptr() for t in ln)

    def check(B: int, T: int, past: int, mask: torch.Tensor | None) -> bool:
        """B rows of T new positions after `past` cached ones; mask (B, T, past + T) additive, or None
        (causal among the new positions)."""
        cache_k, cache_v = (torch.randn(1, B, H, past + T, D // H, generator=g) for _ in range(2))
        x = torch.randn(B, T, D, generator=g)
        k_want, v_want = cache_k.clone(), cache_v.clone()
        h = F.layer_norm(x, (D,), ln[0], ln[1])
        q, kn, vn = (h @ w[0] + b[0]).split(D, -1)  # (B, T, D) each
        k_want[0, :, :, past:], v_want[0, :, :, past:] = (t.view(B, T, H, -1).transpose(1, 2) for t in (kn, vn))
        causal = torch.zeros(T, past + T).masked_fill(torch.ones(T, past + T).tril(past) == 0, float("-inf"))
        att = (q.view(B, T, H, -1).transpose(1, 2) @ k_want[0].transpose(-1, -2)) / math.sqrt(D // H)
        att = att + (causal if mask is None else mask[:, None])  # (B, H, T, past + T)
        a = (att.softmax(-1) @ v_want[0]).transpose(1, 2).reshape(B, T, D)
        want = x + a @ w[1] + b[1]
        want = want + F.gelu(F.layer_norm(want, (D,), ln[2], ln[3]) @ w[2] + b[2], approximate="tanh") @ w[3] + b[3]
        got = x.clone()
        status = k.lib.lmhead_step(ctypes.addressof(layer), 1, 0, got.data_ptr(), B, T, D, H, inner, 1e-5,
                                   cache_k.data_ptr(), cache_v.data_ptr(), *cache_k.stride()[:3], past,
                                   None if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(1), 2)
        return (status == 0 and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
                and torch.allclose(cache_k, k_want, rtol=1e-4, atol=1e-4)
                and torch.allclose(cache_v, v_want, rtol=1e-4, atol=1e-4))

    mask = torch.zeros(2, 1, 4)
    mask[0, 0, 1] = float("-inf")
    return check(2, 1, 3, mask) and check(1, 3, 2, None)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _openmp_of(lib: ctypes.CDLL) -> str | None:
    """The file of the OpenMP runtime that `lib`'s omp_get_max_threads binds to (dlsym searches the
    library, then what it links), or None where that cannot be told (no such symbol, no dladdr)."""
    try:
        addr = ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value
        info = _DlInfo()
        dladdr = ctypes.CDLL(None).dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not addr or not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def _torch_openmp() -> str | None:
    """The OpenMP runtime torch's CPU library binds to, or None where it cannot be told."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return _openmp_of(ctypes.CDLL(str(lib))) if lib.is_file() else None
    except OSError:
        return None


def _check_openmp(lib: ctypes.CDLL) -> None:
    """RuntimeError when the kernels' OpenMP calls would go to another runtime than torch's (their
    threads would then fight torch's for the cores). Another copy that some other package loaded
    for itself (sentencepiece's wheel brings its own libgomp) is not one the kernels use: it is
    left alone, so no other package in the process turns the kernels off."""
    mine, torchs = _openmp_of(lib), _torch_openmp()
    if mine and torchs and mine != torchs:
        raise RuntimeError(f"they would run a second OpenMP runtime beside torch's: {mine} (torch's is {torchs})")


def variants(lib: ctypes.CDLL) -> list[str]:
    """The variants built into `lib` that this CPU runs, best first."""
    built = _typed(lib).lmhead_kernels_variants().decode().split()
    return [v for v in built if lib.lmhead_kernels_supports(v.encode())]


def _import(path: Path) -> ctypes.CDLL:
    """The extension module at `path`, imported (the interpreter checks its ABI: a module built for
    another Python, or not a module at all, fails here), then opened with ctypes (the same mapping)."""
    spec = importlib.util.spec_from_file_location(MODULE, path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except ImportError as e:
        raise RuntimeError(f"it cannot be imported ({' '.join(str(e).split())})") from None
    return ctypes.CDLL(str(path))


def _open(path: Path, variant: str | None = None) -> Kernels:
    """The kernels in the module at `path`: `variant`, or the best this CPU runs. RuntimeError says
    what is wrong with the file."""
    lib = _import(path)
    try:
        if _typed(lib).lmhead_kernels_abi() != ABI:
            raise RuntimeError(f"it is of another version (ABI {lib.lmhead_kernels_abi()}, not {ABI})")
        runs = variants(lib)
        variant = variant or runs[0]
        if variant not in runs:
            raise RuntimeError(f"it has no variant {variant!r} that this CPU runs (it runs: {', '.join(runs)})")
        k = Kernels(lib, variant)
    except AttributeError as e:  # a library without the kernels' symbols
        raise RuntimeError(f"it lacks the kernels ({e})") from None
    _check_openmp(lib)
    with torch.device("cpu"):  # the checks' tensors are the CPU's whatever the caller's default device
        checked = _self_check(k) and _step_check(k)
    if not checked:
        raise RuntimeError("the compiled kernels failed their self-check against torch")
    return k


@functools.cache
def load() -> Kernels | None:
    """The kernels, opened once per process; None where they cannot be (`unavailable()` says why, once
    and for good: a damaged module is not retried)."""
    _why.clear()
    if _turned_off():
        _why.append(f"{ENV}={os.environ[ENV]}")
        return None
    path = module_path()
    if path is None:
        _why.append("they were not built when lmhead was installed (no C compiler then?)")
        return None
    asked = os.environ.get(ENV, "").strip().lower()
    try:
        return _open(path, asked if asked not in ("", "1", "on", "yes", "true") else None)
    except (OSError, RuntimeError) as e:
        _why.append(f"{path}: " + (" ".join(str(e).split()) or type(e).__name__))
        return None


_told: list[bool] = []  # whether fallback_notice has given its line in this process


def fallback_notice(weights: str) -> str | None:
    """One line, once per process, for a user whose `weights` ("int8", "bfloat16", "float32") run
    without the kernels: always when the module is there but damaged or foreign (the line names the
    file), and for int8 and bfloat16 (whose products they speed most) when it was not built. None when
    the kernels load, when the user turned them off, and after the first line."""
    if load() is not None or _turned_off() or _told:
        return None
    if module_path() is None and weights not in ("int8", "bfloat16"):
        return None
    _told.append(True)
    return (f"{weights} weights on the CPU: lmhead's compiled kernels are unavailable ({unavailable()}); "
            "torch's products run instead (the same figures, slower)")


def unavailable() -> str | None:
    """Why the kernels are not in use (None when they are, or were not asked for yet)."""
    return _why[-1] if _why and load.cache_info().currsize and load() is None else None
