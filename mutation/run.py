"""Mutation testing of lmhead's core with mutmut: how many realistic one-line bugs the tests catch.

    python mutation/run.py                  # every module of the core (hours on 2 cores)
    python mutation/run.py head diff        # some of them
    python mutation/run.py --list           # the modules, their files and their tests

For each module: a scratch copy of the package and the tests in build/mutation/<module>/, a
[tool.mutmut] section naming the module's files and its fast test files, then `mutmut run`. mutmut
records which test calls which function and runs only those tests against each mutant (in processes
forked from one that has already imported torch); mutation/narrow.py narrows that to the tests that
executed the mutated statement (per-test line coverage), caps each mutant's memory, and mutmut's own
CPU-time limit stops a mutant that loops. Results are merged into mutation/results.json and written
to docs/mutation-results.md: the score, the counts, every surviving mutant, and those listed in
mutation/equivalent.toml (mutants that cannot change any output) with their reasons.

Not run by .ci/run: it takes far longer than CI's limit. Run it after any change to the core.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "build" / "mutation"
RESULTS = ROOT / "mutation" / "results.json"
REPORT = ROOT / "docs" / "mutation-results.md"
EQUIVALENT = ROOT / "mutation" / "equivalent.toml"

# module: (files to mutate, the fast test files that exercise them). mutmut and narrow.py then pick,
# per mutant, the tests among these that reach it.
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "head": (["lmhead_cli/head.py"], ["tests/test_head.py", "tests/test_diff.py", "tests/test_kernels.py"]),
    "stages": (["lmhead_cli/decoding/stages.py", "lmhead_cli/decoding/presets.py", "lmhead_cli/api/presets.py"],
               ["tests/test_decoding.py"]),
    # test_generate_cli: the rates and mean entropy (Generation's properties), ids against transformers
    "generate": (["lmhead_cli/decoding/generate.py"],
                 ["tests/test_generation.py", "tests/test_logprobs.py", "tests/test_generate_cli.py"]),
    # test_batch: padded batches (the attention mask); test_attribute: components; test_int8: the int8 paths;
    # test_kernels: a decoding step's attention through the compiled kernel against torch's products
    "lean": (["lmhead_cli/engine/lean.py"],
             ["tests/test_engine_parity.py", "tests/test_lens.py", "tests/test_batch.py",
              "tests/test_attribute.py", "tests/test_int8.py", "tests/test_kernels.py"]),
    # test_html: the alternatives; test_logprobs: top log-probs handed over chunk by chunk (on_rows);
    # test_compare: compare walks the windows through score's Window
    "score": (["lmhead_cli/readings/score.py", "lmhead_cli/readings/ranks.py", "lmhead_cli/chunks.py"],
              ["tests/test_score.py", "tests/test_html.py", "tests/test_logprobs.py",
               "tests/test_compare.py"]),
    # test_architectures: the RMSNorm branch (no beta) on Llama, and Gemma-2's refusal
    "attribute": (["lmhead_cli/readings/attribute.py"], ["tests/test_attribute.py", "tests/test_architectures.py"]),
    "diff": (["lmhead_cli/readings/diff.py"], ["tests/test_diff.py"]),
    "lens": (["lmhead_cli/readings/lens.py"], ["tests/test_lens.py"]),
    "compare": (["lmhead_cli/readings/compare.py", "lmhead_cli/readings/agreement.py"],
                ["tests/test_compare.py"]),
}
DETECTED = ("killed", "timeout", "segfault")  # a test failed, or the mutant hung or crashed its process
SAMPLE_SEED = 22  # --sample's seed: a module's sample is the same on every run of the same code
JOBS = 2  # mutant processes at a time: the 2-core machines this project runs on
# A mutant's CPU-time limit, which mutmut sets to (its tests' time in the stats run + constant) × multiplier × 2:
# (t + 10 s) × 6. CPU time, not wall time, so a busy machine does not turn slow mutants into timeouts.
TIMEOUT_MULTIPLIER, TIMEOUT_CONSTANT = 3.0, 10.0


def mutmut_section(files: list[str], tests: list[str]) -> str:
    def toml_list(items):
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    return (f"\n[tool.mutmut]\nsource_paths = [\"lmhead_cli\"]\nonly_mutate = {toml_list(files)}\n"
            f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
            f"pytest_add_cli_args = [\"-p\", \"narrow\", \"-p\", \"no:cacheprovider\"]\n"
            f"also_copy = [\"narrow.py\", \"configs\"]\nprocess_isolation = \"forkserver\"\n"
            f"timeout_multiplier = {TIMEOUT_MULTIPLIER}\ntimeout_constant = {TIMEOUT_CONSTANT}\n"
            f"use_git_change_detection = false\n")


KEPT_DECORATORS = ("staticmethod", "classmethod")  # the only decorators mutmut 3 mutates under


def undecorate(source: str) -> str:
    """The source with each decorated function (top level, or a method of a top-level class: the
    functions mutmut mutates) written undecorated, its decorators applied by an assignment right after
    it: `@property` over `def p` becomes `p = property(p)` after it, `@a @b def f` becomes `f = a(b(f))`.
    mutmut 3 skips decorated functions (bar a lone @staticmethod or @classmethod) because it would put
    its trampoline under the decorators; applied afterwards, the decorator wraps the trampoline and the
    function, its behaviour unchanged, gets mutants. A decorator that names the function (`@p.setter`)
    reads the earlier binding, saved under another name before the def."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        for f in members:
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or not f.decorator_list:
                continue
            only = f.decorator_list[0]
            if len(f.decorator_list) == 1 and isinstance(only, ast.Name) and only.id in KEPT_DECORATORS:
                continue
            found.append(f)
    lines = source.splitlines(keepends=True)
    for f in sorted(found, key=lambda f: f.lineno, reverse=True):  # bottom-up: earlier line numbers stay valid
        indent = " " * f.col_offset
        saved = f"_undecorated_{f.name}"
        renamer = _Rename(f.name, saved)
        applied = f.name
        for d in reversed(f.decorator_list):
            text = ast.unparse(renamer.visit(d))
            applied = f"{text}({applied})" if isinstance(d, (ast.Name, ast.Attribute, ast.Call)) else f"({text})({applied})"
        after = [f"{indent}{f.name} = {applied}\n"] + ([f"{indent}del {saved}\n"] if renamer.used else [])
        before = [f"{indent}{saved} = {f.name}\n"] if renamer.used else []
        end = f.end_lineno
        if not lines[end - 1].endswith("\n"):
            lines[end - 1] += "\n"
        lines[end:end] = after
        lines[f.decorator_list[0].lineno - 1:f.lineno - 1] = before  # the decorator lines (the def's is f.lineno)
    return "".join(lines)


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new, self.used = old, new, False

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id != self.old:
            return node
        self.used = True
        return ast.copy_location(ast.Name(id=self.new, ctx=node.ctx), node)


