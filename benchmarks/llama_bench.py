"""lmhead against llama.cpp on a Llama's GGUF files (issue 48): the section `versus_llamacpp.py --only
llama` runs and writes into benchmarks/RESULTS.md.

The files are benchmarks/llama_checkpoint.py's: a Llama with TinyLlama-1.1B's dimensions and random
weights, converted by llama.cpp's convert_hf_to_gguf.py and quantised by llama-quantize (Q4_K_M,
Q8_0). On each file, in fresh processes, alternating:

* decoding: `lmhead greedy --model FILE.gguf --json`'s steady rate (first new token to last) against
  `llama-bench -n N` (tg: one timed run of N tokens after its one-token warm-up);
* prompt reading: a 512-token prompt (BOS included) read by `lmhead greedy --max-new-tokens 1`, its
  tokens over the seconds to the first token, against `llama-bench -p 512` (pp512);
* peak resident memory of each process against the file's size; lmhead's runtime (torch, lmhead, the
  tokenizer) is the peak of the same command on a one-layer, 256-wide Llama of the same vocabulary,
  and the file's share is the peak less that.

Idle: the best of N; beside one busy process (harness.Competitor): the median of N (a run that failed
or outlasted BUSY_TIMEOUT_S counts as 0).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llama_checkpoint  # noqa: E402
import llamacpp  # noqa: E402
from harness import Competitor, lmhead, load1, log, run  # noqa: E402

BEGIN, END = "<!-- versus llama.cpp, llama: begin -->", "<!-- versus llama.cpp, llama: end -->"
TYPES = ("Q4_K_M", "Q8_0")
PROMPT = "The keys on the table"
PROMPT_TOKENS = 512  # llama-bench's pp512, BOS included
TARGET = 1.0  # the issue's: greedy decoding at least llama.cpp's tg
MEMORY_TARGET = 1.3  # the issue's: peak memory (beyond the runtime) at most 1.3× the file
BUSY_TIMEOUT_S = 300
RUNTIME = {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 4}  # the runtime's model: the same vocabulary, next to no weights


def prompt_text(folder: Path, n: int = PROMPT_TOKENS) -> str:
    """English-like words cut to n - 1 tokens of the checkpoint's own tokenizer (its BOS makes n)."""
    import score_bench
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok(score_bench.make_text(2 * n), add_special_tokens=False)["input_ids"]
    for cut in range(n - 1, n - 9, -1):  # a cut inside a word may read back otherwise
        text = tok.decode(ids[:cut])
        if len(tok(text, add_special_tokens=False)["input_ids"]) == n - 1:
            return text
    raise RuntimeError(f"could not cut a text of exactly {n - 1} tokens")


def lmhead_greedy(gguf: Path, prompt: str, n: int) -> dict:
    """`lmhead greedy --json` on the file in a fresh process: its decoding rate, its prompt's reading
    rate (prompt tokens ÷ seconds to the first token), its peak resident MB."""
    wall, peak, out = run(lmhead("greedy", prompt, "--model", str(gguf), "--max-new-tokens", str(n), "--ignore-eos",
                                 "--device", "cpu", "--json"))
    doc = json.loads(out)
    return {"tps": doc["decode_tokens_per_second"] if n > 1 else None, "prompt_tokens": len(doc["prompt_ids"]),
            "pps": len(doc["prompt_ids"]) / doc["first_token_s"], "peak_mb": peak, "wall_s": wall,
            "weights": doc["dtype"], "products": doc.get("products")}


def llama_bench(gguf: Path, n: int, p: int, threads: int, timeout: float | None = None) -> dict:
    """llama-bench tg{n} and pp{p} in one fresh process (-r 1: one timed run of each)."""
    cmd = [str(llamacpp.binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(p), "-n", str(n),
           "-r", "1", "-o", "json"]
    if timeout:
        cmd = ["timeout", str(int(timeout)), *cmd]
    try:
        wall, peak, out = run(cmd)
    except RuntimeError as e:
        return {"tps": None, "pps": None, "error": str(e).splitlines()[0][:200]}
    tests = json.loads(out)
    tg = next(t["avg_ts"] for t in tests if t["n_gen"] == n and t["n_prompt"] == 0)
    pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == p and t["n_gen"] == 0)
    return {"tps": tg, "pps": pp, "peak_mb": peak, "wall_s": wall}


