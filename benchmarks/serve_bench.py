"""`lmhead serve` (issue 17), as ratios measured in one run on the 124M checkpoint (benchmarks/checkpoint.py):

* requests per second for echo scoring (lm-evaluation-harness's loglikelihood request: a prompt of token
  ids, echo, max_tokens 1, logprobs 1, temperature 0) with 1 client and with 16 clients at once
  (target: 16 clients >= 2x one);
* lm-evaluation-harness's wall time on a multiple-choice task of N docs x 4 choices: `local-completions`
  through `lmhead serve` (already running; num_concurrent 16) against its own `hf` backend on the same
  folder (batch size 16), each as one `lm_eval` process (target: serve <= 1.5x hf).

    python benchmarks/serve_bench.py [--quick]     # prints the markdown section
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

CLIENTS_TARGET, LMEVAL_TARGET = 2.0, 1.5
YAML = (ROOT / "tests" / "data" / "lmhead_mc.yaml").read_text()


def requests_body(rng: random.Random) -> dict:
    n = rng.randint(48, 160)  # a few-shot question with its choice
    return {"model": "m", "prompt": [[rng.randrange(50000) for _ in range(n)]], "echo": True, "max_tokens": 1,
            "logprobs": 1, "temperature": 0, "seed": 1234}


def rate(url: str, bodies: list[dict], clients: int) -> float:
    """Requests per second with `clients` threads sending the bodies (each client its own connection)."""
    import httpx

    local = threading.local()

    def send(body):
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=url, timeout=600)
        r = local.c.post("/v1/completions", json=body)
        r.raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(send, bodies))
    return len(bodies) / (time.perf_counter() - start)


def task_folder(docs: int) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="lmhead-serve-bench-"))
    (folder / "lmhead_mc.yaml").write_text(YAML)
    rng = random.Random(0)
    words = "the keys on table door window garden river city morning evening letter question answer".split()
    with open(folder / "lmhead_mc.jsonl", "w") as f:
        for _ in range(docs):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))).capitalize()
            f.write(json.dumps({"question": q, "choices": [" ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
                                                            for _ in range(4)], "answer": 0}) + "\n")
    return folder


def lm_eval_seconds(folder: Path, model: str, model_args: str, *extra: str) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(folder / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks",
           "lmhead_mc", "--include_path", str(folder), "--output_path", str(folder / model), *extra]
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return time.perf_counter() - start


def measure(quick: bool = False) -> dict:
    from checkpoint import gpt2_small
    from helpers import serving

    ckpt = gpt2_small()
    n_requests, docs = (32, 25) if quick else (96, 100)
    rng = random.Random(0)
    bodies = [requests_body(rng) for _ in range(n_requests)]
    out = {"requests": n_requests, "docs": docs, "load": os.getloadavg()[0]}
    with serving(ckpt, timeout=600) as served:
        rate(served.url, bodies[:4], 1)  # warm-up
        out["one"] = rate(served.url, bodies, 1)
        out["sixteen"] = rate(served.url, bodies, 16)
        folder = task_folder(docs)
        try:
            out["lmeval_serve_s"] = lm_eval_seconds(
                folder, "local-completions",
                f"base_url={served.url}/v1/completions,model=gpt2,max_length=1024,num_concurrent=16")
            out["lmeval_hf_s"] = lm_eval_seconds(folder, "hf", f"pretrained={ckpt},dtype=float32",
                                                 "--device", "cpu", "--batch_size", "16")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    out["load_after"] = os.getloadavg()[0]
    return out


def report(m: dict) -> str:
    clients = m["sixteen"] / m["one"]
    lmeval = m["lmeval_serve_s"] / m["lmeval_hf_s"]
    ok = lambda good: "met" if good else "not met"  # noqa: E731
    return "\n".join([
        "## lmhead serve (benchmarks/serve_bench.py)",
        "",
        f"124M checkpoint (random weights), CPU; load average {m['load']:.1f} at the start, {m['load_after']:.1f} at the end.",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| echo scoring, 1 client ({m['requests']} requests) | {m['one']:.2f} req/s | |",
        f"| echo scoring, 16 clients | {m['sixteen']:.2f} req/s ({clients:.2f}x one) | >= {CLIENTS_TARGET}x: {ok(clients >= CLIENTS_TARGET)} |",
        f"| lm-eval, {m['docs']} docs x 4 choices, local-completions through lmhead serve | {m['lmeval_serve_s']:.1f} s | |",
        f"| lm-eval, same task, its hf backend | {m['lmeval_hf_s']:.1f} s | |",
        f"| serve / hf | {lmeval:.2f}x | <= {LMEVAL_TARGET}x: {ok(lmeval <= LMEVAL_TARGET)} |",
        "",
    ])


if __name__ == "__main__":
    result = measure(quick="--quick" in sys.argv)
    print(json.dumps(result), file=sys.stderr)
    print(report(result))