def prepare(name: str) -> Path:
    """A fresh scratch copy for one module: the package (with configs/ inside, as installed), configs/
    (test_decoding reads it), the tests, the plugin, and pyproject.toml with this module's [tool.mutmut];
    the module's files undecorated (see `undecorate`)."""
    files, tests = MODULES[name]
    work = SCRATCH / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "lmhead_cli", work / "lmhead_cli", ignore=ignore)
    shutil.copytree(ROOT / "configs", work / "lmhead_cli" / "configs", ignore=ignore)
    shutil.copytree(ROOT / "configs", work / "configs", ignore=ignore)  # where the tests read the bundled files
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    for f in files:  # mutmut skips decorated functions: apply their decorators by assignment instead
        (work / f).write_text(undecorate((work / f).read_text()))
    shutil.copy(ROOT / "mutation" / "narrow.py", work / "narrow.py")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "[tool.mutmut]" not in pyproject, "the [tool.mutmut] section is written per module by mutation/run.py"
    (work / "pyproject.toml").write_text(pyproject + mutmut_section(files, tests))
    (work / "provenance.json").write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": git_commit()}))
    return work


def mutmut(work: Path, *args: str, log=None) -> subprocess.CompletedProcess:
    files, _ = MODULES[work.name]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST")}
    env.update(LMHEAD_MUTATION_FILES=",".join(files), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=work, env=env, text=True,
                          stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if log else subprocess.PIPE)


