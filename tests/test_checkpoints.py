"""Checkpoints checked before use (loading/checks.py, loading/validate.py, loading/weights.py): every file and
config field checked against the tensor header before anything is allocated, pickle never reached unasked,
one line naming the file and the fact."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    PROMPT,
    PROMPT_IDS,
    _tokenizer_files,
    build_checkpoint,
    hostile_pickle_folder,
    invoke,
    lmhead,
    one_line,
)


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


def copy_of(folder, tmp_path, name="ckpt") -> Path:
    dest = tmp_path / name
    shutil.copytree(folder, dest)
    return dest


def edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            config.pop(k, None)
        else:
            config[k] = v
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama checkpoint (2 layers, width 64, GPT-2's vocabulary), saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50257, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=256, bos_token_id=50256,
                                         eos_token_id=50256))
    model.save_pretrained(folder)
    _tokenizer_files(folder)
    return folder


def _pickle_shard(folder: Path) -> None:
    """The checkpoint's tensors moved into weights.bin (torch.save), named by model.safetensors.index.json."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "weights.bin")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "weights.bin" for k in state}}))


def test_an_index_naming_a_pickle_shard_is_refused_without_allow_pickle(tiny, tmp_path):
    folder = copy_of(tiny[0], tmp_path)
    _pickle_shard(folder)
    got = invoke(["inspect", "x", "--model", str(folder)])
    one_line(got, 1, "weights.bin", "not a .safetensors file", "--allow-pickle")


def test_an_index_naming_a_pickle_shard_loads_only_with_allow_pickle_and_gives_the_same_figures(tiny, tmp_path):
    folder = copy_of(tiny[0], tmp_path)
    _pickle_shard(folder)
    got = invoke(["inspect", PROMPT, "--model", str(folder), "--allow-pickle", "--json", "-k", "3"])
    assert got.exit_code == 0, got.output
    with torch.no_grad():
        z = tiny[1](torch.tensor([PROMPT_IDS])).logits[0, -1]
    assert [t["id"] for t in json.loads(got.stdout)["top"]] == torch.topk(z, 3).indices.tolist()


def test_allow_pickle_on_a_hostile_pickle_names_the_refused_global_without_torchs_advice(tmp_path):
    folder = hostile_pickle_folder(tmp_path, torch.save)  # what a hostile .bin holds: a call to os.system
    got = invoke(["tie", "--model", str(folder), "--allow-pickle"])
    one_line(got, 1, "pytorch_model.bin", "refused the unsupported global posix.system")
    for advice in ("weights_only", "likely succeed", "trusted source", "add_safe_globals"):
        assert advice not in got.stderr, got.stderr


# transformers' GPT2Config fields that change the arithmetic, with a value that changes it.
ROUTED = {
    "activation_function": "relu",
    "scale_attn_by_inverse_layer_idx": True,
    "scale_attn_weights": False,
    "reorder_and_upcast_attn": True,
    "add_cross_attention": True,
}


HONOURED = {"layer_norm_epsilon": 0.05, "n_inner": 96, "activation_function": "gelu_new"}


def test_every_gpt2_config_field_is_decided():
    """Each field of transformers' GPT2Config is in the lean engine's table: honoured, routed to
    transformers, or without effect on the arithmetic of a loaded model in eval mode."""
    import inspect

    from transformers import GPT2Config

    from lmhead_cli.engine import gpt2_fields

    fields = [p for p in inspect.signature(GPT2Config.__init__).parameters if p not in ("self", "kwargs")]
    undecided = [f for f in fields if f not in gpt2_fields.DECIDED]
    assert undecided == []
    assert set(ROUTED) <= set(gpt2_fields.ROUTED)


def _reference_top(model, k=5):
    with torch.no_grad():
        z = model(torch.tensor([PROMPT_IDS])).logits[0, -1]
    return torch.topk(z, k)


