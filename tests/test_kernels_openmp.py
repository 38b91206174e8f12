"""The compiled kernels and the OpenMP runtimes in the process: another package's own copy of libgomp
(sentencepiece's wheel brings one, and `import gguf` imports sentencepiece when it is installed) does
not turn the kernels off; a kernel module whose OpenMP calls would go to another runtime than torch's
is still refused. Run in fresh interpreters, with sentencepiece importable (skipped where it is not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import build_checkpoint, write_gguf

from lmhead_cli.engine import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=f"the compiled kernels did not load: "
                                                                f"{kernels.unavailable()}")

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, *args: str) -> dict:
    """`code` in a fresh interpreter that can import lmhead and sentencepiece; its one line of JSON."""
    import sentencepiece

    path = os.pathsep.join([str(ROOT), str(Path(sentencepiece.__file__).parent.parent),
                            os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sentencepiece_s_libgomp_beside_torch_s_leaves_the_kernels_on(tmp_path):
    """Before the fix: "they would run a second OpenMP runtime beside torch's", and a GGUF decoded on
    torch's products."""
    pytest.importorskip("sentencepiece")
    model = build_checkpoint(tmp_path / "ckpt", n_inner=256, n_positions=64)
    write_gguf(model, tmp_path / "m.gguf", "F32")
    got = _run("""
import json, sys
import lmhead_cli
from lmhead_cli.engine import kernels
m = lmhead_cli.load(sys.argv[1], device="cpu")
maps = open("/proc/self/maps").read()
print(json.dumps({"sentencepiece": "sentencepiece" in sys.modules, "on": kernels.load() is not None,
                  "why": kernels.unavailable(), "gomps": sorted({l.split()[-1] for l in maps.splitlines()
                                                                 if "libgomp" in l})}))
""", str(tmp_path / "m.gguf"))
    assert got["sentencepiece"], "import gguf no longer imports sentencepiece: the test proves nothing"
    assert len(got["gomps"]) == 2, got  # torch's libgomp and sentencepiece's own
    assert got["on"] and got["why"] is None, got


def test_a_module_bound_to_another_openmp_runtime_is_refused():
    """The check still tells a real conflict: sentencepiece's own extension, whose OpenMP calls go to
    its wheel's libgomp, is one the kernels' check refuses."""
    pytest.importorskip("sentencepiece")
    got = _run("""
import ctypes, glob, json, os, torch
import sentencepiece
from lmhead_cli.engine import kernels
ext = glob.glob(os.path.join(os.path.dirname(sentencepiece.__file__), "_sentencepiece*.so"))[0]
lib = ctypes.CDLL(ext)
try:
    kernels._check_openmp(lib)
    said = None
except RuntimeError as e:
    said = str(e)
print(json.dumps({"mine": kernels._openmp_of(lib), "torch": kernels._torch_openmp(), "said": said}))
""")
    assert got["mine"] and got["torch"] and got["mine"] != got["torch"], got
    assert got["said"].startswith("they would run a second OpenMP runtime beside torch's: "), got
