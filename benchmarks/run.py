"""lmhead against transformers, side by side in one run, on one full-size GPT-2 small checkpoint.

    .venv/bin/python benchmarks/run.py            # about 8 minutes on 2 cores; writes benchmarks/RESULTS.md
    .venv/bin/python benchmarks/run.py --quick    # 1-2 repeats and 32 new tokens: a smoke test

Every figure is the median of several fresh processes (or, for the head alone, of several calls in
one process), and every comparison is a ratio measured in this same run: timings on a shared
machine drift, ratios much less. The checkpoint (random weights: the same shapes and bytes as the
real gpt2) is built once in benchmarks/.cache/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from checkpoint import gpt2_small  # noqa: E402

PYTHON = sys.executable
PROMPT = "The keys on the table"
INSPECT_TARGETS = {"ratio": 0.5, "startup_s": 0.5, "decode_ratio": 1.3, "bound_fraction": 0.7}
HEAD_T = (16, 128, 1024)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}


# ---- running things ----------------------------------------------------------------------------

class Quiet:
    """Before each measurement, wait (up to `patience` s, `budget` s in all) until the CPUs are idle: on a
    shared machine other work stalls multi-threaded kernels for whole scheduler slices. Counts the
    measurements that had to go ahead anyway."""

    def __init__(self, patience: float = 30.0, budget: float = 180.0, busy: float = 0.15):
        self.patience, self.budget, self.busy = patience, budget, busy
        self.waited_s, self.measurements, self.noisy = 0.0, 0, 0

    @staticmethod
    def _busy_fraction(window: float = 0.5) -> float | None:
        def sample():
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            return sum(fields), fields[3] + fields[4]  # total, idle + iowait
        try:
            t0, i0 = sample()
            time.sleep(window)
            t1, i1 = sample()
        except (OSError, ValueError, IndexError):
            return None  # not Linux: no waiting
        return 1 - (i1 - i0) / max(t1 - t0, 1)

    def __call__(self) -> None:
        self.measurements += 1
        start = time.perf_counter()
        while (busy := self._busy_fraction()) is not None and busy > self.busy:
            if time.perf_counter() - start > min(self.patience, self.budget - self.waited_s):
                self.noisy += 1
                break
        self.waited_s += time.perf_counter() - start


QUIET = Quiet()

def run(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Run cmd to completion: (wall seconds, peak resident MB, stdout). Raises on failure."""
    QUIET()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env={**ENV, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr[-2000:]}")
    return wall, usage.ru_maxrss / 1024 * 1.048576, stdout  # ru_maxrss is KiB on Linux


def probe(*args: str, env: dict | None = None) -> dict:
    return json.loads(run([PYTHON, str(HERE / "probes.py"), *args], env)[2].strip().splitlines()[-1])


def lmhead(*args: str) -> list[str]:
    return [PYTHON, "-m", "lmhead_cli", *args]


def has_command(name: str) -> bool:
    from lmhead_cli.cli import app

    return name in {c.name or c.callback.__name__ for c in app.registered_commands}


def has_option(command: str, option: str) -> bool:
    return option in run(lmhead(command, "--help"))[2]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the measurements ------------------------------------------------------------------------

def startup(repeats: int) -> list[dict]:
    """Wall time of fresh processes that should never import torch, and whether they did."""
    rows = []
    references = [("python -c pass", [PYTHON, "-c", "pass"]),
                  ("python -c 'import torch'", [PYTHON, "-c", "import torch"]),
                  ("python -c 'import transformers.models.gpt2'",
                   [PYTHON, "-c", "import transformers.models.gpt2.modeling_gpt2"])]
    commands = [("lmhead --help", ["--help"]), ("lmhead params", ["params"]),
                ("lmhead params --config gpt2-xl", ["params", "--config", "gpt2-xl"]), ("lmhead toy", ["toy"])]
    for name, cmd in references:
        rows.append({"name": name, "s": median([run(cmd)[0] for _ in range(repeats)]), "imported": None})
    for name, args in commands:
        seconds = median([run(lmhead(*args))[0] for _ in range(repeats)])
        rows.append({"name": name, "s": seconds, "imported": probe("imports", *args)["imported"]})
    return rows


