"""`lmhead explore`: piped sessions (one prompt a line), the commands, bad input that never ends the
session, Ctrl-C and Ctrl-D, and the history file."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, PY, REPO, assert_rank, cli, invoke

from lmhead_cli import render
from lmhead_cli.readings import explore
from lmhead_cli.render.big_table import as_big_table
from lmhead_cli.errors import UsageError
from lmhead_cli.readings.explore import Command, apply, parse_command, state
from lmhead_cli.loading.sources import load_model
import subprocess
import textwrap


def session(tiny, script: str, *args):
    return cli("explore", "--model", str(tiny[0]), *args, input=script)


def answers(stdout: str) -> list[dict]:
    """The JSON lines of an `explore --json` session, one per answer."""
    return [json.loads(line) for line in stdout.splitlines()]


def probs_of(answer: dict) -> dict[int, float]:
    """{id: prob} of an answer's rows, then its targets, in order."""
    return {r["id"]: r["prob"] for r in answer["rows"] + answer["targets"]}


def reference(tiny, ids=PROMPT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return tiny[1](torch.tensor([ids])).logits[0, -1].double()


def test_piped_prompts_get_a_table_each_and_temp_applies(tiny):
    got = session(tiny, f"{PROMPT}\n:temp 0.5\nThe key on the table\n")
    assert got.exit_code == 0, got.output
    assert got.stdout.count("» ") == 2 and got.stdout.count("entropy") == 2
    assert "temperature 0.5" in got.stdout
    as_json = session(tiny, f"{PROMPT}\n:temp 0.5\nThe key on the table\n", "--json")
    assert as_json.exit_code == 0 and "settings: top-k 10, temperature 0.5" in as_json.stderr, as_json.output
    first, second = (probs_of(a) for a in answers(as_json.stdout))
    p = torch.softmax(reference(tiny), -1)
    assert list(first) == torch.topk(p, 10).indices.tolist()
    for i, prob in first.items():
        assert prob == pytest.approx(float(p[i]), abs=6e-7)
    ids = load_model(str(tiny[0]), device="cpu").tokenizer.encode("The key on the table")
    p_half = torch.softmax(reference(tiny, ids) / 0.5, -1)  # the second prompt, at T = 0.5
    assert list(second) == torch.topk(p_half, 10).indices.tolist()
    for i, prob in second.items():
        assert prob == pytest.approx(float(p_half[i]), abs=6e-7)


def test_softcap_top_k_and_target(tiny):
    got = session(tiny, f':softcap 0.5\n:top-k 3\n:target " are"\n{PROMPT}\n:lens\n:gen 2\n', "--json")
    assert got.exit_code == 0, got.output
    z = reference(tiny)
    capped = 0.5 * torch.tanh(z / 0.5)
    p = torch.softmax(capped, -1)
    answer, lens, gen = answers(got.stdout)  # stdout holds only the answers, one JSON line each
    assert lens["layers"][-1]["top_id"] == int(z.argmax()) and gen["prompt_ids"] == PROMPT_IDS
    assert len(gen["generated_ids"]) == 2 and gen["seed"] == 0
    probs = probs_of(answer)
    top3 = torch.topk(z, 3).indices.tolist()
    assert list(probs)[:3] == top3 and 389 in probs  # three rows, then the target " are"
    for i, prob in probs.items():
        assert prob == pytest.approx(float(p[i]), abs=6e-7)
    assert answer["targets"][0]["id"] == 389 and answer["knobs"] == {"softcap": 0.5}
    assert_rank(answer["targets"][0]["rank"], z, 389)  # the target's rank


def test_read_matches_arithmetic(tiny):
    loaded = load_model(str(tiny[0]), device="cpu")
    r = explore.read(loaded, PROMPT, state(top_k=4, temperature=2.0, softcap=3.0, targets=(" is",)))
    z = reference(tiny)
    scaled = 3.0 * torch.tanh(z / 3.0) / 2.0  # soft-cap first, then the temperature
    logp = torch.log_softmax(scaled, -1)
    assert [row.id for row in r.rows] == torch.topk(z, 4).indices.tolist()
    for row in r.rows + r.targets:
        assert row.logit == pytest.approx(float(z[row.id]), abs=1e-4)
        assert row.scaled == pytest.approx(float(scaled[row.id]), abs=1e-4)
        assert row.prob == pytest.approx(float(logp[row.id].exp()), rel=1e-4)
        assert_rank(row.rank, z, row.id)
    assert r.targets[0].id == 318 and r.n_tokens == 5
    assert r.entropy == pytest.approx(float(-(logp.exp() * logp).sum()), abs=1e-4)
    assert r.knobs.active() == {"softcap": 3.0, "temperature": 2.0}  # in order: soft-cap, then temperature


def test_bad_input_never_ends_the_session(tiny):
    script = f"\n   \n:temp abc\n:temp -1\n:top-k -1\n:target\n:nonsense\n:gen 3\n:lens\n{PROMPT}\n"
    got = session(tiny, script)
    assert got.exit_code == 0, got.output
    err = got.stderr
    assert ":temp must be a number (got 'abc')" in err
    assert ":temp must be 0 (greedy) or a finite number of at least 1e-06" in err
    assert ":top-k must be at least 1" in err
    assert ":target takes one value" in err
    assert "unknown command :nonsense; :help lists the commands" in err and ":softcap C|off" not in got.stdout
    assert ":gen works on the last prompt; type a prompt first" in err
    assert ":lens works on the last prompt" in err
    assert got.stdout.count("» ") == 1  # empty lines are ignored; the prompt after the errors is answered
    assert "temperature off" in got.stderr  # the bad :temp values changed nothing


def test_gen_and_lens_on_the_last_prompt(tiny):
    got = session(tiny, f"{PROMPT}\n:seed 7\n:gen 4\n:lens\n:quit\nnever read\n")
    assert got.exit_code == 0, got.output
    assert "4 tokens sampled (seed 7)" in got.stdout
    loaded = load_model(str(tiny[0]), device="cpu")
    expected = explore.generate_after(loaded, PROMPT, 4, state(seed=7), lambda _: None)
    assert PROMPT + expected.text + "\n" in got.stdout  # the same tokens a script gets every run
    assert "embeddings" in got.stdout and "block 2" in got.stdout
    assert "never read" not in got.stdout  # :quit ends the session


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number of at least 1e-06"),
    (["--threads", "0"], "--threads must be at least 1 (got 0)"),
])
def test_start_options_are_checked_before_the_load(args, message):
    got = cli("explore", *args, "--model", "random:gpt2", input="")
    assert got.exit_code == 2
    assert message in got.stderr


