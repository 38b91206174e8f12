"""`inspect --file` under torchrun: each rank computes its share of the batches, rank 0 writes the
merged output, the same bytes as one process (lmhead_cli/distributed.py)."""

from __future__ import annotations

import pytest
from helpers import cli, launch

from lmhead_cli.distributed import Ranks

PROMPTS = [f"{s} {p}" for p in ("on the table", "near the door", "in the drawer")
           for s in ("The key", "The keys", "The dog", "The dogs", "A box")] + ["x" * 40, "The end"]


def test_share_gives_each_rank_every_worlds_group():
    """Groups of 2 over 11 items: [0 1] [2 3] [4 5] [6 7] [8 9] [10]; rank 1 of 3 takes groups 1 and 4."""
    assert list(Ranks(1, 3).share(range(11), 2)) == [2, 3, 8, 9]
    assert list(Ranks(2, 3).share(range(11), 2)) == [4, 5, 10]
    taken = sorted(x for r in range(3) for x in Ranks(r, 3).share(range(11), 2))
    assert taken == list(range(11))  # every item once
    assert list(Ranks().share(range(5), 2)) == [0, 1, 2, 3, 4]


def test_ranks_come_from_torchruns_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert Ranks.from_env() == Ranks(0, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # torchrun sets these too
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert Ranks.from_env() == Ranks(3, 4, 1)


def test_stdin_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    got = cli("inspect", "--file", "-", "--model", "random:gpt2", input="a\n")
    assert got.exit_code == 2
    assert "under torchrun" in got.stderr


def lmhead(*args: str, torchrun: int = 0):
    """`lmhead ARGS` in a fresh process, or under torchrun with `torchrun` processes; one thread each, so
    that both sides round alike."""
    return launch(*args, torchrun=torchrun, env={"LMHEAD_THREADS": "1"}, text=True)


@pytest.mark.parametrize("output", [["--json"], []], ids=["json", "table"])
def test_two_processes_write_what_one_writes(tiny, tmp_path, output):
    """7 batches of 3 (the last short) over 2 ranks: rank 0 computes 4, rank 1 computes 3."""
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(PROMPTS[:10] + [""] + PROMPTS[10:]) + "\n", encoding="utf-8")  # an empty line too
    args = ["inspect", "--file", str(f), "--model", str(tiny[0]), "--batch-size", "3", "-t", " is", "-t", " are",
            *output]
    one, two = lmhead(*args), lmhead(*args, torchrun=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout
    if output:
        assert len(two.stdout.splitlines()) == len(PROMPTS)
        assert one.stderr.strip() and one.stderr.strip() in two.stderr  # notices and summary: every rank's counts


def test_counts_from_every_rank_add_up():
    from lmhead_cli.readings.batch import BatchStats

    a = BatchStats(3, [" is", " are"], prompts=6, batches=2, splits=1, max_rows=3, truncated=2, truncated_lines=[4, 9],
                   best=[4, 2], top1=[1, 0])
    b = BatchStats(3, [" is", " are"], prompts=5, batches=2, max_rows=2, truncated=1, truncated_lines=[2],
                   best=[1, 4], top1=[0, 2])
    empty = BatchStats(3, [" is", " are"])
    got = BatchStats.merged([a, b, empty])
    assert (got.prompts, got.batches, got.splits, got.max_rows, got.truncated) == (11, 4, 1, 3, 3)
    assert got.truncated_lines == [2, 4, 9] and got.best == [5, 6] and got.top1 == [1, 2]


def test_score_file_under_two_processes_writes_what_one_writes(tiny, tmp_path):
    """score --file: 8 lines a round per rank; the corpus summary counts every rank's lines."""
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(PROMPTS + ["", "x"] + PROMPTS[:5]) + "\n", encoding="utf-8")
    args = ["score", "--file", str(f), "--model", str(tiny[0]), "--json"]
    one, two = lmhead(*args), lmhead(*args, torchrun=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and len(one.stdout.splitlines()) == len(PROMPTS) + 5
    assert one.stderr.strip() in two.stderr  # the corpus summary: every rank's texts and tokens
