"""The compiled CPU kernels (engine/csrc, an extension module built by pip, opened by engine/kernels.py):
int8 and bfloat16 weights times a few float rows, against float64 sums done here, in every variant this
CPU runs; the module's refusals (not built, damaged, foreign) and that nothing is compiled at run time."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmhead_cli.engine import kernels
from helpers import PROMPT_IDS
from lmhead_cli.loading.sources import load_model

K = kernels.load()
needs_kernels = pytest.mark.skipif(K is None, reason=f"the compiled kernels did not load: {kernels.unavailable()}")
# Every variant of the module that this CPU runs (an AVX-512 BF16 machine runs all five: the VNNI and BF16
# paths, AVX-512 and AVX2 widening, and the portable C), each checked like the one load() picks.
VARIANTS = kernels.variants(ctypes.CDLL(str(kernels.module_path()))) if K is not None else ["none"]


@pytest.fixture(scope="module", params=VARIANTS)
def build(request):
    """The kernels in one variant this CPU runs."""
    if K is None:
        pytest.skip(f"the compiled kernels did not load: {kernels.unavailable()}")
    return kernels._open(kernels.module_path(), request.param)


def test_pip_built_the_kernels_wherever_there_is_a_c_compiler():
    """CI's machine has gcc and installs with pip: a kernel that silently fell back to torch there would
    leave them untested. load() picks the best variant this CPU runs."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    assert K is not None, kernels.unavailable()
    assert kernels.unavailable() is None
    assert kernels.module_path().parent == Path(kernels.__file__).parent
    assert K.variant == VARIANTS[0] and VARIANTS[-1] == "base"


