"""Every example in README.md and docs/*.md runs, and prints what its page shows.

The convention (docs/architecture.md, "How the docs are tested"):
- a fenced block (``` / ```bash / ```console) with `$ ` lines is a shell session: each `$ ` line is a
  command, the lines up to the next `$ ` line are its output as shown; a block without `$ ` lines runs
  its lines that begin with `lmhead ` and checks their exit codes only;
- the exit code is 0, or 1/2 where the shown output has an `lmhead: error:` line; every shown line but
  `...` must appear in the real output (stdout or stderr), word by word (so a line may wrap elsewhere),
  each number exactly as printed: changing any digit of an example fails the test. A number that
  legitimately varies (a timing, float32 summed in another order) is named with its tolerance by a
  `<!-- docs-test: tolerance "SHOWN" WIDTH (reason) -->` marker; there are no wildcards. Shown output
  that is one JSON document must have the real keys;
- a ```python block with `>>> ` prompts is a doctest (one namespace per page);
- markers on the line(s) before a block: `<!-- docs-test: skip (reason) -->`,
  `<!-- docs-test: replace "OLD" "NEW" -->`, `<!-- docs-test: run -->` (a ```python script, run in the
  page's folder), `<!-- docs-test: exit N -->`, `<!-- docs-test: tolerance "SHOWN" WIDTH (reason) -->`.
Each page runs in a folder of its own, in order. `lmhead ARGS` (and `TEXT | lmhead ARGS`) runs in-process
with every model loaded once per session; any other command runs in bash, `lmhead` being
`python -m lmhead_cli`.

`python tests/test_docs.py PAGE.md` prints what each of a page's commands really prints (to copy
real output into a page).
"""

from __future__ import annotations

import doctest
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"", "bash", "console", "sh", "shell"}
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<what>\w+)\s*(?P<rest>.*?)\s*-->\s*$")
TIMEOUT = 600
COLUMNS = "100"  # the width the pages' outputs are copied at (`python tests/test_docs.py PAGE.md`)


@dataclass
class Command:
    line: str  # the command as it will run (replacements made)
    shown: list[str]  # the output the page shows for it
    lineno: int
    tolerance: dict[str, float] = field(default_factory=dict)  # shown number -> how far the real one may be


@dataclass
class Example:
    page: Path
    lineno: int  # of the opening fence
    kind: str  # "shell", "doctest" or "script"
    text: str  # the block's content
    commands: list[Command] = field(default_factory=list)
    skip: str | None = None
    exit: int | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.lineno}"


def parse(page: Path) -> list[Example]:
    """The page's examples, in order, with their markers applied."""
    examples, markers = [], []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line.strip())
        if m:
            markers.append((m["what"], m["rest"], i + 1))
        elif line.startswith("```"):
            lang = line[3:].strip().split(" ")[0].lower()
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            ex = _example(page, start, lang, body, markers)
            if ex is not None:
                examples.append(ex)
            markers = []
        elif line.strip():
            markers = []  # a marker applies only to the block right after it
        i += 1
    return examples


