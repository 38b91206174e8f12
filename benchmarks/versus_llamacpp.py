"""lmhead against llama.cpp on the same weights (issue 35): greedy decoding idle and beside a busy
process, scoring against llama-perplexity, serving against llama-server, and each dtype's fraction of
the machine's read bandwidth (benchmarks/bandwidth.py).

    python benchmarks/versus_llamacpp.py                 # everything (10-15 min idle on 2 cores, estimated)
    python benchmarks/versus_llamacpp.py --write         # the same, its section kept in benchmarks/RESULTS.md
    python benchmarks/versus_llamacpp.py --only decode   # a subset: decode, busy, score, serve, llama (comma-separated)
    python benchmarks/versus_llamacpp.py --only llama    # a Llama's GGUF files (benchmarks/llama_bench.py), its own section
    python benchmarks/versus_llamacpp.py --quick         # a smoke test: 1 run each, 32 tokens, no busy rows

A run of some parts (--only decode,busy) writes those and keeps the others from the section already in
RESULTS.md, each under a line naming the run that measured it (benchmarks/versus_llamacpp_report.py).

llama.cpp is built once by benchmarks/llamacpp.py (cached in $LMHEAD_BENCH_LLAMACPP, else
~/.cache/lmhead-bench/llamacpp; building it took over an hour on a loaded 2-core machine and is not counted above) and
the benchmark's checkpoint (benchmarks/checkpoint.py) converted by its convert_hf_to_gguf.py into F32,
then by llama-quantize into BF16 and Q8_0. Without cmake or a compiler the section says so and stops.

Every figure comes from fresh processes, the two engines alternating, on the machine's cores:
llama.cpp with -t = the core count; lmhead with its own defaults (`lmhead greedy --json`, threads
chosen by timing). Idle: the best of N runs (neighbours on a shared machine only ever slow a run);
busy: the median of N beside one Python spin loop that the benchmark starts and stops.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bandwidth  # noqa: E402
import llama_bench  # noqa: E402
import llamacpp  # noqa: E402
from harness import PYTHON, QUIET, Competitor, cpu_features, lmhead, load1, log, probe, run  # noqa: E402
from versus_llamacpp_report import BEGIN, BUSY_TIMEOUT_S, END, PROMPT, report, section_in, splice  # noqa: E402

SECTIONS = ("decode", "busy", "score", "serve", "llama")  # llama: TinyLlama's shapes (llama_bench.py), busy rows too
SERVE_CLIENTS = (1, 4, 16)


# ---- decoding -----------------------------------------------------------------------------------

def lmhead_decode(folder: Path, dtype: str, n: int) -> dict:
    """`lmhead greedy --json` in a fresh process: its own steady rate (first new token to last)."""
    doc = json.loads(run(lmhead("greedy", PROMPT, "--model", str(folder), "--max-new-tokens", str(n), "--ignore-eos",
                                "--dtype", dtype, "--device", "cpu", "--json"))[2])
    return {"tps": doc["decode_tokens_per_second"]}


def llama_decode(gguf: Path, n: int, threads: int, timeout: float | None = None) -> dict:
    """llama-bench tg{n} in a fresh process (-p 0 -r 1: one timed run of n tokens after llama-bench's
    one-token warm-up, so that, like lmhead's steady rate, the first token's set-up is left out)."""
    cmd = [str(llamacpp.binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n),
           "-r", "1", "-o", "json"]
    if timeout:
        cmd = ["timeout", str(int(timeout)), *cmd]
    try:
        out = run(cmd)[2]
    except RuntimeError as e:
        return {"tps": None, "error": str(e).splitlines()[0][:200]}
    test = next(t for t in json.loads(out) if t["n_gen"] == n)
    return {"tps": test["avg_ts"]}


def decode(folder: Path, ggufs: dict[str, Path], n: int, rounds: int, threads: int, busy: bool) -> dict:
    """Every (lmhead dtype, llama.cpp type) pair, `rounds` times, alternating engine by engine."""
    runs: dict[str, dict[str, list]] = {t: {"lmhead": [], "llama": []} for t in ggufs}
    for i in range(rounds):
        for t, gguf in ggufs.items():
            runs[t]["lmhead"].append(lmhead_decode(folder, llamacpp.LMHEAD_DTYPE[t], n))
            runs[t]["llama"].append(llama_decode(gguf, n, threads, BUSY_TIMEOUT_S if busy else None))
            log(f"  {'busy' if busy else 'idle'} {i + 1}/{rounds} {t}: lmhead "
                f"{runs[t]['lmhead'][-1]['tps']:.1f}, llama.cpp {runs[t]['llama'][-1]['tps'] or float('nan'):.1f}")
    return runs


def drop_from_page_cache(files: list[Path]) -> list[str]:
    """Both engines' weight files out of the page cache (POSIX_FADV_DONTNEED), so that each engine reads
    its own file in its own way, as after a reboot: how a file was last read or written decides the
    page cache's folio sizes, and a file cached in 2 MiB folios is mapped on 2 MiB pages (here the
    converter's GGUF files were, the checkpoint written by save_pretrained was not). The names of the
    files dropped (a page another process maps stays)."""
    dropped = []
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped.append(f.name)
        except (OSError, AttributeError):  # no posix_fadvise (macOS): the cache stays as it is
            pass
        finally:
            os.close(fd)
    return dropped


# ---- scoring ------------------------------------------------------------------------------------

def windows_forwarded(T: int, n_ctx: int, stride: int) -> int:
    """Positions lmhead's score runs through the body: windows of n_ctx beginning every `stride`
    tokens until one reaches the end (docs/score.md)."""
    total, begin = 0, 0
    while True:
        end = min(begin + n_ctx, T)
        total += end - begin
        if end == T:
            return total
        begin += stride


def score_probe(folder: str, text_file: str) -> dict:
    """In this (fresh) process: load through the API, warm up on a short text, then time one
    `Model.score` over the text (default stride: n_ctx / 2, llama-perplexity's halves). The log-probs
    of the tokens llama-perplexity scores (the second half of each n_ctx chunk, with the context from
    the chunk's start, as lmhead's window there has it) give their perplexity too."""
    import lmhead_cli

    text = Path(text_file).read_text(encoding="utf-8")
    model = lmhead_cli.load(folder, device="cpu", dtype="float32")
    model.score("The keys on the table are on the table.")
    start = time.perf_counter()
    result = model.score(text)
    seconds = time.perf_counter() - start
    reading = result.reading
    T, n_ctx = int(reading.ids.numel()), reading.window
    # llama-perplexity's tokens: in chunk c, the logits at positions n_ctx/2 .. n_ctx-2 predict tokens
    # n_ctx/2 + 1 .. n_ctx - 1 (tools/perplexity/perplexity.cpp: n_ctx - 1 - first a chunk)
    halves = [p for c in range(T // n_ctx) for p in range(c * n_ctx + n_ctx // 2 + 1, (c + 1) * n_ctx)]
    nll = -float(reading.logprob[halves].double().sum())
    return {"s": seconds, "tokens": T, "scored": int(reading.scored.sum()), "window": n_ctx, "stride": reading.stride,
            "forwarded": windows_forwarded(T, n_ctx, reading.stride), "halves": len(halves),
            "halves_ppl": math.exp(nll / len(halves))}


def llama_score(gguf: Path, text_file: Path, n_ctx: int, threads: int) -> dict:
    """llama-perplexity over the text in chunks of n_ctx (the second half of each scored), timed by its
    own log's clock from "calculating perplexity" to "Final estimate" (every chunk's forward and
    scoring; its perf summary is not printed at the default verbosity)."""
    import re

    exe = llamacpp.binary("llama-perplexity")
    cmd = ["sh", "-c", 'exec "$0" "$@" 2>&1', str(exe), "-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx),
           "-b", str(n_ctx), "-t", str(threads)]
    wall, _, out = run(cmd)
    stamp = r"(\d+)\.(\d+)\.(\d+)\.(\d+) \w "  # its log's clock: minutes.seconds.ms.µs, then the level
    first = re.search(stamp + r"perplexity: calculating perplexity over (\d+) chunks", out)
    last = re.search(stamp + r"Final estimate: PPL = ([\d.]+)", out)
    if not (first and last):
        raise RuntimeError(f"llama-perplexity's output lacks its chunk count or final estimate:\n{out[-1500:]}")
    clock = lambda m: int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6  # noqa: E731
    chunks = int(first[5])
    return {"s": clock(last) - clock(first), "wall_s": wall, "forwarded": chunks * n_ctx, "chunks": chunks,
            "scored": chunks * (n_ctx - n_ctx // 2 - 1), "ppl": float(last[5])}


def score(folder: Path, gguf: Path, n_tokens: int, rounds: int, threads: int) -> dict:
    """`lmhead score` (in-process timing, fresh process each) against llama-perplexity on the same text."""
    import score_bench

    text = score_bench.make_text(n_tokens)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        ours, theirs = [], []
        for _ in range(rounds):
            wall, _, out = run([PYTHON, str(Path(__file__).resolve()), "score-probe", str(folder), f.name])
            ours.append({**json.loads(out.strip().splitlines()[-1]), "wall_s": wall})
            theirs.append(llama_score(gguf, Path(f.name), 1024, threads))
    finally:
        os.unlink(f.name)
    return {"tokens": n_tokens, "lmhead": ours, "llama": theirs}


# ---- serving ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1, ready (its /health answers 200) inside the block, stopped after."""

    def __init__(self, cmd: list[str], port: int, timeout: float = 300.0):
        self.cmd, self.url, self.timeout = cmd, f"http://127.0.0.1:{port}", timeout

    def __enter__(self):
        import httpx

        self.log = tempfile.TemporaryFile()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{Path(self.cmd[0]).name} exited {self.proc.returncode}: "
                                   f"{self.log.read().decode(errors='replace')[-1500:]}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"{' '.join(self.cmd[:3])} did not answer /health within {self.timeout:.0f} s")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def serve_prompts(n: int, start: int = 0) -> list[str]:
    """Prompts start .. start + n - 1 of one sequence of 12-word prompts (distinct for the first
    len(score_bench.WORDS): 158)."""
    import score_bench

    words = score_bench.WORDS
    return [" ".join(words[(7 * i + 3 * k) % len(words)] for k in range(12)).capitalize()
            for i in range(start, start + n)]