def statuses(work: Path) -> dict[str, str]:
    out = mutmut(work, "results", "--all", "true").stdout
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s+(\S+__mutmut_\d+): (.+)$", out, re.M)}


def diff_of(work: Path, mutant: str) -> tuple[str, list[str], list[str]]:
    """(function, removed lines, added lines) of a mutant, lines stripped."""
    out = mutmut(work, "show", mutant).stdout.splitlines()
    removed = [line[1:].strip() for line in out if line.startswith("-") and not line.startswith("---")]
    added = [line[1:].strip() for line in out if line.startswith("+") and not line.startswith("+++")]
    return function_of(mutant), removed, added


def function_of(mutant: str) -> str:
    """'lmhead_cli.head.x_ranks__mutmut_7' -> 'lmhead_cli.head.ranks'; methods 'module.Class.method'."""
    module, _, rest = mutant.rpartition(".")
    mangled = rest.rpartition("__mutmut_")[0]
    return f"{module}.{'.'.join(mangled.split('ǁ')[1:])}" if mangled.startswith("xǁ") else f"{module}.{mangled[2:]}"


def equivalents() -> list[dict]:
    if not EQUIVALENT.exists():
        return []
    return tomllib.loads(EQUIVALENT.read_text()).get("equivalent", [])


def reason_for(function: str, added: list[str], known: list[dict]) -> str | None:
    """The reason a mutant is equivalent, if mutation/equivalent.toml lists it (by function and the
    mutated line, so that it survives edits elsewhere in the file)."""
    mutated = " / ".join(added)
    for e in known:
        if e["function"] == function and e["mutant"].strip() == mutated:
            return e["reason"]
    return None


def all_mutants(work: Path) -> list[str]:
    """Every mutant mutmut makes of the module's files, named as `mutmut results` names them (mutmut's own
    generator, run in the scratch folder, where its configuration is)."""
    files, _ = MODULES[work.name]
    code = ("import json, sys\nfrom pathlib import Path\n"
            "from mutmut.mutation.file_mutation import mutate_file_contents\n"
            "from mutmut.utils.format_utils import get_mutant_name\n"
            "print(json.dumps([get_mutant_name(Path(f), n) for f in sys.argv[1:]"
            " for n in mutate_file_contents(f, Path(f).read_text()).mutant_names]))")
    out = subprocess.run([sys.executable, "-c", code, *files], cwd=work, text=True, capture_output=True)
    if out.returncode != 0:
        raise SystemExit(f"could not list {work.name}'s mutants:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def sample_of(name: str, mutants: list[str], fraction: float, seed: int = SAMPLE_SEED) -> list[str]:
    """A seeded random sample of a module's mutants (the same for the same module, mutants, fraction and
    seed), in the mutants' order. A new seed draws a fresh sample: after tests were written for one
    sample's survivors, only a fresh one measures the suite without that bias."""
    import random

    k = min(len(mutants), max(1, round(len(mutants) * fraction)))
    chosen = set(random.Random(f"{name}:{seed}").sample(sorted(mutants), k))
    return [m for m in mutants if m in chosen]


def run_module(name: str, jobs: int, fraction: float | None = None, seed: int = SAMPLE_SEED) -> dict:
    work = prepare(name)
    start = time.time()
    log_path = work / "mutmut.log"
    names: list[str] = []
    if fraction is not None:
        every = all_mutants(work)
        names = sample_of(name, every, fraction, seed)
        (work / "sample.json").write_text(json.dumps({"fraction": fraction, "seed": seed, "of": len(every),
                                                      "mutants": names}))
    with open(log_path, "w") as log:
        done = mutmut(work, "run", "--max-children", str(jobs), *names, log=log)
    (work / "seconds").write_text(str(round(time.time() - start)))
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"mutmut failed on {name} (exit {done.returncode}); the end of {log_path}:\n{tail}")
    return collect(name)


