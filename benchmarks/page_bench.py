"""The page of `lmhead serve` (issue 18): how long a 5,000-token text takes to appear after the server's
answer, measured in headless chromium by tests/test_page.py::test_render_time_5000_tokens
(performance.now() in the page: from the answer's arrival, through the JSON parse and the building of
the view, to the first frame after it). Target: within 2 s. Never asserted in a test; reported here.

benchmarks/run.py can call `measure` and append `report`; on its own:

    python benchmarks/page_bench.py          # prints the markdown section
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_MS = 2000


def measure() -> dict | None:
    """One run of the browser test; its timing line, or None when chromium is not here (test skipped)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timing.jsonl"
        env = {**os.environ, "LMHEAD_PAGE_TIMING": str(out), "PYTHONPATH": str(ROOT)}
        got = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/test_page.py::test_render_time_5000_tokens"],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        if got.returncode != 0:
            raise RuntimeError(f"the page's render test failed:\n{got.stdout[-2000:]}{got.stderr[-2000:]}")
        if not out.exists():
            return None
        return json.loads(out.read_text(encoding="utf-8").splitlines()[-1])


def report(r: dict | None) -> str:
    if r is None:
        return "\n## The page\n\nNot measured: chromium and chromium-driver are not installed.\n"
    ok = "✅" if r["to_paint_ms"] <= TARGET_MS else "❌"
    return ("\n## The page\n\n"
            f"A {r['tokens']:,}-token text scored by the page of `lmhead serve` (tiny test checkpoint), timed in "
            "headless chromium with performance.now() (tests/test_page.py): from the server's answer to the "
            "first frame after the view is built.\n\n"
            "| JSON parse | building the view | answer → first frame | target |\n|---:|---:|---:|---|\n"
            f"| {r['parse_ms']:.0f} ms | {r['render_ms']:.0f} ms | {r['to_paint_ms']:.0f} ms | "
            f"{ok} ≤ {TARGET_MS / 1000:g} s |\n\n"
            f"(The server took {r['server_ms'] / 1000:.1f} s to score it, not counted.)\n")


if __name__ == "__main__":
    print(report(measure()))