def measure(files: dict[str, Path], prompt: str, n: int, rounds: int, threads: int, busy: bool) -> dict:
    """Each file `rounds` times: lmhead's decoding, lmhead's prompt reading, llama-bench, in turn."""
    runs = {t: {"lmhead": [], "lmhead_prompt": [], "llama": []} for t in files}
    for i in range(rounds):
        for t, gguf in files.items():
            runs[t]["lmhead"].append(lmhead_greedy(gguf, PROMPT, n))
            runs[t]["lmhead_prompt"].append(lmhead_greedy(gguf, prompt, 1))
            runs[t]["llama"].append(llama_bench(gguf, n, PROMPT_TOKENS, threads, BUSY_TIMEOUT_S if busy else None))
            r = {k: v[-1] for k, v in runs[t].items()}
            log(f"  llama {'busy' if busy else 'idle'} {i + 1}/{rounds} {t}: decode lmhead {r['lmhead']['tps']:.2f}, "
                f"llama.cpp {r['llama']['tps'] or float('nan'):.2f} tok/s; prompt lmhead {r['lmhead_prompt']['pps']:.1f}, "
                f"llama.cpp {r['llama']['pps'] or float('nan'):.1f} tok/s")
    return runs


def run_section(args, threads: int) -> dict:
    """Build (once) the files, then measure idle and, unless `args.quick`, beside a busy process."""
    folder = llama_checkpoint.checkpoint()
    files = llama_checkpoint.ggufs(folder, TYPES)
    runtime = llama_checkpoint.ggufs(llama_checkpoint.checkpoint(folder.with_name(folder.name + "-runtime"),
                                                                 RUNTIME, tokenizer=folder), ("Q8_0",))["Q8_0"]
    prompt = prompt_text(folder)
    R = {"files": {t: {"path": str(p), "bytes": p.stat().st_size} for t, p in files.items()}, "loads": []}
    R["loads"].append(("llama idle", load1()))
    R["runtime_mb"] = min(lmhead_greedy(runtime, PROMPT, 8)["peak_mb"] for _ in range(2 if args.quick else 3))
    R["idle"] = measure(files, prompt, args.new_tokens, args.rounds, threads, busy=False)
    if not args.quick:
        R["loads"].append(("llama busy", load1()))
        with Competitor():
            R["busy"] = measure(files, prompt, args.new_tokens, args.busy_rounds, threads, busy=True)
    return R


# ---- the report ---------------------------------------------------------------------------------

def summary(xs: list[float | None], busy: bool) -> float | None:
    xs = [x or 0.0 for x in xs]
    return (statistics.median(xs) if busy else max(xs)) if xs else None


def _ratio(ours, theirs, target: float = TARGET) -> str:
    if not ours or not theirs:
        return "n/a"
    return f"{'✅' if ours / theirs >= target else '❌'} {ours / theirs:.2f}×"