def throughput_prompts(per_client: dict[int, int]) -> dict[int, list[str]]:
    """Each client count's prompts (clients × per_client[clients]), none sent before in the run: the
    warm-up takes prompt 0, each count the next ones, the first-token probes FIRST_PROMPTS on.
    llama-server keeps each slot's last prompt and reads only what follows a cached prefix, so a prompt
    sent again would be read at one position's cost (lmhead keeps no prompt cache)."""
    out, start = {}, 1
    for clients in SERVE_CLIENTS:
        out[clients] = serve_prompts(clients * per_client[clients], start)
        start += len(out[clients])
    if start > FIRST_PROMPTS:
        raise ValueError(f"{start - 1} throughput prompts run into the first-token ones (from {FIRST_PROMPTS})")
    return out


def load_clients(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """`clients` threads, each with its own connection, sending its share of the prompts one after the
    other (/v1/completions, temperature 0): completion tokens (the servers' own usage counts) per
    second of wall time, all clients together."""
    import httpx

    local = threading.local()

    def send(prompt: str) -> int:
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=url, timeout=900)
        r = local.c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0})
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(send, prompts))
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": len(prompts), "tokens": tokens, "s": wall, "tps": tokens / wall}


def first_token_s(url: str, prompt: str) -> float:
    """Seconds from sending a lone streamed completion (8 tokens, temperature 0, a new connection) to its
    first token's event: the prompt's read and the first token, with the server's own overheads."""
    import httpx

    with httpx.Client(base_url=url, timeout=120) as c:
        start = time.perf_counter()
        with c.stream("POST", "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0, "stream": True}) as r:
            r.raise_for_status()
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url}: the stream ended with no token")
    return first