def inspect(folder: Path, repeats: int) -> dict:
    """`lmhead inspect` end to end against the plain transformers script, alternating, fresh processes."""
    lean_cmd = lmhead("inspect", PROMPT, "--model", str(folder))
    hf_cmd = [PYTHON, str(HERE / "transformers_inspect.py"), str(folder), PROMPT, "10"]
    lean, hf = [], []
    for _ in range(repeats):
        lean.append(run(lean_cmd)[:2])
        hf.append(run(hf_cmd)[:2])
    imported = probe("imports", "inspect", PROMPT, "--model", str(folder))["imported"]
    return {"lean_s": median([w for w, _ in lean]), "hf_s": median([w for w, _ in hf]),
            "lean_rss_mb": median([m for _, m in lean]), "hf_rss_mb": median([m for _, m in hf]),
            "imported": imported}


def decode(folder: Path, repeats: int, new_tokens: int, layouts: list[str]) -> tuple[list[dict], str]:
    """Greedy tokens/s, lmhead against transformers' generate(), float32 and bfloat16, alternating."""
    cli = has_command("greedy")
    layout_flag = cli and has_option("greedy", "--head-layout")
    how = ("`lmhead greedy --json` reports its own tokens_per_second" if cli else "`lmhead greedy` did not exist yet")
    how += "; where the CLI can't run a layout, a greedy loop straight over the engine (benchmarks/probes.py decode)"
    rows = []
    for dtype in ("float32", "bfloat16"):
        bytes_per_token = probe("weight-bytes", str(folder), dtype)["bytes"]
        runs = {layout: [] for layout in layouts}
        runs["transformers"] = []
        if dtype == "float32":
            runs["transformers, columns"] = []  # the same layout inside transformers: what it is worth alone
        for _ in range(repeats):
            for layout in layouts:
                if cli and (layout == "rows" or layout_flag):
                    args = ["greedy", PROMPT, "--model", str(folder), "--max-new-tokens", str(new_tokens),
                            "--ignore-eos", "--dtype", dtype, "--json"]
                    if layout != "rows":
                        args += ["--head-layout", layout]
                    doc = {**json.loads(run(lmhead(*args))[2]), "via": "lmhead greedy"}
                else:
                    doc = {**probe("decode", str(folder), PROMPT, str(new_tokens), dtype, layout), "via": "engine loop"}
                runs[layout].append(doc)
            for name in [k for k in runs if k.startswith("transformers")]:
                extra = ["columns"] if name.endswith("columns") else []
                hf = run([PYTHON, str(HERE / "transformers_generate.py"), str(folder), PROMPT, str(new_tokens), dtype,
                          *extra])
                runs[name].append({**json.loads(hf[2].strip().splitlines()[-1]), "via": "generate()"})
        reference_ids = runs["transformers"][0]["generated_ids"]
        hf_tps = median([d["tokens_per_second"] for d in runs["transformers"]])
        for name, docs in runs.items():
            rows.append({"dtype": dtype, "engine": name, "via": docs[0]["via"],
                         "tps": median([d["tokens_per_second"] for d in docs]),
                         "hf_tps": hf_tps, "bytes_per_token": bytes_per_token,
                         "same_ids": _common_prefix(docs[0]["generated_ids"], reference_ids)})
        log(f"  decode {dtype}: " + ", ".join(f"{r['engine']} {r['tps']:.1f}" for r in rows if r["dtype"] == dtype))
    return rows, how


# ---- the report ------------------------------------------------------------------------------

def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "os": f"{platform.system()} {platform.release()}"}


def ok(passed: bool) -> str:
    return "✅" if passed else "❌"


