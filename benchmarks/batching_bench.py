"""Continuous batching in `lmhead serve` and single-stream greedy speed (issue 30), measured in one run on
random:gpt2 (GPT-2 124M's shapes, random weights: the speed of the real model, offline):

* a 4-token request beside a running 240-token request, against its time alone (target <= 4x);
* a 32-token request sent 1.5 s after a request of 16 choices, against its time alone (target <= 4x);
* 12 streaming clients arriving 0.4 s apart: p90 time to first token against one client's (target <= 5x);
* 16 concurrent clients generating 64 tokens each: tokens per second against one client's (target >= 4x);
* single-stream greedy decoding: Model.generate on today's package against the package at --base
  (read from git, each run in a fresh process, alternating; target >= 0.95x).

Each phase states the load average (1 min) at its start: the machine may be shared, and other work
slows the model's rounds and so every wait behind them. For the arrivals the server's own clock
(/health's `timing`, serve/worker.py) splits a time to first token into the wait in the queue and
the rest (the prompt's read and its first token), beside the mean seconds of a round's prefill and step.

    python benchmarks/batching_bench.py [--quick] [--base COMMIT] [--write]   # --write: its section in RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = "The keys on the table"


def post(url: str, body: dict) -> dict:
    import httpx

    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def timed(url: str, body: dict) -> float:
    start = time.perf_counter()
    post(url, body)
    return time.perf_counter() - start


def first_token(url: str, body: dict) -> float:
    """Seconds to the first streamed token."""
    import httpx

    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token")


def short_beside_long(url: str) -> tuple[float, float]:
    short = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    alone = min(timed(url, short) for _ in range(3))
    long = threading.Thread(target=post, args=(url, {"prompt": PROMPT, "max_tokens": 240, "temperature": 0}))
    long.start()
    time.sleep(1.5)
    beside = timed(url, short)
    long.join()
    return alone, beside


def one_beside_many(url: str, gap: float = 1.5) -> tuple[float, float]:
    """A one-row request's seconds alone (best of 3), and sent `gap` s after a request of 16 choices (which
    fills the 16 rows of a step)."""
    one = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    alone = min(timed(url, one) for _ in range(3))
    many = threading.Thread(target=post, args=(url, {"prompt": PROMPT, "max_tokens": 240, "n": 16,
                                                     "temperature": 0.8, "seed": 1}))
    many.start()
    time.sleep(gap)
    beside = timed(url, one)
    many.join()
    return alone, beside


def arrivals(url: str, clients: int = 12, gap: float = 0.4) -> tuple[float, float]:
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    one = min(first_token(url, body) for _ in range(3))
    out: list[float] = []

    def client(i: int) -> None:
        time.sleep(i * gap)
        out.append(first_token(url, body))

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return one, statistics.quantiles(out, n=10)[-1]


def throughput(url: str, clients: int = 16, tokens: int = 64) -> tuple[float, float]:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0.8, "seed": 1}
    start = time.perf_counter()
    post(url, body)
    one = tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        docs = list(pool.map(lambda i: post(url, {**body, "seed": i}), range(clients)))
    made = sum(d["usage"]["completion_tokens"] for d in docs)
    return one, made / (time.perf_counter() - start)


SPEED = """
import sys, lmhead_cli
model = lmhead_cli.load("random:gpt2", device="cpu")
g = model.generate(sys.argv[1], mode="greedy", max_new_tokens=int(sys.argv[2]), ignore_eos=True)
assert len(g.reading.generated_ids) == int(sys.argv[2])
print(g.reading.decode_tokens_per_second)
"""


def from_git(base: str, folder: Path) -> Path:
    """The package as it was at commit `base`, in `folder` (with the compiled kernels built here, which
    the package at `base` loads if their ABI is its own, and the configs)."""
    import io
    import shutil
    import tarfile

    data = subprocess.run(["git", "-C", str(ROOT), "archive", base, "lmhead_cli", "configs"],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")
    for so in (ROOT / "lmhead_cli" / "engine").glob("_kernels*.so"):
        shutil.copy(so, folder / "lmhead_cli" / "engine" / so.name)
    return folder


def greedy_speed(base: str, tokens: int, rounds: int) -> tuple[float, float]:
    """Decode tokens per second (after the first token) of Model.generate, greedy, the package at `base`
    and today's, each in a fresh process, alternating; the best of each."""
    import tempfile

    rates = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": from_git(base, Path(tmp)), "new": ROOT}
        for _ in range(rounds):
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": str(tree)}
                out = subprocess.run([sys.executable, "-c", SPEED, PROMPT, str(tokens)], env=env, capture_output=True,
                                     text=True, check=True, cwd=tree).stdout
                rates[name].append(float(out.strip().splitlines()[-1]))
    return max(rates["old"]), max(rates["new"])


def health(url: str) -> dict:
    import httpx

    return httpx.get(url + "/health", timeout=60).json()


def clock(before: dict, after: dict) -> dict | None:
    """Means over a stretch from two readings of /health's timing: seconds per request in the queue and
    to the first token (on the server), and per round in prefill and in the step."""
    if "timing" not in before:
        return None
    a, b = before["timing"], after["timing"]
    firsts, rounds = b["firsts"] - a["firsts"], b["rounds"] - a["rounds"]
    return {"requests": firsts, "rounds": rounds,
            "queue_s": (b["queue_s"] - a["queue_s"]) / max(firsts, 1),
            "first_token_s": (b["first_token_s"] - a["first_token_s"]) / max(firsts, 1),
            "prefill_s_per_round": (b["prefill_s"] - a["prefill_s"]) / max(rounds, 1),
            "step_s_per_round": (b["step_s"] - a["step_s"]) / max(rounds, 1)}


