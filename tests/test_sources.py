"""Model sources, safe loading and the tie report, checked against transformers' own objects."""

from __future__ import annotations

import torch
import pytest
from helpers import PROMPT_IDS, invoke
from safetensors.torch import save_file

from lmhead_cli.loading import sources
from lmhead_cli.errors import CorruptCheckpoint, ModelNotFound, UnsafeCheckpoint, UsageError
from lmhead_cli.loading.sources import load_model
from lmhead_cli.cli.boundary import message


def _ref_logits(model, ids=PROMPT_IDS):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def _our_logits(loaded, ids=PROMPT_IDS):
    from lmhead_cli.readings.inspect import last_logits

    return last_logits(loaded, ids)[0]


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_tied_checkpoint_is_tied_by_object(tiny, engine):
    folder, ref = tiny
    loaded = load_model(str(folder), device="cpu", engine=engine)
    tie = loaded.tie
    assert tie.tied and tie.same_object and tie.same_data_ptr
    assert loaded.engine.head_weight is loaded.engine.embedding_weight
    assert tie.config_tie_word_embeddings is True
    assert tie.file_has_lm_head is False  # transformers does not store the tied head
    assert tie.shape == tuple(ref.lm_head.weight.shape)
    torch.testing.assert_close(_our_logits(loaded), _ref_logits(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_untied_checkpoint_keeps_its_own_head(tiny_untied, engine):
    folder, ref = tiny_untied
    loaded = load_model(str(folder), device="cpu", engine=engine)
    assert not loaded.tie.tied and not loaded.tie.same_object
    assert loaded.tie.file_has_lm_head is True
    assert not torch.equal(loaded.engine.head_weight, loaded.engine.embedding_weight)
    torch.testing.assert_close(loaded.engine.head_weight, ref.lm_head.weight)
    torch.testing.assert_close(_our_logits(loaded), _ref_logits(ref), atol=1e-4, rtol=0)


def test_tied_config_with_a_stored_head_reports_it_and_uses_wte(tmp_path, tiny):
    folder, ref = tiny
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = torch.randn_like(state["transformer.wte.weight"])
    for name in ("config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    save_file(state, tmp_path / "model.safetensors")
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.tie.tied and loaded.tie.file_has_lm_head is True
    assert loaded.tie.file_lm_head_equals_wte is False
    torch.testing.assert_close(_our_logits(loaded), _ref_logits(ref), atol=1e-4, rtol=0)


def test_sharded_safetensors_load(tmp_path, tiny):
    _, ref = tiny
    ref.save_pretrained(tmp_path, max_shard_size="5MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(str(tmp_path), device="cpu")
    torch.testing.assert_close(_our_logits(loaded), _ref_logits(ref), atol=1e-4, rtol=0)


def test_pickle_only_checkpoint_is_refused_unless_allowed(tmp_path, tiny):
    folder, ref = tiny
    for name in ("config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpoint, match="pickle.*pass allow_pickle to load") as e:
        load_model(str(tmp_path), device="cpu")
    assert "pass --allow-pickle to load" in message(e.value, "inspect")  # the CLI spells the parameter as its flag
    loaded = load_model(str(tmp_path), device="cpu", allow_pickle=True)
    torch.testing.assert_close(_our_logits(loaded), _ref_logits(ref), atol=1e-4, rtol=0)


def test_truncated_safetensors_names_the_file(tmp_path, tiny):
    folder, _ = tiny
    for name in ("config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match="model.safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_missing_tensor_is_named(tmp_path, tiny):
    folder, _ = tiny
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    del state["transformer.h.1.mlp.c_fc.weight"]
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpoint, match=r"h\.1\.mlp\.c_fc\.weight"):
        load_model(str(tmp_path), device="cpu")


def test_folder_without_weights_or_config(tmp_path, tiny):
    with pytest.raises(ModelNotFound, match="no config.json"):
        load_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_bytes((tiny[0] / "config.json").read_bytes())
    with pytest.raises(ModelNotFound, match="holds no weights"):
        load_model(str(tmp_path), device="cpu")
    with pytest.raises(ModelNotFound, match="no such folder"):
        load_model(str(tmp_path / "nope"), device="cpu")


@pytest.mark.drawn_random_weights  # each engine draws its own: the same seed must give the same weights
def test_random_names_and_seeded_weights():
    with pytest.raises(UsageError, match="random:gpt2.*random:gpt2-xl"):
        load_model("random:gpt3", device="cpu")
    a = load_model("random:distilgpt2", device="cpu")
    b = load_model("random:distilgpt2", device="cpu", engine="transformers")
    assert a.random_weights and a.tie.tied and b.tie.tied
    assert a.engine.head_weight.shape == (50257, 768) and len(a.engine.gpt.h) == 6
    ids = torch.tensor([PROMPT_IDS])
    torch.testing.assert_close(_our_logits(a), b.module(ids).logits[0, -1], atol=1e-4, rtol=0)


def test_uncached_hub_id_offline_fails_with_advice(monkeypatch):
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE.*random:gpt2"):
        load_model("gpt2", device="cpu")


def test_uncached_hub_id_unreachable_fails_without_downloading(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    probed = []
    monkeypatch.setattr(sources, "_reachable", lambda endpoint, timeout=3.0: probed.append(endpoint) or False)
    with pytest.raises(ModelNotFound, match="can't be reached.*local folder.*random:gpt2"):
        load_model("some-org/some-model", device="cpu")
    assert probed, "the hub must be probed quickly before any download is tried"


@pytest.mark.parametrize("offline", [True, False])
def test_the_default_model_falls_back_to_bundled_tiny_offline_saying_why_first(monkeypatch, offline):
    """source None (no model named): gpt2 not cached and the hub offline (HF_HUB_OFFLINE) or unreachable
    -> bundled:tiny, after one line that says why and how to insist; a named gpt2 never falls back."""
    from lmhead_cli.errors import Notice

    if not offline:
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setattr(sources, "_reachable", lambda endpoint, timeout=3.0: False)
    said = []
    loaded = load_model(None, device="cpu", announce=said.append)
    assert loaded.source == "bundled:tiny" and loaded.kind == "bundled"
    why = "HF_HUB_OFFLINE is set" if offline else "the hub can't be reached"
    assert said[0] == (f"gpt2 (the default model) is not in the Hugging Face cache and {why}: running on "
                       "bundled:tiny instead, a small GPT-2 that ships with lmhead; source gpt2 insists")
    assert isinstance(said[0], Notice) and said[0].spelled_with(lambda p: "--model").endswith("; --model gpt2 insists")
    with pytest.raises(ModelNotFound, match=why):
        load_model("gpt2", device="cpu")


def test_the_default_model_does_not_fall_back_from_other_failures(monkeypatch):
    """Only 'not cached and the hub offline or unreachable' gives way: a download that fails is gpt2's error."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(sources, "_reachable", lambda endpoint, timeout=3.0: True)

    def refused(*args, **kwargs):
        if kwargs.get("local_files_only"):
            raise FileNotFoundError("not cached")
        raise OSError("connection reset")

    monkeypatch.setattr("huggingface_hub.snapshot_download", refused)
    with pytest.raises(ModelNotFound, match="could not download 'gpt2'"):
        load_model(None, device="cpu")


def test_bad_device_dtype_engine():
    """The core names the parameter (device=), the CLI its flag (--device): one message, two spellings."""
    for key, value in (("device", "tpu"), ("dtype", "float8"), ("engine", "jax")):
        with pytest.raises(UsageError, match=f"^unknown {key} {value!r}; choose one of: ") as e:
            load_model("random:gpt2", **{key: value})
        assert message(e.value, "inspect").startswith(f"unknown --{key} {value!r}; choose one of: ")


def test_an_architecture_the_lean_engines_do_not_run_needs_transformers_engine(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(UsageError, match="use engine transformers$") as e:
        load_model(str(tmp_path), device="cpu", engine="lean")
    assert message(e.value, "inspect").endswith("use --engine transformers")


def test_bfloat16_loads_and_head_stays_tied(tiny):
    folder, ref = tiny
    loaded = load_model(str(folder), device="cpu", dtype="bfloat16")
    assert loaded.engine.dtype == torch.bfloat16 and loaded.tie.same_object
    ours = _our_logits(loaded)
    assert ours.dtype == torch.float32  # softmax always runs in float32
    torch.testing.assert_close(ours, _ref_logits(ref), atol=0.1, rtol=0.05)


def test_real_gpt2_is_tied(real_gpt2):
    loaded = load_model(str(real_gpt2), device="cpu")
    assert loaded.tie.same_object and loaded.tie.shape == (50257, 768)


def test_cached_hub_id_loads_offline(tmp_path, tiny, monkeypatch):
    """A hub id found in the HF cache (HF_HOME/hub/models--ORG--NAME/snapshots/REV) loads with no network."""
    folder, ref = tiny
    repo = tmp_path / "hf" / "hub" / "models--someorg--tiny-gpt2"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    loaded = load_model("someorg/tiny-gpt2", device="cpu")
    assert loaded.kind == "hub" and loaded.path == str(snap)
    torch.testing.assert_close(_our_logits(loaded), _ref_logits(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("command", [["generate"], ["greedy"], ["sample"], ["softcap"], ["generate", "--beams", "2"]])
def test_every_text_output_of_random_weights_says_so(command):
    got = invoke([*command, "The keys", "-n", "2", "--seed", "1", "--model", "random:distilgpt2"]
                 if command[0] not in ("greedy",) and "--beams" not in command else
                 [*command, "The keys", "-n", "2", "--model", "random:distilgpt2"])
    assert got.exit_code == 0, got.output
    # the banner is prose: a narrow terminal (COLUMNS=40) wraps it
    assert " ".join(got.stdout.split()).startswith("random weights (random:distilgpt2, seeded)")
