"""The machine's read bandwidth, as the bound a decoding step cannot pass: the best of several ways to
stream a buffer far larger than the caches, so that the bound is the machine's and not one method's.

    python benchmarks/bandwidth.py          # one JSON line: every method's rate and the best

Methods: benchmarks/stream_read.c (a compiled streaming read: contiguous slices, interleaved 1 MiB
blocks, slices with a software prefetch; 1 to all cores' threads), built with cc into a temporary
folder at run time and left there; and torch's sum (benchmarks/probes.py bandwidth, 1 and torch's
threads). Each method's figure is its fastest pass (other work can only slow a pass down); the bound
is the fastest method. Without a C compiler the compiled read is left out, and the report says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "stream_read.c"


def compiler() -> str | None:
    """The C compiler to build the probe with ($CC, cc, gcc or clang), None where there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(folder: Path) -> Path | None:
    """benchmarks/stream_read.c compiled into `folder`; None (and one line on stderr) without a compiler
    or when the build fails."""
    cc = compiler()
    if cc is None:
        print("bandwidth: no C compiler (cc, gcc, clang; or $CC): the compiled read is left out", file=sys.stderr)
        return None
    exe = folder / "stream_read"
    for flags in (["-O3", "-march=native"], ["-O3"]):  # -march=native: this machine's widest loads, if it takes it
        r = subprocess.run([cc, *flags, "-pthread", str(SOURCE), "-o", str(exe)], capture_output=True, text=True)
        if r.returncode == 0:
            return exe
    print(f"bandwidth: {cc} could not build {SOURCE.name}: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    return None


def buffer_mib() -> int:
    """Far larger than the last-level cache (4x it, 512 MiB at least), as the weights of a step are."""
    sys.path.insert(0, str(HERE))
    from probes import last_level_cache_bytes

    return max(512, 4 * last_level_cache_bytes() // 2**20)


def stream_read(passes: int = 10, threads: int | None = None, mib: int | None = None) -> dict | None:
    """Run the compiled read: {"bytes", "passes", "rates": [{"method", "threads", "gbs", "sum"}]}, None
    without a compiler. Each entry's `sum` is the sum of every float in the buffer (a check that each
    method read every byte once)."""
    threads = threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="lmhead-bandwidth-") as tmp:
        exe = build(Path(tmp))
        if exe is None:
            return None
        r = subprocess.run([str(exe), str(mib or buffer_mib()), str(threads), str(passes)], capture_output=True,
                           text=True, check=True)
    return json.loads(r.stdout)


def best_of(c_probe: dict | None, torch_probe: dict | None) -> dict:
    """The read bandwidth bound from the compiled read and torch's sum: the fastest method and the
    fastest on one thread, with every method's figure kept. torch_probe: benchmarks/probes.py
    bandwidth's dict (read_gbs_1, read_gbs_N)."""
    methods = []
    for r in (c_probe or {}).get("rates", []):
        methods.append({"method": f"C {r['method']}", "threads": r["threads"], "gbs": r["gbs"]})
    for key, value in (torch_probe or {}).items():
        if key.startswith("read_gbs_"):
            methods.append({"method": "torch sum", "threads": int(key.rsplit("_", 1)[1]), "gbs": value})
    if not methods:
        raise ValueError("no bandwidth measured: neither the compiled read nor torch's sum ran")
    best = max(methods, key=lambda m: m["gbs"])
    best_1 = max((m for m in methods if m["threads"] == 1), key=lambda m: m["gbs"], default=best)
    return {"read_gbs": best["gbs"], "method": best["method"], "threads": best["threads"],
            "read_gbs_1": best_1["gbs"], "method_1": best_1["method"], "compiled": c_probe is not None,
            "buffer_mb": (c_probe or {}).get("bytes", 0) / 1e6 or (torch_probe or {}).get("buffer_mb"),
            "methods": methods}


def measure(probe) -> dict:
    """The bound now: the compiled read in this process's child and torch's sum through `probe` (the
    harness's fresh-process runner, benchmarks/harness.py probe)."""
    return best_of(stream_read(), probe("bandwidth"))


def merge(points: list[dict]) -> dict:
    """Several measurements of the bound (start, middle, end of a run): each method's best, and the best."""
    by_method: dict[tuple[str, int], float] = {}
    for p in points:
        for m in p["methods"]:
            key = (m["method"], m["threads"])
            by_method[key] = max(by_method.get(key, 0.0), m["gbs"])
    methods = [{"method": k[0], "threads": k[1], "gbs": v} for k, v in by_method.items()]
    c_rates = [{"method": m["method"].removeprefix("C "), "threads": m["threads"], "gbs": m["gbs"]}
               for m in methods if m["method"].startswith("C ")]
    torch_rates = {f"read_gbs_{m['threads']}": m["gbs"] for m in methods if m["method"] == "torch sum"}
    out = best_of({"rates": c_rates, "bytes": points[0]["buffer_mb"] * 1e6} if c_rates else None, torch_rates or None)
    out["points"] = len(points)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from harness import probe

    print(json.dumps(measure(probe)))
