"""Instant start: the commands that are arithmetic never import torch or transformers.

Run in a fresh interpreter, since this test session itself has long since imported both. (Which
module may import which, read from the source: tests/test_imports.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

LIGHT_COMMANDS = [
    ["--help"],
    ["--version"],
    ["params", "--config", "gpt2-xl"],
    ["params"],
    ["params", "--json", "--batch", "8", "--seq", "2048", "--vocab", "32000"],
    ["toy"],
    ["toy", "--hidden", "0.5,1,2", "--temperature", "0.7", "--json"],
]

PROBE = """
import json, sys
from typer.testing import CliRunner
from lmhead_cli.cli import app

runner, report = CliRunner(), []
for args in json.loads(sys.argv[1]):
    result = runner.invoke(app, args)
    heavy = [m for m in ("torch", "transformers") if m in sys.modules]
    report.append({"args": args, "exit_code": result.exit_code, "heavy": heavy, "output": result.output[-300:]})
print(json.dumps(report))
"""


def test_light_commands_never_import_torch_or_transformers():
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(LIGHT_COMMANDS)], capture_output=True,
                          text=True, timeout=60, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["args"] for r in report] == LIGHT_COMMANDS
    for r in report:
        assert r["exit_code"] == 0, r
        assert r["heavy"] == [], f"lmhead {' '.join(r['args'])} imported {r['heavy']}"


RENDER_PROBE = """
import importlib, json, pkgutil, sys
import lmhead_cli.render as render

report = {}
for info in pkgutil.iter_modules(render.__path__):
    before = set(sys.modules)
    importlib.import_module("lmhead_cli.render." + info.name)
    report[info.name] = sorted(m for m in set(sys.modules) - before
                               if m == "torch" or m.startswith(("lmhead_cli.loading", "lmhead_cli.engine")))
print(json.dumps(report))
"""


def test_render_never_imports_the_loader_or_an_engine():
    """render/ takes results: no renderer imports the model loader, an engine or torch, even through a
    module it imports (a fresh interpreter, each module's new imports recorded)."""
    done = subprocess.run([sys.executable, "-c", RENDER_PROBE], capture_output=True, text=True, timeout=60,
                          check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"inspect", "score", "html", "explore"} <= set(report)
    assert {name: found for name, found in report.items() if found} == {}


@pytest.mark.parametrize("args", [["inspect", "x", "--model", "random:gpt2"], ["score", "a b", "--model", "random:gpt2"],
                                  ["toy"], ["--version"]])
def test_a_deleted_working_directory_is_one_line_before_torch_is_imported(tmp_path, args):
    """torch's import dies in a deleted working directory ("Intel oneMKL FATAL ERROR", exit 2, no word
    of why): every command says so first, in one line."""
    import os

    from helpers import launch

    gone = tmp_path / "gone"
    gone.mkdir()

    def in_a_deleted_folder():
        os.chdir(gone)
        os.rmdir(gone)

    got = launch(*args, preexec_fn=in_a_deleted_folder, timeout=120, text=True)
    assert (got.returncode, got.stdout) == (1, "")
    assert got.stderr == ("lmhead: error: the working directory no longer exists (it was deleted); cd to a folder "
                          "that exists and run the command again\n")


def test_load_says_the_working_directory_is_gone_before_torch_is_imported(tmp_path):
    import os

    gone = tmp_path / "gone"
    gone.mkdir()
    code = ("import sys, lmhead_cli\ntry:\n    lmhead_cli.load('random:gpt2')\nexcept lmhead_cli.errors.LmheadError as e:\n"
            "    print(e, 'torch' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: (os.chdir(gone), os.rmdir(gone)),
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert got.stdout.endswith("(it was deleted); cd to a folder that exists and run the command again False\n"), got
