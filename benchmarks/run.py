"""lmhead against transformers, side by side in one run, on one full-size GPT-2 small checkpoint.

    .venv/bin/python benchmarks/run.py --quick    # a smoke test: under two minutes, the slow sections left out
    .venv/bin/python benchmarks/run.py            # the full run: 10-20 minutes on 2 cores
    .venv/bin/python benchmarks/run.py --write    # the full run, kept in benchmarks/RESULTS.md
    .venv/bin/python benchmarks/run.py --device cuda   # the same tables on a GPU, where there is one

Only `--write` (a full run) replaces benchmarks/RESULTS.md; every other run writes its report to
benchmarks/.cache/ (the path is printed), so trying the benchmark never overwrites the kept figures.

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
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bandwidth  # noqa: E402 - the read-bandwidth bound: benchmarks/bandwidth.py
import compare_bench  # noqa: E402 - `lmhead compare`'s rows: benchmarks/compare_bench.py
import score_bench  # noqa: E402 - `lmhead score`'s rows, measured and written by benchmarks/score_bench.py
import batching_bench  # noqa: E402 - the batching section, its own run (benchmarks/batching_bench.py)
import versus_llamacpp  # noqa: E402 - the llama.cpp section, its own run (benchmarks/versus_llamacpp.py)
from checkpoint import gpt2_small  # noqa: E402
from harness import PYTHON, QUIET, Competitor, cpu_features, load1, lmhead, log, median, probe, run  # noqa: E402
from prompts import file_prompts  # noqa: E402

PROMPT = "The keys on the table"
TARGETS = {"ratio": 0.5, "startup_s": 0.5, "decode_ratio": 1.3, "bound_fraction": 0.7, "bf16_ratio": 1.5,
           "bf16_bound_fraction": 0.5, "busy_own": 0.7, "int8_vs_f32": 1.8, "bf16_vs_f32": 1.3, "bf16_vs_hf": 1.2}
HEAD_T = (16, 128, 1024)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- the measurements ------------------------------------------------------------------------

def startup(repeats: int, quick: bool) -> list[dict]:
    """Wall time of fresh processes that should never import torch, and whether they did."""
    rows = []
    references = [("python -c pass", [PYTHON, "-c", "pass"]),
                  ("python -c 'import torch'", [PYTHON, "-c", "import torch"]),
                  ("python -c 'import transformers.models.gpt2'",
                   [PYTHON, "-c", "import transformers.models.gpt2.modeling_gpt2"])]
    commands = [("lmhead --help", ["--help"]), ("lmhead params", ["params"]),
                ("lmhead params --config gpt2-xl", ["params", "--config", "gpt2-xl"]), ("lmhead toy", ["toy"])]
    if quick:
        references, commands = references[1:2], commands[:2]
    for name, cmd in references:
        rows.append({"name": name, "s": median([run(cmd)[0] for _ in range(repeats)]), "imported": None})
    for name, args in commands:
        seconds = median([run(lmhead(*args))[0] for _ in range(repeats)])
        rows.append({"name": name, "s": seconds, "imported": probe("imports", *args)["imported"]})
    return rows


def inspect(folder: Path, repeats: int, device: str) -> dict:
    """`lmhead inspect` end to end against the plain transformers script, alternating, fresh processes."""
    lean_cmd = lmhead("inspect", PROMPT, "--model", str(folder), "--device", device)
    hf_cmd = [PYTHON, str(HERE / "transformers_inspect.py"), str(folder), PROMPT, "10", device]
    lean, hf = [], []
    for _ in range(repeats):
        lean.append(run(lean_cmd)[:2])
        hf.append(run(hf_cmd)[:2])
    imported = probe("imports", "inspect", PROMPT, "--model", str(folder), "--device", device)["imported"]
    return {"lean_s": median([w for w, _ in lean]), "hf_s": median([w for w, _ in hf]),
            "lean_rss_mb": median([m for _, m in lean]), "hf_rss_mb": median([m for _, m in hf]),
            "imported": imported}


def prompt_file(prompts: list[str]) -> str:
    """A temporary file holding the prompts, one a line; the caller deletes it."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write("\n".join(prompts) + "\n")
    return f.name


def batch(folder: Path, n: int, repeats: int, separate: bool, device: str) -> dict:
    """`inspect --file` over n short prompts (one process): its time and prompts per second; with
    `separate`, against n separate `inspect` processes, and whether each prompt's top-10 ids and
    target probabilities agree between the two."""
    prompts = file_prompts(n)
    targets = ["--target", " is", "--target", " are"]
    name = prompt_file(prompts)
    try:
        file_cmd = lmhead("inspect", "--file", name, "--model", str(folder), "--json", "--device", device, *targets)
        file_runs = [run(file_cmd) for _ in range(repeats)]
    finally:
        os.unlink(name)
    batched = [json.loads(line) for line in file_runs[0][2].splitlines() if line.strip()]
    separate_s, same = 0.0, 0
    for prompt, doc in zip(prompts, batched if separate else []):
        wall, _, out = run(lmhead("inspect", prompt, "--model", str(folder), "--json", "--device", device, *targets))
        separate_s += wall
        one = json.loads(out)
        same += ([t["id"] for t in one["top"]] == [t["id"] for t in doc["top"]]
                 and all(abs(a["prob"] - b["prob"]) <= 1e-4 * max(a["prob"], 1e-12)
                         for a, b in zip(one["targets"], doc["targets"])))
    return {"n": len(prompts), "file_s": median([w for w, _, _ in file_runs]),
            "separate_s": separate_s if separate else None, "same": same, "documents": len(batched)}


