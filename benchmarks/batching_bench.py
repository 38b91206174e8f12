"""Continuous batching in `lmhead serve` and single-stream greedy speed (issue 30), measured in one run on
random:gpt2 (GPT-2 124M's shapes, random weights: the speed of the real model, offline):

* a 4-token request beside a running 240-token request, against its time alone (target <= 4x);
* 12 streaming clients arriving 0.4 s apart: p90 time to first token against one client's (target <= 5x);
* 16 concurrent clients generating 64 tokens each: tokens per second against one client's (target >= 4x);
* single-stream greedy decoding: Model.generate on decoding/loop.py against the loop it replaced
  (decoding/generate.py at --base, run from git in the same process, alternating; target >= 0.95x).

    python benchmarks/batching_bench.py [--quick] [--base COMMIT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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


def old_generate(base: str):
    """decoding/generate.py as it was at `base`, loaded beside today's modules."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{base}:lmhead_cli/decoding/generate.py"],
                         capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("old_generate", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    exec(compile(src, "old_generate.py", "exec"), mod.__dict__)
    return mod


def greedy_speed(base: str, tokens: int, rounds: int) -> tuple[float, float]:
    """Decode tokens per second (after the first token), old loop and new, alternating; the best of each."""
    import lmhead_cli
    from lmhead_cli.decoding import generate as new

    old = old_generate(base)
    model = lmhead_cli.load("random:gpt2", device="cpu")
    ids = model.encode(PROMPT)
    rates = {"old": [], "new": []}
    for _ in range(rounds):
        for name, mod in (("old", old), ("new", new)):
            g = mod.generate(model.loaded, ids, mod.make_settings(greedy=True, max_new_tokens=tokens, ignore_eos=True))
            assert len(g.generated_ids) == tokens
            rates[name].append(g.decode_tokens_per_second)
    return max(rates["old"]), max(rates["new"])


def main() -> None:
    from helpers import serving

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--base", default="main", help="the commit whose generate loop is the baseline")
    args = ap.parse_args()
    res = {}
    old, new = greedy_speed(args.base, 48 if args.quick else 128, 3 if args.quick else 5)
    res["greedy"] = {"old_tok_s": old, "new_tok_s": new, "ratio": new / old}
    with serving("random:gpt2", timeout=600) as s:
        post(s.url, {"prompt": PROMPT, "max_tokens": 8})  # warm up
        alone, beside = short_beside_long(s.url)
        res["short_beside_long"] = {"alone_s": alone, "beside_s": beside, "ratio": beside / alone}
        one, p90 = arrivals(s.url)
        res["arrivals"] = {"one_ttft_s": one, "p90_ttft_s": p90, "ratio": p90 / one}
        one, many = throughput(s.url)
        res["throughput"] = {"one_tok_s": one, "sixteen_tok_s": many, "ratio": many / one}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