def sums(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) · w (N, K)ᵀ + bias in float64: the exact sums the float32 ones are checked against."""
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


def within_float32_sums(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, n: int) -> None:
    """Float32 arithmetic of n roundings along the way is within γ_n·magnitude of the exact result,
    γ_n = n·u/(1 − n·u), u = 2^-24, magnitude = Σ|terms| (Higham, §3.1)."""
    u = 2.0 ** -24
    bound = n * u / (1 - n * u) * magnitude + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"largest excess {float((err / bound).max()):.2f}x"


# (K, N): vector loops' tails, ragged row blocks, and (int8) a K beyond the VNNI path's exact int32 sums
SHAPES = [(1, 1), (5, 3), (37, 11), (768, 2304), (3072 + 5, 771)]


@pytest.mark.parametrize("k, n", SHAPES + [(65536 + 7, 3)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_int8_rows_times_float_rows_are_float32_sums(build, k, n, m):
    from lmhead_cli.engine.int8 import quantise

    g = torch.Generator().manual_seed(k * n + m)
    q, s = quantise(torch.randn(n, k, generator=g))
    x, bias = torch.randn(m, k, generator=g) * 3, torch.randn(n, generator=g)
    w = q.double() * s.double()[:, None]  # the dequantised weights, exactly
    for b in (bias, None):
        got = build.int8_times(x, q, s, b)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        # the sum of k products, then · s and + bias: k + 2 roundings
        magnitude = x.double().abs() @ w.abs().t() + (0 if b is None else b.double().abs())
        within_float32_sums(got, sums(x, w, b), magnitude, k + 2)


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_bfloat16_rows_are_float32_sums_rounded_once(build, k, n, m):
    """Each output is the float32 sum rounded to bfloat16 once: within half a bfloat16 step of the exact
    sum, plus the float32 sum's own error."""
    g = torch.Generator().manual_seed(k + n + m)
    w = torch.randn(n, k, generator=g).bfloat16()
    x, bias = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    for b in (bias, None):
        got = build.bf16_times(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        want = sums(x, w, b)
        magnitude = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
        u, terms = 2.0 ** -24, k + 1
        bound = want.abs() * 2.0 ** -8 + terms * u / (1 - terms * u) * magnitude * (1 + 2.0 ** -8) + 1e-30
        assert bool(((got.double() - want).abs() <= bound).all())
        # and what torch's bfloat16 product gives, to bfloat16's tolerance
        ref = torch.nn.functional.linear(x, w, b)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2 * float(ref.abs().max()), rtol=2e-2)


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16])
def test_float32_rows_are_float32_sums(build, k, n, m):
    """float32's head product (f32_times: x · wᵀ + bias over (N, K) rows): each output within float32's
    bound of the exact sum, for 1 to 16 rows (more than 4: the pass that reads each block of w once for
    every group of 4 rows, with a ragged last group); a transposed view, another dtype or too many rows
    are handed back (None)."""
    g = torch.Generator().manual_seed(3 * k + n + m)
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    for b in (bias, None):
        got = build.f32_times(x, w, b)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        magnitude = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
        within_float32_sums(got, sums(x, w, b), magnitude, k + 1)
    if n > 1 and k > 1:  # (N, K) as the view of a (K, N) matrix: not rows
        assert build.f32_times(x, w.t().contiguous().t(), None) is None
    assert build.f32_times(x.double(), w.double(), None) is None
    assert build.f32_max_rows == 16 and build.f32_times(torch.randn(build.f32_max_rows + 1, k), w, None) is None


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [2, 3, 4, 5, 9, 16])
def test_float32_conv1d_columns_are_float32_sums(build, k, n, m):
    """A Conv1D's product for a prompt's few positions (f32_columns_times: x · W + bias, W (K, N) as GPT-2
    stores it): each output within float32's bound of the exact sum, for 2 to 16 rows (4 or fewer: x's
    values fixed in each instance; more: one pass whose column tiles hold every row's sums, ragged last
    tiles where N is not a whole number of vectors); one row, 17 rows, a transposed view and another dtype
    are handed back (None)."""
    g = torch.Generator().manual_seed(5 * k + n + m)
    w, x, bias = torch.randn(k, n, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    for b in (bias, None):
        got = build.f32_columns_times(x, w, b)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        magnitude = x.double().abs() @ w.double().abs() + (0 if b is None else b.double().abs())
        within_float32_sums(got, sums(x, w.t(), b), magnitude, k + 1)
    assert build.f32_columns_times(x[:1], w, bias) is None  # one row: BLAS's gemv
    many = torch.randn(kernels.STEP_MAX_ROWS + 1, k)
    assert build.f32_columns_times(many, w, bias) is None
    # the C side refuses more rows than it holds (-1), and nothing it did not write comes back
    assert build._float32(build.lib.lmhead_f32_kn_matvec, many, w, bias, len(many), columns=True) is None
    if n > 1 and k > 1:
        assert build.f32_columns_times(x, w.t().contiguous().t(), bias) is None
    assert build.f32_columns_times(x.double(), w.double(), None) is None


def test_a_short_prompt_s_conv1d_products_run_the_kernel_and_match_transformers(build, tiny, monkeypatch):
    """The lean engine's float32 torch path (a prompt's positions: no decoding step) runs each Conv1D of
    2 to 16 positions through f32_columns_times, and its logits stay transformers' own."""
    folder, model = tiny
    monkeypatch.setattr(kernels, "load", lambda: build)
    calls = []
    real = type(build).f32_columns_times
    monkeypatch.setattr(type(build), "f32_columns_times", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    loaded = load_model(str(folder), device="cpu")
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        got = loaded.engine.head(loaded.engine.body(ids))[0]
        want = model(ids).logits[0]
    assert calls and set(calls) == {len(PROMPT_IDS)}, calls
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bfloat16_rounds_to_nearest_even_and_carries_nan_and_infinity(build):
    """One weight of 1 picks one activation out: the output is that bfloat16 value itself; a sum exactly
    between two bfloat16 values rounds to the even one; an infinity or a NaN in a row reaches its
    outputs as IEEE arithmetic has it (inf · 0 is NaN)."""
    x = torch.tensor([[1.0, 2.0 ** -8, -3.5, 1e30]]).bfloat16()
    assert torch.equal(build.bf16_times(x, torch.eye(4).bfloat16(), None), x)
    # 1 + 2^-8: halfway between 1 and 1 + 2^-7 (bfloat16 has 7 bits after the point): even is 1
    ones = torch.ones(1, 2).bfloat16()
    assert float(build.bf16_times(torch.tensor([[1.0, 2.0 ** -8]]).bfloat16(), ones, None)) == 1.0
    assert float(build.bf16_times(torch.tensor([[1.0, 2.0 ** -8 + 2.0 ** -12]]).bfloat16(), ones, None)) == 1.0 + 2.0 ** -7
    assert float(build.bf16_times(torch.tensor([[1.0 + 2.0 ** -7, 2.0 ** -8]]).bfloat16(), ones, None)) == 1.0 + 2.0 ** -6
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]]).bfloat16()
    for row in ([float("inf"), 1.0], [float("nan"), 1.0], [float("inf"), float("-inf")]):
        xb = torch.tensor([row]).bfloat16()
        got, want = build.bf16_times(xb, w, None).double(), xb.double() @ w.double().t()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_int8_rows_with_nan_or_infinity_get_ieee_results_and_the_other_rows_are_unharmed(build):
    """A row of x that is not finite cannot be written as integers: the product runs in float for it
    (inf · 0 is NaN, inf · w an infinity), and finite rows in the same call are as they would be alone."""
    q = torch.tensor([[1, 0], [1, 1], [0, 2], [-3, 1]], dtype=torch.int8)
    s = torch.tensor([0.5, 1.0, 2.0, 1.0])
    finite = torch.tensor([[0.25, -1.5]])
    alone = build.int8_times(finite, q, s, None)
    for row in ([float("inf"), 1.0], [float("nan"), 1.0], [float("inf"), float("-inf")]):
        x = torch.cat([torch.tensor([row]), finite])
        got = build.int8_times(x, q, s, None).double()
        want = x.double() @ (q.double() * s.double()[:, None]).t()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
        torch.testing.assert_close(got[1:].float(), alone, atol=1e-6, rtol=1e-6)


