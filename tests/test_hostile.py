"""Hostile input: nothing from a file, a prompt, an argument or a model may hijack the terminal,
exhaust memory, or end in the catch-all "unexpected". One test per class, its cases parametrized."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from helpers import build_checkpoint, cli, control_byte_checkpoint, hostile_pickle_folder, launch, reader, start


HOSTILE = "\x1b]0;HACKED\x07\x1b[2J[bold]hi[/] \x9b31m\x7f"  # title, clear screen, markup, C1 CSI, DEL


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """A GPT-2 checkpoint whose every prediction is a control byte (helpers.control_byte_checkpoint):
    the top tokens, the lens and every generated token are ESC or BEL."""
    return control_byte_checkpoint(tmp_path_factory.mktemp("hostile"))


def control_bytes(text: str) -> list[str]:
    """The bytes below 0x20 (but newline and tab), DEL and C1 controls in `text`."""
    return [repr(c) for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]


def invoke(args, **kwargs):
    got = cli(*args, **kwargs)
    assert "unexpected" not in got.stderr, got.stderr
    return got


# ---- 1. terminal safety: no control byte from data reaches stdout -----------------------------------

TERMINAL_CASES = {
    "inspect": ["inspect", HOSTILE, "-t", HOSTILE, "-t", "\x1b", "-k", "3"],
    "inspect --stages": ["inspect", HOSTILE, "--stages", "--temperature", "0.5", "-k", "3"],
    "inspect --explain": ["inspect", HOSTILE, "--explain", "\x1b", "-k", "3"],
    "lens": ["lens", HOSTILE, "-t", HOSTILE],
    "lens --heat": ["lens", HOSTILE, "--heat", "-k", "2", "-t", "[/]"],
    "greedy --show-steps": ["greedy", HOSTILE, "-n", "4", "--show-steps", "2"],
    "sample": ["sample", HOSTILE, "-n", "4", "--seed", "1"],
    "beams": ["generate", HOSTILE, "-n", "3", "--beams", "2"],
    "softcap": ["softcap", HOSTILE, "-n", "3", "--seed", "1"],
}


@pytest.mark.parametrize("case", list(TERMINAL_CASES))
def test_no_control_byte_from_data_reaches_stdout(hostile_model, case):
    got = invoke([*TERMINAL_CASES[case], "--model", hostile_model])
    assert got.exit_code == 0, got.output
    assert control_bytes(got.stdout) == [], got.stdout
    assert control_bytes(got.stderr) == [], got.stderr
    assert "\\x1b" in got.stdout  # shown, escaped


def test_no_control_byte_in_files_explore_and_paths(hostile_model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{HOSTILE}\n\x1b[2Jhi\n", encoding="utf-8")
    got = invoke(["inspect", "--file", str(prompts), "-t", HOSTILE, "--model", hostile_model])
    assert got.exit_code == 0 and control_bytes(got.stdout + got.stderr) == [], got.output
    got = invoke(["explore", "--model", hostile_model, "-t", "\x1b"],
                 input=f"{HOSTILE}\n:target {HOSTILE}\n:gen 3\n:lens\n:\x1b[2J\n")
    assert got.exit_code == 0 and control_bytes(got.stdout + got.stderr) == [], got.output
    odd = tmp_path / "br[" / "]k [bold]x \x1b[2J"  # a path with markup and ESC: shown as it is, escaped
    odd.parent.mkdir()
    os.symlink(hostile_model, odd)
    got = invoke(["tie", "--model", str(odd)])
    assert got.exit_code == 0 and "[bold]x \\x1b[2J" in got.stdout and control_bytes(got.stdout) == []
    got = invoke(["inspect", "x", "--model", str(tmp_path / "gone \x1b[2J")])
    assert got.exit_code == 1 and "gone \\x1b[2J" in got.stderr and control_bytes(got.stderr) == []


def test_json_stays_exact(hostile_model):
    got = invoke(["inspect", HOSTILE, "-t", HOSTILE, "--model", hostile_model, "--json"])
    doc = json.loads(got.stdout)
    assert doc["top"][0]["token"] == "\x1b" and doc["top"][1]["token"] == "\x07"
    assert doc["targets"][0]["token"] == HOSTILE
    got = invoke(["greedy", HOSTILE, "-n", "2", "--model", hostile_model, "--json"])
    assert json.loads(got.stdout)["text"] == "\x1b\x1b"


def test_markup_in_data_is_shown_as_it_is(tiny):
    for args in (["inspect", "[bold]x[/]", "-t", "[/]", "-t", "[", "-t", "b]"],
                 ["greedy", "[/]", "-n", "3", "--show-steps", "3"],
                 ["inspect", "--explain", "[/]", "[x]"]):
        got = invoke([*args, "--model", str(tiny[0])])
        assert got.exit_code == 0, got.output
    got = invoke(["inspect", "[bold]x[/]", "--explain", "[/]", "--model", str(tiny[0])])
    heading = " ".join(got.stdout.split("\n\n")[0].split())  # wrapped as the terminal's width says
    assert heading.startswith('one logit taken apart: [/ (id 13412) after "[bold]x[/]"')


def test_multi_token_target_notice_is_escaped_once(tiny):
    got = invoke(["inspect", "x", "-t", "日本", "--model", str(tiny[0])])
    assert "target '日本' is 4 tokens ('\\xe6\\x97', '\\xa5', " in got.stderr.replace("\n", " ")


# ---- 2. memory bounded by what was asked, not by the input -------------------------------------------

def test_inspect_file_prints_before_the_last_line_is_read(tiny):
    """Two lines in, one batch out, while stdin is still open: the run streams."""
    proc = start("inspect", "--file", "-", "--json", "--batch-size", "2", "--model", str(tiny[0]))
    try:
        proc.stdin.write(b"The keys on the table\nHello\n")
        proc.stdin.flush()
        readline = reader(proc.stdout)  # fails after a timeout instead of hanging the suite
        first = json.loads(readline())  # the first batch, while stdin is still open
        assert first["prompt_tokens"][0]["text"] == "The"
        proc.stdin.write(b"A third line\n")
        proc.stdin.close()
        rest = list(iter(readline, b""))
        assert proc.wait(timeout=120) == 0 and len(rest) == 2
    finally:
        proc.kill()


@pytest.mark.parametrize("command", ["inspect", "score"])
@pytest.mark.parametrize("source, message", [
    ("/dev/zero", "line 1 is longer than 1,048,576 bytes"),
    ("long", "line 2 is longer than 1,048,576 bytes"),
])
def test_file_lines_are_read_with_a_limit(tmp_path, tiny, command, source, message):
    if source == "long":
        source = tmp_path / "long.txt"
        source.write_bytes(b"ok fine\n" + b"a" * (1 << 20) + b"b\n")
    got = invoke([command, "--file", str(source), "--model", str(tiny[0])])
    assert got.exit_code == 2 and message in got.stderr


def test_stdin_prompt_is_read_with_a_limit(monkeypatch):
    import lmhead_cli.inputs as inputs

    monkeypatch.setattr(inputs, "MAX_STDIN_BYTES", 1000)
    got = invoke(["generate", "-", "--model", "random:gpt2"], input=b"\0" * 1001)
    assert got.exit_code == 2 and "the prompt on stdin is longer than 1,000 bytes" in got.stderr
    got = invoke(["score", "-", "--model", "random:gpt2"], input=b"\0" * 1001)
    assert got.exit_code == 2 and "the text on stdin is longer than 1,000 bytes" in got.stderr


LONG_TEXTS = {
    "english": "The keys on the table are here, don't they? " * 4000,
    "newlines and numbers": "line 12\n\tx=3.5e10;\r\n" * 9000,
    "cjk": "日本語の文章です。とても長い。" * 12000,
    "end of text": "a<|endoftext|>b 's 'S\u3000 \xa0x " * 9000,
    "space runs": ("word" + " " * 37) * 5000,
    "one long run": "x" * 70000 + " tail",
}


@pytest.mark.parametrize("name", list(LONG_TEXTS))
def test_a_long_prompt_is_cut_by_tokenizing_bounded_pieces(name, monkeypatch):
    """encode_tail gives exactly the whole text's last ids and count, tokenizing no piece longer than
    a chunk plus the tail (keep x the longest token)."""
    from lmhead_cli.loading import tokenizer as tk

    tok = tk.GPT2Tokenizer.bundled()
    text, keep = LONG_TEXTS[name], 1024
    full = tok.encode(text)
    seen = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda piece: seen.append(len(piece)) or encode(piece))
    ids, dropped = tok.encode_tail(text, keep)
    assert ids == full[-keep:] and dropped == len(full) - keep
    assert max(seen) <= keep * tok.max_token_bytes + tk.CHUNK_CHARS + 1


def test_a_prompt_with_no_place_to_cut_is_refused(monkeypatch):
    from lmhead_cli.loading import tokenizer as tk

    monkeypatch.setattr(tk, "MAX_UNSPLIT_CHARS", 200_000)
    with pytest.raises(tk.UsageError, match="200,000 characters with no break"):
        tk.GPT2Tokenizer.bundled().encode_tail("x" * 400_000, 1024)


# ---- 3. bytes that are not UTF-8 ----------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["inspect", "caf\udce9 au lait"], "the prompt is not UTF-8 text (byte 0xe9 at byte 3)"),
    (["inspect", "x", "-t", "\udcff"], "--target is not UTF-8 text (byte 0xff at byte 0)"),
    (["generate", "ok\udcc3"], "the prompt is not UTF-8 text (byte 0xc3 at byte 2)"),
    (["tie", "--model", "./m\udcff"], "--model is not UTF-8 text (byte 0xff at byte 3)"),
    (["toy", "--hidden", "1,\udcff,2"], "--hidden is not UTF-8 text (byte 0xff at byte 2)"),
])
def test_arguments_that_are_not_utf8_are_usage_errors(args, message):
    got = invoke(args)
    assert got.exit_code == 2 and message in got.stderr


def test_stdin_that_is_not_utf8_is_a_usage_error_and_explore_goes_on(tiny):
    got = invoke(["generate", "-", "--model", str(tiny[0])], input=b"ok \xff\n")
    assert got.exit_code == 2 and "the prompt on stdin is not UTF-8 text (byte 0xff at byte 3)" in got.stderr
    got = invoke(["explore", "--model", str(tiny[0])], input=b"bad \xc3(\nThe keys on the table\n")
    assert got.exit_code == 0 and "this line is not UTF-8 text (byte 0xc3 at byte 4)" in got.stderr
    assert "» The keys on the table" in got.stdout


# ---- 4. output streams: full, closed, not UTF-8; closed stdin -------------------------------------------

@pytest.mark.parametrize("args", [["--help"], ["--version"], ["params"], ["toy", "--json"], ["inspect", "--help"]])
def test_a_full_stdout_is_one_line_and_exit_1(args):
    with open("/dev/full", "w") as full:
        got = launch(*args, stdout=full, stderr=subprocess.PIPE, text=True)
    assert got.returncode == 1, got.stderr
    assert got.stderr == "lmhead: error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("args", [["--help"], ["params"], ["toy"]])
def test_a_closed_pipe_exits_0_quietly(args):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        got = launch(*args, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert got.returncode == 0 and got.stderr == ""


def test_closed_stdout_and_stdin(tiny):
    got = launch("params", stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1))
    assert got.returncode == 1 and got.stderr == "lmhead: error: stdout is closed; there is nowhere to write the output\n"
    for args, message in ((["generate", "-"], "stdin is closed"), (["explore"], "stdin is closed")):
        got = launch(*args, "--model", str(tiny[0]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     preexec_fn=lambda: os.close(0))
        assert got.returncode == 2 and message in got.stderr and "Traceback" not in got.stderr


def test_an_output_encoding_that_is_not_utf8_still_writes():
    got = launch("params", stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PYTHONIOENCODING": "ascii"})
    assert got.returncode == 0 and b"50,257 \\xd7 768" in got.stdout
    got = launch("toy", "--json", stdout=subprocess.PIPE, env={"PYTHONIOENCODING": "ascii"})
    assert got.returncode == 0 and json.loads(got.stdout)["words"] == ["cat", "dog", "fish", "run"]


# ---- 5. checkpoints checked before anything is allocated ----------------------------------------------

def _config_edit(**changes):
    def edit(folder: Path) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is ...:
                config.pop(key)
            else:
                config[key] = value
        path.write_text(json.dumps(config))
    return edit


def _tensors_edit(fn):
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / "model.safetensors"))
        fn(state)
        save_file(state, str(folder / "model.safetensors"))
    return edit


def _write(name: str, content):
    def edit(folder: Path) -> None:
        path = folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is None:
            path.mkdir()
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
    return edit


def _shards(*names):
    def edit(folder: Path) -> None:
        (folder / "model.safetensors").rename(folder / "shard.safetensors")
        _write("model.safetensors.index.json", {"weight_map": {f"t{i}": n for i, n in enumerate(names)}})(folder)
    return edit


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def _extra(state):
    import torch
    state["transformer.h.0.attn.extra"] = torch.zeros(3)


BAD_CHECKPOINTS = {
    "no n_embd": (_config_edit(n_embd=...), "config.json: n_embd is missing"),
    "no n_positions": (_config_edit(n_positions=...), "config.json: n_positions is missing"),
    "n_head does not divide n_embd": (_config_edit(n_head=3), "n_embd 64 is not divisible by n_head 3"),
    "negative vocabulary": (_config_edit(vocab_size=-5), "vocab_size must be at least 1, not -5"),
    "vocabulary as text": (_config_edit(vocab_size="50257"), 'vocab_size must be a whole number, not "50257"'),
    "eos out of range": (_config_edit(eos_token_id=99999), "eos_token_id 99999 is not a token id of its vocabulary"),
    "bad epsilon": (_config_edit(layer_norm_epsilon="x"), "layer_norm_epsilon must be a finite number above 0"),
    "tie as text": (_config_edit(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    "config a list": (_write("config.json", [1, 2]), "config.json must hold a JSON object, not list"),
    "n_layer 1 over 2 layers": (_config_edit(n_layer=1), "says n_layer 1, but"),
    "n_layer 100000": (_config_edit(n_layer=100000), "says n_layer 100,000, but"),
    "n_positions disagrees": (_config_edit(n_positions=512), "wpe.weight is 1,024 × 64, but"),
    "unexpected tensor": (_tensors_edit(_extra), "holds h.0.attn.extra, which a GPT-2 of this config has no place"),
    "missing tensor": (_tensors_edit(lambda s: s.pop("transformer.ln_f.bias")), "lacks ln_f.bias"),
    "truncated file": (_truncate, "cannot be read as safetensors (truncated or corrupt?)"),
    "weights a folder": (lambda f: ((f / "model.safetensors").unlink(), _write("model.safetensors", None)(f)),
                         "cannot be read as safetensors"),
    "index not JSON": (_write("model.safetensors.index.json", "{not json"), "index.json is not valid JSON"),
    "index without a map": (_write("model.safetensors.index.json", {"metadata": {}}), "has no weight_map"),
    "index names ../": (_shards("shard.safetensors", "../other/model.safetensors"), "outside its folder"),
    "index names /": (_shards("/etc/passwd"), "outside its folder"),
    "index names a missing shard": (_shards("shard.safetensors", "gone.safetensors"), "listed in the index but missing"),
    "weights a broken link": (lambda f: ((f / "model.safetensors").unlink(), os.symlink("../blobs/gone", f / "model.safetensors")),
                              "model.safetensors is a link to ../blobs/gone, which does not exist"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_is_one_line_naming_the_file(tiny, tmp_path, case):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny[0], folder)
    edit, message = BAD_CHECKPOINTS[case]
    edit(folder)
    got = invoke(["inspect", "x", "--model", str(folder)])
    assert got.exit_code == 1, got.output
    assert message in got.stderr and str(folder) in got.stderr and len(got.stderr.splitlines()) == 1, got.stderr


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    build_checkpoint(tmp_path / "small", n_embd=16, n_layer=1, vocab_size=1000, eos_token_id=999, bos_token_id=999)
    got = invoke(["inspect", "x", "--model", str(tmp_path / "small")])
    assert got.exit_code == 1 and "vocab_size is 1,000 but the tokenizer" in got.stderr


def test_the_hub_layout_loads(tiny, tmp_path):
    """The real gpt2 repository's file: unprefixed names, the h.N.attn.bias mask buffers stored, no
    lm_head.weight. It passes the header check and gives transformers' own logits."""
    import shutil

    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "hub"
    shutil.copytree(tiny[0], folder)
    _, ref = tiny
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in ref.state_dict().items()
             if k != "lm_head.weight"}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 1024, 1024))
    assert "h.0.attn.c_attn.weight" in state and "wte.weight" in state
    save_file(state, str(folder / "model.safetensors"))
    doc = json.loads(invoke(["inspect", "The keys on the table", "--model", str(folder), "--json", "-k", "3"]).stdout)
    with torch.no_grad():
        z = ref(torch.tensor([[464, 8251, 319, 262, 3084]])).logits[0, -1]
    assert [t["id"] for t in doc["top"]] == torch.topk(z, 3).indices.tolist()
    assert doc["top"][0]["logit"] == pytest.approx(float(z.max()), abs=1e-4)


