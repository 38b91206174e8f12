"""`lmhead inspect --file`: padded batches equal one-at-a-time runs (ours and transformers' own forward),
the head sits at each row's last real token, memory failures split batches, bad files exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPT, cli

from lmhead_cli.readings.batch import batch_logits, inspect_batch, read_prompts
from lmhead_cli.errors import LmheadError, UsageError
from lmhead_cli.readings.inspect import inspect_prompt
from lmhead_cli.loading.sources import load_model

# Lengths from 1 token to a dozen, so every batch mixes padded and unpadded rows.
PROMPTS = ["Hello", PROMPT, "The key on the table", "A", "The authors of the book on the shelf near the door",
           "My friends", "Once upon a time there was", "1 2 3 4 5 6 7 8 9 10 11 12", " leading space", "日本語"]
TARGETS = [" are", " is"]


def sixty_four() -> list[str]:
    subjects = ["The key", "The keys", "The dog", "The dogs", "My friend", "My friends", "The author of the books",
                "The authors of the book"]
    places = ["on the table", "near the door", "in the garden", "by the window", "under the bed", "at the station",
              "in the box", "on the shelf"]
    return [f"{s} {p}" for p in places for s in subjects]


@pytest.fixture(scope="module", params=["lean", "transformers"])
def loaded(tiny, request):
    return load_model(str(tiny[0]), device="cpu", engine=request.param)


def assert_same_reading(batched, single, atol=1e-4):
    assert [t.id for t in batched.prompt_tokens] == [t.id for t in single.prompt_tokens]
    assert batched.shapes == single.shapes
    torch.testing.assert_close(batched.logits, single.logits, atol=atol, rtol=0)
    assert [t.id for t in batched.top] == [t.id for t in single.top]
    for a, b in zip(batched.top, single.top):
        assert a.prob == pytest.approx(b.prob, rel=1e-4)
    assert [t.id for t in batched.targets] == [t.id for t in single.targets]
    for a, b in zip(batched.targets, single.targets):
        # A deep rank may move by the tokens whose logits lie within float noise of the target's.
        close = int(((single.logits - single.logits[b.id]).abs() <= atol).sum()) - 1
        assert abs(a.rank - b.rank) <= close
    assert batched.entropy == pytest.approx(single.entropy, abs=1e-4)


@pytest.mark.parametrize("batch_size", [1, 3, 32])
def test_batches_equal_one_at_a_time_runs(loaded, batch_size):
    run = inspect_batch(loaded, PROMPTS, 5, TARGETS, batch_size)
    assert len(run.results) == len(PROMPTS)
    assert run.batches == -(-len(PROMPTS) // batch_size) and run.splits == 0
    for prompt, batched in zip(PROMPTS, run.results):  # file order, whatever order the batches ran in
        assert_same_reading(batched, inspect_prompt(loaded, prompt, 5, TARGETS))


def test_batches_equal_transformers_own_forward(tiny, loaded):
    _, ref = tiny
    run = inspect_batch(loaded, PROMPTS, 3, None, batch_size=4)
    for batched in run.results:
        ids = torch.tensor([[t.id for t in batched.prompt_tokens]])
        with torch.no_grad():
            z = ref(ids).logits[0, -1]  # transformers, no padding, every position
        torch.testing.assert_close(batched.logits, z, atol=1e-4, rtol=0)
        assert [t.id for t in batched.top] == torch.topk(z, 3).indices.tolist()


def test_sixty_four_prompts_match_one_at_a_time(tiny):
    loaded = load_model(str(tiny[0]), device="cpu")
    prompts = sixty_four()
    run = inspect_batch(loaded, prompts, 3, TARGETS, batch_size=16)
    assert run.batches == 4 and run.max_rows == 16
    for prompt, batched in zip(prompts, run.results):
        assert_same_reading(batched, inspect_prompt(loaded, prompt, 3, TARGETS))


def test_head_sees_each_rows_last_real_token_only(tiny):
    loaded = load_model(str(tiny[0]), device="cpu")
    rows = [[464, 8251, 319, 262, 3084], [464], [15496, 995]]
    seen = []
    hook = loaded.engine.head_module.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        z = batch_logits(loaded, rows)
    finally:
        hook.remove()
    assert seen == [(3, loaded.engine.head_weight.shape[1])]  # (B, D): no (B, T, D), no padded position
    for row, logits in zip(rows, z):
        single = loaded.engine.head(loaded.engine.body(torch.tensor([row]))[:, -1])[0]
        torch.testing.assert_close(logits, single, atol=1e-4, rtol=0)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")])
def test_a_batch_too_large_for_memory_is_halved(tiny, error):
    loaded = load_model(str(tiny[0]), device="cpu")
    sizes = []

    def small_memory(loaded, rows):
        sizes.append(len(rows))
        if len(rows) > 2:
            raise error
        return batch_logits(loaded, rows)

    run = inspect_batch(loaded, PROMPTS, 3, TARGETS, batch_size=8, run=small_memory)
    assert run.splits > 0 and run.max_rows == 2 and sizes[0] == 8
    for prompt, batched in zip(PROMPTS, run.results):
        assert_same_reading(batched, inspect_prompt(loaded, prompt, 3, TARGETS))


def test_other_errors_are_not_taken_for_memory(tiny):
    loaded = load_model(str(tiny[0]), device="cpu")

    def broken(loaded, rows):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        inspect_batch(loaded, PROMPTS, run=broken)

    def no_memory(loaded, rows):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(LmheadError, match="out of memory even for a single prompt"):
        inspect_batch(loaded, PROMPTS[:3], run=no_memory)


def test_wins_count_the_most_probable_target(tiny):
    loaded = load_model(str(tiny[0]), device="cpu")
    run = inspect_batch(loaded, PROMPTS, 3, TARGETS)
    probs = [[t.prob for t in r.targets] for r in run.results]
    assert [w.best_of_targets for w in run.wins] == [sum(p[0] >= p[1] for p in probs),
                                                      sum(p[1] > p[0] for p in probs)]
    assert sum(w.best_of_targets for w in run.wins) == len(PROMPTS)
    assert [w.top1 for w in run.wins] == [sum(r.targets[j].rank == 1 for r in run.results) for j in range(2)]


# ---- the prompt file ----------------------------------------------------------------------------

def test_empty_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfone\r\n\r\n  \ntwo \n\nthree\n")  # a BOM, CRLF, blank and white-space lines
    got = read_prompts(str(path))
    assert got.prompts == ["one", "two ", "three"]
    assert got.skipped_empty == 3  # the final newline ends a line; it opens no empty one


@pytest.mark.parametrize("content, message", [
    (None, "no such prompt file"),
    (b"caf\xe9\nok\n", "is not UTF-8 text (byte 0xe9 on line 1, at byte 3)"),
    (b"\n\n  \n", "holds no prompts"),
])
def test_bad_prompt_files(tmp_path, content, message):
    path = tmp_path / "p.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_prompts(str(path))


def test_cli_json_lines_equal_single_inspect_documents(tiny, tmp_path):
    folder = str(tiny[0])
    path = tmp_path / "prompts.txt"
    path.write_text("The keys on the table\n\nThe key on the table\nHello\n", encoding="utf-8")
    got = cli("inspect", "--file", str(path), "-t", " are", "-k", "3", "--batch-size", "2",
                              "--model", folder, "--json")
    assert got.exit_code == 0, got.output
    docs = [json.loads(line) for line in got.stdout.splitlines()]
    assert "skipped 1 empty line" in got.stderr
    assert "targets won" in got.stderr
    for prompt, doc in zip(["The keys on the table", "The key on the table", "Hello"], docs, strict=True):
        single = json.loads(cli("inspect", prompt, "-t", " are", "-k", "3", "--model", folder,
                                                "--json").stdout)
        assert doc.keys() == single.keys()
        for key in single:
            if key not in ("top", "targets", "entropy", "entropy_bits"):
                assert doc[key] == single[key], key
        assert [t["id"] for t in doc["top"]] == [t["id"] for t in single["top"]]
        for a, b in zip(doc["top"] + doc["targets"], single["top"] + single["targets"]):
            assert a["logit"] == pytest.approx(b["logit"], abs=1e-4)
            assert a["prob"] == pytest.approx(b["prob"], rel=1e-4)
        assert doc["entropy"] == pytest.approx(single["entropy"], abs=1e-4)


def test_cli_table_reads_stdin_and_counts_wins(tiny):
    got = cli("inspect", "--file", "-", "-t", " are", "-t", " is", "--model", str(tiny[0]),
                        input="The keys on the table\nThe key on the table\n")
    assert got.exit_code == 0, got.output
    assert "The keys on the" in got.stdout and "p(␣are)" in got.stdout
    assert "2 prompts, 1 forward pass of ≤ 2 rows" in got.stdout
    assert "targets won (the most probable of the targets): ␣are" in got.stdout.replace("\n", " ")


@pytest.mark.parametrize("args, message", [
    (["--file", "missing.txt"], "no such prompt file: missing.txt"),
    (["--file", "bad.txt"], "bad.txt is not UTF-8 text"),
    (["--file", "good.txt", "Hello"], "give a prompt or --file, not both"),
    (["--file", "good.txt", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["--file", "good.txt", "--explain", " are"], "cannot be combined with --file"),
])
def test_cli_bad_input_exits_2(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "good.txt").write_text("Hello\n", encoding="utf-8")
    got = cli("inspect", *args, "--model", "random:gpt2")  # fails before any load
    assert got.exit_code == 2, got.output
    assert message in got.stderr


@pytest.mark.parametrize("command", ["inspect", "score"])
def test_a_fifo_as_file_is_refused_without_waiting_for_a_writer(tmp_path, command):
    """A named pipe with no writer would block open() for ever: refused by the one input opener
    (readings.batch.open_input) that inspect, score and compare read --file through."""
    import os

    from helpers import launch

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = launch(command, "--file", str(fifo), "--model", "random:gpt2", timeout=120, text=True)
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr
    assert got.stderr.startswith(f"lmhead: error: {fifo} is a FIFO (named pipe), not a regular file")


def test_a_device_as_file_is_still_read_up_to_the_line_limit():
    got = cli("inspect", "--file", "/dev/zero", "--model", "random:gpt2")
    assert got.exit_code == 2 and "line 1 is longer than 1,048,576 bytes" in got.stderr


def test_a_folder_or_a_missing_file_is_named_alike_by_every_file_reader(tmp_path, monkeypatch):
    """--file (readings.batch.open_input), --preset FILE.toml and --json-schema (inputs.read_small_file) say
    it in one wording (inputs.unreadable): 'no such WHAT: NAME', 'the WHAT NAME is a folder, not a file'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir.toml").mkdir()
    for args, what in ((["inspect", "--file"], "prompt file"), (["generate", "x", "--preset"], "preset file"),
                       (["generate", "x", "--json-schema"], "JSON schema file")):
        name = "dir.toml"
        got = cli(*args, name, "--model", "random:gpt2")
        assert (got.exit_code, got.stderr) == (2, f"lmhead: error: the {what} {name} is a folder, not a file\n")
        got = cli(*args, "absent.toml", "--model", "random:gpt2")
        assert (got.exit_code, got.stderr) == (2, f"lmhead: error: no such {what}: absent.toml\n")
