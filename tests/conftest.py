"""Shared fixtures: tiny GPT-2-architecture checkpoints built with transformers (the oracle), with the
real GPT-2 tokenizer, and an isolated environment for every test. The builders are in helpers.py."""

from __future__ import annotations

import os
import sys

# Compiled modules are cached (__pycache__, git-ignored) even where PYTHONDONTWRITEBYTECODE is set, as on
# the machines this suite is measured on: otherwise every worker rewrites every test module's asserts,
# and every `lmhead` the suite starts compiles lmhead_cli from source again (~0.5 s of CPU each).
sys.dont_write_bytecode = False

# Under pytest-xdist the workers share the machine's cores: each worker, and every process it starts, runs
# torch on its share (OMP_NUM_THREADS, read when torch loads, before helpers imports it), unless the caller
# set OMP_NUM_THREADS. Two workers of two OpenMP threads each on 2 cores spun against each other: the
# suite took 351 s and 660 s of CPU, with one thread each 304 s and 560 s. The tests of several threads set
# their count themselves (test_step, test_engine_parity, test_threads).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import pytest  # noqa: E402

# helpers (and torch with it) is imported where a fixture needs it: pytest-xdist's controller loads this
# file too, before it starts any worker, and runs no test (importing torch there held every worker back ~2 s).


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


# random:NAME's seeded weights, made once per worker for each (config, seed) and copied for every load:
# drawing GPT-2's 124M normals takes ~1 s of CPU, and the suite's tests (every --help example runs on
# random:gpt2) drew them ~40 times, 32 s of the workers' ~270 s of CPU in one profile. Each load gets
# its own copy, as from random_state itself; tests marked `drawn_random_weights` draw theirs.
_DRAWN: dict[tuple[str, int], dict] = {}
_DRAWN_MAX = 2  # GPT-2's and distilgpt2's: ~0.8 GB a worker


def _drawn_once(draw):
    def random_state(config: dict, seed: int) -> dict:
        import json

        key = (json.dumps(config, sort_keys=True, default=str), seed)
        if key not in _DRAWN:
            while len(_DRAWN) >= _DRAWN_MAX:
                del _DRAWN[next(iter(_DRAWN))]
            _DRAWN[key] = draw(config, seed)
        return {name: t.clone() for name, t in _DRAWN[key].items()}

    return random_state


@pytest.fixture(autouse=True)
def _random_weights_drawn_once(request, monkeypatch):
    if request.node.get_closest_marker("drawn_random_weights") is None:
        from lmhead_cli.loading import sources

        monkeypatch.setattr(sources, "random_state", _drawn_once(sources.random_state))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(folder, transformers model) for a tied tiny GPT-2: V = 50257, D = 64, 2 layers."""
    from helpers import build_checkpoint

    folder = tmp_path_factory.mktemp("tiny")
    return folder, build_checkpoint(folder)


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    """(folder, transformers model) for a tiny GPT-2 whose head is its own matrix."""
    from helpers import build_checkpoint

    folder = tmp_path_factory.mktemp("tiny_untied")
    return folder, build_checkpoint(folder, tied=False, seed=1)


@pytest.fixture(scope="session")
def eos_model(tmp_path_factory):
    """(folder, model): a tiny untied GPT-2 whose end-of-text (50256) is a strong runner-up, so greedy
    and beam runs finish early."""
    import torch
    from helpers import build_checkpoint

    folder = tmp_path_factory.mktemp("eos")
    model = build_checkpoint(folder, tied=False, seed=3)
    with torch.no_grad():
        h = model.transformer(torch.tensor([list(range(0, 5000, 7))])).last_hidden_state[0].mean(0)
        model.lm_head.weight[50256] = h / h.norm() * 0.7
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="session")
def real_gpt2():
    from helpers import real_gpt2_folder

    folder = real_gpt2_folder()
    if folder is None:
        pytest.skip("real gpt2 weights are not in the local Hugging Face cache")
    return folder


@pytest.fixture(scope="session")
def loud(tmp_path_factory):
    """(folder, transformers model) of loud_checkpoint: peaked distributions, MLPs in gelu's curved range."""
    from helpers import loud_checkpoint

    folder = tmp_path_factory.mktemp("loud")
    return folder, loud_checkpoint(folder)


# The heavy tiers, by the files that hold them (a test that drives the browser through the `browser`
# fixture, runs mypy or calls a C compiler carries its marker itself). Each test of a heavy tier is also
# marked `full`: `-m "not full"` is the fast tier (the README's test command, with the [test] extra),
# and .ci/run runs every tier (the [test-full] extra and chromium).
TIERS = {"test_page.py": "browser", "test_lmeval.py": "lmeval", "test_distributed.py": "torchrun",
         "test_notebook.py": "notebook"}
FULL = ("slow", "browser", "lmeval", "torchrun", "notebook", "typecheck")
HEAVY = ("slow", "lmeval", "torchrun")  # run first


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = TIERS.get(item.path.name) or ("browser" if "browser" in getattr(item, "fixturenames", ()) else None)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
        if any(item.get_closest_marker(name) for name in FULL):
            item.add_marker(pytest.mark.full)
    # The longest tests first (a stable sort: the rest keep their order, the same in every worker, as
    # pytest-xdist requires): started last, one of them kept a worker busy while the other had finished.
    items.sort(key=lambda item: not any(item.get_closest_marker(name) for name in HEAVY))