def _example(page: Path, lineno: int, lang: str, body: list[str], markers) -> Example | None:
    replace, skip, exit_code, run, tolerance = [], None, None, False, {}
    for what, rest, at in markers:
        if what == "skip":
            skip = rest.strip().strip("()").strip()
            if not skip:
                raise ValueError(f"{page.name}:{at}: docs-test: skip needs a reason in parentheses")
        elif what == "replace":
            pair = shlex.split(rest)
            if len(pair) != 2:
                raise ValueError(f'{page.name}:{at}: docs-test: replace takes "OLD" "NEW"')
            replace.append(tuple(pair))
        elif what == "exit":
            exit_code = int(rest)
        elif what == "run":
            run = True
        elif what == "tolerance":
            m = re.fullmatch(r'"(?P<shown>[^"]+)"\s+(?P<width>[0-9.eE+-]+)\s+\((?P<why>[^)]+)\)', rest.strip())
            if not m or _number(m["shown"]) is None:
                raise ValueError(f'{page.name}:{at}: docs-test: tolerance takes "NUMBER" WIDTH (reason)')
            tolerance[m["shown"]] = float(m["width"])
        else:
            raise ValueError(f"{page.name}:{at}: unknown docs-test marker {what!r}")
    text = "\n".join(body) + "\n"
    if lang == "python":
        if any(b.lstrip().startswith(">>> ") for b in body):
            return Example(page, lineno, "doctest", text, skip=skip)
        return Example(page, lineno, "script", text, skip=skip) if run else None
    if lang not in SHELLS:
        return None

    def swap(cmd: str) -> str:
        for old, new in replace:
            cmd = cmd.replace(old, new)
        return cmd

    commands: list[Command] = []
    if any(b.startswith("$ ") for b in body):
        for n, b in enumerate(body):
            if b.startswith("$ "):
                commands.append(Command(swap(b[2:]), [], lineno + 1 + n))
            elif commands:
                commands[-1].shown.append(b)
    else:
        commands = [Command(swap(b), [], lineno + 1 + n) for n, b in enumerate(body) if b.startswith("lmhead ")]
    if not commands:
        return None
    for cmd in commands:
        cmd.tolerance = tolerance
    return Example(page, lineno, "shell", text, commands, skip, exit_code)


# ---- checking output ---------------------------------------------------------------------------------
BOX = re.compile(r"[\s│┃━─╇╋┼┡┩┗┛┏┓╭╮╰╯]+")


NUMBER = re.compile(r"[+\-−]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][+\-]?\d+)?")
PIECE = re.compile(NUMBER.pattern + r"|[^\d+\-−.]+|.")


def words(text: str) -> list[str]:
    """The text's words, box-drawing characters and line breaks aside (a line may wrap elsewhere), each
    number inside a word a word of its own (`"logit":2.417,` is `"logit":`, `2.417`, `,`)."""
    return [p for w in BOX.split(text) if w for p in PIECE.findall(w)]


def _number(word: str) -> float | None:
    if not NUMBER.fullmatch(word):
        return None
    try:
        return float(word.replace(",", "").replace("−", "-"))
    except ValueError:
        return None


def same_word(shown: str, real: str, tolerance: dict[str, float]) -> bool:
    """Equal, or a number that the page gives a tolerance for, within it."""
    if shown == real:
        return True
    if shown not in tolerance:
        return False
    a, b = _number(shown), _number(real)
    return a is not None and b is not None and abs(a - b) <= tolerance[shown]


def contains(hay: list[str], needle: list[str], tolerance: dict[str, float] | None = None) -> bool:
    if not needle:
        return True
    n, tolerance = len(needle), tolerance or {}
    return any(all(same_word(w, h, tolerance) for w, h in zip(needle, hay[i:i + n]))
               for i in range(len(hay) - n + 1))


def key_lines(shown: list[str]) -> list[str]:
    """The shown lines a real run must print: every line but an elision (`...`, `…`)."""
    return [s for s in shown if s.strip() and not s.lstrip().startswith(("...", "…"))]


def check(cmd: Command, code: int, out: str, err: str, exit_code: int | None) -> list[str]:
    """What is wrong with one command's run, as readable lines (empty: it did what the page shows)."""
    problems = []
    error_shown = any(s.startswith("lmhead: error:") for s in cmd.shown)
    if exit_code is not None:
        if code != exit_code:
            problems.append(f"exit code {code}, the page says {exit_code}")
    elif error_shown and code not in (1, 2):
        problems.append(f"exit code {code}, but the page shows an error (exit 1 or 2)")
    elif not error_shown and code != 0:
        problems.append(f"exit code {code}")
    shown_text = "\n".join(cmd.shown).strip()
    if shown_text.startswith(("{", "[")):
        try:
            doc = json.loads(shown_text)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            try:
                real = json.loads(out)
            except ValueError:
                return problems + ["the page shows one JSON document; the command printed something else"]
            if set(real) != set(doc):
                problems.append(f"JSON keys differ: page {sorted(doc)}, real {sorted(real)}")
            return problems
    out_words, err_words = words(out), words(err)
    for s in key_lines(cmd.shown):
        w = words(s)
        if not (contains(out_words, w, cmd.tolerance) or contains(err_words, w, cmd.tolerance)):
            problems.append(f"not printed: {s.strip()!r}")
    return problems


