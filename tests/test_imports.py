"""The house: lmhead_cli's import graph, read from the source with `ast`, has no circle and no arrow back
up against the layers that docs/architecture.md writes down, and no module is over 500 lines.

Every import counts: at the top of a module, inside a function or a class, under `if TYPE_CHECKING:`, and
`importlib.import_module` of a name with a constant prefix. Relative imports are resolved. `from P
import N` is an arrow to P.N where that is a module, else to P (its `__init__.py`).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lmhead_cli"
MAX_LINES = 500

# ---- the graph -------------------------------------------------------------------------------------

def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module under `package`, by dotted name (a package by its own name: its __init__.py)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _covering(name: str, known) -> str | None:
    """The longest module name in `known` that is `name` or holds it (a.b.c -> a.b when a.b.c is a name
    inside a.b, not a module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(source: str, name: str, is_package: bool, known) -> set[str]:
    """The modules of `known` that `source` (module `name`) imports, anywhere in it."""
    out = set()
    here = name.split(".") if is_package else name.split(".")[:-1]  # the package a relative import starts in
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here[: len(here) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module"):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                targets = [arg.value]
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                targets = [str(arg.values[0].value).rstrip(".")]  # f"lmhead_cli.render.{m}": the package
        for t in targets:
            if t == PACKAGE or t.startswith(PACKAGE + ".") or t in known:
                hit = _covering(t, known)
                if hit and hit != name:
                    out.add(hit)
    return out


@functools.cache
def graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """{module: the modules it imports} for every module under `package` (read once per root: the
    callers only read it)."""
    found = modules(root, package)
    return {name: imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", found)
            for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted: every circle
    of imports lies inside one of them."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def layers_from_doc(path: Path = ROOT / "docs" / "architecture.md") -> dict[str, int]:
    """{package or module name: its layer} from the table after docs/architecture.md's marker comment."""
    text = path.read_text(encoding="utf-8")
    table = text[text.index("<!-- the import layers"):].split("\n\n")[0]
    layers = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in re.findall(r"`([\w.]+)`", cells[2]):
                layers[name] = int(cells[0])
    return layers


def layer_of(name: str, layers: dict[str, int]) -> int | None:
    """The layer of the longest table name that covers `name`; the package's own name covers only its
    __init__.py (a new top-level module must be given its own row)."""
    best = None
    for entry in layers:
        if name == entry or (entry != PACKAGE and name.startswith(entry + ".")):
            if best is None or len(entry) > len(best):
                best = entry
    return layers[best] if best is not None else None


def arrows_back_up(edges: dict[str, set[str]], layers: dict[str, int]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if layer_of(b, layers) > layer_of(a, layers))


def without(edges: dict[str, set[str]], allowed) -> dict[str, set[str]]:
    return {a: {b for b in targets if (a, b) not in allowed} for a, targets in edges.items()}


# ---- the checker, on graphs small enough to read ----------------------------------------------------

def test_the_checker_finds_circles_and_arrows_back_up_in_a_tiny_package(tmp_path):
    """A synthetic package with one circle through a function's relative import, one arrow back up and
    one clean arrow: the reader, the circle finder and the layer rule each find exactly those."""
    pkg = tmp_path / "lmhead_cli"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from . import b\n")  # a -> b, inside a function
    (pkg / "low" / "b.py").write_text("from lmhead_cli.low.a import f\n")  # b -> a: a circle
    (pkg / "low" / "c.py").write_text("import importlib\n\ndef g():\n    from ..high import d\n"
                                      "    importlib.import_module(f'lmhead_cli.high.{g}')\n")  # c -> high, up
    (pkg / "high").mkdir()
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "high" / "d.py").write_text("from lmhead_cli.low import c\nimport json\n")  # json: not lmhead's
    edges = graph(tmp_path)
    assert edges == {"lmhead_cli": set(), "lmhead_cli.low": set(), "lmhead_cli.high": set(),
                     "lmhead_cli.low.a": {"lmhead_cli.low.b"}, "lmhead_cli.low.b": {"lmhead_cli.low.a"},
                     "lmhead_cli.low.c": {"lmhead_cli.high.d", "lmhead_cli.high"},
                     "lmhead_cli.high.d": {"lmhead_cli.low.c"}}
    layers = {"lmhead_cli.low": 0, "lmhead_cli.high": 1}
    assert circles(edges) == [["lmhead_cli.high.d", "lmhead_cli.low.c"], ["lmhead_cli.low.a", "lmhead_cli.low.b"]]
    assert arrows_back_up({k: v for k, v in edges.items() if k != "lmhead_cli"}, layers) == [
        ("lmhead_cli.low.c", "lmhead_cli.high"), ("lmhead_cli.low.c", "lmhead_cli.high.d")]
    # a graph without the circle's arrows has none; one new arrow makes a new circle, and it is found
    assert circles(without(edges, {("lmhead_cli.low.b", "lmhead_cli.low.a"),
                                   ("lmhead_cli.high.d", "lmhead_cli.low.c")})) == []
    grown = {**edges, "lmhead_cli.high": {"lmhead_cli.low.c"}, "lmhead_cli.low.c": {"lmhead_cli.high"}}
    assert ["lmhead_cli.high", "lmhead_cli.low.c"] in circles(grown)


def test_the_layer_table_is_read_from_the_architecture_page():
    layers = layers_from_doc()
    assert layers["lmhead_cli.errors"] == 0 and layers["lmhead_cli.engine"] < layers["lmhead_cli.loading"]
    order = ["lmhead_cli.engine", "lmhead_cli.head", "lmhead_cli.decoding", "lmhead_cli.readings", "lmhead_cli.api",
             "lmhead_cli.serve", "lmhead_cli.cli"]
    assert [layers[n] for n in order] == sorted(layers[n] for n in order) and len({layers[n] for n in order}) == 7
    assert layer_of("lmhead_cli.engine.kernels", layers) == layers["lmhead_cli.engine"]
    assert layer_of("lmhead_cli", layers) == layers["lmhead_cli"]
    assert layer_of("lmhead_cli.newthing", layers) is None  # the package's name covers its __init__ alone


# ---- lmhead_cli itself -------------------------------------------------------------------------------

def test_every_module_has_a_layer():
    layers = layers_from_doc()
    assert sorted(m for m in modules() if layer_of(m, layers) is None) == []


def test_the_import_graph_has_no_circle():
    """No circle of imports, counting imports inside functions."""
    edges = graph()
    assert len(edges) > 100
    assert "lmhead_cli.api.compare" in edges["lmhead_cli.api.model"]  # an import inside a method, read
    assert circles(edges) == []


def test_no_arrow_points_back_up():
    """No module imports one of a later layer (docs/architecture.md's table)."""
    assert arrows_back_up(graph(), layers_from_doc()) == []


def test_no_module_is_over_500_lines():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
               for p in modules().values()}
    assert len(lengths) > 100
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}


