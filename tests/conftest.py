"""Shared fixtures: tiny GPT-2-architecture checkpoints built with transformers (the oracle),
with the real GPT-2 tokenizer, and an isolated environment for every test."""

from __future__ import annotations

import os
import shutil
from importlib import resources
from pathlib import Path

import pytest

# Where the user's real Hugging Face cache is, read before any test redirects HF_HOME.
REAL_HF_HOME = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
PROMPT = "The keys on the table"
PROMPT_IDS = [464, 8251, 319, 262, 3084]


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    """No test reads the user's settings or reaches the network; caches live in tmp_path."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LMHEAD_MODEL", raising=False)
    monkeypatch.delenv("LMHEAD_DEBUG", raising=False)


def _tokenizer_files(folder: Path) -> None:
    src = resources.files("lmhead_cli.data") / "gpt2-tokenizer"
    for name in ("vocab.json", "merges.txt"):
        with resources.as_file(src / name) as p:
            shutil.copy(p, folder / name)


def build_checkpoint(folder: Path, *, tied: bool = True, n_embd: int = 64, n_layer: int = 2, n_head: int = 2,
                     n_positions: int = 1024, seed: int = 0, **overrides):
    """A GPT-2-architecture checkpoint with random weights, saved by transformers; returns the model."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions,
                        tie_word_embeddings=tied, **overrides)
    model = GPT2LMHeadModel(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _tokenizer_files(folder)
    return model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(folder, transformers model) for a tied tiny GPT-2: V = 50257, D = 64, 2 layers."""
    folder = tmp_path_factory.mktemp("tiny")
    return folder, build_checkpoint(folder)


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    """(folder, transformers model) for a tiny GPT-2 whose head is its own matrix."""
    folder = tmp_path_factory.mktemp("tiny_untied")
    return folder, build_checkpoint(folder, tied=False, seed=1)


@pytest.fixture(scope="session")
def eos_model(tmp_path_factory):
    """(folder, model): a tiny untied GPT-2 whose end-of-text (50256) is a strong runner-up, so greedy
    and beam runs finish early."""
    import torch

    folder = tmp_path_factory.mktemp("eos")
    model = build_checkpoint(folder, tied=False, seed=3)
    with torch.no_grad():
        h = model.transformer(torch.tensor([list(range(0, 5000, 7))])).last_hidden_state[0].mean(0)
        model.lm_head.weight[50256] = h / h.norm() * 0.7
    model.save_pretrained(folder)
    return folder, model


def real_gpt2_folder() -> Path | None:
    """The real gpt2 snapshot in the user's HF cache, or None (tests using it are skipped)."""
    for repo in ("models--gpt2", "models--openai-community--gpt2"):
        snapshots = REAL_HF_HOME / "hub" / repo / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir()):
                if (snap / "model.safetensors").exists() and (snap / "config.json").exists():
                    return snap
    return None


@pytest.fixture(scope="session")
def real_gpt2():
    folder = real_gpt2_folder()
    if folder is None:
        pytest.skip("real gpt2 weights are not in the local Hugging Face cache")
    return folder
