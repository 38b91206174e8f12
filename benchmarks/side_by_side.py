"""Decode speed of two lmhead installs side by side: the same command, runs alternating, best of N.

    python benchmarks/side_by_side.py --old /work/venvs/main/bin/lmhead --new .venv/bin/lmhead \
        --dtypes float32,bfloat16,int8 --runs 5 --tokens 64

Each run is `lmhead greedy PROMPT --model random:gpt2 --dtype D -n TOKENS --ignore-eos --json` in a fresh
process; its `decode_tokens_per_second` (the steady one-position-per-step rate) is the figure. The
two installs alternate run by run, so drift in the machine's load hits both alike; the table gives
each one's best and median and new/old of the bests. The load average before and after is printed:
on a shared machine the figures are only comparable within one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

PROMPT = "The keys on the table"


def decode_rate(lmhead: str, dtype: str, tokens: int, model: str, threads: int | None) -> float:
    cmd = [lmhead, "greedy", PROMPT, "--model", model, "--dtype", dtype, "-n", str(tokens), "--ignore-eos", "--json"]
    if threads:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)["decode_tokens_per_second"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the reference install's lmhead")
    ap.add_argument("--new", required=True, help="the install under test's lmhead")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--threads", type=int, default=None, help="--threads for both (default: chosen by timing)")
    args = ap.parse_args()

    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    rates: dict[tuple[str, str], list[float]] = {}
    for dtype in args.dtypes.split(","):
        for run in range(args.runs):
            for name, lmhead in (("old", args.old), ("new", args.new)) if run % 2 == 0 else \
                    (("new", args.new), ("old", args.old)):
                rate = decode_rate(lmhead, dtype, args.tokens, args.model, args.threads)
                rates.setdefault((dtype, name), []).append(rate)
                print(f"{dtype:9} {name} run {run + 1}: {rate:6.1f} tok/s", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("\n| dtype | old best | new best | old median | new median | new/old (best) |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        old, new = rates[(dtype, "old")], rates[(dtype, "new")]
        print(f"| {dtype} | {max(old):.1f} | {max(new):.1f} | {statistics.median(old):.1f} | "
              f"{statistics.median(new):.1f} | {max(new) / max(old):.3f} |")


if __name__ == "__main__":
    main()