def _f(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def report(R: dict) -> str:
    """The llama section's markdown (between BEGIN and END) from versus_llamacpp.py's run `R`, whose
    "llama" figures `run_section` measured."""
    L, args, threads, m = R["llama"], R["args"], R["threads"], R["machine"]
    idle, busy = L["idle"], L.get("busy")
    loads = ", ".join(f"{k} {v:.2f}" for k, v in L["loads"])
    lines = [BEGIN, "## Against llama.cpp: a Llama of TinyLlama's shapes at Q4_K_M and Q8_0", "",
             f"Written by `python benchmarks/versus_llamacpp.py{' --write' if args.get('write') else ''} --only "
             f"{args.get('only') or ','.join(('decode', 'busy', 'score', 'serve', 'llama'))}"
             f"{' --quick' if args.get('quick') else ''}` on {R['date']}. llama.cpp: {R['llamacpp']['version']}. "
             f"Machine: {m['cpu']}, {m['cores']} cores ({m.get('features')}); {m['os']}; lmhead with its defaults, "
             f"llama.cpp with -t {threads}.", "",
             "A `LlamaForCausalLM` with TinyLlama-1.1B's dimensions (22 layers, 2,048 wide, 32 heads, 4 key/value "
             "heads, a 5,632-wide MLP, 32,000 tokens) and random weights, saved by transformers with a SentencePiece "
             "tokenizer trained by `sentencepiece`, converted by llama.cpp's convert_hf_to_gguf.py to F16 and "
             "quantised by llama-quantize (benchmarks/llama_checkpoint.py). Decoding: `lmhead greedy --model "
             f"FILE.gguf --json`'s steady rate over {args['new_tokens']} new tokens against `llama-bench -n "
             f"{args['new_tokens']} -t {threads}` (tg{args['new_tokens']}). Prompt reading: a {PROMPT_TOKENS}-token "
             "prompt (BOS included) over lmhead's seconds to its first token, against llama-bench's "
             f"pp{PROMPT_TOKENS}. Fresh processes, alternating; idle the best of {args['rounds']}"
             + (f", beside one busy process the median of {args['busy_rounds']}" if busy else "")
             + f". Load average (1 min) at the start: {loads}.", "",
             "| file | size | idle: lmhead | idle: llama.cpp | idle ratio | busy: lmhead | busy: llama.cpp | busy ratio "
             "| prompt: lmhead | prompt: llama.cpp (pp512) | prompt ratio | all decode runs (tok/s): lmhead; llama.cpp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t, r in idle.items():
        ours, theirs = summary([x["tps"] for x in r["lmhead"]], False), summary([x["tps"] for x in r["llama"]], False)
        b = busy.get(t) if busy else None
        b_ours = summary([x["tps"] for x in b["lmhead"]], True) if b else None
        b_theirs = summary([x["tps"] for x in b["llama"]], True) if b else None
        p_ours = summary([x["pps"] for x in r["lmhead_prompt"]], False)
        p_theirs = summary([x["pps"] for x in r["llama"]], False)
        runs = "; ".join(", ".join(_f(x["tps"]) for x in r[k]) for k in ("lmhead", "llama"))
        lines.append(f"| {t} | {L['files'][t]['bytes'] / 1e6:,.0f} MB | {_f(ours)} tok/s | {_f(theirs)} tok/s | "
                     f"{_ratio(ours, theirs)} | {_f(b_ours)} tok/s | {_f(b_theirs)} tok/s | {_ratio(b_ours, b_theirs)} | "
                     f"{_f(p_ours, '.1f')} tok/s | {_f(p_theirs, '.1f')} tok/s | {_ratio(p_ours, p_theirs)} | {runs} |")
    lines += ["", f"Peak resident memory (the most of any idle run; lmhead's runtime alone: {L['runtime_mb']:,.0f} MB, "
              "the same command on a one-layer, 256-wide Llama of the same vocabulary):", "",
              "| file | size | lmhead peak | lmhead peak − runtime | ÷ file | llama-bench peak | ÷ file |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for t, r in idle.items():
        size = L["files"][t]["bytes"] / 1e6
        ours = max(x["peak_mb"] for x in r["lmhead"] + r["lmhead_prompt"])
        theirs = max((x["peak_mb"] for x in r["llama"] if x.get("peak_mb")), default=None)
        own = ours - L["runtime_mb"]
        lines.append(f"| {t} | {size:,.0f} MB | {ours:,.0f} MB | {own:,.0f} MB | "
                     f"{'✅' if own <= MEMORY_TARGET * size else '❌'} {own / size:.2f}× | {_f(theirs, ',.0f')} MB | "
                     f"{_f(theirs and theirs / size)}× |")
    weights = {t: r["lmhead"][0]["weights"] for t, r in idle.items()}
    products = {t: r["lmhead"][0]["products"] for t, r in idle.items()}
    lines += ["", "lmhead held the weights as " + "; ".join(f"{t}: {weights[t]}, products: {products[t]}"
                                                          for t in idle) + ".",
              "", f"Targets (issue 48): greedy decoding ≥ {TARGET:.1f}× llama-bench's tg, idle and busy; peak memory "
              f"beyond the runtime ≤ {MEMORY_TARGET}× the file; ❌ marks a shortfall. Prompt reading is reported.", END]
    return "\n".join(lines) + "\n"
