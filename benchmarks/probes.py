"""Measurements that run inside one fresh process each, started by benchmarks/run.py; each prints
one JSON line.

    python benchmarks/probes.py bandwidth
    python benchmarks/probes.py head FOLDER T REPEATS
    python benchmarks/probes.py head-forms FOLDER REPEATS
    python benchmarks/probes.py decode FOLDER PROMPT N DTYPE linear|gemv|blocked|-
    python benchmarks/probes.py step FOLDER STEPS
    python benchmarks/probes.py profile FOLDER DTYPE FORM|-   (torch.profiler over decoding steps)
    python benchmarks/probes.py side-by-side FOLDER THREADS ROUNDS SPEC...   (DTYPE:FORM or hf:DTYPE steps, alternating)
    python benchmarks/probes.py weight-bytes FOLDER DTYPE...
    python benchmarks/probes.py bfloat16-error FOLDER PROMPT
    python benchmarks/probes.py precision FOLDER DEVICE     (bfloat16 against float32 over 32 prompts)
    python benchmarks/probes.py imports ARGS...      (runs `lmhead ARGS`, reports heavy imports)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

MB = 1e6


def _times(fn, repeats: int) -> list[float]:
    fn()  # warm: page faults and first-call set-up are not what is measured here
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_time(fn, repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), 0 where it cannot be read."""
    from pathlib import Path

    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        try:
            n = int(text.rstrip("KMG"))
        except ValueError:
            continue
        best = max(best, n * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1))
    return best


def bandwidth(size_bytes: int | None = None, repeats: int = 15) -> dict:
    """Streaming memory bandwidth with torch's own kernels, over buffers far larger than the caches,
    on 1 thread and on all of torch's threads: the fastest of `repeats` passes, since other work can
    only slow a pass down and a bound should not be low.

    copy: bytes read plus bytes written per second (STREAM's convention); read: a sum, bytes read
    per second, which is what a matrix-vector product over weights has to do.
    """
    import torch

    # Far larger than the caches: a buffer the last-level cache holds would measure the cache.
    size_bytes = size_bytes or max(256 * 2**20, 2 * last_level_cache_bytes())
    n = size_bytes // 4
    a, b = torch.full((n,), 1.0), torch.full((n,), 2.0)  # written, so every page is really there
    threads = torch.get_num_threads()
    out = {"buffer_mb": size_bytes / MB, "threads": threads, "copy_gbs": 0.0, "read_gbs": 0.0}
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        copy = 2 * size_bytes / min(_times(lambda: b.copy_(a), repeats)) / 1e9
        read = size_bytes / min(_times(lambda: a.sum(), repeats)) / 1e9
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

    from lmhead_cli.loading.sources import load_model

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


def head_forms(folder: str, repeats: int) -> dict:
    """One position's head, three ways, on the tied E as the checkpoint stores it ([V, D] rows):
    lmhead's blocked product over views of E; F.linear(h, E), BLAS's gemv (transformers' head); and
    h @ Eᵀ over a [D, V] copy of E, the layout BLAS's gemv streams fastest (the copy's one-off cost,
    its memory, and the tie then holding by value only)."""
    import torch
    import torch.nn.functional as F

    from lmhead_cli.engine.products import rows_times
    from lmhead_cli.loading.sources import load_model

    eng = load_model(folder, device="cpu", dtype="float32", engine="lean").engine
    E = eng.head_weight  # (V, D), the same object as wte.weight
    h = eng.body(torch.tensor([[464, 8251, 319, 262, 3084]]))[:, -1, :]  # (1, D)
    start = time.perf_counter()
    Et = E.detach().t().contiguous()  # (D, V)
    copy_s = time.perf_counter() - start
    nbytes = E.numel() * E.element_size()
    forms = {"blocked": lambda: rows_times(E, h), "linear": lambda: F.linear(h, E), "copy": lambda: h @ Et}
    out = {"copy_s": copy_s, "copy_mb": nbytes / MB, "tied": eng.head_weight is eng.embedding_weight}
    times = {name: [] for name in forms}
    with torch.inference_mode():
        for _ in range(3):  # interleaved, so drift hits all three alike
            for name, fn in forms.items():
                times[name].append(_median_time(fn, repeats))
    for name in forms:
        t = statistics.median(times[name])
        out[name] = {"s": t, "gbs": nbytes / t / 1e9}
    return out


