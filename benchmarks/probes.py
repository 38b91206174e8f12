"""Measurements that run inside one fresh process each, started by benchmarks/run.py; each prints
one JSON line.

    python benchmarks/probes.py bandwidth
    python benchmarks/probes.py head FOLDER T REPEATS
    python benchmarks/probes.py layouts FOLDER REPEATS
    python benchmarks/probes.py decode FOLDER PROMPT N DTYPE LAYOUT
    python benchmarks/probes.py imports ARGS...      (runs `lmhead ARGS`, reports heavy imports)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

MB = 1e6


def _median_time(fn, repeats: int) -> float:
    fn()  # warm: page faults and first-call set-up are not what is measured here
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(size_bytes: int = 256 * 2**20, repeats: int = 15) -> dict:
    """Streaming memory bandwidth with torch's own kernels, over buffers far larger than the caches,
    on 1 thread and on all of torch's threads; the best of each is kept (a bound should not be low).

    copy: bytes read plus bytes written per second (STREAM's convention); read: a sum, bytes read
    per second, which is what a matrix-vector product over weights has to do.
    """
    import torch

    n = size_bytes // 4
    a, b = torch.randn(n), torch.randn(n)  # written, so every page is really there
    threads = torch.get_num_threads()
    out = {"buffer_mb": size_bytes / MB, "threads": threads, "copy_gbs": 0.0, "read_gbs": 0.0}
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        copy = 2 * size_bytes / _median_time(lambda: b.copy_(a), repeats) / 1e9
        read = size_bytes / _median_time(lambda: a.sum(), repeats) / 1e9
        out[f"copy_gbs_{t}"], out[f"read_gbs_{t}"] = copy, read
        out["copy_gbs"], out["read_gbs"] = max(out["copy_gbs"], copy), max(out["read_gbs"], read)
    torch.set_num_threads(threads)
    return out


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss_delta_mb(fn) -> float | None:
    """How far the resident set's high-water mark rises above its current size while fn runs.

    Resets the high-water mark first (Linux: write 5 to /proc/self/clear_refs); None if it can't."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _rss_kb("VmRSS")
    fn()
    return (_rss_kb("VmHWM") - base) * 1024 / MB


def head(folder: str, T: int, repeats: int) -> dict:
    """The head on the last position against the head on all T positions: time and peak memory."""
    import torch

    from lmhead_cli.sources import load_model

    eng = load_model(folder, device="cpu", dtype="float32", engine="lean").engine
    ids = torch.randint(0, eng.vocab_size - 1, (1, T), generator=torch.Generator().manual_seed(T))
    hidden = eng.body(ids)  # (1, T, D) after ln_f
    last = lambda: eng.head(hidden[:, -1:, :])  # noqa: E731 - (1, 1, V)
    full = lambda: eng.head(hidden)  # noqa: E731 - (1, T, V)
    out = {"T": T}
    for name, fn in (("last", last), ("full", full)):
        out[f"{name}_s"] = _median_time(fn, repeats)
        out[f"{name}_peak_mb"] = _peak_rss_delta_mb(fn)
        out[f"{name}_logits_mb"] = fn().numel() * 4 / MB
    return out


def layouts(folder: str, repeats: int) -> dict:
    """For each head layout: the load time, the extra memory, and one position's head time and GB/s."""
    import torch

    from lmhead_cli.sources import load_model

    rows = {}
    for layout in ("rows", "columns", "copy"):
        start = time.perf_counter()
        loaded = load_model(folder, device="cpu", dtype="float32", engine="lean", head_layout=layout)
        load_s = time.perf_counter() - start
        eng = loaded.engine
        h = eng.body(torch.tensor([[464, 8251, 319, 262, 3084]]))[:, -1:, :]  # (1, 1, D)
        t = _median_time(lambda: eng.head(h), repeats)
        w = eng.head_weight
        rows[layout] = {"load_s": load_s, "head_s": t, "head_gbs": w.numel() * w.element_size() / t / 1e9,
                        "extra_mb": loaded.tie.head_copy_bytes / MB, "same_object": loaded.tie.same_object}
        del loaded, eng, w, h
    return rows


def decode(folder: str, prompt: str, n: int, dtype: str, layout: str) -> dict:
    """Greedy decoding straight over the engine, timed like `lmhead greedy` (prefill and every step,
    no warm-up): a stand-in for the CLI while `lmhead greedy` does not exist."""
    import torch

    from lmhead_cli.sources import load_model

    loaded = load_model(folder, device="cpu", dtype=dtype, engine="lean", head_layout=layout)
    eng = loaded.engine
    ids = loaded.tokenizer.encode(prompt)
    out = []
    with torch.inference_mode():
        start = time.perf_counter()
        cache = eng.new_cache(1, len(ids) + n)
        x = torch.tensor([ids])
        for _ in range(n):
            token = eng.head(eng.body(x, cache)[:, -1:, :])[:, 0].argmax(-1)  # (1,)
            out.append(int(token))
            x = token[:, None]
        elapsed = time.perf_counter() - start
    return {"generated_ids": out, "elapsed_s": elapsed, "tokens_per_second": n / elapsed}


def weight_bytes_per_token(folder: str, dtype: str) -> dict:
    """Bytes of weights one decoding step reads: every matrix, bias and norm once, the head's matrix
    once (tied: E is read by the head; the embedding lookups read one row each, left out)."""
    from lmhead_cli.sources import load_model

    eng = load_model(folder, device="cpu", dtype=dtype, engine="lean").engine
    lookups = {id(eng.gpt.wpe.weight)} | ({id(eng.gpt.wte.weight)} if eng.gpt.wte.weight is not eng.head_weight else set())
    read = [p for p in eng.gpt.parameters() if id(p) not in lookups]  # parameters() counts a tied one once
    return {"bytes": sum(p.numel() * p.element_size() for p in read)}


IMPORT_PROBE_HEAVY = ("torch", "transformers", "torch._dynamo")


def imports(args: list[str]) -> dict:
    """Run `lmhead ARGS` in this process as `python -m lmhead_cli` would; report the heavy imports."""
    import contextlib
    import io
    import runpy

    sys.argv = ["lmhead", *args]
    code = 0
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_module("lmhead_cli", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code or 0
    return {"exit_code": code, "imported": [m for m in IMPORT_PROBE_HEAVY if m in sys.modules]}


def main(argv: list[str]) -> None:
    what, rest = argv[0], argv[1:]
    if what == "bandwidth":
        result = bandwidth()
    elif what == "head":
        result = head(rest[0], int(rest[1]), int(rest[2]))
    elif what == "layouts":
        result = layouts(rest[0], int(rest[1]))
    elif what == "decode":
        result = decode(rest[0], rest[1], int(rest[2]), rest[3], rest[4])
    elif what == "weight-bytes":
        result = weight_bytes_per_token(rest[0], rest[1])
    elif what == "imports":
        result = imports(rest)
    else:
        raise SystemExit(f"unknown probe {what!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