@needs_kernels
def test_ending_the_calling_thread_s_pool_leaves_the_kernels_working():
    """release_thread_pool ends this thread's OpenMP helpers (lmhead serve's main thread); the next
    parallel product makes them again and gives the same bits."""
    import threading

    from lmhead_cli.engine import execution

    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(3001, 64, generator=g), torch.randn(1, 64, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = K.f32_times(x, w, None)
        helpers = threading.active_count()
        assert execution.release_thread_pool()
        assert torch.equal(K.f32_times(x, w, None), first)
        assert threading.active_count() == helpers  # OpenMP's threads are not Python's: nothing leaked there
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("m", [1, 2])
def test_the_thread_split_does_not_change_any_output(build, m):
    """Each output row is summed by one thread in one order: 1, 2 and 3 threads give the same bits
    (one row of x takes the one-row forms, two the row blocks)."""
    from lmhead_cli.engine.int8 import quantise

    g = torch.Generator().manual_seed(3)
    q, s = quantise(torch.randn(1001, 300, generator=g))
    x = torch.randn(2, 300, generator=g)[:m]
    wb, xb = torch.randn(1001, 300, generator=g).bfloat16(), x.bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append((build.int8_times(x, q, s, None), build.bf16_times(xb, wb, None)))
    finally:
        torch.set_num_threads(before)
    for a, b in outs[1:]:
        assert torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1])


@needs_kernels
def test_fits_takes_only_what_the_kernels_read():
    w = torch.zeros(8, 16, dtype=torch.int8)
    x = torch.zeros(2, 16)
    assert K.fits(x, w, None) and K.fits(x, w, torch.zeros(8))
    assert not K.fits(torch.zeros(K.max_rows + 1, 16), w, None)  # many rows: a GEMM, torch's
    assert not K.fits(torch.zeros(16, 2).t(), w, None)  # a strided view
    assert not K.fits(x, torch.zeros(16, 8, dtype=torch.int8).t(), None)
    assert not K.fits(torch.zeros(2, 15), w, None)
    assert not K.fits(x, w, torch.zeros(7)) and not K.fits(x, w, torch.zeros(16)[::2])
    assert not K.fits(torch.zeros(0, 16), w, None)
    # a product whose dtypes or scale the kernels do not read is handed back to torch: None
    s = torch.ones(8)
    assert K.int8_times(x, w, s, None) is not None
    assert K.int8_times(x.double(), w, s, None) is None and K.int8_times(x, w, s.double(), None) is None
    assert K.int8_times(x, w, torch.ones(16)[::2], None) is None and K.int8_times(x, w, s, s.double()) is None
    assert K.int8_times(torch.zeros(K.max_rows + 1, 16), w, s, None) is None
    assert K.bf16_times(x, torch.zeros(8, 16, dtype=torch.bfloat16), None) is None
    assert K.bf16_times(x.bfloat16(), torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(8)) is None


