"""The markdown of versus_llamacpp.py's GPT-2 section ("Against llama.cpp") in benchmarks/RESULTS.md,
and how a run of some of its parts (`--only`) keeps the others from the section already there.

The section has three parts, each under its own heading: greedy decoding (idle and busy columns of one
table), scoring and serving. A run writes the parts it measured; each part it did not measure is
taken, text and figures as they are, from the previous section, under a line naming the run that
measured it (its command, date, load and read bandwidth), so that no older part reads as new. The
previous section comes from RESULTS.md itself (committed), not from benchmarks/.cache (which a fresh
clone lacks).
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llamacpp  # noqa: E402

PROMPT = "The keys on the table"
TARGET = 1.0  # lmhead ≥ 1.0× llama.cpp in every row
BEGIN, END = "<!-- versus llama.cpp: begin -->", "<!-- versus llama.cpp: end -->"
BUSY_TIMEOUT_S = 150  # a llama-bench run beside the spin loop has taken 75 s (1.7 tok/s); past this it counts as failed
PARTS = {"decode": "### Greedy decoding", "score": "### Scoring", "serve": "### Serving"}  # in the section's order
PART_NAMES = {"decode": "greedy decoding", "score": "scoring", "serve": "serving"}
KEPT_PART = "Kept from an earlier run (this run did not measure it): "
KEPT_COLUMNS = "The {} are kept from an earlier run (this run did not measure them): "
KEPT_TAIL = KEPT_COLUMNS[6:]
IDLE_CELLS, BUSY_CELLS = (2, 3, 4, 9, 10, 11), (5, 6, 7)  # the decoding table's columns of each kind of run
IDLE_KEPT, BUSY_KEPT = "idle columns and the check of the bound", "busy columns"


def listed(xs: list[str]) -> str:
    return ", ".join(xs[:-1]) + " and " + xs[-1] if len(xs) > 1 else "".join(xs)


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def ratio_cell(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "n/a" if ours is None or theirs is None else ("∞" if not theirs else "0.00×")
    x = ours / theirs
    return f"{'✅' if x >= TARGET else '❌'} {x:.2f}×"


def summary(samples: list[float | None], busy: bool) -> float | None:
    """Idle: the best run; busy: the median (a failed llama.cpp run counts as 0 tok/s)."""
    xs = [x or 0.0 for x in samples]
    if not xs:
        return None
    return statistics.median(xs) if busy else max(xs)


# ---- the previous section -----------------------------------------------------------------------

def section_in(text: str, begin: str = BEGIN, end: str = END) -> str | None:
    """The section between `begin` and `end` (the llama.cpp one by default) held in a RESULTS.md text,
    markers included; None if it holds none."""
    if begin not in text or end not in text:
        return None
    return begin + text.split(begin, 1)[1].split(end, 1)[0] + end + "\n"


def splice(results_md: Path, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Put the section into RESULTS.md in place of the previous one between the same markers (or at the end)."""
    text = results_md.read_text(encoding="utf-8") if results_md.is_file() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    results_md.write_text(text, encoding="utf-8")


def parts_in(section: str) -> tuple[str, dict[str, str]]:
    """A written section's run (its command and date, load and read bandwidth, as a kept part names it)
    and its parts' text by name (heading to the line before the next heading or the targets)."""
    body = section.split(BEGIN, 1)[-1].split(END, 1)[0]
    head, *chunks = re.split(r"(?m)^(?=### )", body)
    parts = {}
    for chunk in chunks:
        name = next((n for n, h in PARTS.items() if chunk.startswith(h)), None)
        if name:
            parts[name] = chunk.split("\nTargets: ", 1)[0].strip("\n")
    written = re.search(r"Written by (`[^`]+`) on ([^,]+),", head)
    origin = f"{written[1]} on {written[2]}" if written else "a run whose command and date the section did not state"
    loads = re.search(r"load average \(1 min\) at the start of each section: (.+?) \(on", head)
    bw = re.search(r"\*\*([\d.]+ GB/s)\*\*", head)
    said = [f"load average (1 min) at the start of its sections: {loads[1]}"] if loads else []
    said += [f"read bandwidth {bw[1]}"] if bw else []
    return origin + (f" ({'; '.join(said)})" if said else ""), parts