def test_a_malicious_pickle_gets_no_advice_to_unpickle_it(tmp_path):
    import pickle

    folder = hostile_pickle_folder(tmp_path, lambda boom, path: path.write_bytes(pickle.dumps({"wte.weight": boom})))
    got = invoke(["tie", "--model", str(folder), "--allow-pickle"])
    assert got.exit_code == 1 and "holds more than tensors, which lmhead never unpickles" in got.stderr
    assert "weights_only=False" not in got.stderr and "likely succeed" not in got.stderr


def test_memory_is_estimated_before_the_model_is_built(monkeypatch):
    from lmhead_cli.loading import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 100_000_000)
    got = invoke(["tie", "--model", "random:gpt2-xl", "--dtype", "bfloat16"])
    assert got.exit_code == 1
    assert ("random:gpt2-xl needs about 9.3 GB at its peak (1.56 B parameters, 3.1 GB once loaded), but 100 MB "
            "is available on cpu") in got.stderr.replace("\n", " ")
    monkeypatch.setattr(checks, "available_memory", lambda device: 10**12)
    monkeypatch.setattr(checks, "LARGE_BYTES", 1)
    got = invoke(["tie", "--model", "random:distilgpt2"])
    assert got.exit_code == 0 and "random:distilgpt2: loading needs about 328 MB" in got.stderr
    monkeypatch.setattr(checks, "available_memory", lambda device: 1)
    assert invoke(["tie", "--model", "random:distilgpt2", "--ignore-memory"]).exit_code == 0