def run_load(env: dict) -> str:
    """kernels.load() in a fresh process with `env` added: 'loaded', or why not."""
    code = ("from lmhead_cli.engine import kernels; k = kernels.load(); "
            "print('loaded' if k else 'none: ' + kernels.unavailable())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_lmhead_kernels_0_turns_them_off():
    assert run_load({"LMHEAD_KERNELS": "0"}) == "none: LMHEAD_KERNELS=0"


@pytest.mark.slow
def test_lmhead_kernels_picks_a_variant_this_cpu_runs():
    assert run_load({"LMHEAD_KERNELS": "base"}) == "loaded"
    said = run_load({"LMHEAD_KERNELS": "no-such-variant"})
    assert said.startswith("none: ") and "no variant 'no-such-variant'" in said and "\n" not in said


@pytest.fixture
def module_at(monkeypatch):
    """Point kernels.load() at another file for one test (then back: the next load() opens the real one)."""

    def point(path: Path | None) -> None:
        monkeypatch.setattr(kernels, "module_path", lambda: path)
        monkeypatch.setattr(kernels, "_told", [])
        kernels.load.cache_clear()

    yield point
    kernels.load.cache_clear()


def test_not_built_falls_back_to_torch_and_says_why(module_at):
    module_at(None)
    assert kernels.load() is None
    assert kernels.unavailable() == "they were not built when lmhead was installed (no C compiler then?)"
    assert kernels.fallback_notice("float32") is None  # BLAS's products either way: nothing to say
    assert kernels.fallback_notice("int8").startswith("int8 weights on the CPU: lmhead's compiled kernels are "
                                                      "unavailable (they were not built")
    assert kernels.fallback_notice("bfloat16") is None  # once per process


@pytest.mark.parametrize("content", [b"not a shared library", b"\x7fELF\x02\x01\x01" + bytes(100)])
def test_a_damaged_module_is_one_line_naming_the_file_once_and_never_retried(module_at, tmp_path, monkeypatch,
                                                                             content):
    path = tmp_path / "_kernels.cpython-311-x86_64-linux-gnu.so"
    path.write_bytes(content)
    module_at(path)
    opened = []
    real = kernels._import
    monkeypatch.setattr(kernels, "_import", lambda p: opened.append(p) or real(p))
    assert kernels.load() is None and kernels.load() is None
    assert opened == [path]  # once per process
    why = kernels.unavailable()
    assert why.startswith(f"{path}: it cannot be imported (") and "\n" not in why
    line = kernels.fallback_notice("float32")  # a damaged file is said for every dtype
    assert line == (f"float32 weights on the CPU: lmhead's compiled kernels are unavailable ({why}); torch's "
                    "products run instead (the same figures, slower)")
    assert kernels.fallback_notice("int8") is None


def test_a_foreign_extension_module_is_refused_in_one_line(module_at):
    """A real extension module of another name (the standard library's _json): it defines no PyInit__kernels."""
    import _json

    module_at(Path(_json.__file__))
    assert kernels.load() is None
    assert kernels.unavailable().startswith(f"{_json.__file__}: it cannot be imported (")


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a module without the kernels")
def test_a_module_without_the_kernels_symbols_is_refused(module_at, tmp_path):
    """The right module name and init, but no lmhead_* functions: one line, torch's products."""
    import sysconfig

    src = tmp_path / "m.c"
    src.write_text("#include <Python.h>\nstatic struct PyModuleDef d = {PyModuleDef_HEAD_INIT, \"_kernels\", 0, -1, 0};\n"
                   "PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&d); }\n")
    path = tmp_path / "_kernels.so"
    subprocess.run(["cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", str(path), str(src)],
                   check=True, capture_output=True)
    module_at(path)
    assert kernels.load() is None
    assert kernels.unavailable().startswith(f"{path}: it lacks the kernels (")


@needs_kernels
@pytest.mark.slow
def test_no_command_compiles_or_opens_code_under_the_cache_folders(tmp_path):
    """In a fresh process with HOME and XDG_CACHE_HOME in a temporary folder and a `cc` on PATH that
    records being called: int8, bfloat16 and float32 commands (whose kernels load) start no compiler,
    write nothing executable under either cache folder and map no file from them."""
    home, cache, bin_dir = tmp_path / "home", tmp_path / "xdg", tmp_path / "bin"
    for d in (home, cache, bin_dir):
        d.mkdir()
    marker = tmp_path / "cc-was-called"
    for name in ("cc", "gcc", "clang"):
        (bin_dir / name).write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "from lmhead_cli.cli import app\n"
            "from lmhead_cli.engine import kernels\n"
            "r = CliRunner()\n"
            "for dtype in ('int8', 'bfloat16', 'float32'):\n"
            "    out = r.invoke(app, ['greedy', 'The keys', '--model', 'bundled:tiny', '--dtype', dtype,"
            " '--max-new-tokens', '3', '--json'])\n"
            "    assert out.exit_code == 0, out.output\n"
            "out = r.invoke(app, ['score', '--model', 'bundled:tiny', '--json', 'The keys on the table.'])\n"
            "assert out.exit_code == 0, out.output\n"
            "assert kernels.load() is not None\n"
            "print(open('/proc/self/maps').read())\n")
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(cache), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "CC": "cc", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
    mapped = {line.split()[-1] for line in done.stdout.splitlines() if "/" in line}
    assert str(kernels.module_path()) in mapped
    assert not [p for p in mapped if p.startswith((str(home), str(cache)))]
    written = [p for p in (*home.rglob("*"), *cache.rglob("*")) if p.is_file() and (p.suffix == ".so" or
                                                                                   os.access(p, os.X_OK))]
    assert written == []


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "float32"])
def test_loading_names_the_fallback_unless_the_user_turned_the_kernels_off(tiny, monkeypatch, dtype):
    """Without the kernels (not built), int8 and bfloat16 weights say in one line why and what runs instead;
    float32 (whose products are BLAS's either way) and LMHEAD_KERNELS=0 (the user's own choice) say nothing."""
    from lmhead_cli.loading.sources import load_model

    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "module_path", lambda: None)
    monkeypatch.setattr(kernels, "unavailable", lambda: "no C compiler (cc) on PATH")
    monkeypatch.setattr(kernels, "_told", [])
    said = []
    load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean", announce=said.append)
    notices = [line for line in said if "compiled kernels" in line]
    if dtype == "float32":
        assert notices == []
    else:
        assert notices == [f"{dtype} weights on the CPU: lmhead's compiled kernels are unavailable (no C "
                           "compiler (cc) on PATH); torch's products run instead (the same figures, slower)"]
    monkeypatch.setenv("LMHEAD_KERNELS", "0")
    said.clear()
    load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean", announce=said.append)
    assert not [line for line in said if "compiled kernels" in line]


