"""Shared fixtures: tiny GPT-2-architecture checkpoints built with transformers (the oracle), with the
real GPT-2 tokenizer, and an isolated environment for every test. The builders are in helpers.py."""

from __future__ import annotations

import pytest

from helpers import build_checkpoint, loud_checkpoint, real_gpt2_folder


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    """No test reads the user's settings or reaches the network; caches live in tmp_path. Every test sees
    the same terminal, whatever the shell that runs pytest sets: 80 columns, colour not turned off (a test
    about narrow terminals or NO_COLOR sets them itself)."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LMHEAD_MODEL", raising=False)
    monkeypatch.delenv("LMHEAD_DEBUG", raising=False)


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


@pytest.fixture(scope="session")
def real_gpt2():
    folder = real_gpt2_folder()
    if folder is None:
        pytest.skip("real gpt2 weights are not in the local Hugging Face cache")
    return folder


@pytest.fixture(scope="session")
def loud(tmp_path_factory):
    """(folder, transformers model) of loud_checkpoint: peaked distributions, MLPs in gelu's curved range."""
    folder = tmp_path_factory.mktemp("loud")
    return folder, loud_checkpoint(folder)


# The heavy tiers, by the files that hold them: `-m "not browser and not lmeval and not torchrun"`
# leaves them out of a quick run (the README's test command runs everything, as CI does). A test that
# calls a C compiler carries @pytest.mark.compile itself.
TIERS = {"test_page.py": "browser", "test_lmeval.py": "lmeval", "test_distributed.py": "torchrun"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = TIERS.get(item.path.name)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