# ---- running ----------------------------------------------------------------------------------------
PIPE_INTO = re.compile(r"^(?P<left>[^|]+?)\s*\|\s*(?P<right>lmhead\s.*)$")
SHELL_CHARS = set("|&;<>()$`*?")


def in_process(line: str) -> tuple[list[str], str | None, bool] | None:
    """(args, the shell command whose stdout is the input, whether stderr is discarded) when the line can
    run through the CLI runner; None when it needs a shell."""
    line = line.split("  #")[0].strip()
    left = None
    m = PIPE_INTO.match(line)
    if m and "lmhead" not in m["left"]:
        left, line = m["left"], m["right"]
    quiet = line.endswith("2>/dev/null")
    line = line.removesuffix("2>/dev/null").strip()
    try:
        parts = shlex.split(line)
    except ValueError:
        return None
    if not parts or parts[0] != "lmhead" or any(set(p) & SHELL_CHARS and not _quoted(p, line) for p in parts):
        return None
    return parts[1:], left, quiet


def _quoted(part: str, line: str) -> bool:
    """Whether a word with shell characters was quoted in the line (then it is an argument)."""
    return f'"{part}"' in line or f"'{part}'" in line


_MODELS: dict = {}


def _cached_load_model(real):
    def load_model(source, **kwargs):
        key = (os.path.abspath(source) if os.path.exists(source) else source,
               tuple(sorted((k, v) for k, v in kwargs.items() if k != "announce")))
        if key not in _MODELS:
            _MODELS[key] = real(source, **kwargs)
        return _MODELS[key]

    return load_model


def bash(line: str, cwd: Path, env: dict, input: str | None = None) -> tuple[int, str, str]:
    lmhead = f"lmhead() {{ {shlex.quote(sys.executable)} -m lmhead_cli \"$@\"; }}; export -f lmhead 2>/dev/null; "
    done = subprocess.run(["bash", "-c", lmhead + line], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, input=input)
    return done.returncode, done.stdout, done.stderr


def run_command(cmd: Command, cwd: Path, env: dict) -> tuple[int, str, str]:
    plan = in_process(cmd.line)
    if plan is None:
        return bash(cmd.line, cwd, env)
    from helpers import cli

    args, left, quiet = plan
    stdin = None
    if left is not None:
        code, stdin, err = bash(left, cwd, env)
        if code != 0:
            return code, stdin, err
    old = os.getcwd()
    os.chdir(cwd)
    try:
        got = cli(*args, input=stdin, env={"COLUMNS": COLUMNS})
    finally:
        os.chdir(old)
    return got.exit_code, got.stdout, "" if quiet else got.stderr