# ---- 6. what a newcomer meets -------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["generate"], ["greedy"], ["sample"], ["softcap"], ["generate", "--beams", "2"]])
def test_every_text_output_of_random_weights_says_so(command):
    got = invoke([*command, "The keys", "-n", "2", "--seed", "1", "--model", "random:distilgpt2"]
                 if command[0] not in ("greedy",) and "--beams" not in command else
                 [*command, "The keys", "-n", "2", "--model", "random:distilgpt2"])
    assert got.exit_code == 0, got.output
    # the banner is prose: a narrow terminal (COLUMNS=40) wraps it
    assert " ".join(got.stdout.split()).startswith("random weights (random:distilgpt2, seeded)")


def test_a_long_prompt_shows_a_bounded_number_of_rows(tiny):
    prompt = "The keys on the table " * 240  # 1,200 tokens, longer than... the tiny model's 1,024
    got = invoke(["inspect", prompt, "--model", str(tiny[0]), "-k", "1"])
    rows = [line for line in got.stdout.splitlines().__iter__() if "│" in line]
    assert got.exit_code == 0 and "1,000 more tokens (--json lists them all)" in got.stdout
    assert len(rows) < 40  # 24 prompt tokens, the top token, no 1,024 rows
    assert "keeping the last 1024" in got.stderr.replace("\n", " ") or "1024" in got.stderr


