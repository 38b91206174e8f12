"""The error boundary (cli/boundary.py): every failure is one line and an exit code (2 usage, 1 runtime),
numbers at their limits are refused with the limit or stay finite."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import REPO, cli, invoke, lmhead, one_line


def test_out_of_memory_on_the_cpu_gives_no_advice_to_use_the_cpu(tiny):

    from lmhead_cli.errors import LmheadError
    from lmhead_cli.loading.sources import load_model
    from lmhead_cli.readings.batch import inspect_batch

    def no_memory(loaded, rows):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(LmheadError, match="even for a single prompt of 1 tokens on cpu$"):
        inspect_batch(load_model(str(tiny[0]), device="cpu"), ["Hello"], run=no_memory)


@pytest.mark.parametrize("args, message", [
    (["sample", "x", "--temperature", "1e-39"], "--temperature must be 0 (greedy) or a finite number of at least 1e-06 (got 1e-39)"),
    (["inspect", "x", "--stages", "--temperature", "1e-39"], "--temperature must be 0 (greedy) or a finite number of at least 1e-06"),
    (["inspect", "x", "--stages", "--softcap", "1e-39"], "--softcap must be a finite number between 1e-06 and 1e+06"),
    (["toy", "--hidden", "1e308,1e308,1e308"], "--hidden numbers must lie within ±1e+06"),
    (["toy", "-t", "1e-308"], "--temperature must be 0 (greedy) or a finite number of at least 1e-06 (got 1e-308)"),
])
def test_numbers_at_the_edges_are_refused_with_the_limit(tiny, args, message):
    got = invoke([*args, "--model", str(tiny[0])] if args[0] != "toy" else args)
    assert got.exit_code == 2 and message in got.stderr


def test_numbers_at_the_limits_stay_finite(tiny):
    got = invoke(["inspect", "x", "--stages", "--temperature", "1e-6", "--softcap", "1e-6", "-k", "3",
                  "--model", str(tiny[0]), "--json"])
    stages = json.loads(got.stdout)["stages"]
    assert got.exit_code == 0 and all(math.isfinite(r["prob"]) for r in stages["rows"])
    assert stages["entropy"] >= 0 and "nan" not in got.stdout.lower()
    toy = json.loads(invoke(["toy", "--hidden", "1e6,-1e6,1e6", "-t", "1e-6", "--json"]).stdout)
    assert toy["probs"] == [1.0, 0.0, 0.0, 0.0] and toy["entropy_bits"] == 0
    assert "temperature 1e-06" in invoke(["toy", "-t", "1e-6"]).stdout
    got = invoke(["explore", "--model", str(tiny[0])], input=":temp 1e-39\n:temp 1e-6\nThe keys\n")
    assert got.exit_code == 0 and ":temp must be 0 (greedy) or a finite number of at least 1e-06" in got.stderr
    assert "» The keys" in got.stdout


def test_a_library_panic_is_one_line_at_the_boundary(tiny, monkeypatch):
    """pyo3's PanicException derives from BaseException, past any `except Exception`."""
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    panic = type("PanicException", (BaseException,), {"__module__": "pyo3_runtime"})

    def encode(self, text):
        raise panic("called `Result::unwrap()` on an `Err` value: onig error")

    monkeypatch.setattr(GPT2Tokenizer, "encode", encode)
    got = invoke(["inspect", "x", "--model", str(tiny[0])])
    one_line(got, 1, "a library lmhead uses failed (PanicException", "onig error")


@pytest.mark.parametrize("args, needle", [
    (["inspect", "x", "-k", "1e309"], "-k"),
    (["inspect", "x", "-k", "nan"], "-k"),
    (["greedy", "x", "-n", "1e3"], "-n"),
    (["inspect", "x", "--nope"], "--nope"),
    (["inspect", "x", "--threads", "99999"], "--threads must be"),
    (["inspect", "x", "--threads", "1" * 26], "--threads must be"),
    (["inspect", "--file", "-", "--batch-size", "1" * 26], "--batch-size must be"),
    (["sample", "x", "--temperature", "nan"], "--temperature"),
], ids=["k 1e309", "k nan", "n 1e3", "unknown option", "threads 99999", "threads 26 digits", "batch-size 26 digits",
        "temperature nan"])
def test_a_bad_number_or_option_is_one_line_not_clicks_panel(args, needle):
    got = invoke([*args, "--model", "random:distilgpt2"], input="x\n")
    one_line(got, 2, needle)


def test_a_bad_lmhead_threads_is_one_line(monkeypatch):
    monkeypatch.setenv("LMHEAD_THREADS", "abc")
    got = invoke(["inspect", "x", "--model", "random:distilgpt2"])
    one_line(got, 2, "LMHEAD_THREADS")