def run_script(ex: Example, cwd: Path, env: dict) -> list[str]:
    done = subprocess.run([sys.executable, "-"], input=ex.text, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    return [] if done.returncode == 0 else [f"exit code {done.returncode}: {done.stderr.strip()[-2000:]}"]


def subprocess_env() -> dict:
    env = dict(os.environ, COLUMNS=COLUMNS, NO_COLOR="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# ---- the tests ---------------------------------------------------------------------------------------
def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


SHELL_PAGES = [p for p in PAGES if any(e.kind in ("shell", "script") for e in parse(p))]
PYTHON_PAGES = [p for p in PAGES if any(e.kind == "doctest" for e in parse(p))]


def test_every_page_parses_and_has_no_unmarked_hub_model():
    """Each page's markers are well formed, and no example that runs loads the hub's gpt2 (offline)."""
    for page in PAGES:
        for ex in parse(page):
            for cmd in ex.commands:
                if ex.skip is None:
                    assert not re.search(r"--model\s+(gpt2|distilgpt2)\b", cmd.line), (
                        f"{ex.where}: {cmd.line!r} needs the hub; use random:gpt2 or a docs-test marker")


@pytest.fixture
def models_once(monkeypatch):
    """Every model that the examples load is loaded once per session (the loader is memoised)."""
    import lmhead_cli.loading.sources as sources

    monkeypatch.setattr(sources, "load_model", _cached_load_model(sources.load_model))


@pytest.mark.parametrize("page", SHELL_PAGES, ids=_id)
@pytest.mark.slow
def test_shell_examples(page, tmp_path, monkeypatch, models_once):
    """Each command of the page exits as shown and prints the shape of the output the page shows."""
    monkeypatch.setenv("NO_COLOR", "1")
    env = subprocess_env()
    failures, ran, skipped = [], 0, 0
    for ex in parse(page):
        if ex.kind == "doctest":
            continue
        if ex.skip is not None:
            skipped += 1
            continue
        if ex.kind == "script":
            failures += [f"{ex.where}: {p}" for p in run_script(ex, tmp_path, env)]
            continue
        for n, cmd in enumerate(ex.commands):
            last = n == len(ex.commands) - 1
            code, out, err = run_command(cmd, tmp_path, env)
            ran += 1
            for p in check(cmd, code, out, err, ex.exit if last else None):
                failures.append(f"{page.name}:{cmd.lineno}: $ {cmd.line}\n    {p}\n    stdout: {out[:800]!r}\n"
                                f"    stderr: {err[:800]!r}")
    assert not failures, f"{len(failures)} of {ran} examples differ from the page:\n" + "\n".join(failures)


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_id)
def test_python_examples(page, tmp_path, monkeypatch, models_once):
    """The page's >>> examples, as one doctest in page order."""
    monkeypatch.chdir(tmp_path)
    parser = doctest.DocTestParser()
    blocks = [ex for ex in parse(page) if ex.kind == "doctest" and ex.skip is None]
    globs: dict = {}
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for ex in blocks:
        test = parser.get_doctest(ex.text, globs, ex.where, str(page), ex.lineno)
        runner.run(test, out=report.append, clear_globs=False)
        globs = test.globs
    assert runner.failures == 0, "".join(report)


if __name__ == "__main__":  # print what each command of a page really prints
    sys.path.insert(0, str(ROOT / "tests"))
    import tempfile

    env = subprocess_env()
    with tempfile.TemporaryDirectory() as folder:
        for arg in sys.argv[1:]:
            for ex in parse(Path(arg).resolve()):
                if ex.skip is not None or ex.kind == "doctest":
                    continue
                if ex.kind == "script":
                    print(f"== {ex.where}: script", run_script(ex, Path(folder), env))
                    continue
                for cmd in ex.commands:
                    code, out, err = bash(cmd.line, Path(folder), env)
                    print(f"== {ex.page.name}:{cmd.lineno} exit {code}\n$ {cmd.line}\n{err}{out}")


def test_the_check_catches_what_a_page_would_get_wrong():
    """The checker itself: a wrong exit code, a missing header, a missing error line, different JSON keys
    and any changed digit are each caught; a rewrapped line is not a difference, nor a number within the
    tolerance its page gives it."""
    shown = ["random weights (random:gpt2, seeded): the architecture and the",
             " rank ┃ id ┃ token ┃ prob", "...", "entropy: 10.6704 nats = 15.3942 bits (bars are relative)"]
    out = ("random weights (random:gpt2, seeded):\nthe architecture and the arithmetic\n rank ┃  id ┃ token ┃ prob\n"
           "    1 │ 37060 │ heon │ 0.0191%\nentropy: 10.6704 nats = 15.3942\nbits (bars are relative)\n")
    assert check(Command("lmhead x", shown, 1), 0, out, "", None) == []
    assert check(Command("lmhead x", shown, 1), 0, out.replace("prob", "p"), "", None)  # a header changed
    assert check(Command("lmhead x", shown, 1), 1, out, "", None)  # an exit code the page does not show
    for i, ch in enumerate(shown[-1]):  # any digit of the example changed: caught
        if ch.isdigit():
            changed = shown[:-1] + [shown[-1][:i] + str((int(ch) + 1) % 10) + shown[-1][i + 1:]]
            assert check(Command("lmhead x", changed, 1), 0, out, "", None), changed[-1]
    near = out.replace("10.6704", "10.6709")
    assert check(Command("lmhead x", shown, 1), 0, near, "", None)
    assert check(Command("lmhead x", shown, 1, {"10.6704": 0.0005}), 0, near, "", None) == []
    assert check(Command("lmhead x", shown, 1, {"10.6704": 0.0004}), 0, near, "", None)  # past it
    assert check(Command("lmhead x", shown, 1, {"10.6704": 1}), 0, out.replace("10.6704 nats", "10.6704 bits"),
                 "", None)  # a tolerance is for the number, not its unit
    error = ["lmhead: error: --top-k must be at least 1 (got 0)"]
    assert check(Command("lmhead x", error, 1), 2, "", error[0] + "\n", None) == []
    assert check(Command("lmhead x", error, 1), 0, "", error[0] + "\n", None)  # an error must not exit 0
    assert check(Command("lmhead x", error, 1), 2, "", "lmhead: error: other\n", None)
    assert check(Command("lmhead x", error, 1), 2, "", error[0], 1)  # the marker's exit code wins
    assert check(Command("lmhead x", ['{"a": 1, "b": 2}'], 1), 0, '{"a": 5, "b": 6}', "", None) == []
    assert check(Command("lmhead x", ['{"a": 1, "b": 2}'], 1), 0, '{"a": 5}', "", None)


def test_a_changed_digit_in_the_readmes_examples_fails_its_check():
    """Each digit of each README example's shown output, changed, makes the check fail against what the
    page shows itself (standing for the real run, which the shell test compares it with): no number is
    a wildcard."""
    changed = 0
    for ex in parse(ROOT / "README.md"):
        for cmd in ex.commands:
            real = "\n".join(cmd.shown)
            for n, line in enumerate(cmd.shown):
                if line.lstrip().startswith(("...", "…")):
                    continue
                for i, ch in enumerate(line):
                    if ch.isdigit() and line[max(0, i - 1):i + 1] != ":" + ch:
                        other = cmd.shown[:n] + [line[:i] + str((int(ch) + 1) % 10) + line[i + 1:]] + cmd.shown[n + 1:]
                        mutated = Command(cmd.line, other, cmd.lineno, cmd.tolerance)
                        problems = check(mutated, 0, real, "", 0)
                        word = [w for w in words(line) if ch in w]
                        if all(w in cmd.tolerance for w in word):
                            continue
                        assert problems, (cmd.line, other[n])
                        changed += 1
    assert changed > 100


def test_the_parser_reads_sessions_markers_and_doctests(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('''# A page

```console
$ lmhead params
gpt2: counted
$ printf 'a\\n' > a.txt
```

<!-- docs-test: replace "--model gpt2" "--model random:gpt2" -->
```
lmhead inspect "x" --model gpt2   # a comment
pip install lmhead
```

<!-- docs-test: skip (serves until stopped) -->
```bash
$ lmhead serve
```

```python
>>> 1 + 1
2
```

```python
print("not run")
```
''', encoding="utf-8")
    found = parse(page)
    assert [e.kind for e in found] == ["shell", "shell", "shell", "doctest"]
    assert [(c.line, c.shown) for c in found[0].commands] == [("lmhead params", ["gpt2: counted"]),
                                                             ("printf 'a\\n' > a.txt", [])]
    assert [c.line for c in found[1].commands] == ['lmhead inspect "x" --model random:gpt2   # a comment']
    assert found[2].skip == "serves until stopped" and found[0].skip is None is found[1].skip
    assert in_process(found[1].commands[0].line) == (["inspect", "x", "--model", "random:gpt2"], None, False)
    assert in_process(found[0].commands[1].line) is None  # not lmhead: bash runs it
    assert in_process("printf 'a\\nb\\n' | lmhead explore -k 2 2>/dev/null") == (["explore", "-k", "2"],
                                                                                  "printf 'a\\nb\\n'", True)


def test_the_readme_ci_and_constraints_say_the_same_about_installing_and_testing():
    """The README's test command is the fast tier with the light [test] extra (no lm-eval, selenium,
    Jupyter or mypy); .ci/run installs the [test-full] extra and runs every tier; both install with
    -c constraints.txt, and what constraints.txt says about leaving -c out the README says too."""
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    heavy = ("lm-eval", "selenium", "nbclient", "ipykernel", "mypy")
    assert not [d for d in extras["test"] if d.startswith(heavy)]
    assert all(any(d.startswith(h) for d in extras["test-full"]) for h in heavy) and "lmhead[test]" in extras["test-full"]
    fast = 'pip install -c constraints.txt -e ".[test]" && python -m pytest -q -n auto -m "not full"'
    assert fast in readme
    assert 'pip install -c constraints.txt -e ".[test-full]" && python -m pytest -q -n auto\n' in ci
    for line in re.findall(r"^.*pip install.*$", readme + ci, flags=re.M):
        if "-e ." in line or "-e \"." in line:
            assert "-c constraints.txt" in line, line
    said = " ".join(line.lstrip("# ") for line in (ROOT / "constraints.txt").read_text().splitlines()
                    if line.startswith("#"))
    leave_out = re.search(r"leave it out.*?too\.", said)[0]
    assert leave_out in " ".join(readme.split()), leave_out
    assert "drop -c" not in said


def test_every_heavy_tier_is_marked_full_and_left_out_of_the_fast_tier():
    """tests/conftest.py marks each test of a heavy tier `full`, so `-m "not full"` (the README's command)
    leaves the browser, lm-eval, torchrun, notebook, typecheck and slow tests out."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "full", "tests/test_page.py", "tests/test_lmeval.py", "tests/test_notebook.py",
                           "tests/test_settings.py", "tests/test_serve_security.py", "tests/test_inputs.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    picked = done.stdout
    for needle in ("test_page.py::", "test_settings.py::test_a_type_checker_sees_the_stage_fields",
                   "test_inputs.py::"):
        assert needle in picked, (needle, picked[-2000:])
    assert "test_settings.py::test_unknown_keyword_is_a_type_error" not in picked  # an ordinary test is not


def test_the_readmes_performance_table_is_the_benchmark_results_and_carries_no_run_times():
    """Each figure of the README's performance table is one that benchmarks/versus_llamacpp.py wrote into
    benchmarks/RESULTS.md ("Against llama.cpp"); the README holds no run timestamps or load averages."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Performance", 1)[1].split("\n## ", 1)[0]
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").split("## Against llama.cpp", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 6
    found = set(words(results))
    for row in rows:
        figures = [w for w in words(row.split("|", 2)[2]) if _number(w) is not None and not w.endswith("×")]
        assert figures and all(f in found for f in figures), (row, [f for f in figures if f not in found])
    assert not re.search(r"\d\d:\d\d UTC|load average|20\d\d-\d\d-\d\d", readme)
    assert len([s for s in re.split(r"(?<=[.!?])\s+", section.split("\n\n", 2)[2].strip()) if s]) <= 3