# ---- score's rows ---------------------------------------------------------------------------------

def torch_rows(z: torch.Tensor, ids: torch.Tensor, top: int = 0):
    """head.score_rows on torch alone (no kernel given), the reference here."""
    from lmhead_cli import head

    return head.score_rows(z.clone(), ids, top)


FIELDS = ("logprob", "rank", "entropy", "top_id", "top_logprob")


@pytest.mark.parametrize("v", [1, 17, 50257])
def test_score_rows_match_torch_s(build, v):
    """logprob, rank, entropy and top-1 of each row as torch's path computes them: ties in the rank
    (1 + strictly higher) and in the top-1 (the lowest id), -inf logits, a row of equal logits."""
    g = torch.Generator().manual_seed(v)
    z = (torch.randn(9, v, generator=g) * 4).round_()  # rounded: many ties
    ids = torch.randint(0, v, (9,), generator=g)
    z[1, :] = 2.0
    if v > 1:
        z[2, 0] = float("-inf")
        z[3, :] = float("-inf")
        z[3, v // 2] = 0.0
    logprob, rank, entropy, top_id, top_logprob, varentropy, margin, bad = build.score_rows(z, ids)
    want = torch_rows(z, ids)
    assert bad == 0
    assert torch.equal(rank, want.rank) and torch.equal(top_id, want.top_id)
    for got, ref in ((logprob, want.logprob), (entropy, want.entropy), (top_logprob, want.top_logprob),
                     (varentropy, want.varentropy)):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(margin, want.margin)  # the same two logits subtracted (inf for V = 1 and row 3)
    assert not bool((entropy < 0).any()) and not bool(torch.signbit(entropy).any())
    assert not bool(torch.signbit(varentropy).any())


def test_score_rows_count_rows_that_are_not_finite(build):
    z = torch.zeros(5, 40)
    z[0, 3], z[2, 1], z[4, :] = float("nan"), float("inf"), float("-inf")
    logprob, _, entropy, top_id, _, varentropy, margin, bad = build.score_rows(z, torch.zeros(5, dtype=torch.long))
    assert bad == 3
    assert torch.equal(torch.isnan(logprob), torch.tensor([True, False, True, False, True]))
    assert top_id.tolist() == [-1, 0, -1, 0, -1]
    assert torch.equal(torch.isnan(varentropy), torch.isnan(logprob)) and torch.equal(torch.isnan(margin), torch.isnan(logprob))


@pytest.mark.parametrize("at", [3, 37, 38])  # in the vector loop, in the scalar tail (AVX2), the last
def test_strict_score_rows_count_a_row_with_a_minus_inf_logit(build, at):
    """A decoding step's record (strict) counts any logit not finite, -inf too; scoring (not strict) takes
    -inf as a token ruled out and gives the row its figures. NaN and +inf count either way; one row (a
    step's) runs on the calling thread. Mutants: strict ignored; -inf counted without it."""
    z = torch.randn(4, 39, generator=torch.Generator().manual_seed(0))
    z[1, at], z[2, at], z[3, at] = float("-inf"), float("nan"), float("inf")
    ids = torch.zeros(4, dtype=torch.long)
    for strict, want in ((False, [False, False, True, True]), (True, [False, True, True, True])):
        logprob, *_, bad = build.score_rows(z, ids, strict=strict)
        assert torch.isnan(logprob).tolist() == want and bad == sum(want)
        for n in range(4):
            assert build.score_rows(z[n:n + 1], ids[:1], strict=strict)[-1] == want[n]
    assert torch.isfinite(build.score_rows(z[1:2], ids[:1])[2]).all()  # the -inf row's entropy, not strict


def test_score_rows_refuse_an_id_outside_the_vocabulary(build):
    with pytest.raises(ValueError, match="outside the vocabulary of 40"):
        build.score_rows(torch.zeros(2, 40), torch.tensor([0, 40]))
    with pytest.raises(ValueError):
        build.score_rows(torch.zeros(2, 40), torch.tensor([-1, 0]))


@needs_kernels
@needs_kernels
def test_head_score_rows_uses_the_kernel_and_keeps_torch_s_errors_and_top_lists():
    """head.score_rows on the CPU with the engine's row kernel (engine/execution.py `row_kernel`): the
    kernel's figures, torch's top-k lists beside them, the same NonFiniteLogits line, and an id outside
    the vocabulary left to torch's own error."""
    from lmhead_cli import head
    from lmhead_cli.errors import NonFiniteLogits

    g = torch.Generator().manual_seed(1)
    z, ids = torch.randn(6, 300, generator=g), torch.randint(0, 300, (6,), generator=g)
    got, want = head.score_rows(z.clone(), ids, top=4, kernel=K.score_rows), torch_rows(z, ids, top=4)
    assert torch.equal(got.top_ids, want.top_ids)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=2e-6, rtol=2e-6)
    calls = []
    counted = lambda *a: calls.append(1) or K.score_rows(*a)  # noqa: E731
    head.score_rows(z.clone(), ids, kernel=counted)
    head.score_rows(z.t().contiguous().t().clone(), ids, kernel=counted)  # a strided view is made contiguous first
    assert calls == [1, 1]
    bad = z.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(NonFiniteLogits) as fast:
        head.score_rows(bad.clone(), ids, kernel=K.score_rows)
    with pytest.raises(NonFiniteLogits) as slow:
        torch_rows(bad, ids)
    assert str(fast.value) == str(slow.value)
    with pytest.raises(RuntimeError):
        head.score_rows(z.clone(), torch.tensor([0, 1, 2, 3, 4, 300]), kernel=K.score_rows)


