"""Structured output's cost (issue 49): lmhead's decoding rate under a JSON schema against its own free
decoding, in one process on random:gpt2 (GPT-2 124M's shapes, random weights: the real model's speed,
offline), alternating free and constrained runs so that both see the same machine.

Each run is one `Model.generate` of up to NEW_TOKENS tokens after the same prompt, greedy and sampled
(temperature 1, seeded); its steady rate is `decode_tokens_per_second` (tokens after the first over
the time after the first), the first token's time (the prompt's read, and the grammar's compile on
its first use) left out. The schema holds one free string, so the text can go on for as long as a
free one; a constrained run that ends sooner (the model closes the string and the object) counts
the tokens it made. Each round runs a free and a constrained generation back to back (their order
alternating between rounds), so the two see the same load; the ratio is the median over the rounds
of each pair's ratio, which a machine whose load drifts between rounds leaves alone (the rates
themselves, medians too, move with it).

The issue also asks for llama-server's `json_schema` rate on the same weights in the same run. That
needs llama.cpp built here (benchmarks/llamacpp.py build); where it is not, the row says "not run".

    python benchmarks/grammar_bench.py [--quick] [--write]   # --write: its section in RESULTS.md
"""

from __future__ import annotations

import argparse
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
BEGIN, END = "<!-- grammar: begin -->", "<!-- grammar: end -->"


def load() -> float:
    return os.getloadavg()[0]


def measure(quick: bool) -> dict:
    import lmhead_cli

    new_tokens, rounds = (32, 3) if quick else (48, 11)
    model = lmhead_cli.load("random:gpt2")
    modes = {"greedy": {"greedy": True}, "sampled": {"temperature": 1.0, "seed": 1}}
    model.generate(PROMPT, max_new_tokens=4, json_schema=SCHEMA, **modes["sampled"])  # compile and warm once
    runs: dict = {(m, c): [] for m in modes for c in ("free", "schema")}
    start_load = load()
    t0 = time.perf_counter()
    for r in range(rounds):
        for m, kw in modes.items():
            order = ("free", "schema") if r % 2 == 0 else ("schema", "free")
            for c in order:
                g = model.generate(PROMPT, max_new_tokens=new_tokens, **kw,
                                   **({"json_schema": SCHEMA} if c == "schema" else {})).reading
                runs[(m, c)].append({"rate": g.decode_tokens_per_second, "tokens": len(g.generated_ids),
                                     "stop": g.stop, "ids": g.generated_ids})
    out = {"quick": quick, "new_tokens": new_tokens, "rounds": rounds, "load_start": start_load, "load_end": load(),
           "seconds": time.perf_counter() - t0, "source": model.provenance.products, "modes": {}}
    for m in modes:
        free = statistics.median(x["rate"] for x in runs[(m, "free")])
        ruled = statistics.median(x["rate"] for x in runs[(m, "schema")])
        pairs = [b["rate"] / a["rate"] for a, b in zip(runs[(m, "free")], runs[(m, "schema")])]
        out["modes"][m] = {"free_tok_s": free, "schema_tok_s": ruled, "ratio": statistics.median(pairs),
                           "pair_ratios": pairs,
                           "schema_tokens": [x["tokens"] for x in runs[(m, "schema")]],
                           "free_runs": [x["rate"] for x in runs[(m, "free")]],
                           "schema_runs": [x["rate"] for x in runs[(m, "schema")]]}
    out["mask_us"] = mask_cost(model, runs[("sampled", "schema")][-1]["ids"])
    out["llama_server"] = llama_server_note()
    return out


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


def llama_server_note() -> str:
    """Why llama-server's json_schema rate is not in this run."""
    import llamacpp

    where = llamacpp.binary("llama-server")
    if where is None:
        return "not run: llama-server is not built on this machine (python benchmarks/llamacpp.py build)"
    return f"not run: {where} is built, but this script does not drive llama-server yet"


def report(r: dict) -> str:
    lines = [BEGIN, "## Structured output: a JSON schema's cost (benchmarks/grammar_bench.py)", "",
             f"random:gpt2 (GPT-2 124M's shapes, random weights), float32 on the CPU ({r['source']}), one process, "
             f"{r['rounds']} rounds of up to {r['new_tokens']} tokens, free and constrained runs alternating"
             f"{' (--quick)' if r['quick'] else ''}. The schema: one free string in an object "
             f"(`{json.dumps(SCHEMA)}`). Steady rate (tokens after the first per second after it), medians; the ratio "
             f"is the median of each round's constrained/free pair (run back to back). "
             f"Load average (1 min) {r['load_start']:.2f} at the start, {r['load_end']:.2f} at the end.", "",
             "| mode | free tok/s | JSON schema tok/s | ratio (median of pairs) | pairs, lowest-highest | target | "
             "tokens per constrained run |",
             "|---|---:|---:|---:|---|---|---|"]
    for m, x in r["modes"].items():
        ok = "✅" if x["ratio"] >= TARGET else "❌"
        lines.append(f"| {m} | {x['free_tok_s']:.1f} | {x['schema_tok_s']:.1f} | {x['ratio']:.3f}x | "
                     f"{min(x['pair_ratios']):.2f}-{max(x['pair_ratios']):.2f} | {ok} >= {TARGET}x | "
                     f"{', '.join(map(str, x['schema_tokens']))} |")
    lines += ["", f"The grammar's own work per step (llguidance's mask as a bool tensor over the 50,257 tokens, and "
                  f"the advance), replayed on a constrained run's tokens: {r['mask_us']:.0f} µs (best of 20 passes).",
              "", f"llama-server's `json_schema` on the same weights: {r['llama_server']}.", ""]
    return "\n".join(lines + [END]) + "\n"


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