def rerun_survivors(name: str, jobs: int) -> dict:
    """After new tests: copy the tests (and the plugin) into the module's scratch folder and rerun only
    its mutants that were not detected; mutmut records the new tests' calls first. Then collect.
    Only tests are copied: after a change to the package itself, run the module afresh. Where the scratch
    folder is not the recorded run's (a fresh clone, or the run was made in another worktree), the rerun
    starts from the record instead (`rerun_from_record`)."""
    work = SCRATCH / name
    record = recorded(name)
    made = work / "provenance.json"
    if record and (not made.exists() or json.loads(made.read_text()) != {"date": record["date"], "commit": record["commit"]}):
        return rerun_from_record(name, jobs, record)
    before = statuses(work)
    sampled = set(json.loads((work / "sample.json").read_text())["mutants"]) if (work / "sample.json").exists() else None
    left = [m for m, status in before.items() if status not in DETECTED and (sampled is None or m in sampled)]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for where in (work, work / "mutants"):
        shutil.copytree(ROOT / "tests", where / "tests", ignore=ignore, dirs_exist_ok=True)
        shutil.copy(ROOT / "mutation" / "narrow.py", where / "narrow.py")
    start = time.time()
    rerun_mutants(work, name, jobs, left)
    seconds = work / "seconds"
    seconds.write_text(str(int(seconds.read_text() if seconds.exists() else 0) + round(time.time() - start)))
    return collect(name)


def rerun_mutants(work: Path, name: str, jobs: int, left: list[str]) -> None:
    """mutmut on the mutants `left` in the scratch folder `work` (it records the tests' calls first)."""
    if not left:
        return
    log_path = work / "mutmut-rerun.log"
    with open(log_path, "w") as log:
        done = mutmut(work, "run", "--max-children", str(jobs), *left, log=log)
    if done.returncode != 0:  # e.g. the stats of the new tests could not be collected: nothing was rerun
        raise SystemExit(f"mutmut failed rerunning {name} (exit {done.returncode}); results left as they were; "
                         f"the end of {log_path}:\n{log_path.read_text()[-3000:]}")


def recorded(name: str) -> dict | None:
    return json.loads(RESULTS.read_text()).get(name) if RESULTS.exists() else None


def rerun_from_record(name: str, jobs: int, record: dict) -> dict:
    """--rerun without the recorded run's scratch folder: a fresh scratch copy of the package and tests,
    checked to make the very mutants the recorded run made (else the code changed: run afresh), runs
    only the mutants the record lists as undetected (survivors and equivalents); every other mutant
    keeps its recorded status. The date and commit stay the recorded run's, as in a plain rerun."""
    work = prepare(name)
    if drawn(all_mutants(work)) != record["drawn"]:
        raise SystemExit(f"{name}: the code now makes other mutants than its recorded run ({record['commit']}); "
                         f"run the module afresh")
    start = time.time()
    rerun_mutants(work, name, jobs, [e["mutant"] for e in record["survivors"] + record["equivalent"]])
    (work / "seconds").write_text(str(record["seconds"] + round(time.time() - start)))
    # the record's date and commit, marked: this folder ran only some mutants, so a later --rerun starts
    # from the record again rather than rerunning every mutant this folder left unchecked
    (work / "provenance.json").write_text(json.dumps({"date": record["date"], "commit": record["commit"],
                                                      "from_record": True}))
    return merged(record, collect(name), statuses(work))


def merged(record: dict, rerun: dict, now: dict[str, str]) -> dict:
    """A record updated by a rerun of its undetected mutants (`rerun`: collect's result, where the mutants
    not rerun read "not checked"; `now`: the rerun's status of each mutant): those mutants take their new
    status, every other one keeps its recorded status, and the sample and test counts stay the record's."""
    counts = dict(record["counts"])
    for e in record["survivors"] + record["equivalent"]:
        counts[e["status"]] -= 1
        counts[now[e["mutant"]]] = counts.get(now[e["mutant"]], 0) + 1
    counts = {k: v for k, v in counts.items() if v}
    detected = sum(counts.get(k, 0) for k in DETECTED)
    considered = rerun["mutants"] - counts.get("not checked", 0) - len(rerun["equivalent"])
    return {**rerun, "counts": counts, "detected": detected, "considered": considered, "sample": record["sample"],
            "tests_per_mutant": record["tests_per_mutant"],
            "score": round(100 * detected / considered, 1) if considered else None}