@needs_kernels
def test_head_never_hands_the_kernel_a_tensor_off_the_cpu():
    """The kernel reads raw CPU pointers: z or ids on another device (meta here, as a GPU's would be)
    goes to torch, the kernel never called. Mutants: the device checks joined by `and`."""
    from lmhead_cli import head

    cpu_z, cpu_ids = torch.zeros(3, 10), torch.zeros(3, dtype=torch.long)
    calls = []

    def spy(z, ids):  # fails here, rather than crashing the process on a pointer that is not the CPU's
        calls.append(1)
        assert z.is_cpu and ids.is_cpu, "the kernel was handed a tensor off the CPU"
        return K.score_rows(z, ids)

    for z, ids in ((cpu_z.to("meta"), cpu_ids), (cpu_z, cpu_ids.to("meta"))):
        assert head._compiled_rows(spy, z, ids, 0) is None
    assert head._compiled_rows(spy, cpu_z, cpu_ids, 0) is not None and calls == [1]


def test_head_score_rows_refuses_ids_that_do_not_match_the_rows():
    """One id per row: ids of another length are torch's error on either path (the compiled kernel
    would read past them). Mutant: the shape check joined by `and`."""
    from lmhead_cli import head

    for ids in (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1])):
        with pytest.raises(RuntimeError):
            head.score_rows(torch.zeros(3, 10), ids, kernel=K.score_rows if K is not None else None)