# ---- the front ends call only the API ---------------------------------------------------------------

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

# What the server (lmhead_cli/serve/, the page's routes among them) may import from lmhead_cli: the same
# door as the command line. Its model work goes through Model methods (api/serving.py among them).
SERVER_MAY_IMPORT = {
    "lmhead_cli.serve": "its own modules",
    "lmhead_cli.page": "the page's files (HTML, CSS, JavaScript), served at /",
    "lmhead_cli.api": "the one door: the Model's methods, and api.serving's names for the worker's rows",
    "lmhead_cli.render": "the documents: OpenAI's, the page's views, the one JSON encoder, terminal-safe text",
    "lmhead_cli.errors": "the domain errors, turned into OpenAI's error shape",
}


def reaching_past(imported: set[str], may: dict) -> list[str]:
    """The imported modules that no entry of `may` covers (the package's name covers only itself)."""
    return sorted(m for m in imported
                  if not any(m == a or (a != PACKAGE and m.startswith(a + ".")) for a in may))


def _front_end(package: str, may: dict) -> dict[str, list[str]]:
    return {m: past for m, targets in graph().items() if m == package or m.startswith(package + ".")
            if (past := reaching_past(targets, may))}


def test_the_front_end_rule_finds_what_it_must():
    """The rule's reader finds an import of the readings, an engine or decoding inside a function."""
    known = modules()
    source = ("def f():\n    from lmhead_cli.readings import toy\n    import lmhead_cli.engine.threads\n"
              "    from lmhead_cli import head, api\n    from lmhead_cli.api import checks\n"
              "    from ..decoding import stages\n")
    imported = imports_of(source, "lmhead_cli.cli.x", False, known)
    assert reaching_past(imported, CLI_MAY_IMPORT) == ["lmhead_cli.decoding.stages", "lmhead_cli.engine.threads",
                                                       "lmhead_cli.head", "lmhead_cli.readings.toy"]
    imported = imports_of("from lmhead_cli.readings.score import Line\nfrom lmhead_cli.api.serving import Row\n"
                          "from lmhead_cli.decoding import stages\n", "lmhead_cli.serve.x", False, known)
    assert reaching_past(imported, SERVER_MAY_IMPORT) == ["lmhead_cli.decoding.stages", "lmhead_cli.readings.score"]


def test_the_command_line_imports_only_the_api_render_and_its_boundary():
    """Every module of lmhead_cli/cli/ (imports inside functions included): none imports the readings,
    engines, loader, decoding or head directly; each goes through lmhead_cli.api."""
    assert {"lmhead_cli.cli.inspect", "lmhead_cli.cli.score", "lmhead_cli.cli.options"} <= set(modules())
    assert _front_end("lmhead_cli.cli", CLI_MAY_IMPORT) == {}


@pytest.mark.parametrize("package", ["lmhead_cli.serve", "lmhead_cli.page"])
def test_the_server_and_the_page_import_only_the_api_render_and_errors(package):
    """Every module of lmhead_cli/serve/ (the page's routes, serve/page.py, among them) and lmhead_cli/page/:
    none imports the readings, decoding, engines or loader; each goes through lmhead_cli.api."""
    assert {"lmhead_cli.serve.app", "lmhead_cli.serve.page", "lmhead_cli.page"} <= set(modules())
    assert _front_end(package, SERVER_MAY_IMPORT) == {}
    if package == "lmhead_cli.page":  # the page's files only: nothing of lmhead
        assert graph()["lmhead_cli.page"] == set()