def collect(name: str) -> dict:
    """The results of a module from its scratch folder (after `run_module`, or after rerunning some of
    its mutants there with `python -m mutmut run NAME`)."""
    work = SCRATCH / name
    found = statuses(work)
    if not found:
        raise SystemExit(f"no mutmut results in {work}; run the module first")
    elapsed = int((work / "seconds").read_text()) if (work / "seconds").exists() else 0
    known = equivalents()
    survivors, equivalent = [], []
    for mutant, status in sorted(found.items()):
        if status in DETECTED or status == "not checked":
            continue
        function, removed, added = diff_of(work, mutant)
        entry = {"mutant": mutant, "status": status, "function": function, "removed": removed, "added": added}
        reason = reason_for(function, added, known) if status == "survived" else None
        if reason:
            equivalent.append({**entry, "reason": reason})
        else:
            survivors.append(entry)
    narrowed = [line.split() for line in (work / "mutants" / "narrow.log").read_text().splitlines()] \
        if (work / "mutants" / "narrow.log").exists() else []
    counts: dict[str, int] = {}
    for status in found.values():
        counts[status] = counts.get(status, 0) + 1
    detected = sum(counts.get(s, 0) for s in DETECTED)
    considered = len(found) - counts.get("not checked", 0) - len(equivalent)  # an interrupted run leaves some unchecked
    made = json.loads((work / "provenance.json").read_text())
    sample = json.loads((work / "sample.json").read_text()) if (work / "sample.json").exists() else None
    return {"module": name, "files": MODULES[name][0], "tests": MODULES[name][1],
            "date": made["date"], "commit": made["commit"], "seconds": round(elapsed),
            "mutants": len(found), "counts": counts, "equivalent": equivalent, "survivors": survivors,
            "detected": detected, "considered": considered,
            "drawn": drawn(list(found)),  # which mutants the code made: a full run's first pass is kept by it
            "sample": {"fraction": sample["fraction"], "seed": sample.get("seed", SAMPLE_SEED),
                       "mutants": len(sample["mutants"]), "of": sample["of"], "drawn": drawn(sample["mutants"])}
            if sample else None,
            # mean tests per mutant: those that call its function (mutmut), those that execute its statement (narrow.py)
            "tests_per_mutant": [round(sum(int(n[1]) for n in narrowed) / len(narrowed), 1),
                                 round(sum(int(n[2]) for n in narrowed) / len(narrowed), 1)] if narrowed else None,
            "score": round(100 * detected / considered, 1) if considered else None}


def drawn(names: list[str]) -> str:
    """A short digest of the mutants a sample drew: the same seed draws other mutants once the
    module's code (and so its list of mutants) changes."""
    import hashlib

    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:12]


def first_pass(previous: dict | None, new: dict) -> dict | None:
    """The figures of the first run of the same mutants (the same sample drawn, or for a full run the
    same code's mutants), which a rerun or a fresh run of them after new tests must not overwrite: only
    that first pass measures the tests as they were before its survivors were seen. It keeps the names
    of its survivors, so that one marked equivalent later leaves its denominator (`first_counts`).
    None when `new` is itself a first pass (new mutants)."""
    if not previous or draw_of(previous) is None or draw_of(previous) != draw_of(new):
        return None
    return previous.get("first_pass") or {"detected": previous["detected"], "considered": previous["considered"],
                                           "commit": previous["commit"], "date": previous["date"],
                                           "survivors": [s["mutant"] for s in previous["survivors"]]}


def draw_of(r: dict) -> str | None:
    """The digest of the mutants a result ran: its sample's, or all the module's for a full run."""
    return r["sample"].get("drawn") if r.get("sample") else r.get("drawn")


