"""The compiled products over GGUF's blocks (csrc/quants.c lmhead_gguf_matvec: Q4_0, Q8_0, Q4_K, Q6_K
with llama.cpp's arithmetic), in every variant this CPU runs, against float64 sums done here.

Each kernel rounds the rows of x per block to 8 bits, as llama.cpp does (Q8_0 blocks with float
scales, Q8_K super-blocks); the test rounds them the same way in numpy (its own port of
quantize_row_q8_K_ref and quantize_row_q8_0_ref) and checks the product against the float64 product of
the dequantised matrix (gguf.quants) with those rounded rows, to float32's rounding; and against the
float64 product with x unrounded, within the bound that the rounding allows (Σ|w|·half a step of x).
The weights are random raw blocks with finite float16 scales (gguf-py cannot quantise the K-quants)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from helpers import k_quant_blocks

from lmhead_cli.engine import kernels, quant

K = kernels.load()
VARIANTS = kernels.variants(ctypes.CDLL(str(kernels.module_path()))) if K is not None else ["none"]
TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


@pytest.fixture(scope="module", params=VARIANTS)
def build(request):
    """The kernels in one variant this CPU runs."""
    if K is None:
        pytest.skip(f"the compiled kernels did not load: {kernels.unavailable()}")
    return kernels._open(kernels.module_path(), request.param)


def nearest(v: np.ndarray) -> np.ndarray:
    return np.rint(v)  # half to even, as ggml's nearest_int and the AVX2 rounding


def rounded(x: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x (M, K) float32 rounded per block as the kernel's activations: (values d·q float64,
    half a step d/2 per value float64)."""
    M, K_ = x.shape
    if qtype in ("Q4_K", "Q6_K"):  # Q8_K: 256 a block, d = max/-127 with max the value of largest |x|
        b = x.reshape(M, -1, 256)
        at = np.abs(b).argmax(-1)[..., None]
        mx = np.take_along_axis(b, at, -1)  # (M, nb, 1) float32
        iscale = np.where(mx != 0, np.float32(-127.0) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
        q = np.minimum(nearest(iscale * b), 127)
        d = np.where(mx != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    else:  # Q8_0 with a float scale: 32 a block, d = max|x|/127
        b = x.reshape(M, -1, 32)
        amax = np.abs(b).max(-1, keepdims=True)
        d = (amax / np.float32(127)).astype(np.float32)
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
        q = nearest(b * inv)
    d = d.astype(np.float64)
    return (d * q).reshape(M, K_), np.broadcast_to(np.abs(d) / 2, b.shape).reshape(M, K_)


def blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype in ("Q4_K", "Q6_K"):
        return k_quant_blocks(qtype, rows, cols, seed=seed)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return quantize(w, GGMLQuantizationType[qtype])


@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_s_product_is_the_dequantised_matrix_times_the_rows(build, qtype):
    """Rounded (llama.cpp's arithmetic): the float64 product with x rounded as the kernel rounds it, and
    with x itself within the rounding's bound; unrounded: the float64 product with x itself."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    t = GGMLQuantizationType[qtype]
    cols = 512 if qtype in ("Q4_K", "Q6_K") else 96 * 4  # whole blocks; rows not a multiple of any width
    for N, M in ((37, 1), (19, 3), (53, kernels.GGUF_MAX_ROWS), (45, 51)):  # 51: a prompt's rows, 4 tiles of 16 (the last of 3)
        raw = blocks(qtype, N, cols, seed=N)
        w = dequantize(raw, t).astype(np.float64)  # (N, cols)
        rng = np.random.default_rng(M)
        x = (rng.standard_normal((M, cols)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
        x[0, :7] = 0  # a block with zeros, and (Q8_0) a row's first values
        bias = torch.randn(N, generator=torch.Generator().manual_seed(N))
        got = build.gguf_times(int(t), torch.from_numpy(x), torch.from_numpy(raw), bias)
        assert got is not None and got.shape == (M, N)
        xr, half = rounded(x, qtype)
        got = got.double().numpy() - bias.double().numpy()
        scale = np.abs(xr) @ np.abs(w).T  # what float32's rounding of the sums is relative to
        assert np.all(np.abs(got - xr @ w.T) <= 2e-6 * scale + 1e-30), qtype
        # and the float product of the unrounded rows, within what rounding x can move it
        exact = x.astype(np.float64) @ w.T
        assert np.all(np.abs(got - exact) <= half @ np.abs(w).T * (1 + 1e-5) + 2e-6 * scale)
        # x unrounded: that product, to float32's rounding
        got = build.gguf_times(int(t), torch.from_numpy(x), torch.from_numpy(raw), bias, rounded=False)
        got = got.double().numpy() - bias.double().numpy()
        assert np.all(np.abs(got - exact) <= 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30), qtype
        for rounded_x in (True, False):  # one order of sums for a row of x, whoever it comes with:
            xs, raws = torch.from_numpy(x), torch.from_numpy(raw)
            batch = build.gguf_times(int(t), xs, raws, bias, rounded=rounded_x)
            if M <= kernels.GGUF_MAX_ROWS:  # a step's rows: each alone gives the bits it gives in the batch
                alone = torch.cat([build.gguf_times(int(t), xs[m:m + 1], raws, bias, rounded=rounded_x)
                                   for m in range(M)])
            else:  # a prompt's (whose K-quants may take another order of float sums): any other prompt's
                alone = torch.cat([build.gguf_times(int(t), xs[a:a + 17], raws, bias, rounded=rounded_x)
                                   for a in range(0, M, 17)])
            assert torch.equal(batch, alone), (qtype, rounded_x)


def test_the_product_refuses_what_it_does_not_take(build):
    """Rows of x not finite (when rounded), a type without a product, K not whole blocks, rows of W whose
    bytes are not K's blocks of the type (the C side checks them against its own block), no rows."""
    from gguf.constants import GGMLQuantizationType

    raw = torch.from_numpy(blocks("Q4_K", 4, 256, seed=0))
    x = torch.randn(2, 256)
    x[1, 5] = float("nan")  # a row not finite: not rounded, left to torch, which keeps IEEE's NaN
    assert build.gguf_times(int(GGMLQuantizationType.Q4_K), x, raw, None) is None
    got = build.gguf_times(int(GGMLQuantizationType.Q4_K), x, raw, None, rounded=False)  # unrounded: NaN flows
    assert got[1].isnan().all() and got[0].isfinite().all()
    x[1, 5] = float("inf")
    assert build.gguf_times(int(GGMLQuantizationType.Q4_K), x, raw, None) is None
    x[1, 5] = 0
    assert build.gguf_times(int(GGMLQuantizationType.Q5_K), x, raw, None) is None  # a type it has no product for
    assert build.gguf_times(int(GGMLQuantizationType.Q4_K), x[:, :128].contiguous(), raw, None) is None  # K % 256
    short = raw[:, :-1].contiguous()  # rows a byte short of K's blocks: refused, not read past
    assert build.gguf_times(int(GGMLQuantizationType.Q4_K), x, short, None) is None
    assert build.gguf_times(int(GGMLQuantizationType.Q6_K), x, raw, None) is None  # Q4_K's rows read as Q6_K's
    assert build.q8_0_times(x, raw, None) is None  # nor as Q8_0's
    assert build.gguf_times(int(GGMLQuantizationType.Q4_K), x[:0], raw, None) is None  # no rows
    for name in ("Q5_K", "Q4_K"):  # dequantising: another type, rows a byte short
        assert build.gguf_rows(int(GGMLQuantizationType[name]), short, 256) is None


@pytest.mark.parametrize("qtype", TYPES)
def test_quant_linear_takes_the_compiled_product_in_each_type_s_arithmetic(qtype, monkeypatch):
    """QuantLinear runs the kernel in the type's arithmetic (quant.ROUNDED: x rounded for the 4-bit types,
    unrounded for Q8_0) or the one LMHEAD_GGUF_ARITHMETIC asks for: rounded, one call for any number of
    rows; unrounded, the kernel for up to KERNEL_ROWS rows and torch's
    chunked product of the dequantised matrix for more (a prompt's). All agree within the rounding."""
    from gguf.constants import GGMLQuantizationType

    if K is None:
        pytest.skip("the compiled kernels are not built here")
    t = GGMLQuantizationType[qtype]
    raw = blocks(qtype, 40, 512, seed=9)
    layer = quant.QuantLinear(quant.Blocks(torch.from_numpy(raw), t, 512), torch.randn(40))
    x = torch.randn(3, 13, 512)  # 39 rows: a prompt's, more than KERNEL_ROWS
    flat = x.view(39, 512)
    step = flat[:quant.KERNEL_ROWS].contiguous()  # a decoding step's rows

    def calls(rows: torch.Tensor, rounded: bool) -> torch.Tensor:  # the kernel: rounded, one call; else 16 rows a call
        if rounded:
            return K.gguf_times(int(t), rows.contiguous(), layer.weight.data, layer.bias, rounded)
        if qtype == "Q8_0":
            return torch.cat([K.q8_0_times(rows[a:a + 16].contiguous(), layer.weight.data, layer.bias)
                              for a in range(0, rows.shape[0], 16)])
        return torch.cat([K.gguf_times(int(t), rows[a:a + 16].contiguous(), layer.weight.data, layer.bias, False)
                          for a in range(0, rows.shape[0], 16)])

    def chunked(rows: torch.Tensor) -> torch.Tensor:  # torch's product, as where the kernels are off
        with monkeypatch.context() as m:
            m.setattr(quant, "KERNEL_ROWS", 0)
            return layer(rows)

    default = layer(x).view(39, 40)
    rounds = qtype != "Q8_0"
    assert torch.equal(default, calls(flat, True) if rounds else chunked(flat)) and quant.rounded(int(t)) == rounds
    assert torch.equal(layer(step), calls(step, rounds))
    monkeypatch.setenv(quant.ARITHMETIC, "exact")
    exact = layer(x).view(39, 40)
    assert torch.equal(exact, chunked(flat)) and torch.equal(layer(step), calls(step, False))
    assert not quant.rounded(int(t))
    monkeypatch.setenv(quant.ARITHMETIC, "llama.cpp")
    rounded = layer(x).view(39, 40)
    assert torch.equal(rounded, calls(flat, True)) and quant.rounded(int(t))
    want = chunked(flat).double()
    assert torch.allclose(calls(flat, False).double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert not torch.equal(rounded, exact)
    assert torch.allclose(rounded.double(), want, rtol=0, atol=0.05 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_avx512_rounding_of_x_gives_the_scalar_code_s_bits(qtype):
    """The AVX-512 variants round x 16 values a step, the AVX2 one value by value; where their dots are the
    same code (ggml's AVX2: every type's without VNNI, Q4_0's and Q8_0's with it) the products must agree
    to the bit: ties of the largest magnitude with both signs (Q8_K takes the first one's sign), an
    all-zero block, tiny and huge values. (With VNNI the K-quants' sums run in another order: the first
    test holds them to the product of x rounded.)"""
    if K is None:
        pytest.skip(f"the compiled kernels did not load: {kernels.unavailable()}")
    wide = [v for v in VARIANTS if v.startswith("avx512") and (qtype in ("Q4_0", "Q8_0") or v == "avx512")]
    if "avx2" not in VARIANTS or not wide:
        pytest.skip("this CPU does not run both an AVX2 and an AVX-512 variant")
    from gguf.constants import GGMLQuantizationType

    t = GGMLQuantizationType[qtype]
    raw = torch.from_numpy(np.ascontiguousarray(blocks(qtype, 40, 512, seed=3)))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 512, generator=g) * torch.rand(4, 512, generator=g) ** 3
    x[1, :256] = 0.0
    x[2, 7], x[2, 200] = -x[2].abs().max() * 2, x[2].abs().max() * 2  # a tie: the first is negative
    x[3] *= 1e30
    got = {v: kernels._open(kernels.module_path(), v).gguf_times(int(t), x, raw, None, rounded=True)
           for v in ["avx2", *wide]}
    assert all(y is not None and torch.equal(y, got["avx2"]) for y in got.values())