def cache_views(B: int, H: int, T: int, hd: int, T_max: int, g: torch.Generator):
    """q as the lean engine's qkv permute leaves it (a strided view), and keys/values as KVCache.append
    returns them (the first T of T_max positions)."""
    qkv = torch.randn(B, 1, 3, H, hd, generator=g).permute(2, 0, 3, 1, 4)  # 3 × (B, H, 1, hd)
    k = torch.randn(B, H, T_max, hd, generator=g)[:, :, :T]
    v = torch.randn(B, H, T_max, hd, generator=g)[:, :, :T]
    return qkv[0], k, v


def attention64(q, k, v, mask):
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s + mask.double()
    return (s.softmax(-1) @ v.double()).transpose(1, 2).reshape(q.shape[0], 1, -1)  # (B, 1, H·hd)


@pytest.mark.parametrize("B, H, T, hd", [(1, 12, 1, 64), (1, 12, 37, 64), (3, 2, 200, 24), (2, 1, 5, 7)])
def test_attention_of_one_query_over_the_cache_is_softmax_of_scaled_scores_times_values(build, B, H, T, hd):
    g = torch.Generator().manual_seed(T)
    q, k, v = cache_views(B, H, T, hd, T + 9, g)
    mask = torch.zeros(B, 1, 1, T)
    mask[0, ..., : T // 2] = float("-inf")  # row 0's first half padded: it sees its later half only
    for m in (None, mask):
        got = build.attend(q, k, v, m)
        assert got.shape == (B, 1, H * hd) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), attention64(q, k, v, m), rtol=1e-5, atol=1e-6)
    before = torch.get_num_threads()
    try:  # each head is one thread's: the thread count changes no bit
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(build.attend(q, k, v, mask))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_attention_carries_nan_and_hands_back_what_it_does_not_take(build):
    g = torch.Generator().manual_seed(1)
    q, k, v = cache_views(2, 3, 6, 8, 8, g)
    k[1, 2, 4, 0] = float("nan")  # one cached key of one head
    got = build.attend(q, k, v, None).view(2, 3, 8)
    assert got[1, 2].isnan().all() and not got[0].isnan().any() and not got[1, :2].isnan().any()
    assert build.attend(q.double(), k.double(), v.double(), None) is None  # float32 only
    assert build.attend(q, k, v.contiguous(), None) is None  # keys and values must lie alike
    assert build.attend(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, None) is None  # positions hd apart
    assert build.attend(q, k, v, torch.zeros(2, 1, 1, 7)) is None  # a mask of another length
    assert build.attend(torch.randn(2, 3, 2, 8), k, v, None) is None  # two queries: SDPA's


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_decoding_steps_attend_through_the_kernel_as_torch_does(tiny, monkeypatch, dtype):
    """Each decoding step's attention takes the kernel on the CPU (once per layer per step), and the
    hidden states equal those of torch's three products (kernels off) over left-padded rows. The torch
    path's attention: the compiled step (engine/step.py, tests/test_step.py) turned off, as a reading's
    hooks turn it off."""
    from lmhead_cli.engine import lean
    from lmhead_cli.loading.sources import load_model

    monkeypatch.setenv("LMHEAD_STEP", "0")

    eng = load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean").engine
    ids = torch.tensor([[50256, 50256, 464, 8251], [464, 8251, 319, 262]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])

    def steps():
        cache = eng.new_cache(2, 8)
        out = [eng.body(ids, cache, mask)[:, -1]]
        for t in range(3):
            mask_t = torch.cat([mask, torch.ones(2, t + 1, dtype=mask.dtype)], 1)
            out.append(eng.body(torch.tensor([[11 + t], [13 + t]]), cache, mask_t)[:, -1])
        return torch.stack(out).float()

    calls = []
    real = kernels.Kernels.attend
    monkeypatch.setattr(kernels.Kernels, "attend", lambda self, *a: calls.append(1) or real(self, *a))
    compiled = steps()
    assert len(calls) == 3 * eng.config["n_layer"]  # the three one-position steps, each layer
    monkeypatch.setattr(lean.kernels, "load", lambda: None)
    torch.testing.assert_close(compiled, steps(), rtol=1e-5, atol=1e-5)


