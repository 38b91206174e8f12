"""Instant start: the commands that are arithmetic never import torch or transformers.

Run in a fresh interpreter, since this test session itself has long since imported both.
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


# ---- the command line calls only the API -----------------------------------------------------------

# What lmhead_cli/cli/ may import from lmhead_cli (a module and everything under it), and why. Anything
# else (readings, engine, loading, decoding, head, distributed, data...) is reached through lmhead_cli.api.
CLI_MAY_IMPORT = {
    "lmhead_cli.cli": "its own modules",
    "lmhead_cli.api": "the one door: load(), the Model's methods, the checks, the --file pipeline, and "
                      "api.choices (the stage registry and the values the options offer, torch-free)",
    "lmhead_cli.render": "the output of a result: tables, JSON documents, notices",
    "lmhead_cli.errors": "the one error boundary turns the domain errors into one line and an exit code",
    "lmhead_cli.inputs": "reading a text from stdin with its limits is the front end's own input",
    "lmhead_cli.outputs": "writing a file (--html) whole or not at all is the front end's own output",
    "lmhead_cli.serve": "`lmhead serve` starts the server, another front end beside the command line",
    "lmhead_cli": "the package itself, for --version's __version__ (its submodules are checked by name)",
}


def _imported(source: str, package: str, root) -> list[str]:
    """The lmhead_cli modules a module's source imports (at any depth in its functions): `from P import
    N` counts as P.N when that is a module or package under `root` (the folder holding lmhead_cli), else P."""
    import ast

    def is_module(name: str) -> bool:
        path = root.joinpath(*name.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y, inside `package`
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
    return [m for m in found if m == "lmhead_cli" or m.startswith("lmhead_cli.")]


def _reaching_past(source: str, root, may: dict = CLI_MAY_IMPORT, package: str = "lmhead_cli.cli") -> list[str]:
    allowed = sorted(may, key=len, reverse=True)
    return [m for m in _imported(source, package, root)
            if not any(m == a or (a != "lmhead_cli" and m.startswith(a + ".")) for a in allowed)]


def test_the_command_line_imports_only_the_api_render_and_its_boundary():
    """Every module of lmhead_cli/cli/, parsed (imports inside functions included): none imports the
    readings, engines, loader, decoding or head directly; each goes through lmhead_cli.api."""
    from pathlib import Path

    import lmhead_cli.cli

    folder = Path(lmhead_cli.cli.__file__).parent
    root = folder.parent.parent
    # the check itself finds what it must (so the test below cannot pass by finding nothing)
    assert _reaching_past("def f():\n    from lmhead_cli.readings import toy\n    import lmhead_cli.engine.threads\n"
                          "    from lmhead_cli import head, api\n    from lmhead_cli.api import checks\n", root) == [
        "lmhead_cli.readings.toy", "lmhead_cli.engine.threads", "lmhead_cli.head"]
    modules = sorted(folder.glob("*.py"))
    assert {"inspect.py", "score.py", "options.py", "boundary.py"} <= {p.name for p in modules}
    found = {p.name: _reaching_past(p.read_text(encoding="utf-8"), root) for p in modules}
    assert {name: past for name, past in found.items() if past} == {}


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


# What the server (lmhead_cli/serve/) and the page (lmhead_cli/page/) may import from lmhead_cli: the
# same door as the command line. Their model work goes through Model methods (api/serving.py among them).
SERVER_MAY_IMPORT = {
    "lmhead_cli.serve": "its own modules",
    "lmhead_cli.page": "the page's files and routes, served by the server",
    "lmhead_cli.api": "the one door: the Model's methods, and api.serving's names for the worker's rows",
    "lmhead_cli.render": "the documents: OpenAI's, the page's views, the one JSON encoder, terminal-safe text",
    "lmhead_cli.errors": "the domain errors, turned into OpenAI's error shape",
}


def test_the_server_and_the_page_import_only_the_api_render_and_errors():
    """Every module of lmhead_cli/serve/ and lmhead_cli/page/, parsed (imports inside functions included):
    none imports the readings, decoding, engines or loader; each goes through lmhead_cli.api."""
    from pathlib import Path

    import lmhead_cli.page
    import lmhead_cli.serve

    root = Path(lmhead_cli.serve.__file__).parent.parent.parent
    assert _reaching_past("from lmhead_cli.readings.completion import Row\nfrom lmhead_cli.api.serving import Row\n"
                          "from lmhead_cli.decoding import stages\n", root, SERVER_MAY_IMPORT,
                          "lmhead_cli.serve") == ["lmhead_cli.readings.completion", "lmhead_cli.decoding.stages"]
    found = {}
    for package in (lmhead_cli.serve, lmhead_cli.page):
        folder = Path(package.__file__).parent
        modules = sorted(folder.glob("*.py"))
        assert modules
        for p in modules:
            found[f"{package.__name__}/{p.name}"] = _reaching_past(p.read_text(encoding="utf-8"), root,
                                                                   SERVER_MAY_IMPORT, package.__name__)
    assert {"lmhead_cli.serve/app.py", "lmhead_cli.serve/requests.py", "lmhead_cli.page/routes.py"} <= set(found)
    assert {name: past for name, past in found.items() if past} == {}