def test_threads_and_start_settings(tiny, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls = []
    got = session(tiny, f"{PROMPT}\n", "--threads", "1", "--temperature", "0.7", "-k", "2", "-t", " are", "--json")
    assert got.exit_code == 0, got.output
    # each of the model's calls runs on 1 (the count is never timed): set to 1, or already 1 in this process
    assert set(calls) <= {1} and (calls or torch.get_num_threads() == 1)
    [answer] = answers(got.stdout)
    assert answer["knobs"] == {"temperature": 0.7} and len(answer["rows"]) == 2 and len(answer["targets"]) == 1


# ---- the pieces --------------------------------------------------------------------------------

@pytest.mark.parametrize("line, name, args", [
    (':target " are"', "target", [" are"]),
    (":TEMP 0.8", "temp", ["0.8"]),
    (":temperature off", "temp", ["off"]),
    (":k 20", "top-k", ["20"]),
    (":q", "quit", []),
    (":", "help", []),
    (":bogus 1", "unknown", ["bogus"]),
])
def test_parse_command(line, name, args):
    assert parse_command(line) == Command(name, args)


def test_parse_command_unclosed_quote():
    with pytest.raises(UsageError, match="cannot read"):
        parse_command(':target " are')


def test_apply_settings_and_off():
    s = apply(state(), Command("temp", ["0.8"]))
    s = apply(s, Command("softcap", ["30"]))
    s = apply(apply(s, Command("target", [" are"])), Command("target", [" is"]))
    assert (s.temperature, s.softcap, s.targets) == (0.8, 30.0, (" are", " is"))
    s = apply(apply(apply(s, Command("temp", ["off"])), Command("softcap", ["none"])), Command("target", ["clear"]))
    assert (s.temperature, s.softcap, s.targets) == (None, None, ())
    for bad in (Command("temp", ["nan"]), Command("softcap", ["-1"]), Command("top-k", ["2.5"]),
                Command("seed", ["-3"]), Command("temp", ["1", "2"])):
        with pytest.raises(UsageError):
            apply(s, bad)


def test_ctrl_c_cancels_the_line_and_ctrl_d_ends(monkeypatch):
    typed = iter([KeyboardInterrupt, "a prompt", EOFError])

    def fake_input(prompt):
        assert prompt == explore.PROMPT
        item = next(typed)
        if isinstance(item, type):
            raise item
        return item

    monkeypatch.setattr("builtins.input", fake_input)
    cancels = []
    assert list(explore.terminal_lines(on_cancel=lambda: cancels.append(1))) == ["a prompt"]
    assert cancels == [1]


def test_ctrl_c_while_computing_cancels_that_line_only():
    class Show:
        def __init__(self):
            self.events = []

        def cancelled(self):
            self.events.append("cancelled")

        def error(self, message):
            self.events.append(message)

    class Interrupted(explore.Session):
        def handle(self, line):
            if line == "slow":
                raise KeyboardInterrupt
            self.show.events.append(line)
            return True

    show = Show()
    Interrupted(None, state(), show).run(["slow", "next"])
    assert show.events == ["cancelled", "next"]


def test_history_is_written_and_never_fails(tmp_path, monkeypatch):
    pytest.importorskip("readline")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = explore.history_file()
    assert path == tmp_path / "cache" / "lmhead" / "history"
    history = explore.History(path)
    history.readline.add_history("The keys on the table")
    history.save()
    assert "The keys on the table" in path.read_text(encoding="utf-8", errors="replace")
    (tmp_path / "file").write_text("not a folder")
    explore.History(tmp_path / "file" / "history").save()  # cannot be written: no error


def test_piped_lines_strip_line_ends():
    assert list(explore.piped_lines(["a\r\n", "b\n", "c"])) == ["a", "b", "c"]


def test_help_lists_every_command(tiny):
    got = session(tiny, ":help\n")
    assert got.exit_code == 0
    for name in explore.COMMANDS:
        assert re.search(rf":{re.escape(name)}\b", got.stdout), name


def test_warm_up_keeps_a_fixed_thread_count(tiny):
    """--threads 1: warm_up times nothing and keeps the count asked for (for the model's calls: the
    caller's count is its own again after each)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        loaded = load_model(str(tiny[0]), device="cpu", threads=1)
        assert explore.warm_up(loaded) == 1 == loaded.execution.threads and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_warm_up_settles_the_thread_count(tiny, monkeypatch):
    """warm_up times 10-token forwards with each count (engine/threads.py) and keeps the faster."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU core: there is no second thread count for warm_up to time")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # whatever an earlier test left: two counts to choose between
        loaded = load_model(str(tiny[0]), device="cpu")
        # after a warm-up, torch's count and 1 are timed (each with the product forms the engine
        # offers): a clock on which every one-thread call takes 1 s and every two-thread call 8 s
        now = [0.0]

        def clock():
            now[0] += 1.0 if torch.get_num_threads() == 1 else 8.0
            return now[0]

        monkeypatch.setattr("lmhead_cli.engine.threads.time.perf_counter", clock)
        assert explore.warm_up(loaded) == loaded.execution.threads == 1 and torch.get_num_threads() == 2
        assert loaded.execution.chooser.choices and set(loaded.execution.chooser.choices) == {1}
    finally:
        torch.set_num_threads(before)