def first_counts(r: dict) -> tuple[int, int]:
    """(detected, considered) of a module's first pass (its latest run when that is the first), less
    the first pass's survivors that have since been marked equivalent (they cannot change any output,
    so they were never in the score's denominator)."""
    fp = r.get("first_pass")
    if not fp:
        return r["detected"], r["considered"]
    now_equivalent = {e["mutant"] for e in r["equivalent"]}
    return fp["detected"], fp["considered"] - len(now_equivalent.intersection(fp.get("survivors", [])))


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "lmhead_cli", "tests"], cwd=ROOT, text=True,
                           capture_output=True).stdout.strip()
    return r.stdout.strip() + (" + uncommitted changes" if dirty else "")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion k/n, in percent."""
    if n == 0:
        return 0.0, 100.0
    p = k / n
    centre, half = p + z * z / (2 * n), z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5
    return 100 * (centre - half) / (1 + z * z / n), 100 * (centre + half) / (1 + z * z / n)


def core_estimate(rows: list[dict]) -> tuple[float, float, float]:
    """The score over every mutant of the modules run, from their samples: each module's score weighted by
    its mutant count (a stratified estimate), with a normal 95% interval (each module's variance from the
    Agresti-Coull proportion, so that a sample without survivors does not claim certainty); in percent."""
    total = sum(r["mutants"] for r in rows if r["considered"])
    mid = var = 0.0
    for r in rows:
        if not r["considered"]:
            continue
        w, p, n = r["mutants"] / total, r["detected"] / r["considered"], r["considered"]
        mid += w * p
        q = (r["detected"] + 2) / (n + 4)  # Agresti-Coull: a sample with no survivors still leaves some doubt
        var += w * w * q * (1 - q) / n * (1 - n / r["mutants"] if r.get("sample") else 0.0)  # finite population
    half = 1.96 * var ** 0.5
    return 100 * max(0.0, mid - half), 100 * mid, 100 * min(1.0, mid + half)


def write_report(results: dict) -> None:
    rows = [results[m] for m in MODULES if m in results]
    missing = [m for m in MODULES if m not in results]
    detected = sum(r["detected"] for r in rows)
    considered = sum(r["considered"] for r in rows)
    lines = ["# Mutation testing results", "",
             "Written by `python mutation/run.py` (see [mutation-testing.md](mutation-testing.md)); do not edit by hand.",
             "Score = mutants detected (a test failed, or the mutant timed out or crashed) / mutants that are not "
             "equivalent.", ""]
    if rows:
        lines += [f"**Over the modules run: {detected} of {considered} non-equivalent mutants detected: "
                  f"{100 * detected / considered:.1f}%** "
                  f"({sum(r['mutants'] for r in rows)} mutants, {sum(len(r['equivalent']) for r in rows)} equivalent).", ""]
    if any(r.get("sample") for r in rows):
        low, mid, high = core_estimate(rows)
        lines += ["Some modules ran a seeded random sample of their mutants (`--sample`; the rest count as not "
                  "checked). Estimated over every mutant of the modules run, each module's score weighted by its "
                  f"mutants: **{mid:.1f}%** (95% interval {low:.1f}% to {high:.1f}%). Once tests are written for a "
                  "sample's survivors (`--rerun`), the sample is no longer a random draw for those tests: its score "
                  "then overstates the module's, and a fresh sample (or the full run) is the measure.", ""]
    if any(r.get("first_pass") for r in rows):
        firsts = [dict(zip(("detected", "considered"), first_counts(r))) for r in rows]
        fd, fc = sum(f["detected"] for f in firsts), sum(f["considered"] for f in firsts)
        low, mid, high = core_estimate([{**r, **f} for r, f in zip(rows, firsts)])
        lines += [f"**First pass** (each module's mutants as first run, before any test was written for their "
                  f"survivors: the unbiased measure of the suite; survivors marked equivalent since then are left "
                  f"out): {fd} of {fc} detected, {100 * fd / fc:.1f}%; estimated over every mutant {mid:.1f}% (95% "
                  f"interval {low:.1f}% to {high:.1f}%). The table's columns are the latest run of each module, "
                  "after the tests written for its survivors.", ""]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)}.", ""]
    lines += ["| module | date | commit | mutants | sampled | first pass | detected | survived | no tests | equivalent "
              "| not checked | score (95% interval) | time |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["counts"]
        sampled = f"{r['sample']['mutants']} (seed {r['sample'].get('seed', SAMPLE_SEED)})" if r.get("sample") else "all"
        low, high = wilson(r["detected"], r["considered"])
        fp = r.get("first_pass")
        first = "{}/{} ({})".format(*first_counts(r), fp["commit"]) if fp else "this run"
        lines.append(f"| {r['module']} | {r['date']} | {r['commit']} | {r['mutants']} | {sampled} | {first} | {r['detected']} | "
                     f"{c.get('survived', 0) - len(r['equivalent'])} | {c.get('no tests', 0)} | {len(r['equivalent'])} | "
                     f"{c.get('not checked', 0)} | {r['score']}% ({low:.1f}-{high:.1f}) | {r['seconds'] // 60} min |")
    for r in rows:
        if r.get("tests_per_mutant"):
            by_function, by_statement = r["tests_per_mutant"]
            lines.append(f"- {r['module']}: {by_function} tests per mutant reach its function, {by_statement} its "
                         f"statement (only those run); test files: {', '.join(r['tests'])}")
    lines += ["", "## Surviving mutants", ""]
    any_left = False
    for r in rows:
        for s in r["survivors"]:
            any_left = True
            lines.append(f"- `{s['mutant']}` ({s['status']}): `{' / '.join(s['removed'])}` → `{' / '.join(s['added'])}`")
    if not any_left:
        lines.append("None.")
    lines += ["", "## Equivalent mutants (cannot change any output)", ""]
    for r in rows:
        for e in r["equivalent"]:
            lines.append(f"- `{e['function']}`: `{' / '.join(e['removed'])}` → `{' / '.join(e['added'])}`: {e['reason']}")
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("modules", nargs="*", help=f"modules to run (default: all): {', '.join(MODULES)}")
    p.add_argument("--jobs", type=int, default=JOBS, help="mutant processes at a time")
    p.add_argument("--list", action="store_true", help="list the modules, their files and tests")
    p.add_argument("--report-only", action="store_true", help="rewrite the report from mutation/results.json")
    p.add_argument("--rerun", action="store_true",
                   help="after writing tests: rerun only the mutants a module's last run did not detect")
    p.add_argument("--collect", action="store_true",
                   help="read the results from the modules' scratch folders again, without running mutmut")
    p.add_argument("--sample", type=float, metavar="FRACTION",
                   help="run a seeded random sample of each module's mutants (0 < FRACTION ≤ 1); the report "
                        "gives the score of the sample with its 95%% interval")
    p.add_argument("--seed", type=int, default=SAMPLE_SEED,
                   help=f"--sample's seed (default {SAMPLE_SEED}); a new seed draws a fresh sample")
    p.add_argument("--tests", nargs="+", help="test files to use instead of the module's (a trial; not recorded)")
    a = p.parse_args()
    if a.list:
        for name, (files, tests) in MODULES.items():
            print(f"{name}: {' '.join(files)}\n    tests: {' '.join(tests)}")
        return
    if a.sample is not None and not 0 < a.sample <= 1:
        p.error(f"--sample must be a fraction above 0 and at most 1 (got {a.sample})")
    unknown = [m for m in a.modules if m not in MODULES]
    if unknown:
        p.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    for name in [] if a.report_only else (a.modules or list(MODULES)):
        if a.tests:
            MODULES[name] = (MODULES[name][0], a.tests)
        print(f"{name}: {'collecting' if a.collect else 'running mutmut on'} {', '.join(MODULES[name][0])} ...", flush=True)
        r = collect(name) if a.collect else rerun_survivors(name, a.jobs) if a.rerun else run_module(name, a.jobs, a.sample, a.seed)
        if a.tests:
            print(json.dumps(r, indent=1, ensure_ascii=False))
            continue
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # another module's run may have written
        first = first_pass(results.get(name), r)
        if first:
            r["first_pass"] = first
        results[name] = r
        RESULTS.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        write_report(results)
        print(f"{name}: {r['detected']}/{r['considered']} detected ({r['score']}%), {len(r['survivors'])} surviving, "
              f"{len(r['equivalent'])} equivalent, {r['seconds']} s", flush=True)
    write_report(json.loads(RESULTS.read_text()) if RESULTS.exists() else {})


if __name__ == "__main__":
    main()
