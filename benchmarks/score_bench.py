"""`lmhead score` against what it replaces (issue 11), as ratios measured in one run:

* peak resident memory of `score` on a 1,024-token text against `inspect` on the same text (target:
  score ≤ inspect + 64 MB), beside the params calculator's figure for the full [T, V] logits;
* a 20,000-token text through windows: peak memory within the same bound;
* end to end: `score` on 1,024 tokens against benchmarks/transformers_score.py (import, load, one
  forward with the full logits, log-softmax, gather; target ≤ 0.7×);
* in one process: time per scored token against transformers' forward with the full logits (≤ 1.0×).

benchmarks/run.py calls `measure` and appends `report`; on its own:

    python benchmarks/score_bench.py [--quick]         # prints the markdown section
    python benchmarks/score_bench.py probe FOLDER TEXT_FILE REPEATS   # the in-process timing, one JSON line
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
BOUND_MB = 64
E2E_TARGET, IN_PROCESS_TARGET = 0.7, 1.0
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there one all we their been has when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now "
         "such like our over man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day same another know "
         "while last might us great old year off come since against go came right used take three house table "
         "keys door window garden river city morning evening letter question answer").split()


def make_text(n_tokens: int, seed: int = 0) -> str:
    """Plain English-like words, cut to exactly `n_tokens` GPT-2 tokens (checked by re-encoding)."""
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    tok, rng = GPT2Tokenizer.bundled(), random.Random(seed)
    sentences = []
    while True:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", ",", "?"]))
        text = " ".join(sentences)
        if len(sentences) % 50 == 0 and len(tok.encode(text)) > n_tokens:
            break
    for cut in range(n_tokens, n_tokens - 8, -1):  # a cut inside a word may re-encode differently
        candidate = tok.decode(tok.encode(text)[:cut])
        if len(tok.encode(candidate)) == n_tokens:
            return candidate
    raise RuntimeError(f"could not cut a text of exactly {n_tokens} tokens")


# ---- the in-process probe ------------------------------------------------------------------------

def probe(folder: str, text_file: str, repeats: int) -> dict:
    """Seconds per scored token: lmhead's score_text (lean engine, windows and chunked head) against
    transformers' GPT2LMHeadModel forward with the full [1, T, V] logits, alternating, warm."""
    import torch
    from transformers import GPT2LMHeadModel

    from lmhead_cli.loading.sources import load_model
    from lmhead_cli.readings.score import score_text

    text = Path(text_file).read_text(encoding="utf-8")
    loaded = load_model(folder, device="cpu", dtype="float32", engine="lean")
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.tensor([loaded.tokenizer.encode(text)])  # (1, T)
    ours = lambda: score_text(loaded, text)  # noqa: E731
    theirs = lambda: model(ids).logits  # noqa: E731 - (1, T, V)
    with torch.inference_mode():
        scored = ours().scored_tokens
        theirs()
        times = {"ours": [], "theirs": []}
        for _ in range(repeats):
            for name, fn in (("ours", ours), ("theirs", theirs)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {"tokens": int(ids.shape[1]), "scored": scored, "ours_s": statistics.median(times["ours"]),
            "theirs_s": statistics.median(times["theirs"]), "threads": torch.get_num_threads()}


# ---- the measurements, run by benchmarks/run.py ------------------------------------------------------

def measure(folder: Path, run, quick: bool = False) -> dict:
    """All four measurements; `run(cmd) -> (wall s, peak RSS MB, stdout)` is run.py's quiet runner."""
    repeats = 1 if quick else 3
    lm = [PYTHON, "-m", "lmhead_cli"]
    with tempfile.TemporaryDirectory() as tmp:
        short, long = Path(tmp, "1024.txt"), Path(tmp, "20000.txt")
        # --quick is a smoke test (run.py's whole --quick aims at 90 s): a shorter text and no long one (the
        # windows are tests/test_score.py's). Its figures are not the targets' figures.
        short.write_text(make_text(256 if quick else 1024), encoding="utf-8")
        if not quick:
            long.write_text(make_text(20_000, seed=1), encoding="utf-8")
        # stdin through `exec`, so the measured process is lmhead itself.
        score = lambda path: ["bash", "-c", f'exec "$0" -m lmhead_cli score - --json --model "$1" < "$2"',  # noqa: E731
                              PYTHON, str(folder), str(path)]
        inspect = ["bash", "-c", 'exec "$0" -m lmhead_cli inspect "$(cat "$2")" --model "$1"', PYTHON, str(folder),
                   str(short)]
        hf = [PYTHON, str(HERE / "transformers_score.py"), str(folder), str(short)]
        runs = {"score": [], "inspect": [], "hf": []}
        for _ in range(repeats):
            for name, cmd in (("score", score(short)), ("inspect", inspect), ("hf", hf)):
                runs[name].append(run(cmd))
        ours, theirs = json.loads(runs["score"][0][2]), json.loads(runs["hf"][0][2].strip().splitlines()[-1])
        long_run = None if quick else run(score(long))
        inproc = json.loads(run([PYTHON, str(HERE / "score_bench.py"), "probe", str(folder), str(short),
                                 str(repeats)])[2].strip().splitlines()[-1])
    med = lambda name, i: statistics.median(r[i] for r in runs[name])  # noqa: E731
    return {
        "tokens": len(ours["tokens"]), "scored": ours["scored_tokens"], "chunk": ours["chunk"],
        "score_s": med("score", 0), "score_rss_mb": med("score", 1),
        "inspect_s": med("inspect", 0), "inspect_rss_mb": med("inspect", 1),
        "hf_s": med("hf", 0), "hf_rss_mb": med("hf", 1),
        "ppl": ours["perplexity"], "hf_ppl": theirs["perplexity"], "hf_scored": theirs["scored_tokens"],
        "full_logits_mb": _logits_mb(len(ours["tokens"])),
        **({} if long_run is None else long_figures(*long_run)),
        "inproc": inproc, "repeats": repeats,
    }


def _logits_mb(tokens: int) -> float:
    """The full [1, T, V] float32 logits, in MB, as `lmhead params --seq T` predicts them."""
    from lmhead_cli.readings.params import logits_memory

    return logits_memory(1, tokens, 50257).all_positions_bytes / 1e6


def long_figures(wall: float, rss: float, out: str) -> dict:
    doc = json.loads(out)
    return {"long_tokens": len(doc["tokens"]), "long_scored": doc["scored_tokens"], "long_stride": doc["stride"],
            "long_s": wall, "long_rss_mb": rss,
            "long_full_logits_mb": _logits_mb(len(doc["tokens"]))}


def _ok(passed: bool) -> str:
    return "✅" if passed else "❌"


def report(s: dict) -> str:
    """The markdown section for benchmarks/RESULTS.md."""
    bound = s["inspect_rss_mb"] + BOUND_MB
    e2e = s["score_s"] / s["hf_s"]
    p = s["inproc"]
    per_ours, per_theirs = p["ours_s"] / p["scored"], p["theirs_s"] / p["tokens"]
    return "\n".join([
        "",
        "## `lmhead score`: every token of a text, the head in chunks",
        "",
        f"A {s['tokens']:,}-token English-like text (GPT-2 small shapes, random weights): `lmhead score - --json` "
        f"(stdin, windows of 1,024, the head {s['chunk']} positions at a time) against `lmhead inspect` on the same "
        "text (the body on every position, the head on the last only) and benchmarks/transformers_score.py "
        "(import, load, one forward with the full logits, log-softmax, gather). Fresh processes, "
        f"median of {s['repeats']}; peak resident memory from the kernel (each process's own ru_maxrss, read by benchmarks/launch.py).",
        "",
        "| | score | inspect | transformers script | target |",
        "|---|---:|---:|---:|---|",
        f"| peak resident memory | {s['score_rss_mb']:.0f} MB | {s['inspect_rss_mb']:.0f} MB | {s['hf_rss_mb']:.0f} MB "
        f"| {_ok(s['score_rss_mb'] <= bound)} score ≤ inspect + {BOUND_MB} MB ({bound:.0f} MB) |",
        f"| wall time | {s['score_s']:.2f} s | {s['inspect_s']:.2f} s | {s['hf_s']:.2f} s | "
        f"{_ok(e2e <= E2E_TARGET)} score / script = {e2e:.2f}× ≤ {E2E_TARGET}× |",
        f"| perplexity | {s['ppl']:,.2f} ({s['scored']:,} tokens) | | {s['hf_ppl']:,.2f} ({s['hf_scored']:,} tokens) | "
        "equal |",
        "",
        f"The full [1, {s['tokens']:,}, 50,257] float32 logits, as `lmhead params --seq {s['tokens']}` predicts them: "
        f"{s['full_logits_mb']:.0f} MB. score never holds them: {s['score_rss_mb'] - s['inspect_rss_mb']:+.0f} MB "
        "over inspect.",
        "",
        *([f"A {s['long_tokens']:,}-token text through windows (stride {s['long_stride']}, {s['long_scored']:,} "
           f"tokens scored, one run): {s['long_s']:.1f} s, peak {s['long_rss_mb']:.0f} MB "
           f"({_ok(s['long_rss_mb'] <= bound)} ≤ {bound:.0f} MB; its full logits would be "
           f"{s['long_full_logits_mb'] / 1e3:.1f} GB).", ""] if "long_s" in s else
          ["No long text in --quick (the windows are tested by tests/test_score.py).", ""]),
        f"In one process, warm ({p['threads']} threads, median of {s['repeats']}, alternating): score_text "
        f"{per_ours * 1e3:.2f} ms per scored token ({p['ours_s']:.2f} s for {p['scored']:,}) against transformers' "
        f"forward with the full logits {per_theirs * 1e3:.2f} ms per token ({p['theirs_s']:.2f} s for {p['tokens']:,}): "
        f"{per_ours / per_theirs:.2f}× ({_ok(per_ours / per_theirs <= IN_PROCESS_TARGET)} ≤ {IN_PROCESS_TARGET}×; "
        "score also does the log-softmax, entropy, rank and top-1 that the forward alone does not).",
    ]) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        print(json.dumps(probe(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    sys.path.insert(0, str(HERE))
    from checkpoint import gpt2_small
    from harness import run

    s = measure(gpt2_small(), run, quick="--quick" in sys.argv)
    print(json.dumps(s), file=sys.stderr)
    print(report(s))


if __name__ == "__main__":
    main()
