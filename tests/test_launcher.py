"""The suite's own launcher (tests/helpers.py `launch`, `start`, `serving`; tests/zygote.py): an `lmhead`
forked from the launcher gives what a fresh interpreter gives, byte for byte, and a fresh interpreter is
kept wherever the fork could differ."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from helpers import FRESH_ENV, PROMPT, Forked, _env, forkable, launch, reader, start


def both(*args: str, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """(forked, fresh) runs of `lmhead ARGS`."""
    assert forkable(_env(kwargs.get("env")), {}) is not None, "the launcher did not start"
    forked = launch(*args, **kwargs)
    fresh = launch(*args, **{**kwargs, "env": {**kwargs.get("env", {}), FRESH_ENV: "1"}})
    return forked, fresh


@pytest.mark.parametrize("args", [
    ["params"],
    ["toy", "--json"],
    ["inspect", PROMPT, "--json", "-t", " is"],
    ["inspect", PROMPT, "--top-k", "0"],  # a usage error: exit 2, one line
    ["inspect", PROMPT, "--model", "/"],  # a folder that holds no model: a runtime error, exit 1
])
@pytest.mark.slow
def test_a_forked_lmhead_writes_what_a_fresh_one_writes(tiny, args):
    forked, fresh = both(*args, env={"LMHEAD_MODEL": str(tiny[0])}, text=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    if args[-1] == " is":  # the environment reached the child: the model it names answered
        assert json.loads(forked.stdout)["model"] == str(tiny[0])


@pytest.mark.slow
def test_the_child_takes_the_requests_folder_stdin_and_exit_code(tiny, tmp_path):
    (tmp_path / "prompts.txt").write_text("The keys on the table\nHello\n")
    got = launch("inspect", "--file", "prompts.txt", "--json", "--model", str(tiny[0]), cwd=tmp_path, text=True)
    assert got.returncode == 0 and len(got.stdout.splitlines()) == 2, got.stderr
    got = launch("inspect", "--file", "-", "--json", "--model", str(tiny[0]), input="One\nTwo\nThree\n", text=True)
    assert got.returncode == 0 and len(got.stdout.splitlines()) == 3, got.stderr


def test_a_signal_reaches_the_forked_child(tiny):
    proc = start("explore", "--model", str(tiny[0]))
    assert isinstance(proc, Forked)
    try:
        readline = reader(proc.stdout)
        proc.stdin.write(b"The keys on the table\n")
        proc.stdin.flush()
        assert readline()  # it is running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()


@pytest.mark.parametrize("env, kwargs", [
    ({"PYTHONIOENCODING": "ascii"}, {}),  # read as the interpreter starts
    ({"OMP_NUM_THREADS": "3"}, {}),  # read as OpenMP loads, with torch
    ({"LC_ALL": "C"}, {}),
    ({FRESH_ENV: "1"}, {}),
    ({}, {"preexec_fn": lambda: None}),
    ({}, {"start_new_session": True}),
])
def test_what_a_fork_could_change_gets_a_fresh_interpreter(env, kwargs):
    assert forkable(_env(None), {}) is not None
    assert forkable(_env(env), kwargs) is None
