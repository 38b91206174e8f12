"""lm-evaluation-harness through `lmhead serve`: its `local-completions` backend, on a multiple-choice task
from a local file, gives the same per-sample loglikelihoods and is_greedy as its own `hf` backend on the
same checkpoint folder. Offline: the task is tests/data/lmhead_mc.yaml + .jsonl (plus docs whose answer
is the model's own greedy continuation, so that is_greedy is True somewhere and its check means something)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import serving

pytest.importorskip("lm_eval")
DATA = Path(__file__).parent / "data"
QUESTIONS = ["The keys on the table", "A long time ago", "My favourite colour is", "In the beginning",
             "The weather today", "She opened the door and"]


def greedy_docs(folder: Path, model) -> list[dict]:
    """Docs whose first choice is the model's greedy 2-token continuation (tokenized the same way in context)."""
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    tok = GPT2Tokenizer.from_folder(folder)
    docs = []
    for q in QUESTIONS:
        ids = tok.encode(q)
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False, pad_token_id=50256)[0, len(ids):]
        cont = tok.decode(g.tolist())
        if cont.startswith(" ") and cont.strip() and tok.encode(q + cont) == ids + g.tolist():
            docs.append({"question": q, "choices": [cont[1:], "banana", "the end", "nothing at all"], "answer": 0})
    return docs


# lm_eval's command line as `python -m lm_eval`, except that its task index holds only --include_path's
# tasks: indexing its ~14,000 built-in task files (TaskManager's include_defaults, which its command line
# does not expose) took ~10 s of each run, for tasks this test never names.
CLI = """
import functools, sys
import lm_eval.tasks.manager as manager
manager.TaskManager.__init__ = functools.partialmethod(manager.TaskManager.__init__, include_defaults=False)
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
cli_evaluate()
"""


def lm_eval(cwd: Path, out: Path, model: str, model_args: str, *extra: str) -> dict[int, list]:
    """Run the lm_eval command line; returns {doc_id: [(loglikelihood, is_greedy) per choice]}."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(cwd / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-c", CLI, "run", "--model", model, "--model_args", model_args, "--tasks", "lmhead_mc",
           "--include_path", str(cwd), "--log_samples", "--output_path", str(out), *extra]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    (samples,) = out.rglob("samples_lmhead_mc_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {row["doc_id"]: [(float(ll), flag == "True") for ((ll, flag),) in row["resps"]] for row in rows}


@pytest.mark.slow  # two lm_eval runs and a server: 40 s alone on 2 cores
def test_local_completions_through_lmhead_serve_equals_hf_backend(tiny, tmp_path):
    folder, model = tiny
    for name in ("lmhead_mc.yaml", "lmhead_mc.jsonl"):
        shutil.copy(DATA / name, tmp_path / name)
    docs = greedy_docs(folder, model)
    assert docs, "no question's greedy continuation re-tokenizes the same way"
    with open(tmp_path / "lmhead_mc.jsonl", "a") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)

    with serving(folder) as served:
        via_serve = lm_eval(tmp_path, tmp_path / "serve", "local-completions",
                            f"base_url={served.url}/v1/completions,model=tiny,max_length=1024,num_concurrent=4")
    via_hf = lm_eval(tmp_path, tmp_path / "hf_out", "hf", f"pretrained={folder},dtype=float32",
                     "--device", "cpu", "--batch_size", "4")

    assert sorted(via_serve) == sorted(via_hf) == list(range(8 + len(docs)))
    for doc_id, choices in via_hf.items():
        got = via_serve[doc_id]
        assert [g for _, g in got] == [g for _, g in choices], doc_id
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in choices], abs=1e-4), doc_id
    assert any(g for choices in via_hf.values() for _, g in choices)  # is_greedy is compared where it is True too