FIRST_PROMPTS = 100  # the first-token prompts are serve_prompts' from this one on: none of the load's


def first_tokens(url: str, n: int) -> dict:
    """A lone request's time to first token, `n` times, each a 12-word prompt the server has not seen
    (llama-server keeps each slot's last prompt and reads only what follows a cached prefix: the same
    prompt again measured one position's read, prompt_n 1 of 12): the best and the median, in seconds."""
    times = sorted(first_token_s(url, p) for p in serve_prompts(FIRST_PROMPTS + n)[FIRST_PROMPTS:])
    return {"n": n, "best_s": times[0], "median_s": times[len(times) // 2]}


def serve(folder: Path, gguf: Path, threads: int, max_tokens: int, per_client: dict[int, int],
          firsts: int = 20) -> dict:
    """`lmhead serve` (float32) and `llama-server -np 16` (F32), one after the other: after one warm-up
    request, a lone request's time to first token (`firsts` times), then 1, 4 and 16 clients."""
    out = {}
    servers = {
        "lmhead": lambda port: [PYTHON, "-m", "lmhead_cli", "serve", "--model", str(folder), "--port", str(port),
                                "--dtype", "float32", "--device", "cpu"],
        "llama": lambda port: [str(llamacpp.binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
                               "--port", str(port), "-t", str(threads), "-np", str(max(SERVE_CLIENTS)),
                               "-c", str(max(SERVE_CLIENTS) * 256)],
    }
    for name, cmd in servers.items():
        QUIET.wait()
        port = free_port()
        with Server(cmd(port), port) as server:
            load_clients(server.url, serve_prompts(1), 1, max_tokens)  # warm-up
            out.setdefault("first_token", {})[name] = first_tokens(server.url, firsts)
            log(f"  serve {name}, a lone request's first token: {out['first_token'][name]['best_s'] * 1e3:.1f} ms")
            out[name] = []
            for clients, prompts in throughput_prompts(per_client).items():
                out[name].append(load_clients(server.url, prompts, clients, max_tokens))
                log(f"  serve {name}, {clients} clients: {out[name][-1]['tps']:.1f} tok/s")
    return out


# ---- the run ------------------------------------------------------------------------------------

def machine() -> dict:
    import platform

    cpu = platform.processor() or "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {"cpu": cpu, "cores": os.cpu_count(), "os": f"{platform.system()} {platform.release()}",
            "features": cpu_features()}


def main(argv: list[str]) -> int:
    if argv[:1] == ["score-probe"]:
        print(json.dumps(score_probe(argv[1], argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"a comma-separated subset of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="idle decode runs per engine and dtype (best of)")
    parser.add_argument("--busy-rounds", type=int, default=3, help="decode runs beside a busy process (median of)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--score-tokens", type=int, default=4096, help="the scored text's length (≥ 2,048)")
    parser.add_argument("--score-rounds", type=int, default=3)
    parser.add_argument("--serve-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 run each, 32 tokens, no busy rows, the bound measured once")
    parser.add_argument("--write", action="store_true", help="keep the section in benchmarks/RESULTS.md")
    parser.add_argument("--report-from", type=Path, metavar="JSON", help="write the section again from kept figures")
    args = parser.parse_args(argv)
    if args.report_from:
        R = json.loads(args.report_from.read_text(encoding="utf-8"))
        return emit(R, args)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    if only - set(SECTIONS):
        parser.error(f"--only takes {', '.join(SECTIONS)} (not {', '.join(sorted(only - set(SECTIONS)))})")
    if args.quick:
        args.rounds, args.busy_rounds, args.new_tokens, args.score_rounds = 1, 1, 32, 1
        only.discard("busy")
    if args.score_tokens < 2048:
        parser.error("--score-tokens: at least 2,048 (llama-perplexity needs two chunks of 1,024)")
    # a 15-minute run on a shared machine: shorter waits for idle CPUs than run.py's
    QUIET.patience, QUIET.budget, QUIET.retry_budget = 10.0, 60.0, 90.0
    needs = {"decode": "llama-bench", "busy": "llama-bench", "score": "llama-perplexity", "serve": "llama-server",
             "llama": "llama-bench"}
    try:  # only the tools this run uses (and llama-quantize, for the BF16 and Q8_0 files)
        llamacpp.build(tools=tuple(sorted({"llama-quantize"} | {needs[s] for s in only})))
    except llamacpp.Unavailable as e:
        log(f"versus_llamacpp: {e}")
        return 1
    from checkpoint import gpt2_small

    began = time.perf_counter()
    R: dict = {"loads": [], "args": {**vars(args), "only": args.only, "report_from": None},
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": machine(), "threads": os.cpu_count() or 1}

    def section(name: str) -> None:
        R["loads"].append((name, load1()))
        log(f"{name} ... (load average {R['loads'][-1][1]:.2f}, {time.perf_counter() - began:.0f} s)")

    section("start")
    R["llamacpp"] = {"version": llamacpp.version()}
    if "llama" in only:  # first: its files' page cache is dropped with GPT-2's
        R["llama"] = llama_bench.run_section(args, R["threads"])
    if not only - {"llama"}:
        return keep(R, args, began)
    folder = gpt2_small()
    ggufs = llamacpp.convert(folder)
    R["llamacpp"]["files"] = {t: str(p) for t, p in ggufs.items()}
    R["bytes"] = {"llama": {t: llamacpp.weight_bytes(p) for t, p in ggufs.items()},
                  "lmhead": probe("weight-bytes", str(folder), *llamacpp.LMHEAD_DTYPE.values())["bytes"]}
    R["dropped"] = drop_from_page_cache([folder / "model.safetensors", *ggufs.values()])
    points = [bandwidth.measure(probe)]
    if "decode" in only:
        section("decode")
        R["decode"] = decode(folder, ggufs, args.new_tokens, args.rounds, R["threads"], busy=False)
        if not args.quick:  # a smoke test measures the bound once
            points.append(bandwidth.measure(probe))
    if "busy" in only:
        section("busy")
        with Competitor():
            R["busy"] = decode(folder, ggufs, args.new_tokens, args.busy_rounds, R["threads"], busy=True)
    if "score" in only:
        section("score")
        R["score"] = score(folder, ggufs["F32"], args.score_tokens, args.score_rounds, R["threads"])
    if "serve" in only:
        section("serve")
        per_client = {1: 2, 4: 2, 16: 1} if args.quick else {1: 4, 4: 2, 16: 2}
        R["serve"] = serve(folder, ggufs["F32"], R["threads"], args.serve_tokens, per_client)
    if not args.quick:
        points.append(bandwidth.measure(probe))
    R["bandwidth"] = bandwidth.merge(points)
    section("end")
    return keep(R, args, began)


def keep(R: dict, args, began: float) -> int:
    """The run's figures kept in benchmarks/.cache (for --report-from), then its sections written."""
    R["elapsed_s"] = time.perf_counter() - began
    R["quiet"] = {k: v for k, v in vars(QUIET).items() if isinstance(v, (int, float))}
    kept = HERE / ".cache" / "measured-llamacpp.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(R), encoding="utf-8")
    log(f"figures kept in {kept}")
    return emit(R, args)


def emit(R: dict, args) -> int:
    """The run's sections, printed and written (into RESULTS.md with --write, else beside the kept
    figures). The GPT-2 section keeps the parts this run did not measure from the one in RESULTS.md."""
    results = HERE / "RESULTS.md"
    previous = section_in(results.read_text(encoding="utf-8")) if results.is_file() else None
    parts = ([(report(R, previous), BEGIN, END)] if "bytes" in R else []) + (
        [(llama_bench.report(R), llama_bench.BEGIN, llama_bench.END)] if "llama" in R else [])
    text = "\n".join(p for p, _, _ in parts)
    print(text)
    if args.write:
        for part, begin, end in parts:
            splice(results, part, begin, end)
        log("written into benchmarks/RESULTS.md")
    else:
        out = HERE / ".cache" / "RESULTS-llamacpp.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        log(f"written to {out} (--write puts it into benchmarks/RESULTS.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