def test_markup_like_tokens_are_shown_as_they_are(tiny):
    got = session(tiny, f':target "[/"\n{PROMPT}\n:lens\n')
    assert got.exit_code == 0, got.output
    assert "│ [/ " in got.stdout and "[/ rank" in got.stdout  # the explore table and the lens header


@pytest.mark.slow
def test_explore_completion_and_offline_advice(tiny, monkeypatch):
    drawn = []  # rows of each table drawn line by line by render.big_table (rich took ~50 s for this one)

    def spy(con, table):
        big = as_big_table(con, table)
        drawn.extend([len(table.rows)] if big else [])
        return big

    monkeypatch.setattr(render, "as_big_table", spy)
    got = invoke(["explore", "--model", str(tiny[0])], input=":foo\n:top-k 100000\nThe keys\n")
    assert got.exit_code == 0 and got.stderr.count("unknown command :foo; :help lists the commands") == 1
    assert ":softcap C|off" not in got.stdout and "50,257" in got.stdout  # every token's row, ranked by a sort
    assert drawn == [50257] and len(got.stdout.splitlines()) > 50257
    assert "--install-completion" in invoke(["--help"]).stdout
    got = invoke(["tie", "--model", "distilgpt2"])
    assert got.exit_code == 1 and "--model random:distilgpt2" in got.stderr


