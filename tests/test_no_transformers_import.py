"""The lean hot path never imports transformers: `inspect`, `greedy` and `generate` on
a local GPT-2 checkpoint, run as `python -m lmhead_cli` in a fresh interpreter.

transformers' GPT-2 import alone costs 3-4.5 s on a 2-core machine, more than the whole lean inspect.
torch._dynamo is guarded too: building nn.Embedding on the meta device once pulled it in (~1.5 s).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("transformers", "torch._dynamo")

# Runs the CLI as `python -m lmhead_cli ARGS` would, then reports what was imported.
PROBE = """
import json, runpy, sys
out, args = sys.argv[1], sys.argv[2:]
sys.argv = ["lmhead", *args]
code = 0
try:
    runpy.run_module("lmhead_cli", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code or 0
heavy = [m for m in {heavy!r} if m in sys.modules]
with open(out, "w") as f:
    json.dump({{"exit_code": code, "heavy": heavy}}, f)
""".format(heavy=HEAVY)

COMMANDS = {
    "inspect": ["inspect", "The keys on the table", "--json"],
    "greedy": ["greedy", "The keys on the table", "--max-new-tokens", "3", "--json"],
    "generate": ["generate", "The keys on the table", "--max-new-tokens", "3", "--seed", "0", "--json"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.slow
def test_lean_path_never_imports_transformers(name, tiny, tmp_path):
    folder, _ = tiny
    report = tmp_path / "report.json"
    args = COMMANDS[name] + ["--model", str(folder)]
    done = subprocess.run([sys.executable, "-c", PROBE, str(report), *args], capture_output=True, text=True,
                          timeout=120)
    assert report.is_file(), done.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["exit_code"] == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)  # it did the work: one JSON document
    assert result["heavy"] == [], f"lmhead {name} imported {result['heavy']}"
