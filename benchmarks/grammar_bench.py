"""Structured output's cost (issue 49): lmhead's decoding rate under a JSON schema against its own free
decoding, in one process on the benchmark's checkpoint (random:gpt2's shapes, GPT-2 124M, with seeded random
weights: the real model's speed, offline; a folder, so that llama-server can read the same weights as GGUF),
alternating free and constrained runs so that both see the same machine.

Each run is one `Model.generate` of up to NEW_TOKENS tokens after the same prompt, greedy and sampled
(temperature 1, seeded); its steady rate is `decode_tokens_per_second` (tokens after the first over
the time after the first), the first token's time (the prompt's read, and the grammar's compile on
its first use) left out. The schema holds one free string, so the text can go on for as long as a
free one; a constrained run that ends sooner (the model closes the string and the object) counts
the tokens it made. Each round runs a free and a constrained generation back to back (their order
alternating between rounds), so the two see the same load; the ratio is the median over the rounds
of each pair's ratio, which a machine whose load drifts between rounds leaves alone (the rates
themselves, medians too, move with it).

llama-server runs in the same rounds on the same weights: the benchmark's checkpoint (benchmarks/checkpoint.py:
GPT-2 124M's shapes, seeded random weights), which lmhead reads from its folder and llama-server from its F32
GGUF (benchmarks/llamacpp.py convert), started as versus_llamacpp.py starts it (its Server, `-t 2`, one
slot). Each of its runs is one /completion request of the same prompt, free or with the same schema as its
`json_schema` field (llama.cpp's own schema-to-grammar), greedy (temperature 0) or sampled (temperature 1,
seed 1, its top-k/top-p/min-p off); its rate is its own `timings.predicted_per_second`. Its ratios are
medians of per-round pairs too. Where llama.cpp is not built (benchmarks/llamacpp.py build) its rows say
"not run".

    python benchmarks/grammar_bench.py [--quick] [--write]   # --write: its section in RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PROMPT = "The keys on the table"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["story"],
          "properties": {"story": {"type": "string"}}}
TARGET = 0.85  # constrained rate / free rate, each mode
TARGET_LLAMA = 1.0  # lmhead's constrained rate / llama-server's constrained rate, each mode
THREADS = 2
BEGIN, END = "<!-- grammar: begin -->", "<!-- grammar: end -->"


def load() -> float:
    return os.getloadavg()[0]


def measure(quick: bool) -> dict:
    import lmhead_cli

    from checkpoint import gpt2_small

    new_tokens, rounds = (32, 3) if quick else (48, 11)
    folder = gpt2_small()
    model = lmhead_cli.load(str(folder), device="cpu")
    modes = {"greedy": {"greedy": True}, "sampled": {"temperature": 1.0, "seed": 1}}
    model.generate(PROMPT, max_new_tokens=4, json_schema=SCHEMA, **modes["sampled"])  # compile and warm once
    runs: dict = {(e, m, c): [] for e in ("lmhead", "llama") for m in modes for c in ("free", "schema")}
    with contextlib.ExitStack() as stack:
        server, note = llama_server(folder, stack)
        start_load = load()
        t0 = time.perf_counter()
        for r in range(rounds):
            for m, kw in modes.items():
                order = ("free", "schema") if r % 2 == 0 else ("schema", "free")
                for c in order:
                    g = model.generate(PROMPT, max_new_tokens=new_tokens, **kw,
                                       **({"json_schema": SCHEMA} if c == "schema" else {})).reading
                    runs[("lmhead", m, c)].append({"rate": g.decode_tokens_per_second,
                                                   "tokens": len(g.generated_ids), "ids": g.generated_ids})
                for c in order if server else ():
                    runs[("llama", m, c)].append(llama_run(server, m, c == "schema", new_tokens))
        out = {"quick": quick, "new_tokens": new_tokens, "rounds": rounds, "load_start": start_load,
               "load_end": load(), "seconds": time.perf_counter() - t0, "source": model.provenance.products,
               "threads": THREADS, "modes": {}, "llama_server": note}
    for m in modes:
        out["modes"][m] = {**rates(runs, "lmhead", m), "llama": rates(runs, "llama", m) if server else None}
        if server:
            out["modes"][m]["versus_llama"] = statistics.median(
                a["rate"] / b["rate"] for a, b in zip(runs[("lmhead", m, "schema")], runs[("llama", m, "schema")]))
    out["mask_us"] = mask_cost(model, runs[("lmhead", "sampled", "schema")][-1]["ids"])
    return out


def rates(runs: dict, engine: str, m: str) -> dict:
    """One engine's free and constrained rates in one mode (medians) and their ratio (median of the pairs)."""
    free, ruled = runs[(engine, m, "free")], runs[(engine, m, "schema")]
    pairs = [b["rate"] / a["rate"] for a, b in zip(free, ruled)]
    return {"free_tok_s": statistics.median(x["rate"] for x in free),
            "schema_tok_s": statistics.median(x["rate"] for x in ruled), "ratio": statistics.median(pairs),
            "pair_ratios": pairs, "schema_tokens": [x["tokens"] for x in ruled],
            "free_runs": [x["rate"] for x in free], "schema_runs": [x["rate"] for x in ruled]}