def test_a_fifo_as_explores_history_neither_blocks_nor_is_replaced(tmp_path):
    history = tmp_path / "history"
    os.mkfifo(history)
    script = ("import sys; from pathlib import Path; from lmhead_cli.readings.explore import History; "
              "h = History(Path(sys.argv[1])); h.readline.add_history('x'); h.save()")
    got = subprocess.run([PY, "-c", script, str(history)], env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60,
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert history.is_fifo()


SESSION = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from lmhead_cli.readings.explore import History
    path, line, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    h = History(path)
    h.readline.add_history(line)
    while not go.exists():
        time.sleep(0.05)
    h.save()
""")


@pytest.mark.slow
def test_two_explore_sessions_sharing_a_history_keep_both(tmp_path):
    path = tmp_path / "history"
    path.write_text("from before\n")
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([PY, "-c", SESSION, str(path), line, str(go)], env=env) for line in ("one", "two")]
    import time

    time.sleep(3)  # both have read the file
    go.touch()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    lines = path.read_text().splitlines()
    assert lines[0] == "from before" and sorted(lines[1:]) == ["one", "two"]


def test_every_explore_setting_goes_through_the_one_settings_conversion(monkeypatch):
    """:temp, :softcap and :seed, :gen's count and the start-up settings are checked by
    decoding.settings.make, the function every door converts through, with the session's values.
    Mutant: a command checking its value against the stage registry directly (make never called)."""
    from lmhead_cli.api import explore as api_explore
    from lmhead_cli.decoding import settings as decoding

    seen = []
    real = decoding.make
    monkeypatch.setattr(decoding, "make", lambda **values: seen.append(values) or real(**values))
    s = apply(state(), Command("temp", ["0.5"]))
    s = apply(s, Command("softcap", ["20"]))
    s = apply(s, Command("seed", ["9"]))
    assert [(v["temperature"], v["softcap"], v["seed"]) for v in seen][-3:] == [(0.5, None, 0), (0.5, 20.0, 0),
                                                                                   (0.5, 20.0, 9)]
    assert s.generation(3).max_new_tokens == 3 and seen[-1]["max_new_tokens"] == 3
    seen.clear()
    start = api_explore.settings(5, temperature=0.7, softcap=30.0)
    assert seen and (seen[0]["temperature"], seen[0]["softcap"]) == (0.7, 30.0) and start.top_k == 5


def test_explore_refuses_and_accepts_what_generate_does():
    """The same values, the same answers: temperature 0 is greedy in :gen's settings (the table shows the
    greedy distribution), a temperature below 1e-6 is refused with generate's words and advice."""
    from lmhead_cli.decoding.settings import make
    from lmhead_cli.decoding.stages import from_text
    from lmhead_cli.errors import BadValue

    s = apply(state(), Command("temp", ["0"]))
    assert s.temperature == 0 and s.decoding.greedy and s.decoding.zero_temperature
    for value in ("1e-7", "inf", "-1"):
        with pytest.raises(BadValue) as e:
            apply(state(), Command("temp", [value]))
        with pytest.raises(BadValue) as want:  # the number the text spells, as every text door passes it
            make(temperature=from_text(value))
        assert str(e.value) == str(want.value) and "0 is greedy" in str(e.value)
