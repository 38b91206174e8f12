"""pytest plugin for the mutation run (mutation/run.py loads it with `-p narrow`): per-line test selection.

mutmut runs, for each mutant, the tests that called the function it sits in. This plugin narrows that
to the tests that executed the mutated statement. While mutmut runs the tests once to see which test
calls which function ("stats"), the plugin records per-test line coverage of the files under mutation
(mutmut's copies in mutants/, where each function's original body sits beside its mutants). For each
mutant it then keeps only the tests that executed the statement the mutant changes: a test that never
executes a statement cannot see a change to it, so nothing that could kill the mutant is dropped. When
the coverage holds no test for the statement, nothing is narrowed.

It also caps each mutant process's address space, so that a mutant that allocates without bound fails
alone instead of starving a shared machine.

Environment: LMHEAD_MUTATION_FILES (comma-separated paths under mutants/, set by run.py) names the files
to cover; MUTANT_UNDER_TEST is set by mutmut ("stats" for the stats run, the mutant's name after).
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
from pathlib import Path

import pytest

MEMORY_LIMIT = int(os.environ.get("LMHEAD_MUTATION_MEMORY", str(8 * 2**30)))  # address space per mutant process
COVERAGE = "coverage-lines.json"  # in mutants/, the tests' working directory
_cov = None


# Imported once in mutmut's fork server (its warm-up collects the tests with this plugin loaded), so that
# each mutant's process starts with them: under load, importing transformers alone takes half a minute.
PRELOAD = ("torch", "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.generation.logits_process",
           "safetensors.torch", "typer.testing", "lmhead_cli.cli", "lmhead_cli.loading.sources", "lmhead_cli.engine.lean",
           "lmhead_cli.engine.hf", "lmhead_cli.decoding.generate", "lmhead_cli.readings.inspect",
           "lmhead_cli.readings.score", "lmhead_cli.readings.diff", "lmhead_cli.readings.lens",
           "lmhead_cli.readings.attribute", "lmhead_cli.readings.compare", "lmhead_cli.api")


def _preload() -> None:
    import importlib

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:  # a module that does not exist (yet) on this branch
            pass


if os.environ.get("LMHEAD_MUTATION_FILES"):
    _preload()


# ---- the stats run: per-test line coverage --------------------------------------------------------

def pytest_configure(config):
    global _cov
    name = os.environ.get("MUTANT_UNDER_TEST", "")
    if name == "stats" and os.environ.get("LMHEAD_MUTATION_FILES"):
        import coverage

        files = [str(Path(f).resolve()) for f in os.environ["LMHEAD_MUTATION_FILES"].split(",")]
        _cov = coverage.Coverage(data_file=None, include=files)
        _cov.start()
    elif "__mutmut_" in name:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        clear_caches()


def clear_caches(modules: set[str] | None = None) -> None:
    """Empty the functools caches of the modules under mutation (LMHEAD_MUTATION_FILES; or `modules`):
    before each test of the stats run (see pytest_runtest_protocol), and as each mutant's process
    starts. That process is forked from the server that ran the tests once (the stats run), so a cached
    function's results were computed by its original body there; a mutant of that function would never
    run, and survive for nothing (stages._softcap_processor_class: four such survivors in the first
    full run). Only those modules: the others hold no mutant, and a cache such as kernels.load() is a
    singleton the tests hold on to."""
    import functools
    import sys

    if modules is None:
        files = os.environ.get("LMHEAD_MUTATION_FILES", "")
        modules = {f.removesuffix(".py").replace("/", ".") for f in files.split(",") if f}
    for name in modules:
        module = sys.modules.get(name)
        for value in list(vars(module).values()) if module is not None else ():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _cov is not None:
        _cov.switch_context(item.nodeid)  # setup, call and teardown count for the test
        # Each test calls a cached function's body itself, so that mutmut and the coverage record it as
        # reaching that function (else only the first test to call it would, and a mutant there would
        # run against that one test alone).
        clear_caches()
    yield


def pytest_unconfigure(config):
    global _cov
    if _cov is None:
        return
    _cov.stop()
    data = _cov.get_data()
    # mutmut reruns the stats for new tests only: add to what an earlier stats run recorded
    old = json.loads(Path(COVERAGE).read_text()) if Path(COVERAGE).exists() else {"tests": [], "lines": {}}
    tests: dict[str, int] = {t: i for i, t in enumerate(old["tests"])}
    lines: dict[str, dict[str, set[int]]] = {f: {n: set(ids) for n, ids in by.items()} for f, by in old["lines"].items()}
    root = Path.cwd().resolve()
    for path in data.measured_files():
        rel = str(Path(path).resolve().relative_to(root))
        for n, ctx in data.contexts_by_lineno(path).items():
            lines.setdefault(rel, {}).setdefault(str(n), set()).update(tests.setdefault(c, len(tests)) for c in ctx if c)
    Path(COVERAGE).write_text(json.dumps({"tests": list(tests), "lines": {
        f: {n: sorted(ids) for n, ids in by.items()} for f, by in lines.items()}}))
    _cov = None


# ---- pass 2: each mutant runs only the tests that execute its statement --------------------------

def pytest_collection_modifyitems(config, items):
    name = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" not in name or not Path(COVERAGE).exists():
        return
    allowed = tests_reaching(name)
    before = len(items)
    keep = [i for i in items if i.nodeid in allowed] if allowed else []
    if keep and len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in allowed])
        items[:] = keep
    fastest_first(items)
    with open("narrow.log", "a") as log:  # mutant, tests reaching its function, tests kept
        log.write(f"{name} {before} {len(items)}\n")


def fastest_first(items) -> None:
    """Order the tests so that a kill (the run stops at the first failure) comes as early as it can:
    the test files by their fastest test, then each file's tests by their time in the stats run
    (a file's tests stay together, so its module fixtures are built once)."""
    try:
        took = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    first: dict[str, float] = {}
    for i in items:
        first[i.fspath.strpath] = min(first.get(i.fspath.strpath, float("inf")), took.get(i.nodeid, 0.0))
    items.sort(key=lambda i: (first[i.fspath.strpath], i.fspath.strpath, took.get(i.nodeid, 0.0)))


def split_name(name: str) -> tuple[str, str, str]:
    """'lmhead_cli.head.x_ranks__mutmut_7' -> ('lmhead_cli/head.py', 'x_ranks', '7');
    methods are 'module.xǁClassǁmethod__mutmut_N'."""
    module, _, rest = name.rpartition(".")
    mangled, _, n = rest.rpartition("__mutmut_")
    return module.replace(".", "/") + ".py", mangled, n


def changed_lines(name: str) -> tuple[list[int], ast.Module] | None:
    """The lines of mutmut's copy of the file (mutants/...) where the mutant changes the original: the
    lines of the function's original copy, `x_f__mutmut_orig`, which is what the tests executed."""
    path, mangled, n = split_name(name)
    if not Path(path).exists():
        return None
    source = Path(path).read_text()
    tree = ast.parse(source)
    funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    orig, mut = funcs.get(f"{mangled}__mutmut_orig"), funcs.get(f"{mangled}__mutmut_{n}")
    if orig is None or mut is None:
        return None
    text = source.splitlines()
    a = [re.sub(r"__mutmut_orig\b", "", s) for s in text[orig.lineno - 1:orig.end_lineno]]
    b = [re.sub(rf"__mutmut_{n}\b", "", s) for s in text[mut.lineno - 1:mut.end_lineno]]
    rel = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            rel.update(range(i1, max(i2, i1 + 1)))
    return sorted(orig.lineno + r for r in rel), tree


def statement_lines(tree: ast.AST, line: int) -> range:
    """The lines of the innermost statement holding `line` (only the header of a compound statement)."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno and (node.end_lineno or 0) <= (best.end_lineno or 0):
                best = node
    if best is None:
        return range(line, line + 1)
    body = getattr(best, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt) and line < body[0].lineno:
        return range(best.lineno, body[0].lineno)
    return range(best.lineno, (best.end_lineno or best.lineno) + 1)


def tests_reaching(name: str) -> set[str] | None:
    """Node ids of the tests that executed the mutated statement; None when unknown (no narrowing)."""
    found = changed_lines(name)
    if not found:
        return None
    lines, tree = found
    cov = json.loads(Path(COVERAGE).read_text())
    by_line = cov["lines"].get(split_name(name)[0], {})
    hit: set[int] = set()
    for line in lines:
        for n in statement_lines(tree, line):
            hit.update(by_line.get(str(n), ()))
    return {cov["tests"][i] for i in hit} or None