def mask_cost(model, ids: list[int], repeats: int = 20) -> float:
    """Microseconds per step of the grammar's own work (the mask as a (V,) bool tensor, then the advance on
    the chosen token), replaying a constrained run's tokens on a fresh matcher: best of `repeats` passes."""
    from lmhead_cli.decoding.grammar import Matcher, from_json_schema

    grammar, best = from_json_schema(SCHEMA), float("inf")
    V, eos = model.loaded.engine.vocab_size, model.eos_token_id
    for _ in range(repeats):
        m = Matcher(grammar, model.tokenizer, V, eos)
        start = time.perf_counter()
        for t in ids:
            m.allowed()
            if t != eos:
                m.advance(t)
        best = min(best, (time.perf_counter() - start) / len(ids) * 1e6)
    return best


def llama_server(folder: Path, stack: contextlib.ExitStack):
    """llama-server on the checkpoint's F32 GGUF, started as versus_llamacpp.py starts it and stopped when
    `stack` closes, after one warm-up request of each kind; (None, why not) where llama.cpp is not built."""
    import llamacpp
    from versus_llamacpp import Server, free_port

    where = llamacpp.binary("llama-server")
    if where is None:
        return None, "not run: llama-server is not built on this machine (python benchmarks/llamacpp.py build)"
    try:
        gguf = llamacpp.convert(folder)["F32"]
    except llamacpp.Unavailable as e:
        return None, f"not run: {e}"
    port = free_port()
    server = stack.enter_context(Server([str(where), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                         "-t", str(THREADS), "-np", "1", "-c", "1024"], port))
    for schema in (False, True):
        llama_run(server, "sampled", schema, 4)
    return server, f"{gguf.name}, `llama-server -t {THREADS} -np 1 -c 1024`, {llamacpp.version()}"


def llama_run(server, mode: str, schema: bool, new_tokens: int) -> dict:
    """One /completion request: its decode rate (`timings.predicted_per_second`) and tokens made."""
    import httpx

    body = {"prompt": PROMPT, "n_predict": new_tokens, "cache_prompt": False,
            **({"temperature": 0} if mode == "greedy" else
               {"temperature": 1.0, "seed": 1, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
            **({"json_schema": SCHEMA} if schema else {})}
    r = httpx.post(server.url + "/completion", json=body, timeout=600)
    r.raise_for_status()
    t = r.json()["timings"]
    return {"rate": float(t["predicted_per_second"]), "tokens": int(t["predicted_n"]), "text": r.json()["content"]}


def report(r: dict) -> str:
    lines = [BEGIN, "## Structured output: a JSON schema's cost (benchmarks/grammar_bench.py)", "",
             f"The benchmark's checkpoint (GPT-2 124M's shapes, seeded random weights), float32 on the CPU "
             f"({r['source']}), one process, {r['rounds']} rounds of up to {r['new_tokens']} tokens, free and "
             f"constrained runs alternating{' (--quick)' if r['quick'] else ''}. The schema: one free string in an "
             f"object (`{json.dumps(SCHEMA)}`). Steady rate (tokens after the first per second after it), medians; "
             f"the ratio is the median of each round's constrained/free pair (run back to back). "
             f"Load average (1 min) {r['load_start']:.2f} at the start, {r['load_end']:.2f} at the end.", "",
             "| mode | free tok/s | JSON schema tok/s | ratio (median of pairs) | pairs, lowest-highest | target | "
             "tokens per constrained run |",
             "|---|---:|---:|---:|---|---|---|"]
    for m, x in r["modes"].items():
        lines.append(f"| {m} | {x['free_tok_s']:.1f} | {x['schema_tok_s']:.1f} | {x['ratio']:.3f}x | "
                     f"{min(x['pair_ratios']):.2f}-{max(x['pair_ratios']):.2f} | {mark(x['ratio'], TARGET)} | "
                     f"{', '.join(map(str, x['schema_tokens']))} |")
    lines += ["", f"The grammar's own work per step (llguidance's mask as a bool tensor over the 50,257 tokens, and "
                  f"the advance), replayed on a constrained run's tokens: {r['mask_us']:.0f} µs (best of 20 passes).",
              "", "### Against llama-server's `json_schema`, same weights, same rounds", ""]
    if not any(x["llama"] for x in r["modes"].values()):
        return "\n".join(lines + [f"llama-server: {r['llama_server']}.", "", END]) + "\n"
    lines += [f"llama-server: {r['llama_server']}; its rate is its own `timings.predicted_per_second`, its run "
              f"after lmhead's in each round. lmhead / llama-server is the median of each round's pair of "
              f"constrained rates.", "",
              "| mode | llama-server free tok/s | llama-server JSON schema tok/s | its schema/free (median of pairs) | "
              "its runs, lowest-highest (free; schema) | lmhead schema / llama-server schema | target |",
              "|---|---:|---:|---:|---|---:|---|"]
    for m, x in r["modes"].items():
        y = x["llama"]
        lines.append(f"| {m} | {y['free_tok_s']:.1f} | {y['schema_tok_s']:.1f} | {y['ratio']:.3f}x | "
                     f"{span(y['free_runs'])}; {span(y['schema_runs'])} | {x['versus_llama']:.3f}x | "
                     f"{mark(x['versus_llama'], TARGET_LLAMA)} |")
    return "\n".join(lines + ["", END]) + "\n"


def span(rates: list[float]) -> str:
    return f"{min(rates):.1f}-{max(rates):.1f}"


def mark(ratio: float, target: float) -> str:
    return f"{'✅' if ratio >= target else '❌'} >= {target}x"


def main() -> None:
    from harness import print_section

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write", action="store_true", help="keep the section in benchmarks/RESULTS.md")
    args = ap.parse_args()
    res = measure(args.quick)
    print_section(res, report(res), args.write, BEGIN, END)


if __name__ == "__main__":
    main()