@pytest.mark.parametrize("field", list(ROUTED))
def test_a_gpt2_field_the_lean_engine_lacks_routes_to_transformers_with_a_note(tmp_path, field):
    model = build_checkpoint(tmp_path / field, n_embd=32, n_layer=3, n_head=4, **{field: ROUTED[field]})
    got = invoke(["inspect", PROMPT, "--model", str(tmp_path / field), "--json", "-k", "5"])
    assert got.exit_code == 0, got.output
    assert field in got.stderr and "transformers" in got.stderr  # the note says why
    top = _reference_top(model)
    doc = json.loads(got.stdout)
    assert [t["id"] for t in doc["top"]] == top.indices.tolist()
    assert [t["logit"] for t in doc["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("field", list(ROUTED))
def test_a_gpt2_field_the_lean_engine_lacks_is_refused_by_name_on_engine_lean(tmp_path, field):
    build_checkpoint(tmp_path / field, n_embd=32, n_layer=1, n_head=4, **{field: ROUTED[field]})
    got = invoke(["inspect", PROMPT, "--model", str(tmp_path / field), "--engine", "lean"])
    one_line(got, 2, field, "--engine transformers")


@pytest.mark.parametrize("field", list(HONOURED))
def test_a_gpt2_field_the_lean_engine_honours_gives_transformers_figures(tmp_path, field):
    model = build_checkpoint(tmp_path / field, n_embd=32, n_layer=2, n_head=4, **{field: HONOURED[field]})
    with torch.no_grad():  # make ln_1/ln_f statistics matter for epsilon: small activations
        pass
    got = invoke(["inspect", PROMPT, "--model", str(tmp_path / field), "--json", "-k", "5", "--engine", "lean"])
    assert got.exit_code == 0, got.output
    top = _reference_top(model)
    assert [t["logit"] for t in json.loads(got.stdout)["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)


def _retype(name, fn):
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / "model.safetensors"))
        state[name] = fn(state[name])
        save_file(state, str(folder / "model.safetensors"))
    return edit


BAD_DTYPES = {
    "int8 wte": (_retype("transformer.wte.weight", lambda t: t.to(torch.int8)), "wte.weight", "I8"),
    "bool ln_f": (_retype("transformer.ln_f.weight", lambda t: t > 0), "ln_f.weight", "BOOL"),
    "int64 wte of 2^62": (_retype("transformer.wte.weight", lambda t: torch.full(t.shape, 2**62, dtype=torch.int64)),
                          "wte.weight", "I64"),
}


@pytest.mark.parametrize("case", list(BAD_DTYPES))
def test_a_tensor_that_is_not_floating_point_is_refused_before_use(tiny, tmp_path, case):
    edit, name, dtype = BAD_DTYPES[case]
    folder = copy_of(tiny[0], tmp_path)
    edit(folder)
    got = invoke(["inspect", "x", "--model", str(folder)])
    one_line(got, 1, name, dtype, "floating-point", str(folder))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "vocab.json", "tokenizer.json"])
@pytest.mark.slow
def test_a_fifo_in_a_checkpoint_is_refused_without_blocking(tiny, tmp_path, name):
    folder = copy_of(tiny[0], tmp_path)
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    got = lmhead("inspect", "x", "--model", str(folder), timeout=60)
    assert got.returncode == 1, got.stderr
    assert f"{folder / name} is a FIFO (named pipe), not a regular file" in got.stderr and len(got.stderr.splitlines()) == 1