def test_more_positions_than_a_few_never_take_the_few_row_products(tiny, monkeypatch):
    """The head over more positions than the kernels take (float32's: 16) is one GEMM (F.linear), not the
    few-row forms. Mutant: the few-row path taken whenever the engine has forms."""
    from lmhead_cli.engine import lean

    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    assert eng.forms
    taken = []
    plain = lean.few_rows_product
    monkeypatch.setattr(lean, "few_rows_product", lambda *a: taken.append(a[1].shape[0]) or plain(*a))
    h = eng.body(torch.tensor([(PROMPT_IDS * 4)[:kernels.STEP_MAX_ROWS + 1]]))
    taken.clear()
    eng.head(h)
    assert taken == []
    eng.head(h[:, -1:])
    assert taken == [1]


@needs_kernels
def test_up_to_sixteen_float32_rows_take_the_kernel_head(tiny, monkeypatch):
    """5 to 16 rows, one position each (a batched decoding step) or the positions of one short text,
    run float32's head in the compiled kernel (E read once for all rows; the same bits at any thread
    count, where MKL's GEMM changes 5 to 11 rows' last bits with it), within float32 rounding of
    F.linear; 17 rows or bfloat16 rows run torch's GEMM. Mutants: the row bound off by one, the dtype
    check dropped."""
    from lmhead_cli.engine import lean

    taken = []
    plain = lean.few_rows_product
    monkeypatch.setattr(lean, "few_rows_product", lambda *a: taken.append(a[1].shape[0]) or plain(*a))
    for dtype, rows, want in (("float32", 16, [16]), ("float32", 5, [5]), ("float32", 17, []), ("bfloat16", 16, [])):
        eng = load_model(str(tiny[0]), device="cpu", engine="lean", dtype=dtype).engine
        h = torch.randn(rows, 1, eng.head_weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(eng.head_weight.dtype)
        taken.clear()
        with torch.inference_mode():
            got = eng.head(h)
        assert taken == want, (dtype, rows)
        torch.testing.assert_close(got, torch.nn.functional.linear(h, eng.head_weight), rtol=1e-5, atol=1e-5)
    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    for positions, want in ((16, [16]), (17, [])):
        taken.clear()
        eng.head(torch.randn(1, positions, eng.head_weight.shape[1]))
        assert taken == want, positions


@needs_kernels
def test_every_kernel_writes_to_the_cpu_under_another_default_device():
    """A caller under `with torch.device(...)` (a GPU session's default; the meta device here) still gets
    CPU outputs from the kernels, equal to the ones without it, and can open the module (its self-check's
    tensors are the CPU's). Mutant: an output allocated on the default device, a pointer 0 the C writes to
    (the process crashed in the suite)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    q, s = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=g), torch.rand(48, generator=g)
    k = torch.randn(1, 2, 5, 32, generator=g)
    v, qa = torch.randn(1, 2, 5, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g)
    z, ids = torch.randn(3, 40, generator=g), torch.tensor([0, 5, 39])
    calls = [lambda K: K.f32_times(x, w, b), lambda K: K.bf16_times(x.bfloat16(), w.bfloat16(), b.bfloat16()),
             lambda K: K.int8_times(x, q, s, b), lambda K: K.attend(qa, k, v, None), lambda K: K.score_rows(z, ids)]
    want = [f(K) for f in calls]
    with torch.device("meta"):
        opened = kernels._open(kernels.module_path())
        got = [f(opened) for f in calls]
    for a, b_ in zip(want, got):
        for t, u in zip(*((a, b_) if isinstance(a, tuple) else ((a,), (b_,)))):
            if isinstance(t, torch.Tensor):
                assert u.is_cpu and torch.equal(t, u)
            else:
                assert t == u