def origin_of(text: str, lead: str, default: str) -> str:
    """The run a kept part (or kept columns) came from, as the line beginning `lead` names it; `default`
    where the text has no such line (the part was measured by the run that wrote its section)."""
    line = next((x for x in text.splitlines() if x.startswith(lead)), None)
    return line[len(lead):].rstrip(".") if line else default


def kept_part(text: str, origin: str) -> str:
    """A part of the previous section, under a line naming its run (once: a part kept again keeps its line)."""
    if KEPT_PART in text:
        return text
    heading, _, rest = text.partition("\n")
    return f"{heading}\n\n{KEPT_PART}{origin}.\n{rest}"


def table_rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The decoding table's cells by (lmhead dtype, llama.cpp type)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 12 and cells[0] != "lmhead":
            rows[(cells[0], cells[1])] = cells
    return rows


# ---- the section --------------------------------------------------------------------------------

def report(R: dict, previous: str | None = None) -> str:
    """The GPT-2 section's markdown from a run's figures `R`; with `previous` (the section now in
    RESULTS.md), the parts this run did not measure are that section's, each said to be from its run."""
    origin, old = parts_in(previous) if previous else ("", {})
    parts: dict[str, list[str]] = {}
    ran = []
    if R.get("decode") or R.get("busy"):
        parts["decode"] = decoding(R, old.get("decode"), origin)
        ran.append("greedy decoding" + ("" if R.get("decode") and R.get("busy") else
                                        " idle" if R.get("decode") else " beside a busy process"))
    for name, part in (("score", scoring), ("serve", serving)):
        if R.get(name):
            parts[name] = part(R)
            ran.append(PART_NAMES[name])
    kept = [PART_NAMES[name] for name in PARTS if name not in parts and name in old]
    if any(KEPT_TAIL in line for line in parts.get("decode", [])):
        kept.insert(0, f"greedy decoding's {BUSY_KEPT if R.get('decode') else IDLE_KEPT}")
    lines = header(R)
    if kept:  # said where the run is named, not only under each heading
        lines[3] += (f" This run measured {listed(ran) or 'no part'}; {listed(kept)} "
                     f"{'is' if len(kept) == 1 else 'are'} kept from earlier runs of this script, each under a "
                     "line naming its run (command, date, load and read bandwidth). The machine, load and "
                     "bandwidth below are this run's.")
    for name in PARTS:
        if name in parts:
            lines += ["", *parts[name]]
        elif name in old:
            lines += ["", kept_part(old[name], origin)]
    lines += ["", f"Targets: lmhead ≥ {TARGET:.1f}× llama.cpp in every row (decode idle and busy, score, serve at "
              "16 clients, and a lone request's first token: llama-server's time over lmhead's); ❌ marks a "
              "shortfall.", END]
    return "\n".join(lines) + "\n"