def test_a_narrow_terminal_never_cuts_figures(tiny, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    got = invoke(["params"])
    assert "38,597,376" in got.stdout and "124,439,808" in got.stdout and "7,087,872" in got.stdout
    doc = json.loads(invoke(["inspect", "The keys", "--model", str(tiny[0]), "-k", "3", "--json"]).stdout)
    table = invoke(["inspect", "The keys", "--model", str(tiny[0]), "-k", "3"]).stdout
    for t in doc["top"]:
        assert f"{t['logit']:.4f}" in table and f"{t['prob']:.4%}" in table and f"{t['logprob']:.4f}" in table
    steps = invoke(["greedy", "The keys", "-n", "2", "--show-steps", "3", "--model", str(tiny[0])]).stdout
    assert not any("…" in line for line in steps.splitlines() if "│" in line)


def test_explore_completion_and_offline_advice(tiny):
    got = invoke(["explore", "--model", str(tiny[0])], input=":foo\n:top-k 100000\nThe keys\n")
    assert got.exit_code == 0 and got.stderr.count("unknown command :foo; :help lists the commands") == 1
    assert ":softcap C|off" not in got.stdout and "50,257" in got.stdout  # every token's row, ranked by a sort
    assert "--install-completion" in invoke(["--help"]).stdout
    got = invoke(["tie", "--model", "distilgpt2"])
    assert got.exit_code == 1 and "--model random:distilgpt2" in got.stderr


def test_beams_are_bounded_by_the_memory_they_need(tiny, monkeypatch):
    from lmhead_cli.loading import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 10**9)
    got = invoke(["generate", "x", "--beams", "1000000", "-n", "3", "--model", str(tiny[0])])
    assert got.exit_code == 2 and "--beams of 1,000,000 need about" in got.stderr
    assert "but 1.0 GB is available; at most " in got.stderr


def test_out_of_memory_on_the_cpu_gives_no_advice_to_use_the_cpu(tiny):
    import torch

    from lmhead_cli.errors import LmheadError
    from lmhead_cli.loading.sources import load_model
    from lmhead_cli.readings.batch import inspect_batch

    def no_memory(loaded, rows):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(LmheadError, match="even for a single prompt of 1 tokens on cpu$"):
        inspect_batch(load_model(str(tiny[0]), device="cpu"), ["Hello"], run=no_memory)


# ---- 7. numbers at the edges ----------------------------------------------------------------------------

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