def distributed(folder: Path, n: int, procs: int, repeats: int) -> dict:
    """`inspect --file` over n prompts in one process against the same command under
    `torchrun --standalone --nproc-per-node procs` (gloo on the CPU): times, and whether the two
    outputs are byte for byte the same."""
    name = prompt_file(file_prompts(n))
    args = ["inspect", "--file", name, "--model", str(folder), "--json", "--target", " is", "--target", " are"]
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
                "-m", "lmhead_cli", *args]
    # The same threads per process on both sides (torchrun's own default is 1): BLAS need not give the
    # last bit alike on different thread counts, and the comparison is of the distribution, not of BLAS.
    threads = {"LMHEAD_THREADS": str(max(1, (os.cpu_count() or 1) // procs))}
    try:
        one, many = [], []
        for _ in range(repeats):
            one.append(run(lmhead(*args), threads))
            many.append(run(torchrun, threads))
    finally:
        os.unlink(name)
    return {"n": n, "procs": procs, "one_s": median([w for w, _, _ in one]), "many_s": median([w for w, _, _ in many]),
            "identical": one[0][2] == many[0][2], "lines": len(one[0][2].splitlines())}


# The greedy-decoding variants: (label, how it runs). lmhead's own rows run `lmhead greedy --json`;
# "threads" fixes --threads, "spin" is OpenMP's endless spinning wait instead of lmhead's ~1 ms spin.
VARIANTS = {
    "lmhead": {"via": "`lmhead greedy`"},
    "lmhead, 1 thread": {"via": "`lmhead greedy --threads 1`", "threads": 1},
    "lmhead, spinning threads": {"via": "`OMP_WAIT_POLICY=ACTIVE lmhead greedy --threads N`", "spin": True},
    # torch's forms run with the compiled kernels off: bfloat16 offers them only then (float32 has none)
    "lmhead, linear form": {"via": "engine loop, gemm", "probe": "linear", "env": {"LMHEAD_KERNELS": "0"}},
    "lmhead, gemv form": {"via": "engine loop, gemv", "probe": "gemv", "env": {"LMHEAD_KERNELS": "0"}},
    "lmhead, blocked form": {"via": "engine loop, blocked rows", "probe": "blocked", "env": {"LMHEAD_KERNELS": "0"}},
    "lmhead, kernel form": {"via": "engine loop, compiled kernel", "probe": "kernel"},
    "lmhead, torch's products": {"via": "`LMHEAD_KERNELS=0 lmhead greedy`", "env": {"LMHEAD_KERNELS": "0"}},
    "transformers": {"via": "`generate()`"},
}


def greedy_once(folder: Path, variant: str, dtype: str, new_tokens: int, device: str) -> dict:
    """One fresh process of greedy decoding by `variant` (VARIANTS): its JSON figures."""
    how = VARIANTS[variant]
    if variant == "transformers":
        out = run([PYTHON, str(HERE / "transformers_generate.py"), str(folder), PROMPT, str(new_tokens), dtype,
                   device])[2]
        return json.loads(out.strip().splitlines()[-1])
    if "probe" in how:
        return probe("decode", str(folder), PROMPT, str(new_tokens), dtype, how["probe"], env=how.get("env"))
    args = ["greedy", PROMPT, "--model", str(folder), "--max-new-tokens", str(new_tokens), "--ignore-eos",
            "--dtype", dtype, "--device", device, "--json"]
    env = dict(how.get("env", {}))
    if "threads" in how:
        args += ["--threads", str(how["threads"])]
    if how.get("spin"):
        args += ["--threads", str(os.cpu_count() or 1)]
        env["OMP_WAIT_POLICY"] = "ACTIVE"
    return json.loads(run(lmhead(*args), env)[2])


def decode(folder: Path, repeats: int, new_tokens: int, plan: dict[str, list[str]], device: str,
           label: str = "") -> list[dict]:
    """Greedy tokens/s of every (dtype, variant) in `plan`, all in one alternating loop (drift hits all
    alike), each against transformers' generate() in the same dtype and conditions where the plan has
    it (int8 has none: its ids are compared with lmhead float32's)."""
    pairs = [(dtype, v) for dtype, variants in plan.items() for v in variants]
    weighed = probe("weight-bytes", str(folder), *plan)["bytes"] if device == "cpu" else {}
    bytes_per_token = {d: weighed.get(d) for d in plan}
    runs: dict[tuple[str, str], list[dict]] = {p: [] for p in pairs}
    for _ in range(repeats):
        for dtype, v in pairs:
            runs[dtype, v].append(greedy_once(folder, v, dtype, new_tokens, device))
    rows = []
    for (dtype, name), docs in runs.items():
        reference = runs.get((dtype, "transformers"))
        same_as = "transformers" if reference else "lmhead float32"
        ids_ref = (reference or runs.get(("float32", "lmhead")) or docs)[0]["generated_ids"]
        rows.append({"dtype": dtype, "engine": name, "via": VARIANTS[name]["via"],
                     "tps": median([d["tokens_per_second"] for d in docs]),
                     "hf_tps": median([d["tokens_per_second"] for d in reference]) if reference else None,
                     "steady": median([d["decode_tokens_per_second"] for d in docs]),
                     "hf_steady": median([d["decode_tokens_per_second"] for d in reference]) if reference else None,
                     "bytes_per_token": bytes_per_token[dtype], "same_as": same_as,
                     "same_ids": _common_prefix(docs[0]["generated_ids"], ids_ref)})
    for dtype in plan:
        log(f"  decode {label}{dtype}: " + ", ".join(f"{r['engine']} {r['steady']:.1f}" for r in rows
                                                     if r["dtype"] == dtype))
    return rows


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
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "os": f"{platform.system()} {platform.release()}", "features": cpu_features()}


def ok(passed: bool) -> str:
    return "✅" if passed else "❌"


def bound(r: dict, gbs: float) -> float | None:
    """The bandwidth bound in tokens/s for a decode row: weight bytes per token over `gbs` GB/s."""
    return gbs * 1e9 / r["bytes_per_token"] if r["bytes_per_token"] else None


def decode_table(rows: list[dict], bw: dict | None, new_tokens: int) -> list[str]:
    f32 = row(rows, "float32", "lmhead")
    lines = ["| dtype | engine | tokens/s | after the first token | vs transformers (same dtype) | "
             "vs lmhead float32 | weight bytes / token | bound | fraction of bound | same ids |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        b = bound(r, bw["read_gbs"]) if bw else None
        b1 = bound(r, bw["read_gbs_1"]) if bw else None
        vs_hf = f"{r['steady'] / r['hf_steady']:.2f}×" if r["hf_steady"] else "n/a"
        vs_f32 = f"{r['steady'] / f32['steady']:.2f}×" if f32 else "n/a"
        lines.append(f"| {r['dtype']} | {r['engine']} ({r['via']}) | {r['tps']:.1f} | {r['steady']:.1f} | {vs_hf} | "
                     f"{vs_f32} | "
                     + (f"{r['bytes_per_token'] / 1e6:.0f} MB | {b:.1f} tok/s | {r['steady'] / b:.2f} "
                        f"({r['steady'] / b1:.2f}) | " if b else "n/a | n/a | n/a | ")
                     + f"{r['same_ids']} of {new_tokens} as {r['same_as']} |")
    return lines


def row(rows: list[dict], dtype: str, engine: str) -> dict | None:
    return next((r for r in rows if r["dtype"] == dtype and r["engine"] == engine), None)


def targets(R: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for every target; None: not measured."""
    t = TARGETS
    out = []
    if "inspect" in R:
        insp = R["inspect"]
        ratio = insp["lean_s"] / insp["hf_s"]
        out.append((f"inspect ≤ {t['ratio']}× the transformers script", f"{ratio:.2f}×", ratio <= t["ratio"]))
        lm = [r for r in R["startup"] if r["imported"] is not None]
        no_torch = all("torch" not in r["imported"] for r in lm)
        out.append(("start-up without torch", f"{len(lm)} commands, torch imported by "
                    f"{sum('torch' in r['imported'] for r in lm)}", no_torch))
    idle, bw = R["decode"], R.get("bandwidth")
    f32 = row(idle, "float32", "lmhead")
    for dtype, ratio_key, fraction_key, vs, bound_name in (
            ("float32", "decode_ratio", "bound_fraction", "generate()", "the bandwidth bound"),
            ("bfloat16", "bf16_ratio", "bf16_bound_fraction", "generate() in bfloat16", "the bfloat16 bound")):
        r = row(idle, dtype, "lmhead")
        if not r:
            continue
        x = r["steady"] / r["hf_steady"]
        out.append((f"{dtype} greedy ≥ {t[ratio_key]}× {vs}", f"{x:.2f}×", x >= t[ratio_key]))
        if bw:
            f = r["steady"] / bound(r, bw["read_gbs"])
            out.append((f"{dtype} ≥ {t[fraction_key]} of {bound_name}", f"{f:.2f}", f >= t[fraction_key]))
    busy = R.get("busy")
    # "alone": no competitor started by the run (the header gives the load average it met); "busy": beside one
    for when, rows in (("alone", idle), ("busy", busy)):  # cheaper arithmetic: int8 and bfloat16 against float32
        base = row(rows or [], "float32", "lmhead")
        i8, b16 = row(rows or [], "int8", "lmhead"), row(rows or [], "bfloat16", "lmhead")
        if base and i8:
            x = i8["steady"] / base["steady"]
            out.append((f"{when}: int8 greedy ≥ {t['int8_vs_f32']}× lmhead float32", f"{x:.2f}×", x >= t["int8_vs_f32"]))
        if base and b16:
            x, y = b16["steady"] / base["steady"], b16["steady"] / b16["hf_steady"]
            out.append((f"{when}: bfloat16 greedy ≥ {t['bf16_vs_f32']}× lmhead float32", f"{x:.2f}×",
                        x >= t["bf16_vs_f32"]))
            out.append((f"{when}: bfloat16 greedy ≥ {t['bf16_vs_hf']}× generate() in bfloat16", f"{y:.2f}×",
                        y >= t["bf16_vs_hf"]))
    if busy and f32:
        lb = row(busy, "float32", "lmhead")
        x = lb["steady"] / f32["steady"]
        out.append((f"busy: lmhead ≥ {t['busy_own']}× its own speed alone", f"{x:.2f}×", x >= t["busy_own"]))
        if lb["hf_steady"]:
            y = lb["steady"] / lb["hf_steady"]
            out.append((f"busy: lmhead ≥ {t['decode_ratio']}× generate() beside the same competitor", f"{y:.2f}×",
                        y >= t["decode_ratio"]))
    score = R.get("score")
    if score:
        p = score["inproc"]
        x = (p["ours_s"] / p["scored"]) / (p["theirs_s"] / p["tokens"])
        out.append((f"score in-process ≤ {score_bench.IN_PROCESS_TARGET}× transformers' full-logits forward",
                    f"{x:.2f}×", x <= score_bench.IN_PROCESS_TARGET))
    dist = R.get("distributed")
    if dist:
        out.append((f"torchrun, {dist['procs']} processes: output identical to 1 process ({dist['n']} prompts)",
                    "identical" if dist["identical"] else "different", dist["identical"]))
    return out


def report_front(R: dict) -> list[str]:
    """Start-up and `inspect` end to end."""
    t, insp, lines = TARGETS, R["inspect"], []
    lines += ["", "## Start-up (fresh process)", "", "| command | wall time | torch imported | target |",
              "|---|---:|---|---|"]
    for r in R["startup"]:
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
    ]
    return lines


def report(R: dict, args) -> str:
    m, ck, bw = R["machine"], R["checkpoint"], R.get("bandwidth")
    t = TARGETS
    loads = R["loads"]
    lines = [
        "# lmhead benchmark results",
        "",
        f"Written by `python benchmarks/run.py{' --quick' if args.quick else ''}{' --decode-only' if args.decode_only else ''}"
        f"{' --write' if args.write else ''}"
        f"{' --device ' + args.device if args.device != 'cpu' else ''}` on "
        f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, in {R['elapsed_s'] / 60:.1f} min. "
        "Every comparison is a ratio of two figures measured in this same run. The comparison with llama.cpp "
        "is a run of its own, `python benchmarks/versus_llamacpp.py --write` (about 10-15 min on an idle "
        "2-core machine, estimated from its parts, once llama.cpp is built; `--only decode,busy,score,serve` for "
        "a subset), which writes the section "
        "\"Against llama.cpp\" at the end and which a run of this script keeps.",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores ({m.get('features', 'instruction set not recorded')}), {m['memory_gib']:.0f} GiB; {m['os']}; "
        f"torch {m['torch']} ({m['torch_threads']} threads), transformers {m['transformers']}, Python {m['python']}"
        + (f"; GPU: {m['gpu']}" if m.get("gpu") else ""),
        "- load average (1 min) at the start of each section: "
        + ", ".join(f"{name} {value:.2f}" for name, value in loads)
        + f" (on {m['cores']} cores; other work on the machine slows both sides of every ratio, and "
        "multi-threaded kernels most). Before each of the "
        f"{QUIET.measurements} measured processes the run waited for idle CPUs (at most {QUIET.patience:.0f} s "
        f"each, {QUIET.budget:.0f} s in all; it waited {QUIET.waited_s:.0f} s), and took a measurement again when "
        f"other processes had kept more than {QUIET.busy:.0%} of a core busy during it: {QUIET.repeated} taken "
        f"again ({QUIET.retried_s:.0f} s, at most {QUIET.retry_budget:.0f} s), {QUIET.noisy} kept although disturbed",
        f"- checkpoint: GPT-2 small's shapes ({ck['n_layer']} layers, D {ck['n_embd']}, V {ck['vocab_size']:,}, "
        f"tie_word_embeddings {str(ck.get('tie_word_embeddings', True)).lower()}), seeded random weights, saved by "
        f"transformers as model.safetensors ({ck['file_mb']:.1f} MB)",
        f"- repeats: {args.repeats} fresh processes per start-up and inspect figure, {args.decode_repeats} per "
        f"decode figure ({args.new_tokens} new tokens); medians",
    ]
    if bw:
        lines.append(
            f"- read bandwidth (benchmarks/bandwidth.py: the fastest of a compiled streaming read and torch's sum, "
            f"{bw['buffer_mb']:.0f} MB buffers, the fastest pass of each method at {bw['points']} points of the run): "
            f"{bw['read_gbs']:.1f} GB/s ({bw.get('method', 'torch sum')}, {bw['threads']} threads), {bw['read_gbs_1']:.1f} "
            f"GB/s on 1 thread ({bw.get('method_1', 'torch sum')})"
            + ("" if bw.get("compiled") else "; no C compiler, so torch's sum only"))
    lines += ["", "## Targets", "", "| target | measured in this run | met |", "|---|---|---|"]
    for name, value, met in targets(R):
        lines.append(f"| {name} | {value} | {ok(met)} |")
    if "startup" in R:
        lines += report_front(R)
    lines += [
        "",
        "## Greedy decoding",
        "",
        f"{args.new_tokens} new tokens after the {len(PROMPT.split())}-word prompt, end-of-text ignored, timed from "
        "the prefill to the last token with no warm-up (a first call's set-up counts), and from the first new "
        "token to the last (the steady rate, which the bound and every ratio here are about), in a fresh process "
        "each; every row of the table alternates with every other in one loop. lmhead: `lmhead greedy --json`, its "
        "own figures, with its defaults: threads (torch's count or 1) and product form chosen by timing the first "
        "steps, OpenMP threads spinning ~1 ms before they sleep; `1 thread` fixes `--threads 1`; `spinning threads` "
        "is torch's count with threads that spin without end (OMP_WAIT_POLICY=ACTIVE); `kernel`, `gemv`, `linear` and "
        "`blocked form` are the engine loop (benchmarks/probes.py decode) with one product form fixed on torch's thread "
        "count and no trials: lmhead's compiled kernel (engine/csrc; the only form of float32 and bfloat16 where it builds); "
        "gemv (BLAS for float32, its only form without the kernels; torch's own for bfloat16), gemm (oneDNN, bfloat16) and batched "
        "matmuls over row blocks (bfloat16), these three with the compiled kernels off (LMHEAD_KERNELS=0), since "
        "bfloat16 offers them only then. `torch's products` is `lmhead greedy` with the compiled kernels off: int8 "
        "then runs torch._int_mm over activation digits, bfloat16 chooses among torch's three forms. float32 reads "
        "the checkpoint's (in, out) matrices in place, bfloat16 (out, in) "
        "rows made at load. int8: `lmhead greedy --dtype int8` (engine/int8.py). transformers: "
        "benchmarks/transformers_generate.py, `generate(do_sample=False)`. The bandwidth bound is the weight "
        "bytes one step reads (every matrix once; the tied head's E once; int8: the int8 tables and their "
        "float32 scales) ÷ the read bandwidth above: the speed if nothing but reading the weights took any time; "
        "the fraction is given against the best read bandwidth and, in brackets, against the 1-thread one. Same "
        "ids: how many of the first new tokens equal transformers' in the same dtype (int8: lmhead float32's).",
        "",
        *decode_table(R["decode"], bw, args.new_tokens),
        "",
        f"Targets: lmhead float32 ≥ {t['decode_ratio']}× transformers and ≥ {t['bound_fraction']} of the bound; "
        f"bfloat16 ≥ {t['bf16_ratio']}× transformers in bfloat16 (and ≥ {t['bf16_vs_hf']}×, idle and busy), ≥ "
        f"{t['bf16_vs_f32']}× lmhead float32 and ≥ {t['bf16_bound_fraction']} of its bound; int8 ≥ "
        f"{t['int8_vs_f32']}× lmhead float32.",
    ]
    parts = R.get("step")
    if parts:
        step_s = parts["body_s"] + parts["head_s"]
        lines += [
            "",
            f"Where a float32 step goes (the engine alone, warm, median of 60 steps after a 64-token prompt, median "
            f"of 3 processes; benchmarks/probes.py step): the body {parts['body_s'] * 1e3:.1f} ms for "
            f"{parts['body_mb']:.0f} MB of weights ({parts['body_gbs']:.1f} GB/s, attention, norms and every small "
            f"dispatched op included), the head {parts['head_s'] * 1e3:.1f} ms for {parts['head_mb']:.0f} MB "
            f"({parts['head_gbs']:.1f} GB/s): {1 / step_s:.1f} steps/s. The body's {parts['matrices']:.0f} "
            f"matrices per step are {parts['smallest_mb']:.1f} to {parts['largest_mb']:.1f} MB each.",
        ]
    profiles = R.get("profiles")
    if profiles:
        lines += [
            "",
            "Where a decoding step's time goes, by op (torch.profiler over 20 warm steps, one product form fixed, "
            "torch's threads; benchmarks/probes.py profile): each op's share of the profiled time, calls per step, "
            "time per call.",
            "",
            "| dtype, form | ms per step (profiled) | ops per step | top ops: share, calls/step, µs/call |",
            "|---|---:|---:|---|",
        ]
        for p in profiles:
            top = "; ".join(f"{o['op'].removeprefix('aten::')} {o['share']:.0%}, {o['calls_per_step']:.0f}, "
                            f"{o['us_per_call']:.0f}" for o in p["top"][:6])
            lines.append(f"| {p['dtype']}, {p['form']} | {p['step_ms_profiled']:.1f} | {p['ops_per_step']:.0f} | {top} |")
    bf16 = R.get("bf16_error")
    if bf16:
        lines += [
            "",
            f"bfloat16 ids part ways because bfloat16 moves the logits more than the random model's top tokens "
            f"stand apart: on the prompt, the float32 gap between the two best logits is {bf16['gap']:.4f}, while "
            f"bfloat16 moves a logit by up to {bf16['hf_err']:.4f} in transformers and {bf16['lean_err']:.4f} in "
            f"lmhead (they differ from each other by up to {bf16['lean_vs_hf']:.4f}); best token (float32, "
            f"transformers bfloat16, lmhead bfloat16): {', '.join(str(i) for i in bf16['top1'])}. float32 ids are "
            "token-identical (tests/test_engine_parity.py pins this on every prompt length).",
        ]
    prec = R.get("precision")
    if prec:
        lines += [
            "",
            "## bfloat16 against float32: the next-token distribution",
            "",
            f"Over the {prec['lmhead']['prompts']} fixed prompts of benchmarks/prompts.py (prose, code, numbers, "
            "markup), the KL divergence KL(p_float32 ‖ p_bfloat16) of the next-token distribution at the last "
            "position, in nats, and how often the two pick the same top-1 token, as llama.cpp's perplexity tool "
            "reports quantisation error. With random weights the distributions are flat and the top tokens close, "
            "so the top-1 rate is a harsh test here; the KL divergence is the figure to compare.",
            "",
            "| engine | KL mean | KL median | KL max | same top-1 token |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, p in prec.items():
            lines.append(f"| {name} | {p['kl_mean']:.2e} | {p['kl_median']:.2e} | {p['kl_max']:.2e} | "
                         f"{p['top1_same']} of {p['prompts']} ({p['top1_same'] / p['prompts']:.0%}) |")
    busy = R.get("busy")
    if busy:
        lines += [
            "",
            "## With one busy process beside it",
            "",
            "The decode rows again while the benchmark keeps one CPU-bound process running beside them "
            f"(`python -c 'while True: pass'`, started and ended by the benchmark; load average at the start of the "
            f"section {dict(loads)['busy']:.2f}). Own idle speed: the same variant's steady rate in the table above.",
            "",
            "| dtype | engine | tokens/s | after the first token | vs its own idle speed | vs transformers beside "
            "the same competitor (same dtype) | vs lmhead float32 beside it | target |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        base = row(busy, "float32", "lmhead")
        for r in busy:
            idle = row(R["decode"], r["dtype"], r["engine"])
            own = f"{r['steady'] / idle['steady']:.2f}×" if idle else "n/a"
            vs_hf = f"{r['steady'] / r['hf_steady']:.2f}×" if r["hf_steady"] else "n/a"
            vs_f32 = f"{r['steady'] / base['steady']:.2f}×" if base else "n/a"
            target = ""
            if r["engine"] == "lmhead" and r["dtype"] == "float32" and r["hf_steady"]:
                target = (f"{ok(idle is not None and r['steady'] / idle['steady'] >= t['busy_own'])} ≥ "
                          f"{t['busy_own']}× idle, {ok(r['steady'] / r['hf_steady'] >= t['decode_ratio'])} ≥ "
                          f"{t['decode_ratio']}× transformers")
            elif r["engine"] == "lmhead" and r["dtype"] == "bfloat16" and base and r["hf_steady"]:
                target = (f"{ok(r['steady'] / base['steady'] >= t['bf16_vs_f32'])} ≥ {t['bf16_vs_f32']}× float32, "
                          f"{ok(r['steady'] / r['hf_steady'] >= t['bf16_vs_hf'])} ≥ {t['bf16_vs_hf']}× transformers")
            elif r["engine"] == "lmhead" and r["dtype"] == "int8" and base:
                target = f"{ok(r['steady'] / base['steady'] >= t['int8_vs_f32'])} ≥ {t['int8_vs_f32']}× float32"
            lines.append(f"| {r['dtype']} | {r['engine']} ({r['via']}) | {r['tps']:.1f} | {r['steady']:.1f} | {own} | "
                         f"{vs_hf} | {vs_f32} | {target} |")
    heads = R.get("heads")
    if heads:
        lines += [
            "",
            "## The head alone: the last position against every position (float32)",
            "",
            "The body's hidden states after ln_f for T positions are computed once; then the head on the last "
            "position (what `inspect` and every decoding step do) against the head on all T positions (the full "
            "[1, T, V] logits). Peak memory: how far the process's resident high-water mark rises during the call "
            f"(the kernel updates it in steps of up to 256 kB, so one position's "
            f"{heads[0]['last_logits_mb'] * 1e3:.0f} kB of logits can read 0).",
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
    forms = R.get("forms")
    if forms:
        base = forms["linear"]["s"]
        lines += [
            "",
            "## The head's product and layout (float32, one position)",
            "",
            "A checkpoint stores W_out = E as [V, D] rows. `F.linear(h, E)` (transformers' head) hands one "
            "position to BLAS as a matrix-vector product over those rows. BLAS can stream the same product over a "
            f"[D, V] copy of E instead (faster on some machines and runs), but that copy costs "
            f"{forms['copy_mb']:.0f} MB and {forms['copy_s'] * 1e3:.0f} ms once, and the tie then holds by value, "
            "not by object. lmhead runs one position as BLAS's gemv over E's rows as they are stored (the product "
            "F.linear makes for one position): the tie stays one object, so no layout option is offered. The "
            "blocked rows (one batched matmul over views of E's row blocks) are a form the lean engine offers only "
            "for bfloat16 without the compiled kernels; they are kept here for comparison."
            + (" Every product here reads the same E again, so part of it can come from the last-level cache: "
               "rates above the read bandwidth measured at the top of this report say so."
               if bw and max(forms[f]["gbs"] for f in ("linear", "copy", "blocked")) > bw["read_gbs"] else ""),
            "",
            "| head product | time | GB/s of E read | vs F.linear | extra memory | lm_head.weight is wte.weight |",
            "|---|---:|---:|---:|---:|---|",
            f"| `F.linear(h, E)`, E [V, D] as stored | {base * 1e3:.2f} ms | {forms['linear']['gbs']:.1f} | 1.00× | "
            "0 MB | yes |",
            f"| `h @ Eᵀ` over a [D, V] copy | {forms['copy']['s'] * 1e3:.2f} ms | {forms['copy']['gbs']:.1f} | "
            f"{base / forms['copy']['s']:.2f}× | {forms['copy_mb']:.0f} MB | no (equal values) |",
            f"| blocked rows of E (`engine/products.rows_times`) | {forms['blocked']['s'] * 1e3:.2f} ms | "
            f"{forms['blocked']['gbs']:.1f} | {base / forms['blocked']['s']:.2f}× | 0 MB | "
            f"{'yes' if forms['tied'] else 'no'} |",
        ]
    lines += report_batch(R["batch"]) if "batch" in R else []
    dist = R.get("distributed")
    if dist:
        lines += [
            "",
            "## Beyond one process: `inspect --file` under torchrun",
            "",
            f"The same `lmhead inspect --file PROMPTS --json` over {dist['n']} prompts, once as one process and once "
            f"under `torchrun --standalone --nproc-per-node {dist['procs']}` (gloo; each rank takes every "
            f"{dist['procs']}th batch, rank 0 writes the merged output in input order), both with `--threads` = cores ÷ "
            "processes. Output: whether the two runs' stdout is byte for byte the same.",
            "",
            "| prompts | one process | torchrun | processes | output |",
            "|---:|---:|---:|---:|---|",
            f"| {dist['n']} | {dist['one_s']:.2f} s | {dist['many_s']:.2f} s | {dist['procs']} | "
            f"{ok(dist['identical'])} {'identical' if dist['identical'] else 'different'} ({dist['lines']} lines) |",
            "",
            "On one 2-core machine the processes share the same cores and each loads the model, so torchrun is "
            "not faster here; it is for machines (or nodes) with cores or GPUs to spare.",
        ]
    return "\n".join(lines) + "\n"


def report_batch(b: dict) -> list[str]:
    lines = [
        "",
        "## Many prompts: `inspect --file`",
        "",
        f"{b['n']} short prompts (\"The keys on the table\", \"The dogs near the door\", …) with `--target ' is' "
        "--target ' are' --json`: one `lmhead inspect --file` process (padded batches of 32, the head at each row's "
        "last real token)"
        + (f" against {b['n']} separate `lmhead inspect` processes, run once each. Same: prompts whose top-10 ids "
           "and target probabilities (to a relative 1e-4) agree between the two." if b["separate_s"] else "."),
        "",
    ]
    rate = b["n"] / b["file_s"]
    if b["separate_s"]:
        ratio = b["separate_s"] / b["file_s"]
        lines += ["| prompts | one `inspect --file` | prompts/s | separate processes, total | speed-up | target | same |",
                  "|---:|---:|---:|---:|---:|---|---|",
                  f"| {b['n']} | {b['file_s']:.2f} s | {rate:.1f} | {b['separate_s']:.1f} s | {ratio:.1f}× | "
                  f"{ok(ratio >= 3)} ≥ 3× | {b['same']} of {b['documents']} |"]
    else:
        lines += ["| prompts | one `inspect --file` | prompts/s |", "|---:|---:|---:|",
                  f"| {b['n']} | {b['file_s']:.2f} s | {rate:.1f} |"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per start-up/inspect figure")
    parser.add_argument("--decode-repeats", type=int, default=3, help="fresh processes per decode figure")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test of about 90 s on an idle machine (88 s by its own clock, 90.5 s in all, measured from a load of 0.65): one process per figure, 16 new tokens, no waiting for "
                        "idle CPUs, the slow sections left out")
    parser.add_argument("--write", action="store_true", help="keep the report in benchmarks/RESULTS.md (full runs only)")
    parser.add_argument("--no-wait", action="store_true",
                        help="measure at once: no waiting for idle CPUs, no measurement taken again (a busy machine)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the bandwidth, the greedy-decoding sections (idle and busy) and the step profiles")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models run")
    parser.add_argument("--out", type=Path, help="where the report goes (default: benchmarks/.cache/RESULTS-*.md)")
    parser.add_argument("--report-from", type=Path, metavar="JSON",
                        help="write the report again from a run's kept figures (benchmarks/.cache/measured-*.json)")
    args = parser.parse_args()
    if args.report_from:
        kept = json.loads(args.report_from.read_text(encoding="utf-8"))
        kept_args = argparse.Namespace(**{**kept["args"], "out": args.out})
        R = kept["R"]
        R["loads"] = [tuple(x) for x in R["loads"]]
        for k, v in R.get("quiet", {}).items():  # the run's own waiting and retry counts
            setattr(QUIET, k, v)
        out = args.out or (HERE / "RESULTS.md" if kept_args.write else args.report_from.with_suffix(".md"))
        write(R, kept_args, out)
        return
    if args.write and (args.quick or args.decode_only):
        parser.error("--write keeps a full run's figures; other runs are written to benchmarks/.cache/")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            log("benchmarks/run.py --device cuda: no CUDA GPU here (torch.cuda.is_available() is False; torch "
                f"{torch.__version__}); nothing measured. Run it where there is one, or without --device.")
            raise SystemExit(1)
    if args.quick:
        args.repeats, args.decode_repeats, args.new_tokens = 1, 1, 16
    if args.quick or args.no_wait:
        QUIET.patience, QUIET.retries = 0.0, 0
    out = args.out or (HERE / "RESULTS.md" if args.write else
                       HERE / ".cache" / f"RESULTS-{'quick' if args.quick else 'decode' if args.decode_only else 'full'}.md")
    cpu = args.device == "cpu"
    began = time.perf_counter()
    R: dict = {"loads": []}

    def section(name: str) -> None:
        R["loads"].append((name, load1()))
        log(f"{name} ... (load average {R['loads'][-1][1]:.2f}, {time.perf_counter() - began:.0f} s)")

    section("start")
    folder = gpt2_small()
    bandwidths = [bandwidth.measure(probe)] if cpu else []
    if not args.decode_only:
        section("start-up")
        R["startup"] = startup(args.repeats, args.quick)
        section("inspect")
        R["inspect"] = inspect(folder, args.repeats, args.device)
        section("inspect --file")
        R["batch"] = batch(folder, 16 if args.quick else 32, args.repeats, not args.quick, args.device)
    section("decode")
    if cpu and not args.quick:
        bandwidths.append(bandwidth.measure(probe))
    f32 = ["lmhead", "transformers"] if args.quick or not cpu else \
        ["lmhead", "lmhead, 1 thread", "lmhead, spinning threads", "lmhead, gemv form", "transformers"]
    b16 = ["lmhead", "transformers"] if args.quick or not cpu else \
        ["lmhead", "lmhead, kernel form", "lmhead, gemv form", "lmhead, linear form", "lmhead, blocked form",
         "lmhead, torch's products", "transformers"]
    i8 = ["lmhead"] if args.quick else ["lmhead", "lmhead, torch's products"]
    R["decode"] = decode(folder, args.decode_repeats, args.new_tokens,
                         {"float32": f32, "bfloat16": b16, **({"int8": i8} if cpu else {})}, args.device)
    if not args.quick and not args.decode_only:
        section("precision")
        R["precision"] = probe("precision", str(folder), args.device)
    if cpu and not args.quick:  # --quick (≤ 90 s) leaves the busy rows out: a smoke test, not the targets' figures
        section("busy")
        with Competitor():
            R["busy"] = decode(folder, args.decode_repeats, args.new_tokens,
                               {"float32": [v for v in f32 if not v.endswith(" form")],
                                "bfloat16": ["lmhead", "transformers"], "int8": ["lmhead"]}, args.device,
                               "beside a busy process, ")
    if cpu and not args.quick:
        section("step")
        R["bf16_error"] = probe("bfloat16-error", str(folder), PROMPT)
        steps = [probe("step", str(folder), "60") for _ in range(3)]
        R["step"] = {k: median([p[k] for p in steps]) for k in steps[0]}
        R["profiles"] = [probe("profile", str(folder), dtype, form)
                         for dtype, form in (("float32", "kernel"), ("int8", "-"),
                                             ("bfloat16", "kernel"))]
        bandwidths.append(bandwidth.measure(probe))
    if cpu and not args.quick and not args.decode_only:
        section("head alone")
        # Every allocation over 64 kB straight from mmap and back on free, so the resident high-water mark
        # shows each call's own peak (glibc otherwise keeps freed blocks resident and reuses them).
        R["heads"] = [probe("head", str(folder), str(T), str(max(args.repeats, 3)),
                            env={"MALLOC_MMAP_THRESHOLD_": "65536"}) for T in HEAD_T]
        R["forms"] = probe("head-forms", str(folder), str(max(args.repeats * 4, 10)))
        section("distributed")
        R["distributed"] = distributed(folder, 256, 2, 1)
    if cpu and not args.decode_only:  # `lmhead score` (benchmarks/score_bench.py)
        section("score")
        R["score"] = score_bench.measure(folder, run, quick=args.quick)
        section("compare")  # `lmhead compare` (benchmarks/compare_bench.py), where the command exists
        R["compare"] = compare_bench.measure(folder, run, quick=args.quick)
    if bandwidths:
        # The best of the measurements (start, middle, end): other work can only make it look lower.
        R["bandwidth"] = bandwidth.merge(bandwidths)
    section("end")
    R["checkpoint"] = {**json.loads((folder / "config.json").read_text()),
                       "file_mb": (folder / "model.safetensors").stat().st_size / 1e6}
    R["machine"] = machine()
    R["elapsed_s"] = time.perf_counter() - began
    R["quiet"] = {k: v for k, v in vars(QUIET).items() if isinstance(v, (int, float))}
    measured = HERE / ".cache" / f"measured-{out.stem}.json"  # the figures, kept before the report is written
    measured.parent.mkdir(parents=True, exist_ok=True)
    measured.write_text(json.dumps({"R": R, "args": vars(args)}, default=str), encoding="utf-8")
    write(R, args, out)


KEPT_SECTIONS = [(versus_llamacpp.BEGIN, versus_llamacpp.END), (versus_llamacpp.llama_bench.BEGIN, versus_llamacpp.llama_bench.END),
                 (batching_bench.BEGIN, batching_bench.END),
                 ("<!-- grammar: begin -->", "<!-- grammar: end -->"),  # benchmarks/grammar_bench.py
                 ("<!-- test suite: begin -->", "<!-- test suite: end -->")]


def write(R: dict, args, out: Path) -> None:
    text = report(R, args) + (score_bench.report(R["score"]) if "score" in R else "") + (
        compare_bench.report(R["compare"]) if R.get("compare") else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = out.read_text(encoding="utf-8") if out.is_file() else ""
    out.write_text(text, encoding="utf-8")
    # the sections of other runs stay: llama.cpp's, batching's, and the test suite's timing (measured by hand)
    for begin, end in KEPT_SECTIONS:
        kept = versus_llamacpp.section_in(previous, begin, end)
        if kept:
            versus_llamacpp.splice(out, kept, begin, end)
    print(text)
    log(f"written to {out}" + ("" if args.write else " (only a full run with --write replaces benchmarks/RESULTS.md)"))


if __name__ == "__main__":
    main()