def decode(folder: str, prompt: str, n: int, dtype: str, form: str) -> dict:
    """Greedy decoding straight over the engine, timed as `lmhead greedy` times itself (prefill and
    every step, no warm-up; and the rate after the first token), with the product form `form`
    (engine/products.py) fixed on torch's thread count: nothing is chosen by timing."""
    import torch

    from lmhead_cli.loading.sources import load_model

    loaded = load_model(folder, device="cpu", dtype=dtype, engine="lean")
    eng = loaded.engine
    eng.use_form(form)
    ids = loaded.tokenizer.encode(prompt)
    out = []
    with torch.inference_mode():
        start = time.perf_counter()
        cache = eng.new_cache(1, len(ids) + n)
        x = torch.tensor([ids])
        for _ in range(n):
            token = eng.head(eng.body(x, cache)[:, -1:, :])[:, 0].argmax(-1)  # (1,)
            out.append(int(token))
            if len(out) == 1:
                first = time.perf_counter() - start
            x = token[:, None]
        elapsed = time.perf_counter() - start
    return {"generated_ids": out, "elapsed_s": elapsed, "first_token_s": first, "tokens_per_second": n / elapsed,
            "decode_tokens_per_second": (n - 1) / (elapsed - first)}


def step(folder: str, steps: int) -> dict:
    """Where one float32 decoding step's time goes (warm, after a 64-token prefill): the body on one
    new position, then the head on it, each with the bytes of weights it reads."""
    import torch

    from lmhead_cli.engine.lean import Conv1D
    from lmhead_cli.loading.sources import load_model

    eng = load_model(folder, device="cpu", dtype="float32", engine="lean").engine
    E = eng.head_weight
    head_bytes = E.numel() * E.element_size()
    body_bytes = sum(p.numel() * p.element_size() for name, p in eng.gpt.named_parameters()
                     if name.startswith(("h.", "ln_f.")))
    prompt = torch.randint(0, eng.vocab_size - 1, (1, 64), generator=torch.Generator().manual_seed(0))
    cache = eng.new_cache(1, 64 + steps + 8)
    h = eng.body(prompt, cache)[:, -1:]
    token = eng.head(h)[:, 0].argmax(-1)[:, None]
    body_t, head_t = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        h = eng.body(token, cache)
        t1 = time.perf_counter()
        token = eng.head(h)[:, 0].argmax(-1)[:, None]
        t2 = time.perf_counter()
        if i >= 3:  # the first steps fault the weights' pages in
            body_t.append(t1 - t0)
            head_t.append(t2 - t1)
    body, head = statistics.median(body_t), statistics.median(head_t)
    matrices = [m.weight for m in eng.gpt.h.modules() if isinstance(m, Conv1D)]
    sizes = [w.numel() * w.element_size() / MB for w in matrices]
    return {"body_s": body, "head_s": head, "body_gbs": body_bytes / body / 1e9, "head_gbs": head_bytes / head / 1e9,
            "body_mb": body_bytes / MB, "head_mb": head_bytes / MB, "matrices": len(matrices),
            "smallest_mb": min(sizes), "largest_mb": max(sizes)}


