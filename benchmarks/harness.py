"""The benchmark's harness, a leaf module that run.py and score_bench.py both import: how a measured
process is started (fresh, on a quiet machine, its own peak memory read by benchmarks/launch.py), the
busy competitor, and small helpers. It imports nothing else of the benchmark's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}


# ---- running things ----------------------------------------------------------------------------

def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs so far, from /proc/stat; None where there is none."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields) - fields[3] - fields[4], sum(fields)  # idle and iowait are not busy


class Quiet:
    """Keeps other work out of the figures on a shared machine, where it stalls multi-threaded kernels
    for whole scheduler slices. Before each measurement it waits (up to `patience` s, `budget` s in
    all) for idle CPUs; after it, it compares the CPU time all processes used with the CPU time the
    measured one used, and a measurement during which other work kept more than `busy` of a core
    busy is taken again (`retries` times at most, `retry_budget` s of measuring again in all).
    `expected` cores of other work are the benchmark's own (its busy competitor), not disturbance.
    Counts what it could not avoid."""

    def __init__(self, patience: float = 30.0, budget: float = 180.0, busy: float = 0.15, retries: int = 2,
                 retry_budget: float = 240.0):
        self.patience, self.budget, self.busy, self.retries = patience, budget, busy, retries
        self.retry_budget, self.retried_s, self.expected = retry_budget, 0.0, 0.0
        self.waited_s, self.measurements, self.repeated, self.noisy = 0.0, 0, 0, 0
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.cores = os.cpu_count() or 1

    def wait(self) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < min(self.patience, self.budget - self.waited_s):
            before = _cpu_jiffies()
            time.sleep(0.5)
            after = _cpu_jiffies()
            if before is None or after is None:
                break
            busy_cores = (after[0] - before[0]) / max(after[1] - before[1], 1) * self.cores
            if busy_cores <= self.busy + self.expected:
                break
        self.waited_s += time.perf_counter() - start

    def others(self, before, after, wall: float, own_cpu_s: float) -> float:
        """Cores' worth of CPU time that other processes used during a measurement of `wall` seconds."""
        if before is None or after is None or wall <= 0:
            return 0.0
        return max(0.0, max(0.0, (after[0] - before[0]) / self.tick - own_cpu_s) / wall - self.expected)


QUIET = Quiet()


def run(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Run cmd to completion on a quiet machine: (wall seconds, peak resident MB, stdout). Raises on failure.

    cmd runs under benchmarks/launch.py, a few-MB process that forks it and reads its peak resident
    size: read from here (a large process by now), the kernel would count this process's size in every
    child's peak."""
    QUIET.measurements += 1
    for attempt in range(QUIET.retries + 1):
        QUIET.wait()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.NamedTemporaryFile(suffix=".json") as usage_file:
            before, start = _cpu_jiffies(), time.perf_counter()
            proc = subprocess.Popen([PYTHON, "-S", str(HERE / "launch.py"), usage_file.name, *cmd], stdout=out,
                                    stderr=err, cwd=ROOT, env={**ENV, **(env or {})})
            _, status, usage = os.wait4(proc.pid, 0)
            wall, after = time.perf_counter() - start, _cpu_jiffies()
            out.seek(0), err.seek(0)
            stdout, stderr = out.read().decode(), err.read().decode()
            code = os.waitstatus_to_exitcode(status)
            child = json.loads(Path(usage_file.name).read_text() or "{}") if code == 0 else {}
        if code != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{stderr[-2000:]}")
        if QUIET.others(before, after, wall, usage.ru_utime + usage.ru_stime) <= QUIET.busy:
            break
        if attempt < QUIET.retries and QUIET.retried_s < QUIET.retry_budget:
            QUIET.repeated += 1
            QUIET.retried_s += wall
        else:
            QUIET.noisy += 1
            break
    return wall, child["maxrss_kb"] / 1024 * 1.048576, stdout  # ru_maxrss is KiB on Linux; MB here


def probe(*args: str, env: dict | None = None) -> dict:
    """benchmarks/probes.py ARGS in a fresh process: its one JSON line."""
    return json.loads(run([PYTHON, str(HERE / "probes.py"), *args], env)[2].strip().splitlines()[-1])


def lmhead(*args: str) -> list[str]:
    return [PYTHON, "-m", "lmhead_cli", *args]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load1() -> float:
    return os.getloadavg()[0]


class Competitor:
    """One CPU-bound process beside the measurements (a Python loop), started and ended here; the
    Quiet checks count its core as expected, not as disturbance."""

    def __enter__(self):
        self.proc = subprocess.Popen([PYTHON, "-c", "while True: pass"])
        QUIET.expected = 1.0
        time.sleep(1.0)  # scheduled and spinning before the first measurement
        return self

    def __exit__(self, *exc):
        QUIET.expected = 0.0
        self.proc.kill()
        self.proc.wait()


def cpu_features() -> str:
    """The CPU's widest vector instructions (its flags in /proc/cpuinfo) and the variant of lmhead's
    compiled kernels that loads on it: the figures of one machine need not hold on another (an AVX2 CPU
    runs int8 and bfloat16 without dot-product instructions, where llama.cpp rounds activations to 8 bits)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if "avx512f" in flags:
        extra = [name for name, flag in (("VNNI", "avx512_vnni"), ("BF16", "avx512_bf16"), ("AMX", "amx_tile"))
                 if flag in flags]
        isa = "AVX-512" + (f" with {', '.join(extra)}" if extra else "")
    elif "avx2" in flags:
        isa = "AVX2, no AVX-512"
    else:
        isa = "no AVX2" if flags else "instruction set unknown"
    from lmhead_cli.engine import kernels

    k = kernels.load()
    return f"{isa}; lmhead's kernels: {k.variant if k is not None else 'not loaded'} variant"


def print_section(res: dict, text: str, write: bool, begin: str, end: str) -> None:
    """A section's figures (JSON) and its markdown; with `write`, the markdown kept in benchmarks/RESULTS.md
    in place of the previous one between the same markers (batching_bench.py, grammar_bench.py)."""
    import versus_llamacpp_report

    print(json.dumps(res, indent=1))
    print(text)
    if write:
        versus_llamacpp_report.splice(HERE / "RESULTS.md", text, begin, end)