def report(m: dict, bw: dict, start: list[dict], insp: dict, dec: list[dict], how: str, heads: list[dict],
           lay: dict, args, loads: tuple[float, float], elapsed: float) -> str:
    t = INSPECT_TARGETS
    copy_gbs = bw["copy_gbs"]
    lines = [
        "# lmhead benchmark results",
        "",
        f"Written by `python benchmarks/run.py{' --quick' if args.quick else ''}` on "
        f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, in {elapsed / 60:.1f} min. "
        "Every comparison is a ratio of two figures measured in this same run.",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.0f} GiB; {m['os']}; "
        f"torch {m['torch']} ({m['torch_threads']} threads), transformers {m['transformers']}, Python {m['python']}",
        f"- load average (1 min) at the start / end: {loads[0]:.2f} / {loads[1]:.2f} "
        "(other work on the machine slows both sides, and multi-threaded kernels most); before each of the "
        f"{QUIET.measurements} processes the run waited for idle CPUs (at most {QUIET.patience:.0f} s each, "
        f"{QUIET.budget:.0f} s in all; it waited {QUIET.waited_s:.0f} s); {QUIET.noisy} had to start while other "
        "work was running",
        "- checkpoint: GPT-2 small (124M, 12 layers, D 768, V 50,257, tied), seeded random weights, "
        "saved by transformers as model.safetensors (497.8 MB)",
        f"- repeats: {args.repeats} fresh processes per start-up and inspect figure, {args.decode_repeats} per "
        f"decode figure ({args.new_tokens} new tokens); medians",
        f"- memory bandwidth (torch, {bw['buffer_mb']:.0f} MB buffers): copy {copy_gbs:.1f} GB/s (read + write, "
        f"the better of 1 and {bw['threads']} threads; {bw['copy_gbs_1']:.1f} GB/s on 1 thread), read "
        f"{bw['read_gbs']:.1f} GB/s ({bw['read_gbs_1']:.1f} on 1 thread)",
        "",
        "## Start-up (fresh process)",
        "",
        "| command | wall time | torch imported | target |",
        "|---|---:|---|---|",
    ]
    for r in start:
        if r["imported"] is None:
            lines.append(f"| `{r['name']}` (reference) | {r['s']:.2f} s | | |")
        else:
            torch_in = "torch" in r["imported"]
            lines.append(f"| `{r['name']}` | {r['s']:.2f} s | {'yes' if torch_in else 'no'} | "
                         f"{ok(r['s'] < t['startup_s'] and not torch_in)} < {t['startup_s']} s, no torch |")
    ratio = insp["lean_s"] / insp["hf_s"]
    rss_ok = insp["lean_rss_mb"] <= insp["hf_rss_mb"]
    lines += [
        "",
        "## `lmhead inspect` end to end (fresh process)",
        "",
        f"`lmhead inspect \"{PROMPT}\" --model CHECKPOINT` (tables on stdout) against "
        "benchmarks/transformers_inspect.py doing the same work (import, load the folder, one forward with "
        "`logits_to_keep=1`, softmax, top 10).",
        "",
        "| | lmhead inspect | transformers script | ratio | target |",
        "|---|---:|---:|---:|---|",
        f"| wall time | {insp['lean_s']:.2f} s | {insp['hf_s']:.2f} s | {ratio:.2f}× | "
        f"{ok(ratio <= t['ratio'])} ≤ {t['ratio']}× |",
        f"| peak resident memory | {insp['lean_rss_mb']:.0f} MB | {insp['hf_rss_mb']:.0f} MB | "
        f"{insp['lean_rss_mb'] / insp['hf_rss_mb']:.2f}× | {ok(rss_ok)} ≤ 1× |",
        "",
        f"Heavy modules imported by `lmhead inspect`: {', '.join(insp['imported']) or 'none'} "
        f"({ok('transformers' not in insp['imported'])} no transformers).",
        "",
        "## Greedy decoding",
        "",
        f"{args.new_tokens} new tokens after the {len(PROMPT.split())}-word prompt, end-of-text ignored, timed from "
        "the prefill to the last token, in a fresh process each. lmhead: " + how + ", no warm-up; "
        "transformers: benchmarks/transformers_generate.py, `generate(do_sample=False)` after one untimed "
        "warm-up call; `columns` there is the same in-place re-layout of its tied matrix. The bandwidth "
        "bound is the weight bytes one step reads (every matrix once; the tied head's E once) ÷ the copy "
        "bandwidth above: the speed if nothing but reading the weights took any time; the fraction is given "
        "against the best copy bandwidth and, in brackets, against the 1-thread one. Same ids: how many of "
        "the first new tokens equal transformers' in the same dtype.",
        "",
        "| dtype | engine | head layout | tokens/s | vs transformers | weight bytes / token | bound | "
        "fraction of bound | same ids as transformers |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in dec:
        bound = copy_gbs * 1e9 / r["bytes_per_token"]
        bound_1 = bw["copy_gbs_1"] * 1e9 / r["bytes_per_token"]
        hf = r["engine"].startswith("transformers")
        engine = f"transformers, {r['via']}" if hf else f"lmhead, {r['via']}"
        layout = ("columns" if r["engine"].endswith("columns") else "rows") if hf else r["engine"]
        target = ""
        if not hf and r["dtype"] == "float32":
            target = f" {ok(r['tps'] / r['hf_tps'] >= t['decode_ratio'])}"
        lines.append(f"| {r['dtype']} | {engine} | {layout} | {r['tps']:.1f} | {r['tps'] / r['hf_tps']:.2f}×{target} | "
                     f"{r['bytes_per_token'] / 1e6:.0f} MB | {bound:.1f} tok/s | {r['tps'] / bound:.2f} "
                     f"({r['tps'] / bound_1:.2f}) | {r['same_ids']} of {args.new_tokens} |")
    lines += [
        "",
        f"Targets: lmhead float32 ≥ {t['decode_ratio']}× transformers; fraction of the bound aimed at ≥ "
        f"{t['bound_fraction']}.",
        "",
        "## The head alone: the last position against every position (float32)",
        "",
        "The body's hidden states after ln_f for T positions are computed once; then the head on the last "
        "position (what `inspect` and every decoding step do) against the head on all T positions (the full "
        "[1, T, V] logits). Peak memory: how far the process's resident high-water mark rises during the call "
        "(the kernel updates it in steps of up to 256 kB, so one position's 201 kB of logits can read 0).",
        "",
        "| T | last position | all positions | time ratio | logits, last | logits, all | peak rise, last | "
        "peak rise, all |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for h in heads:
        peak = lambda v: "n/a" if v is None else f"{v:.1f} MB"  # noqa: E731
        lines.append(f"| {h['T']} | {h['last_s'] * 1e3:.1f} ms | {h['full_s'] * 1e3:.1f} ms | "
                     f"{h['full_s'] / h['last_s']:.0f}× | {h['last_logits_mb'] * 1e3:.0f} kB | "
                     f"{h['full_logits_mb']:.1f} MB | {peak(h['last_peak_mb'])} | {peak(h['full_peak_mb'])} |")
    rows = lay["rows"]
    lines += [
        "",
        "## The head's layout (float32, one position)",
        "",
        "A checkpoint stores W_out = E as [V, D] rows, and `F.linear(h, E)` on one position is BLAS's "
        "dot-product matrix-vector form. The same product over a [D, V] layout is the column form, which "
        "streams faster. `columns` re-lays the one shared matrix out in place (the tie holds by object; "
        "the embedding lookup then gathers strided columns); `copy` gives the head its own [D, V] copy "
        "(the tie holds by value, not by object).",
        "",
        "| head layout | head time | GB/s | vs rows | load time | extra memory | lm_head.weight is wte.weight |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in lay.items():
        lines.append(f"| {name} | {r['head_s'] * 1e3:.2f} ms | {r['head_gbs']:.1f} | "
                     f"{rows['head_s'] / r['head_s']:.2f}× | {r['load_s']:.2f} s | {r['extra_mb']:.0f} MB | "
                     f"{'yes' if r['same_object'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per start-up/inspect figure")
    parser.add_argument("--decode-repeats", type=int, default=3, help="fresh processes per decode figure")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="1-2 repeats and 32 new tokens (a smoke test)")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="where the markdown goes")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.decode_repeats, args.new_tokens = 2, 1, 32
    began, load0 = time.perf_counter(), os.getloadavg()[0]

    log("checkpoint ...")
    folder = gpt2_small()
    log("memory bandwidth ...")
    bw = probe("bandwidth")
    log("start-up ...")
    start = startup(args.repeats)
    log("inspect ...")
    insp = inspect(folder, args.repeats)
    log("decode ...")
    dec, how = decode(folder, args.decode_repeats, args.new_tokens, ["rows", "columns"])
    log("head alone ...")
    # Every allocation over 64 kB straight from mmap and back on free, so the resident high-water mark
    # shows each call's own peak (glibc otherwise keeps freed blocks resident and reuses them).
    heads = [probe("head", str(folder), str(T), str(max(args.repeats, 3)), env={"MALLOC_MMAP_THRESHOLD_": "65536"})
             for T in HEAD_T]
    lay = probe("layouts", str(folder), str(max(args.repeats * 4, 10)))
    text = report(machine(), bw, start, insp, dec, how, heads, lay, args, (load0, os.getloadavg()[0]),
                  time.perf_counter() - began)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