def test_layer_counts_are_checked_against_the_header_before_anything_is_built(llama, tmp_path, monkeypatch):
    from lmhead_cli.loading import sources

    def never(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(sources, "build_transformers", never)
    folder = edit_config(copy_of(llama, tmp_path), num_hidden_layers=100_000)
    got = invoke(["inspect", "x", "--model", str(folder)])
    one_line(got, 1, "num_hidden_layers 100,000", "holds 2 layers", str(folder))


def _tok_json(folder: Path, content) -> None:
    (folder / "tokenizer.json").write_text(content if isinstance(content, str) else json.dumps(content))


def _bpe_tokenizer_json() -> dict:
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    return json.loads(GPT2Tokenizer.bundled().tok.to_str())


def _unknown_merges(folder: Path) -> None:
    (folder / "merges.txt").write_text("#version: 0.2\nzzq\u0100 \u0101qqx\n")


BAD_FILES = {
    "tokenizer.json truncated": (lambda f: _tok_json(f, json.dumps(_bpe_tokenizer_json())[:5000]), "tokenizer.json"),
    "tokenizer.json {}": (lambda f: _tok_json(f, {}), "tokenizer.json"),
    "vocab.json a list": (lambda f: (f / "vocab.json").write_text("[1, 2, 3]"), "vocab.json"),
    "vocab.json not JSON": (lambda f: (f / "vocab.json").write_text("{\"a\": "), "vocab.json"),
    "merges naming unknown tokens": (_unknown_merges, "merges.txt"),
    "config.json nested 100,000 deep": (lambda f: (f / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                                        "config.json"),
    "config.json not UTF-8": (lambda f: (f / "config.json").write_bytes(b'{"model_type": "gpt2\xff"}'), "config.json"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_tokenizer_or_config_file_is_one_line_naming_it(tiny, tmp_path, case):
    edit, name = BAD_FILES[case]
    folder = copy_of(tiny[0], tmp_path)
    edit(folder)
    got = invoke(["inspect", "x", "--model", str(folder)])
    one_line(got, 1, str(folder / name))


def test_a_config_with_a_byte_order_mark_loads(tiny, tmp_path):
    folder = copy_of(tiny[0], tmp_path)
    (folder / "config.json").write_bytes(b"\xef\xbb\xbf" + (folder / "config.json").read_bytes())
    assert invoke(["inspect", "x", "--model", str(folder)]).exit_code == 0


LLAMA_CONFIGS = {
    "num_attention_heads 0": ({"num_attention_heads": 0}, "num_attention_heads must be at least 1"),
    "heads do not divide the width": ({"num_attention_heads": 3, "head_dim": ...}, "not a multiple"),
    "rope_parameters a string": ({"rope_parameters": "x"}, "rope_parameters"),
    "max_position_embeddings a string": ({"max_position_embeddings": "x"}, "max_position_embeddings"),
    "max_position_embeddings -5": ({"max_position_embeddings": -5}, "max_position_embeddings must be at least 1"),
    "tie_word_embeddings yes": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    "hidden_act unknown": ({"hidden_act": "wiggle"}, "hidden_act 'wiggle' is not an activation transformers knows"),
}


@pytest.mark.parametrize("case", list(LLAMA_CONFIGS))
def test_a_config_transformers_would_reject_is_one_line_before_the_weights(llama, tmp_path, case, monkeypatch):
    from lmhead_cli.loading import sources

    monkeypatch.setattr(sources, "read_weights", lambda *a: pytest.fail("weights read before the config check"))
    changes, message = LLAMA_CONFIGS[case]
    folder = edit_config(copy_of(llama, tmp_path), **changes)
    got = invoke(["inspect", "x", "--model", str(folder)])
    one_line(got, 1, message, str(folder / "config.json"))


@pytest.mark.parametrize("cap", [0, 0.0, "x", -2.0])
def test_gemma2_softcapping_that_is_not_a_positive_number_is_refused(llama, tmp_path, cap):
    folder = edit_config(copy_of(llama, tmp_path), model_type="gemma2", final_logit_softcapping=cap)
    got = invoke(["inspect", "x", "--model", str(folder)])
    one_line(got, 1, "final_logit_softcapping", str(folder / "config.json"))


def test_a_llama_with_a_context_of_one_does_not_blame_stride(llama, tmp_path):
    folder = edit_config(copy_of(llama, tmp_path), max_position_embeddings=1)
    got = invoke(["score", "The keys on the table", "--model", str(folder)])
    assert got.exit_code in (1, 2) and "--stride" not in got.stderr and "unexpected" not in got.stderr
    assert "context of 1" in got.stderr or "max_position_embeddings" in got.stderr
