"""`lmhead compare`'s rows: what int8 costs against float32 on the same checkpoint, and what compare
itself costs against `score` on the same text. benchmarks/run.py calls `measure` and appends
`report` when `lmhead compare` exists (the section is left out where it does not).

The reading of compare's own statistics (mean KLD, "same top p", Δp) belongs in `report`, taken from
the --json document `measure` keeps, beside the time and peak memory measured here.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from harness import PYTHON, ROOT, ENV, lmhead

QUICK_TOKENS, FULL_TOKENS = 256, 1024


def available() -> bool:
    """`lmhead compare --help` exits 0."""
    import subprocess

    return subprocess.run(lmhead("compare", "--help"), cwd=ROOT, env=ENV, capture_output=True).returncode == 0


def measure(folder: Path, run, quick: bool = False) -> dict | None:
    """`lmhead compare - --model FOLDER --dtype int8 --base FOLDER --json` and `lmhead score` on the same
    text, one fresh process each: wall time, peak memory, compare's document. None without compare."""
    from score_bench import make_text

    if not available():
        return None
    n = QUICK_TOKENS if quick else FULL_TOKENS
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp, "text.txt")
        text.write_text(make_text(n, seed=2), encoding="utf-8")
        stdin = lambda *args: ["bash", "-c", 'exec "$0" -m lmhead_cli "${@:2}" < "$1"', PYTHON, str(text), *args]  # noqa: E731
        wall, rss, out = run(stdin("compare", "-", "--model", str(folder), "--dtype", "int8", "--base", str(folder),
                                   "--json"))
        score_wall, score_rss, _ = run(stdin("score", "-", "--model", str(folder), "--json"))
    return {"tokens": n, "wall_s": wall, "rss_mb": rss, "score_s": score_wall, "score_rss_mb": score_rss,
            "doc": json.loads(out)}


def report(r: dict) -> str:
    """The markdown section for benchmarks/RESULTS.md."""
    return "\n".join([
        "",
        "## `lmhead compare`: int8 against float32",
        "",
        f"`lmhead compare - --model CHECKPOINT --dtype int8 --base CHECKPOINT --json` on a {r['tokens']:,}-token "
        "English-like text, against `lmhead score` on the same text (one fresh process each).",
        "",
        "| | compare (int8 against float32) | score (float32) |",
        "|---|---:|---:|",
        f"| wall time | {r['wall_s']:.2f} s | {r['score_s']:.2f} s |",
        f"| peak resident memory | {r['rss_mb']:.0f} MB | {r['score_rss_mb']:.0f} MB |",
    ]) + "\n"
