"""The mutation run's own code. mutation/narrow.py, the per-line test selection: on a file laid out as
mutmut 3 lays out its mutants, it finds the statement a mutant changes and keeps the tests that executed
it. mutation/run.py's rewrite of decorated functions (which mutmut skips) into undecorated ones with the
decorators applied after them: the same behaviour, and only the functions mutmut mutates."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MUTANTS_FILE = '''\
def x_f__mutmut_orig(a, b):
    if a > 1:
        return a + b
    c = (a +
         b)
    return c


def x_f__mutmut_1(a, b):
    if a >= 1:
        return a + b
    c = (a +
         b)
    return c


def x_f__mutmut_2(a, b):
    if a > 1:
        return a + b
    c = (a -
         b)
    return c


def x_g__mutmut_orig():
    return 1


def x_g__mutmut_1():
    return 2
'''


@pytest.fixture
def narrow(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("narrow_under_test", ROOT / "mutation" / "narrow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(MUTANTS_FILE)
    # line 2 (the if) ran in t1 and t2, line 3 in t1; of the assignment on lines 4-5, line 5 in t3; line 25, a
    # def, in t4 (at import)
    lines = {"pkg/mod.py": {"2": [0, 1], "3": [0], "5": [2], "6": [1, 2], "25": [3]}}
    (tmp_path / module.COVERAGE).write_text(json.dumps({"tests": ["t1", "t2", "t3", "t4"], "lines": lines}))
    monkeypatch.chdir(tmp_path)
    return module


def test_a_mutant_runs_only_the_tests_that_executed_its_statement(narrow):
    assert narrow.changed_lines("pkg.mod.x_f__mutmut_1")[0] == [2]
    assert narrow.tests_reaching("pkg.mod.x_f__mutmut_1") == {"t1", "t2"}  # the if's header, not its body


def test_a_statement_over_several_lines_counts_each_of_them(narrow):
    assert narrow.changed_lines("pkg.mod.x_f__mutmut_2")[0] == [4]
    assert narrow.tests_reaching("pkg.mod.x_f__mutmut_2") == {"t3"}  # recorded on the statement's 2nd line


def test_without_coverage_of_the_statement_nothing_is_narrowed(narrow):
    assert narrow.tests_reaching("pkg.mod.x_g__mutmut_1") is None  # its line 26 ran in no test (only the def, 25)
    assert narrow.tests_reaching("pkg.mod.x_missing__mutmut_1") is None


def test_mutant_names_split_into_file_function_and_number(narrow):
    assert narrow.split_name("lmhead_cli.head.x_ranks__mutmut_7") == ("lmhead_cli/head.py", "x_ranks", "7")
    assert narrow.split_name("lmhead_cli.engine.lean.xǁMLPǁforward__mutmut_12") == (
        "lmhead_cli/engine/lean.py", "xǁMLPǁforward", "12")


# ---- mutation/run.py: decorated functions are written undecorated, so that mutmut mutates them -----

DECORATED = '''\
import functools


class A:
    def __init__(self):
        self._p = 1

    @property
    def p(self):
        return self._p

    @p.setter
    def p(self, v):
        self._p = v

    @staticmethod
    def s(x):
        return x + 1

    @functools.cache
    @staticmethod
    def c(x):
        return x + 2


@functools.lru_cache(
    maxsize=2)
def g(x):
    return x * 2
'''


@pytest.fixture
def run_py():
    spec = importlib.util.spec_from_file_location("run_under_test", ROOT / "mutation" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decorators_become_assignments_after_the_function(run_py):
    out = run_py.undecorate(DECORATED)
    lines = out.splitlines()
    assert [line for line in lines if line.lstrip().startswith("@")] == ["    @staticmethod"]  # the lone one mutmut takes
    assert "    p = property(p)" in lines and "g = functools.lru_cache(maxsize=2)(g)" in lines
    assert "    c = functools.cache(staticmethod(c))" in lines  # @a @b def f: f = a(b(f))
    # a decorator that names the function reads the earlier binding (the property), saved before the def
    setter = lines.index("    p = _undecorated_p.setter(p)")
    assert lines[setter - 3:setter - 1] == ["    _undecorated_p = p", "    def p(self, v):"]
    assert lines[setter + 1] == "    del _undecorated_p"
    before, after = {}, {}
    exec(DECORATED, before)
    exec(out, after)
    for ns in (before, after):  # the same behaviour either way
        a = ns["A"]()
        a.p = 5
        assert (a.p, ns["A"].s(1), ns["A"].c(1), ns["g"](3), ns["g"].cache_info().misses) == (5, 2, 3, 6, 1)
        assert isinstance(ns["A"].__dict__["p"], property)


def test_only_the_functions_mutmut_mutates_are_rewritten(run_py):
    """Top-level functions and methods of top-level classes; a class's own decorator (@dataclass) and a
    function nested in another stay as they are, and a file without decorators is unchanged."""
    source = ("from dataclasses import dataclass\n\n\n@dataclass(frozen=True)\nclass B:\n    x: int = 0\n\n\n"
              "def outer():\n    @functools.cache\n    def inner():\n        return 1\n    return inner\n")
    assert run_py.undecorate(source) == source
    assert run_py.undecorate(MUTANTS_FILE) == MUTANTS_FILE


def test_every_module_names_files_and_test_files_that_exist(run_py):
    for name, (files, tests) in run_py.MODULES.items():
        assert files and tests, name
        assert all((ROOT / f).is_file() for f in files + tests), name


def test_the_docs_table_lists_each_module_with_its_test_files(run_py):
    rows = {}
    for line in (ROOT / "docs" / "mutation-testing.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0] in run_py.MODULES:
            rows[cells[0]] = [t.strip() for t in cells[2].split(",")]
    assert rows == {name: [Path(t).stem for t in tests] for name, (_, tests) in run_py.MODULES.items()}


def test_a_sample_is_seeded_sized_and_in_the_mutants_order(run_py):
    mutants = [f"m.x_f__mutmut_{i}" for i in range(1, 201)]
    one = run_py.sample_of("head", mutants, 0.25)
    assert one == run_py.sample_of("head", mutants, 0.25)  # the same sample on every run
    assert len(one) == 50 and len(set(one)) == 50 and set(one) <= set(mutants)
    assert one == [m for m in mutants if m in set(one)]
    assert one != run_py.sample_of("lens", mutants, 0.25)  # each module its own draw
    assert run_py.sample_of("head", mutants, 1.0) == mutants


def test_the_interval_of_a_sampled_score_is_wilsons_and_the_core_estimate_weights_modules(run_py):
    low, high = run_py.wilson(95, 100)  # Wilson's 95% interval of 95/100: 88.8% to 97.8%
    assert low == pytest.approx(88.82, abs=0.01) and high == pytest.approx(97.85, abs=0.01)
    assert run_py.wilson(0, 0) == (0.0, 100.0)
    full = {"mutants": 100, "considered": 100, "detected": 100, "equivalent": [], "counts": {}, "sample": None}
    half = {"mutants": 300, "considered": 150, "detected": 120, "equivalent": [], "counts": {"not checked": 150},
            "sample": {"fraction": 0.5}}
    low, mid, high = run_py.core_estimate([full, half])
    assert mid == pytest.approx(100 * (0.25 * 1.0 + 0.75 * 0.8))  # 85%
    q = 122 / 154  # (detected + 2) / (n + 4)
    half_width = 1.96 * (0.75 ** 2 * q * (1 - q) / 150 * (1 - 150 / 300)) ** 0.5
    assert low == pytest.approx(100 * (0.85 - half_width)) and high == pytest.approx(100 * (0.85 + half_width))
    perfect = {**half, "detected": 150}  # a sample without survivors still has an interval
    low, mid, high = run_py.core_estimate([full, perfect])
    assert mid == pytest.approx(100.0) and low < 100.0


def test_a_first_pass_is_kept_by_its_mutants_and_loses_survivors_marked_equivalent_later(run_py):
    survivor = {"mutant": "m.x_f__mutmut_3"}
    first = {"mutants": 10, "considered": 10, "detected": 8, "commit": "a", "date": "d", "sample": None,
             "drawn": "abc", "survivors": [survivor, {"mutant": "m.x_f__mutmut_7"}], "equivalent": []}
    later = {**first, "detected": 9, "considered": 9, "commit": "b", "survivors": [],
             "equivalent": [{**survivor, "reason": "r"}]}  # one killed by a test, one marked equivalent
    kept = run_py.first_pass(first, later)  # a full run again over the same mutants keeps the first figures
    assert kept == {"detected": 8, "considered": 10, "commit": "a", "date": "d",
                    "survivors": ["m.x_f__mutmut_3", "m.x_f__mutmut_7"]}
    assert run_py.first_counts({**later, "first_pass": kept}) == (8, 9)  # 8 of 9: the equivalent one left out
    assert run_py.first_counts(later) == (9, 9)  # no first pass kept: the run is its own first pass
    assert run_py.first_pass(first, {**later, "drawn": "other"}) is None  # other mutants (changed code): a new first pass
    sampled = {**first, "drawn": "abc", "sample": {"drawn": "s1"}}
    assert run_py.first_pass(sampled, {**later, "sample": {"drawn": "s1"}})["detected"] == 8
    assert run_py.first_pass(sampled, {**later, "sample": {"drawn": "s2"}}) is None
    assert run_py.first_pass(sampled, later) is None  # a full run after a sample is a new first pass


def test_a_rerun_from_the_record_keeps_the_recorded_status_of_every_mutant_it_did_not_run(run_py):
    """--rerun without the recorded run's scratch folder runs only the record's survivors and equivalents
    afresh: one now killed, one still a survivor, the equivalent one still surviving (and equivalent)."""
    gone, kept, same = ({"mutant": f"m.x_f__mutmut_{i}", "status": "survived"} for i in (1, 2, 3))
    record = {"mutants": 10, "counts": {"killed": 6, "timeout": 1, "survived": 3}, "survivors": [gone, kept],
              "equivalent": [{**same, "reason": "r"}], "sample": None, "tests_per_mutant": [3.0, 2.0]}
    rerun = {"mutants": 10, "counts": {"killed": 1, "survived": 2, "not checked": 7}, "survivors": [kept],
             "equivalent": [{**same, "reason": "r"}], "sample": None, "tests_per_mutant": [1.0, 1.0],
             "detected": 1, "considered": 2, "score": 50.0}
    now = {gone["mutant"]: "killed", kept["mutant"]: "survived", same["mutant"]: "survived"}
    r = run_py.merged(record, rerun, now)
    assert r["counts"] == {"killed": 7, "timeout": 1, "survived": 2}
    assert (r["detected"], r["considered"], r["score"]) == (8, 9, 88.9)
    assert r["survivors"] == [kept] and r["tests_per_mutant"] == [3.0, 2.0]
    sampled = {**record, "counts": {"killed": 2, "survived": 3, "not checked": 5}, "sample": {"drawn": "s"}}
    r = run_py.merged(sampled, rerun, now)
    assert r["counts"] == {"killed": 3, "survived": 2, "not checked": 5} and r["sample"] == {"drawn": "s"}
    assert (r["detected"], r["considered"]) == (3, 4)


def test_each_mutant_process_starts_with_lmhead_s_caches_empty(narrow, monkeypatch):
    """The stats run filled the fork server's caches with what the original code returned: a mutant's
    process empties them, so that a mutant of a cached function runs."""
    from lmhead_cli.engine import heap, kernels

    heap.fix_mmap_threshold()
    kernels.load()
    assert heap.fix_mmap_threshold.cache_info().currsize == 1
    narrow.clear_caches({"lmhead_cli.engine.heap"})
    assert heap.fix_mmap_threshold.cache_info().currsize == 0
    assert kernels.load.cache_info().currsize == 1  # a module not under mutation keeps its cache
    heap.fix_mmap_threshold()
    monkeypatch.setenv("LMHEAD_MUTATION_FILES", "lmhead_cli/engine/heap.py,lmhead_cli/head.py")
    narrow.clear_caches()
    assert heap.fix_mmap_threshold.cache_info().currsize == 0
