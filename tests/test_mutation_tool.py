"""mutation/narrow.py, the per-line test selection of the mutation run: on a file laid out as mutmut 3
lays out its mutants, it finds the statement a mutant changes and keeps the tests that executed it."""

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