def load() -> float:
    return round(os.getloadavg()[0], 2)


TARGETS = {"short_beside_long": ("<=", 4.0), "one_beside_many": ("<=", 4.0), "arrivals": ("<=", 5.0), "throughput": (">=", 4.0), "greedy": (">=", 0.95)}
BEGIN, END = "<!-- batching: begin -->", "<!-- batching: end -->"


def met(name: str, ratio: float) -> bool:
    op, bound = TARGETS[name]
    return ratio <= bound if op == "<=" else ratio >= bound


def measure(quick: bool, base: str) -> dict:
    from helpers import serving

    res = {"quick": quick, "base": base}
    res["greedy"] = {"load": load()}
    old, new = greedy_speed(base, 48 if quick else 128, 3 if quick else 5)
    res["greedy"].update(old_tok_s=old, new_tok_s=new, ratio=new / old)
    with serving("random:gpt2", timeout=600) as s:
        post(s.url, {"prompt": PROMPT, "max_tokens": 8})  # warm up
        res["short_beside_long"] = {"load": load()}
        alone, beside = short_beside_long(s.url)
        res["short_beside_long"].update(alone_s=alone, beside_s=beside, ratio=beside / alone)
        res["one_beside_many"] = {"load": load()}
        alone, beside = one_beside_many(s.url)
        res["one_beside_many"].update(alone_s=alone, beside_s=beside, ratio=beside / alone)
        res["arrivals"] = {"load": load()}
        before = health(s.url)
        one, p90 = arrivals(s.url)
        res["arrivals"].update(one_ttft_s=one, p90_ttft_s=p90, ratio=p90 / one, server=clock(before, health(s.url)))
        res["throughput"] = {"load": load()}
        one, many = throughput(s.url)
        res["throughput"].update(one_tok_s=one, sixteen_tok_s=many, ratio=many / one)
    res["load_end"] = load()
    return res


def report(r: dict) -> str:
    """The markdown section for benchmarks/RESULTS.md."""
    ok = lambda name: ("✅" if met(name, r[name]["ratio"]) else "❌")  # noqa: E731
    target = lambda name: f"{TARGETS[name][0]} {TARGETS[name][1]}x"  # noqa: E731
    sb, ar, th, gr = r["short_beside_long"], r["arrivals"], r["throughput"], r["greedy"]
    om = r["one_beside_many"]
    lines = [BEGIN, "## Continuous batching in `lmhead serve` (benchmarks/batching_bench.py)", "",
             f"random:gpt2 (GPT-2 124M's shapes, random weights), float32 on the CPU, one run{' (--quick)' if r['quick'] else ''}; "
             "each ratio is of two figures measured in the same run, a few seconds apart. Load average (1 min) at "
             "the start of each measure, on a machine shared with other work: it slows every round, and every "
             "wait behind a round with it.", "",
             "| measure | alone | beside the others | ratio | target | load |", "|---|---:|---:|---:|---|---:|",
             f"| a 4-token request, beside a running 240-token one (s) | {sb['alone_s']:.3f} | {sb['beside_s']:.3f} | "
             f"{sb['ratio']:.2f}x | {ok('short_beside_long')} {target('short_beside_long')} | {sb['load']:.2f} |",
             f"| a 32-token request, sent 1.5 s after one of 16 choices x 240 tokens (s) | {om['alone_s']:.3f} | "
             f"{om['beside_s']:.3f} | {om['ratio']:.2f}x | {ok('one_beside_many')} {target('one_beside_many')} | "
             f"{om['load']:.2f} |",
             f"| time to first token, 12 streaming clients 0.4 s apart: p90 against one client's (s) | {ar['one_ttft_s']:.3f} | "
             f"{ar['p90_ttft_s']:.3f} | {ar['ratio']:.2f}x | {ok('arrivals')} {target('arrivals')} | {ar['load']:.2f} |",
             f"| tokens/s, 16 clients x 64 tokens against one client | {th['one_tok_s']:.1f} | {th['sixteen_tok_s']:.1f} | "
             f"{th['ratio']:.2f}x | {ok('throughput')} {target('throughput')} | {th['load']:.2f} |",
             f"| single-stream greedy tok/s: today's decoding loop against the one at {r['base']} | {gr['old_tok_s']:.1f} | "
             f"{gr['new_tok_s']:.1f} | {gr['ratio']:.3f}x | {ok('greedy')} {target('greedy')} | {gr['load']:.2f} |", ""]
    c = ar.get("server")
    if c:
        lines += [f"The arrivals on the server's clock (/health `timing`, {c['requests']} requests, {c['rounds']} rounds): "
                  f"{c['first_token_s']:.3f} s from queued to first token on average, {c['queue_s']:.3f} s of it in the "
                  f"queue; a round spent {c['prefill_s_per_round']:.3f} s reading prompts and {c['step_s_per_round']:.3f} s "
                  f"stepping, on average. Load average at the end: {r['load_end']:.2f}.", ""]
    return "\n".join(lines + [END]) + "\n"


def main() -> None:
    from harness import print_section

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--base", default="main", help="the commit whose generate loop is the baseline")
    ap.add_argument("--write", action="store_true", help="keep the section in benchmarks/RESULTS.md")
    args = ap.parse_args()
    res = measure(args.quick, args.base)
    print_section(res, report(res), args.write, BEGIN, END)


if __name__ == "__main__":
    main()