def profile_step(folder: str, dtype: str, form: str, steps: int = 20) -> dict:
    """torch.profiler over `steps` warm decoding steps (after a 64-token prefill) in `dtype` with the
    product form `form` on torch's thread count: each op's share of the time, the wall time per step,
    and how many ops one step dispatches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lmhead_cli.loading.sources import load_model

    eng = load_model(folder, device="cpu", dtype=dtype, engine="lean").engine
    if form != "-":
        eng.use_form(form)
    prompt = torch.randint(0, eng.vocab_size - 1, (1, 64), generator=torch.Generator().manual_seed(0))
    cache = eng.new_cache(1, 64 + 2 * steps + 8)
    token = eng.head(eng.body(prompt, cache)[:, -1:])[:, 0].argmax(-1)[:, None]
    for _ in range(steps):  # lays the weights out, faults the pages in
        token = eng.head(eng.body(token, cache))[:, 0].argmax(-1)[:, None]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            token = eng.head(eng.body(token, cache))[:, 0].argmax(-1)[:, None]
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {"dtype": dtype, "form": form, "threads": torch.get_num_threads(), "step_ms_profiled": wall * 1e3,
            "ops_per_step": sum(e.count for e in events) / steps,
            "top": [{"op": e.key, "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps,
                     "us_per_call": e.self_cpu_time_total / e.count} for e in top]}


BLOCK = 4  # side_by_side: steps per set-up per round


def side_by_side(folder: str, threads: int, rounds: int, specs: list[str]) -> dict:
    """Warm decoding steps of several set-ups in ONE process, alternating step by step (drift and other
    work hit all alike): each spec is DTYPE:FORM for lmhead's engine (FORM "-": the default) or
    hf:DTYPE for transformers' GPT2LMHeadModel stepping with its own KV cache, as generate() does.
    Each round runs BLOCK steps of each set-up in turn. Median seconds per step after a 16-token
    prompt, on `threads` threads, and the read bandwidth measured in the same process."""
    import torch
    from transformers import GPT2LMHeadModel

    from lmhead_cli.loading.sources import load_model

    torch.set_num_threads(threads)
    prompt = torch.randint(0, 50256, (1, 16), generator=torch.Generator().manual_seed(0))
    steppers = {}
    for spec in specs:
        kind, form = spec.split(":")
        if kind == "hf":
            model = GPT2LMHeadModel.from_pretrained(folder, dtype=getattr(torch, form)).eval()
            state = {"past": None, "x": prompt}

            def step(model=model, state=state):
                out = model(state["x"], past_key_values=state["past"], use_cache=True, logits_to_keep=1)
                state["past"], state["x"] = out.past_key_values, out.logits[:, -1].argmax(-1)[:, None]
        else:
            eng = load_model(folder, device="cpu", dtype=kind, engine="lean").engine
            if form != "-":
                eng.use_form(form)
            state = {"cache": eng.new_cache(1, 16 + BLOCK * rounds + 8), "x": prompt}

            def step(eng=eng, state=state):
                h = eng.body(state["x"], state["cache"])[:, -1:]
                state["x"] = eng.head(h)[:, 0].argmax(-1)[:, None]
        steppers[spec] = step
    times = {spec: [] for spec in specs}
    with torch.inference_mode():
        for step in steppers.values():
            for _ in range(3):  # prefill, then the lay-out step
                step()
        for _ in range(rounds):
            for spec, step in steppers.items():
                for i in range(BLOCK):  # a few steps each: a model small enough stays in the cache, as it
                    start = time.perf_counter()  # would decoding on its own; the first of a block is left out
                    step()
                    if i:
                        times[spec].append(time.perf_counter() - start)
    bw = bandwidth(repeats=5)
    return {"threads": threads, "rounds": rounds, "read_gbs": bw[f"read_gbs_{threads}"] if f"read_gbs_{threads}" in bw
            else bw["read_gbs"], "step_s": {k: statistics.median(v) for k, v in times.items()},
            "best_s": {k: min(v) for k, v in times.items()}}


def weight_bytes_per_token(folder: str, dtypes: list[str]) -> dict:
    """Bytes of weights one decoding step reads, per dtype: every matrix, bias and norm once, the head's
    matrix once (tied: E is read by the head; the embedding lookups read one row each, left out). One
    process for every dtype: the start-up is paid once."""
    from lmhead_cli.loading.sources import load_model

    out = {}
    for dtype in dtypes:
        eng = load_model(folder, device="cpu", dtype=dtype, engine="lean").engine
        lookups = {id(eng.gpt.wpe.weight)} | ({id(p) for p in eng.gpt.wte.parameters()} if not eng.tied else set())
        read = [p for p in eng.gpt.parameters() if id(p) not in lookups]  # parameters() counts a tied one once
        out[dtype] = sum(p.numel() * p.element_size() for p in read)
    return {"bytes": out}


def bfloat16_error(folder: str, prompt: str) -> dict:
    """How far each engine's bfloat16 last-position logits lie from float32 transformers', against the
    float32 gap between the two best tokens: why bfloat16 greedy ids part ways."""
    import torch
    from transformers import GPT2LMHeadModel

    from lmhead_cli.loading.sources import load_model

    lean = load_model(folder, device="cpu", dtype="bfloat16", engine="lean")
    ids = torch.tensor([lean.tokenizer.encode(prompt)])
    with torch.inference_mode():
        z = GPT2LMHeadModel.from_pretrained(folder).eval()(ids).logits[0, -1]
        z_hf = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.bfloat16).eval()(ids).logits[0, -1].float()
        z_lean = lean.engine.head(lean.engine.body(ids)[:, -1:])[0, 0].float()
    top2 = z.topk(2).values
    return {"gap": float(top2[0] - top2[1]), "hf_err": float((z_hf - z).abs().max()),
            "lean_err": float((z_lean - z).abs().max()), "lean_vs_hf": float((z_lean - z_hf).abs().max()),
            "top1": [int(z.argmax()), int(z_hf.argmax()), int(z_lean.argmax())]}


def precision(folder: str, device: str) -> dict:
    """bfloat16 against float32 on the fixed 32 prompts (benchmarks/prompts.py), for lmhead and for
    transformers: per prompt the KL divergence KL(p_float32 ‖ p_bfloat16) of the next-token
    distribution (nats) and whether the two agree on the top-1 token."""
    import torch
    from transformers import GPT2LMHeadModel

    from lmhead_cli.loading.sources import load_model
    from prompts import PRECISION_PROMPTS

    def lean(dtype):
        loaded = load_model(folder, device=device, dtype=dtype, engine="lean")
        return loaded.tokenizer, lambda ids: loaded.engine.head(loaded.engine.body(ids)[:, -1:])[0, 0]

    def hf(dtype):
        model = GPT2LMHeadModel.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
        return lambda ids: model(ids, logits_to_keep=1).logits[0, -1]

    tokenizer, lean32 = lean("float32")
    _, lean16 = lean("bfloat16")
    pairs = {"lmhead": (lean32, lean16), "transformers": (hf("float32"), hf("bfloat16"))}
    out = {}
    with torch.inference_mode():
        for name, (f32, b16) in pairs.items():
            kl, same = [], 0
            for text in PRECISION_PROMPTS:
                ids = torch.tensor([tokenizer.encode(text)], device=device)
                p = torch.log_softmax(f32(ids).float(), -1)  # (V,)
                q = torch.log_softmax(b16(ids).float(), -1)
                kl.append(float((p.exp() * (p - q)).sum()))
                same += int(p.argmax()) == int(q.argmax())
            out[name] = {"kl_mean": statistics.mean(kl), "kl_median": statistics.median(kl), "kl_max": max(kl),
                         "top1_same": same, "prompts": len(PRECISION_PROMPTS)}
    return out


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
    from lmhead_cli.engine.execution import own_process

    own_process()  # OpenMP's wait policy as the lmhead command sets it, before torch's import: every probe runs as lmhead runs
    what, rest = argv[0], argv[1:]
    if what == "bandwidth":
        result = bandwidth()
    elif what == "head":
        result = head(rest[0], int(rest[1]), int(rest[2]))
    elif what == "head-forms":
        result = head_forms(rest[0], int(rest[1]))
    elif what == "decode":
        result = decode(rest[0], rest[1], int(rest[2]), rest[3], rest[4])
    elif what == "step":
        result = step(rest[0], int(rest[1]))
    elif what == "side-by-side":
        result = side_by_side(rest[0], int(rest[1]), int(rest[2]), rest[3:])
    elif what == "profile":
        result = profile_step(rest[0], rest[1], rest[2])
    elif what == "weight-bytes":
        result = weight_bytes_per_token(rest[0], rest[1:])
    elif what == "bfloat16-error":
        result = bfloat16_error(rest[0], rest[1])
    elif what == "precision":
        result = precision(rest[0], rest[1])
    elif what == "imports":
        result = imports(rest)
    else:
        raise SystemExit(f"unknown probe {what!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
