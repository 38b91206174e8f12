"""Every command's --help example runs offline as written (on random:gpt2 or by arithmetic)."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import cli
from typer.main import get_command

from lmhead_cli.cli import app
from lmhead_cli.cli.boundary import RICH_HELP_WIDTH

GROUP = get_command(app)


def example(name: str) -> str:
    """The `Example:` line of a command's help text."""
    found = re.search(r"Example: (.+)", GROUP.commands[name].help or "")
    assert found, f"lmhead {name} --help has no example"
    return found.group(1).strip()


def test_top_help_says_how_to_set_the_default_model():
    out = cli("--help", env={"COLUMNS": "200"}).stdout
    assert "LMHEAD_MODEL" in out and "random:gpt2" in out


@pytest.mark.parametrize("name", sorted(GROUP.commands))
@pytest.mark.slow
def test_help_example_runs_offline(name):
    line = example(name)
    stdin = None
    if "|" in line:  # printf '...' | lmhead explore ...: the printed lines are explore's input
        feed, line = (part.strip() for part in line.split("|", 1))
        stdin = shlex.split(feed)[1].encode().decode("unicode_escape")
    words = shlex.split(line)
    assert words[:2] == ["lmhead", name]
    assert "--model" in words or name in ("params", "toy"), "a model command's example names an offline model"
    result = cli(*words[1:], input=stdin)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def long_options(command) -> list[str]:
    return [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


@pytest.mark.parametrize("columns", ["40", "55", str(RICH_HELP_WIDTH)])
def test_help_cuts_nothing_on_a_narrow_terminal(columns):
    # rich's panels end a long option name or path in "…" when the terminal is narrower than they need
    # (--install-c… at 40 columns); below RICH_HELP_WIDTH the help is click's plain one, which wraps
    for name, command in [("", GROUP), *sorted(GROUP.commands.items())]:
        out = cli(*filter(None, [name, "--help"]), env={"COLUMNS": columns, "NO_COLOR": "1"}).stdout
        assert "…" not in out, f"lmhead {name} --help at {columns} columns"
        assert [o for o in long_options(command) if o not in out] == [], f"lmhead {name} --help at {columns}"
        assert (command.help or "").split()[0] in out


@pytest.mark.parametrize("command, buffers", [("score", 2), ("compare", 4)])
def test_chunk_default_in_the_help_is_the_chunk_a_run_uses(tiny, command, buffers):
    """--chunk's default in the help is computed, not typed in: it is the chunk that a run on a model with
    GPT-2's vocabulary (the tiny checkpoint's 50,257 tokens) reports, and 32 MiB over `buffers`
    float32 (chunk, V) buffers by the arithmetic here."""
    import json

    out = " ".join(cli(command, "--help", env={"COLUMNS": "200"}).stdout.split())
    shown = int(re.search(r"the most within 32 MiB: (\d+) for GPT-2", out).group(1))
    assert shown == (32 * 2**20) // (buffers * 50257 * 4)
    run = cli(command, "The keys on the table are on the table.", "--model", str(tiny[0]), "--device", "cpu",
              "--json")
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["chunk"] == shown
