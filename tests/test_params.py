"""`lmhead params`: the arithmetic account against transformers' own tensors, and the CLI around it.

Every expected figure is computed here independently: by hand-written arithmetic, or by building
transformers' GPT2LMHeadModel (on the meta device, so gpt2-xl costs no memory) and counting its tensors.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from lmhead_cli.loading.model_configs import config_names, load_config
from lmhead_cli.readings.params import account_from_config, account_from_tensors, head_cost, logits_memory


def meta_model(config: dict, **changes) -> GPT2LMHeadModel:
    """transformers' GPT-2 for ``config`` with meta tensors: shapes and ties, no memory."""
    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(**{**config, **changes}))


def unique_numel(module: torch.nn.Module) -> int:
    """Parameters counted the way torch dedups them: each Parameter object once."""
    return sum(p.numel() for p in module.parameters())


def invoke(*args: str):
    return cli(*args)


# ---- arithmetic ---------------------------------------------------------------------------------

def test_gpt2_small_by_hand():
    V, P, d, L = 50257, 1024, 768, 12
    block = (d + d) + (d * 3 * d + 3 * d) + (d * d + d) + (d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    total = V * d + P * d + L * block + (d + d)

    acc = account_from_config(load_config("gpt2"))

    assert (acc.total, acc.embedding, acc.position, acc.per_block) == (total, V * d, P * d, block)
    assert (acc.blocks, acc.final_norm, acc.head_extra, acc.tied) == (L * block, 2 * d, 0, True)
    assert acc.untied_total == total + V * d
    # The figures the issue quotes, and 31.0%.
    assert (acc.total, acc.embedding, acc.untied_total) == (124_439_808, 38_597_376, 163_037_184)
    assert f"{acc.embedding_share:.1%}" == "31.0%"


def test_n_inner_given_overrides_four_d():
    acc = account_from_config({**load_config("gpt2"), "n_inner": 1000})
    assert acc.n_inner == 1000
    assert acc.block.mlp_up == 768 * 1000 + 1000
    assert acc.block.mlp_down == 1000 * 768 + 768


# ---- agreement with real tensors ----------------------------------------------------------------

@pytest.mark.parametrize("name", config_names())
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_arithmetic_equals_transformers_tensors(name, tied):
    config = {**load_config(name), "tie_word_embeddings": tied}
    model = meta_model(config)

    from_tensors = account_from_tensors(model.named_parameters(remove_duplicate=False))

    assert account_from_config(config) == from_tensors
    assert from_tensors.total == model.num_parameters() == unique_numel(model)
    assert from_tensors.tied is tied
    V, d = config["vocab_size"], config["n_embd"]
    assert from_tensors.head_extra == (0 if tied else V * d)
    block = model.transformer.h[0]
    parts = {"ln_1": block.ln_1, "attn_qkv": block.attn.c_attn, "attn_proj": block.attn.c_proj,
             "ln_2": block.ln_2, "mlp_up": block.mlp.c_fc, "mlp_down": block.mlp.c_proj}
    for field, module in parts.items():
        assert getattr(from_tensors.block, field) == unique_numel(module), field
    assert from_tensors.final_norm == unique_numel(model.transformer.ln_f)


def test_real_cpu_tensors_tied_and_untied(tiny, tiny_untied):
    """Real storage (not meta): sharing is found by data_ptr, in named_parameters and in state dicts."""
    for (_, model), tied in ((tiny, True), (tiny_untied, False)):
        config = model.config.to_dict()
        for named in (model.named_parameters(remove_duplicate=False), model.state_dict()):
            acc = account_from_tensors(named)
            assert acc.tied is tied
            assert acc.total == model.num_parameters() == unique_numel(model)
            assert acc == account_from_config(config)


def test_a_copied_head_is_not_tied():
    """Equal values in separate storage are two matrices: the head is counted on its own."""
    config = {**load_config("gpt2"), "n_layer": 1, "n_positions": 8, "n_embd": 16, "n_head": 2, "vocab_size": 50}
    model = GPT2LMHeadModel(GPT2Config(**config))
    state = {k: v.clone() for k, v in model.state_dict().items()}

    acc = account_from_tensors(state)

    assert acc.tied is False
    assert acc.head_extra == 50 * 16
    assert acc.total == model.num_parameters() + 50 * 16


def test_names_without_prefix_buffers_and_strangers():
    config = {**load_config("gpt2"), "n_layer": 2, "n_positions": 8, "n_embd": 16, "n_head": 2, "vocab_size": 50}
    base = GPT2Model(GPT2Config(**config))  # no "transformer." prefix, no head
    state = dict(base.state_dict())
    state["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)  # the causal mask old checkpoints carry: not a parameter

    acc = account_from_tensors(state)

    assert acc.tied is True  # no head tensor: GPT-2 checkpoints store the tied head only as wte
    assert acc.other == 0
    assert acc.total == unique_numel(base)
    assert acc == account_from_config(config)

    state["adapter.weight"] = torch.zeros(3, 4)
    assert account_from_tensors(state).other == 12
    assert account_from_tensors(state).total == unique_numel(base) + 12


# ---- head cost and logits memory ----------------------------------------------------------------

def test_head_cost_and_logits_memory():
    assert head_cost(768, 50257).multiply_adds_per_position == 768 * 50257
    mem = logits_memory(8, 2048, 32000)
    assert mem.all_positions_bytes == 8 * 2048 * 32000 * 4
    assert round(mem.all_positions_bytes / 1e9, 1) == 2.1
    assert mem.last_position_bytes == 8 * 32000 * 4


# ---- CLI ----------------------------------------------------------------------------------------

def test_cli_default_is_gpt2():
    r = invoke("params")
    assert r.exit_code == 0, r.output
    for figure in (f"{124_439_808:,}", f"{50257 * 768:,}", "31.0%", f"{163_037_184:,}", f"{768 * 50257:,}"):
        assert figure in r.stdout
    assert "counted from the bundled config" in r.stdout


def test_cli_json_every_config_matches_transformers():
    for name in config_names():
        r = invoke("params", "--config", name, "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        model = meta_model(load_config(name))
        V, d = model.config.vocab_size, model.config.n_embd
        assert doc["total"] == model.num_parameters()
        assert doc["embedding"] == V * d
        assert doc["position"] == model.config.n_positions * d
        assert doc["blocks"] == unique_numel(model.transformer.h)
        assert doc["final_norm"] == 2 * d
        assert (doc["head_extra"], doc["tied"]) == (0, True)
        assert doc["untied_total"] == model.num_parameters() + V * d


def test_cli_memory_options():
    r = invoke("params", "--batch", "8", "--seq", "2048", "--vocab", "32000", "--json")
    assert r.exit_code == 0, r.output
    mem = json.loads(r.stdout)["logits_memory"]
    assert mem["all_positions_bytes"] == 8 * 2048 * 32000 * 4
    assert mem["last_position_bytes"] == 8 * 32000 * 4
    plain = invoke("params", "--batch", "8", "--seq", "2048", "--vocab", "32000")
    assert f"{8 * 2048 * 32000 * 4:,} bytes" in plain.stdout
    assert "2.1 GB" in plain.stdout


def test_cli_model_counts_real_tensors(tiny_untied, tiny):
    for (folder, model), tied in ((tiny_untied, False), (tiny, True)):
        r = invoke("params", "--model", str(folder), "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert doc["counted_from"] == "tensors"
        assert doc["total"] == model.num_parameters()
        assert doc["tied"] is tied
        V, d = model.config.vocab_size, model.config.n_embd
        assert doc["head_extra"] == (0 if tied else V * d)


@pytest.mark.real_weights
def test_cli_model_real_gpt2(real_gpt2):
    doc = json.loads(invoke("params", "--model", str(real_gpt2), "--json").stdout)
    assert (doc["total"], doc["embedding"], doc["untied_total"]) == (124_439_808, 50257 * 768, 163_037_184)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--config", "gpt3"], "unknown config 'gpt3'; choose one of: " + ", ".join(config_names())),
        (["--config", "gpt2", "--model", "gpt2"], "--config and --model are mutually exclusive: --config counts "
         "a bundled config by arithmetic, --model counts a loaded model's tensors"),
        (["--batch", "0"], "--batch must be at least 1; got 0"),
        (["--seq", "0"], "--seq must be at least 1; got 0"),
        (["--vocab", "-5"], "--vocab must be at least 1; got -5"),
    ],
)
def test_cli_bad_input(args, line):
    r = invoke("params", *args)
    assert r.exit_code == 2
    assert r.stderr == f"lmhead: error: {line}\n"
    assert r.stdout == ""