def header(R: dict) -> list[str]:
    m, args, bw = R["machine"], R["args"], R.get("bandwidth")
    loads = ", ".join(f"{k} {v:.2f}" for k, v in R["loads"])
    lines = [
        BEGIN,
        "## Against llama.cpp",
        "",
        f"Written by `python benchmarks/versus_llamacpp.py{' --write' if args.get('write') else ''}"
        f"{' --only ' + args['only'] if args.get('only') else ''}{' --quick' if args.get('quick') else ''}` on "
        f"{R['date']}, in {R['elapsed_s'] / 60:.1f} min (llama.cpp's build not counted). llama.cpp: "
        f"{R['llamacpp']['version']}, built by benchmarks/llamacpp.py (Release, GGML_NATIVE), the checkpoint "
        "converted by its convert_hf_to_gguf.py into F32, then by llama-quantize into BF16 and Q8_0.",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores ({m.get('features', 'instruction set not recorded')}); {m['os']}; lmhead with its defaults (threads chosen by "
        f"timing), llama.cpp with -t {R['threads']}",
        f"- load average (1 min) at the start of each section: {loads} (on {m['cores']} cores). Before each "
        f"measured process the run waited for idle CPUs (it waited {R['quiet']['waited_s']:.0f} s in all) and "
        f"took a disturbed measurement again ({R['quiet']['repeated']} taken again, {R['quiet']['noisy']} kept "
        "although disturbed)",
        "- page cache: " + (f"{', '.join(R['dropped'])} dropped from it before the first section (each engine "
                            "then reads its own file into it its own way, as after a reboot; engine/pages.py)"
                            if R.get("dropped") else "as found (nothing dropped)"),
    ]
    if bw:
        best = f"{bw['method']}, {bw['threads']} thread{'s' if bw['threads'] > 1 else ''}"
        lines.append(
            f"- read bandwidth (benchmarks/bandwidth.py, {bw['buffer_mb']:.0f} MB buffer, the fastest pass of each "
            f"method at {bw['points']} point{'s' if bw['points'] > 1 else ''} of the run): **{bw['read_gbs']:.1f} GB/s** ({best}); 1 thread "
            f"{bw['read_gbs_1']:.1f} GB/s ({bw['method_1']}). Every method: "
            + ", ".join(f"{x['method']} ×{x['threads']} {x['gbs']:.1f}" for x in bw["methods"])
            + ("" if bw["compiled"] else " (no C compiler: the compiled read was left out)"))
    return lines


def decoding(R: dict, old: str | None, origin: str) -> list[str]:
    """The decoding part. A run of only idle (or only busy) decoding keeps the other kind's columns
    from the previous section's table, row by row, and says from which run."""
    args, bw = R["args"], R.get("bandwidth")
    dec, busy = R.get("decode") or {}, R.get("busy") or {}
    lines = ["### Greedy decoding", "",
             f"{args['new_tokens']} new tokens: `lmhead greedy --json`'s steady rate (first new token to last, "
             f"after the {len(PROMPT.split())}-word prompt, end-of-text ignored) against `llama-bench -p 0 -n "
             f"{args['new_tokens']} -r 1 -t {R['threads']}` (tg{args['new_tokens']}: one timed run of "
             f"{args['new_tokens']} tokens after its one-token warm-up), fresh processes, alternating. "
             "Idle: the best of "
             f"{args['rounds']}; beside one busy process (`python -c 'while True: pass'`): the median of "
             f"{args['busy_rounds']} (a llama-bench run that had not ended after {BUSY_TIMEOUT_S} s counts "
             "as 0). The bound: the weight bytes one step reads ÷ the read bandwidth above; lmhead's bytes as "
             "benchmarks/probes.py weight-bytes counts them, llama.cpp's from the GGUF file (every tensor "
             "but position_embd; tied, token_embd is the head).",
             "",
             "| lmhead | llama.cpp | idle: lmhead | idle: llama.cpp | idle ratio | busy: lmhead | busy: "
             "llama.cpp | busy ratio | bytes / token (lmhead, llama.cpp) | lmhead, fraction of bound | "
             "llama.cpp, fraction of bound | all runs (tok/s): lmhead; llama.cpp |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    old_rows = table_rows(old) if old else {}
    keep = (BUSY_CELLS, BUSY_KEPT) if not busy else (IDLE_CELLS, IDLE_KEPT) if not dec else ((), "")
    kept_any = False
    for t in dict.fromkeys([*dec, *busy]):
        dtype = llamacpp.LMHEAD_DTYPE[t]
        pair, b = dec.get(t), busy.get(t)
        ours = summary([r["tps"] for r in pair["lmhead"]], False) if pair else None
        theirs = summary([r["tps"] for r in pair["llama"]], False) if pair else None
        b_ours = summary([r["tps"] for r in b["lmhead"]], True) if b else None
        b_theirs = summary([r["tps"] for r in b["llama"]], True) if b else None
        nb_ours, nb_theirs = R["bytes"]["lmhead"].get(dtype), R["bytes"]["llama"][t]["bytes"]

        def frac(tps, nb):
            return fmt(tps * nb / (bw["read_gbs"] * 1e9), ".2f") if bw and tps and nb else "n/a"

        runs = "; ".join(", ".join(fmt(r["tps"]) for r in pair[k]) for k in ("lmhead", "llama")) if pair else "n/a"
        cells = [dtype, t, fmt(ours), fmt(theirs), ratio_cell(ours, theirs) if pair else "n/a", fmt(b_ours),
                 fmt(b_theirs), ratio_cell(b_ours, b_theirs) if b else "n/a",
                 f"{nb_ours / 1e6:.0f} MB, {nb_theirs / 1e6:.0f} MB", frac(ours, nb_ours), frac(theirs, nb_theirs), runs]
        was = old_rows.get((dtype, t))
        if was and any(was[i] != "n/a" for i in keep[0]):  # a previous run's figures, not its blanks
            for i in keep[0]:
                cells[i] = was[i]
            kept_any = True
        lines.append("| " + " | ".join(cells) + " |")
    if kept_any:
        lead = KEPT_COLUMNS.format(keep[1])
        lines += ["", lead + origin_of(old, lead, origin_of(old, KEPT_PART, origin)) + "."]
    failed = [(t, r["error"]) for src in (dec, busy) for t, p in src.items() for r in p["llama"] if r.get("error")]
    if failed:
        lines += ["", f"llama-bench runs that failed or ran past {BUSY_TIMEOUT_S} s: "
                  + "; ".join(f"{t}: {e}" for t, e in failed)]
    if bw and dec:
        top = max(((t, summary([r["tps"] for r in p["llama"]], False) or 0) for t, p in dec.items()),
                  key=lambda x: x[1] * R["bytes"]["llama"][x[0]]["bytes"])
        achieved = top[1] * R["bytes"]["llama"][top[0]]["bytes"] / 1e9
        lines += ["", f"Check of the bound: llama.cpp's fastest achieved read rate here is {achieved:.1f} GB/s "
                  f"({top[0]}: {top[1]:.1f} tok/s × {R['bytes']['llama'][top[0]]['bytes'] / 1e6:.0f} MB), "
                  + (f"{achieved / bw['read_gbs']:.2f} of the measured {bw['read_gbs']:.1f} GB/s: ✅ the "
                     "probe reads at least as fast as llama.cpp does." if achieved <= bw["read_gbs"] else
                     f"above the measured {bw['read_gbs']:.1f} GB/s: ❌ the probe did not reach the machine's "
                     "limit in this run (or llama.cpp's step hits the cache), so every fraction above is too "
                     "high.")]
    elif kept_any:  # busy only: the check of the bound goes with the idle columns it was made from
        check = next((x for x in old.splitlines() if x.startswith("Check of the bound:")), None)
        lines += ["", check] if check else []
    return lines


def scoring(R: dict) -> list[str]:
    sc = R["score"]
    best = lambda xs, k: min(x[k] for x in xs)  # noqa: E731 - idle: the fastest run
    ours, theirs = sc["lmhead"], sc["llama"]
    o, t = ours[0], theirs[0]
    o_s, t_s = best(ours, "s"), best(theirs, "s")
    return ["### Scoring: `lmhead score` against `llama-perplexity`", "",
            f"The same {sc['tokens']:,}-token English-like text (benchmarks/score_bench.py make_text), float32 / "
            f"F32. lmhead: `Model.score(text)` timed in a fresh process after loading and one short warm-up "
            f"(windows of {o['window']} every {o['stride']} tokens: each token scored once). llama.cpp: "
            f"`llama-perplexity -c 1024 -b 1024 -t {R['threads']}`, timed by its own log's clock from the "
            "first chunk to the final estimate (chunks of 1,024, the second half of each scored). Fastest of "
            f"{len(ours)} runs each, alternating. Both run every 1,024-token window through the whole "
            "model; lmhead's overlapping windows score every token, llama-perplexity's half of them, so "
            "both rates are given. Check: the perplexity of the tokens llama-perplexity scores, from "
            "lmhead's own log-probs of the same positions.",
            "",
            "| | lmhead score | llama-perplexity | ratio |",
            "|---|---:|---:|---:|",
            f"| seconds (own timing; process wall) | {o_s:.2f} s ({best(ours, 'wall_s'):.1f} s) | {t_s:.2f} s "
            f"({best(theirs, 'wall_s'):.1f} s) | |",
            f"| tokens scored | {o['scored']:,} | {t['scored']:,} | |",
            f"| scored tokens/s | {o['scored'] / o_s:.0f} | {t['scored'] / t_s:.0f} | "
            f"{ratio_cell(o['scored'] / o_s, t['scored'] / t_s)} |",
            f"| positions through the model | {o['forwarded']:,} | {t['forwarded']:,} | |",
            f"| positions/s | {o['forwarded'] / o_s:.0f} | {t['forwarded'] / t_s:.0f} | "
            f"{ratio_cell(o['forwarded'] / o_s, t['forwarded'] / t_s)} |",
            f"| perplexity of the second halves ({o['halves']:,} tokens) | {o['halves_ppl']:,.2f} | "
            f"{t['ppl']:,.2f} | {o['halves_ppl'] / t['ppl']:.4f} |"]


def serving(R: dict) -> list[str]:
    sv = R["serve"]
    lines = ["### Serving: `lmhead serve` against `llama-server`", "",
             f"Greedy completions of {R['args']['serve_tokens']} tokens (`/v1/completions`, temperature 0) for "
             "12-word prompts, from 1, 4 and 16 client threads at once (each its own connection, its "
             "requests one after the other); completion tokens as each server's usage counts them, per "
             "second of wall time, all clients together, after one warm-up request. `lmhead serve --dtype "
             f"float32` with its defaults; `llama-server -np 16 -c 4096 -t {R['threads']}` (F32; continuous "
             "batching on, its default). One server at a time.",
             "",
             "| clients | requests | lmhead serve | llama-server | ratio | lmhead vs its 1 client | "
             "llama-server vs its 1 client |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(sv["lmhead"], sv["llama"]):
        lines.append(f"| {a['clients']} | {a['requests']} | {a['tps']:.1f} tok/s | {b['tps']:.1f} tok/s | "
                     f"{ratio_cell(a['tps'], b['tps'])} | {a['tps'] / sv['lmhead'][0]['tps']:.2f}× | "
                     f"{b['tps'] / sv['llama'][0]['tps']:.2f}× |")
    ft = sv.get("first_token")
    if ft:  # kept figures from before it was measured have none
        o, t = ft["lmhead"], ft["llama"]
        lines += ["", f"A lone request's first token (a streamed 12-word prompt new to the server, 8 tokens, "
                  f"temperature 0, a new connection each; {o['n']} after the warm-up, before the clients): lmhead serve "
                  f"{o['best_s'] * 1e3:.1f} ms best ({o['median_s'] * 1e3:.1f} median), llama-server "
                  f"{t['best_s'] * 1e3:.1f} ms best ({t['median_s'] * 1e3:.1f} median); llama-server's best over "
                  f"lmhead's: {ratio_cell(t['best_s'], o['best_s'])}."]
    return lines