@pytest.mark.parametrize("args, env, message", [
    (["inspect", "x", "--threads", "abc"], {}, "--threads must be a whole number (got 'abc')"),
    (["inspect", "x"], {"LMHEAD_THREADS": "abc"},
     "the environment variable LMHEAD_THREADS (for --threads) must be a whole number (got 'abc')"),
    (["inspect", "x"], {"LMHEAD_THREADS": "0"},
     "the environment variable LMHEAD_THREADS (for --threads) must be at least 1 (got 0)"),
    (["inspect", "x", "--threads", "0"], {"LMHEAD_THREADS": "2"}, "--threads must be at least 1 (got 0)"),
    (["compare", "x", "--llama-chunks", "-99999999999999999999"], {},
     "--llama-chunks must be a 64-bit integer, at least -9,223,372,036,854,775,808 (got -99,999,999,999,999,999,999)"),
    (["inspect", "x", "-k", "99999999999999999999"], {},
     "--top-k must be a 64-bit integer, at most 9,223,372,036,854,775,807 (got 99,999,999,999,999,999,999)"),
    (["serve", "--port", "-1"], {}, "--port must be between 0 and 65,535 (got -1)"),
], ids=["threads abc", "env abc", "env 0", "flag 0 over env", "llama-chunks -1e20", "k 1e20", "port -1"])
def test_a_whole_number_is_refused_naming_its_source_and_the_bound_it_broke(monkeypatch, args, env, message):
    """Issue 50: `--threads abc` blamed LMHEAD_THREADS, unset; `--llama-chunks -1e20` was told "must be
    at most"."""
    monkeypatch.delenv("LMHEAD_THREADS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    got = invoke([*args, "--model", "random:distilgpt2"])
    one_line(got, 2)
    assert got.stderr.strip() == f"lmhead: error: {message}"


def test_world_size_without_torchrun_is_one_line_with_advice(tiny):
    got = cli("score", "--file", str(REPO / "README.md"), "--model", str(tiny[0]),
              env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "", "MASTER_PORT": ""})
    assert got.exit_code == 2, got.stderr
    assert got.stderr.startswith("lmhead: error: WORLD_SIZE is 2 but MASTER_ADDR") and "torchrun" in got.stderr
    assert len(got.stderr.splitlines()) == 1


def test_a_rank_error_is_one_line_not_a_tuple():
    import pickle

    from lmhead_cli.distributed import RankFailed

    e = pickle.loads(pickle.dumps(RankFailed(("x.txt is not UTF-8 text",), 2, 1)))
    assert str(e) == "x.txt is not UTF-8 text (on rank 1)" and e.exit_code == 2


@pytest.mark.parametrize("path", ["/proc/self/mem"])
def test_a_file_that_cannot_be_read_is_one_line(path):
    got = invoke(["inspect", "--file", path, "--model", "random:distilgpt2"])
    one_line(got, 2, path)


def test_non_ascii_arguments_under_a_c_locale():
    env = {"LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    got = lmhead("inspect", "café ☕", "-t", "é", "--model", "random:distilgpt2", "--json", "-k", "1", env=env)
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    assert [t["id"] for t in doc["prompt_tokens"]] == GPT2Tokenizer.bundled().encode("café ☕")
    assert doc["targets"][0]["token"] == "é"


@pytest.mark.parametrize("content", [b'temperature = 0.5\ndescription = "caf\xe9"\n',
                                     b"top_k = " + b"[" * 50_000 + b"]" * 50_000 + b"\n"])
def test_a_bad_preset_file_is_one_line(tmp_path, content):
    preset = tmp_path / "mine.toml"
    preset.write_bytes(content)
    got = invoke(["sample", "x", "--preset", str(preset), "-n", "1", "--model", "random:distilgpt2"])
    one_line(got, 2, str(preset))


@pytest.mark.parametrize("args", [
    ["inspect", "x", "--model", "{missing}"],
    ["inspect", "x", "--model", "{missing}.gguf"],
    ["inspect", "x", "--model", "{folder}.gguf"],
    ["inspect", "x", "--model", "{file}"],
    ["lens", "x", "--tuned", "{missing}", "--model", "{tiny}"],
    ["lens", "x", "--tuned", "{folder}", "--model", "{tiny}"],
    ["inspect", "--file", "{missing}", "--model", "{tiny}"],
    ["score", "--file", "{missing}", "--model", "{tiny}"],
    ["compare", "--file", "{missing}", "--model", "{tiny}"],
    ["calibrate", "--file", "{missing}", "--model", "{tiny}"],
    ["generate", "x", "--preset", "{missing}.toml", "--model", "{tiny}"],
], ids=lambda a: " ".join(a[:1] + [w for w in a if w.startswith("--")][:1]))
def test_a_path_that_is_missing_or_the_wrong_kind_is_a_usage_error_wherever_it_is_given(tiny, tmp_path, args):
    """Exit 2 and one line naming the path, for a model folder or file, a tuned lens, an input file and
    a preset: the same kind of mistake gets the same exit code wherever it is made (docs/errors.md)."""
    (tmp_path / "a-folder.gguf").mkdir()
    (tmp_path / "a-file").write_text("x")
    paths = {"missing": str(tmp_path / "no-such"), "folder": str(tmp_path / "a-folder"),
             "file": str(tmp_path / "a-file"), "tiny": str(tiny[0])}
    got = invoke([a.format(**paths) for a in args])
    one_line(got, 2, str(tmp_path))


def test_serve_on_a_busy_port_is_one_line_naming_it_before_any_serving_line(tiny):
    """A port another program listens on: one `lmhead: error:` line naming host and port, exit 1, and
    nothing first that says it is serving (it binds before it announces)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        got = invoke(["serve", "--model", str(tiny[0]), "--port", str(port)])
    one_line(got, 1, f"cannot listen on 127.0.0.1:{port}", "--port")
    assert "serv" not in got.stdout
