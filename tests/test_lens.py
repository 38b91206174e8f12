"""`lmhead lens`: every layer's row against transformers' own hidden states, ln_f and lm_head;
the last row against `inspect`, exactly."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, assert_rank, cli, with_ln_f

from lmhead_cli.head import log_softmax
from lmhead_cli.readings.inspect import inspect_prompt
from lmhead_cli.readings.lens import lens_prompt
from lmhead_cli.loading.sources import load_model

N_LAYER = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return with_ln_f(tmp_path_factory.mktemp("lens"), seed=3, n_layer=N_LAYER)


def reference_residuals(model, ids=PROMPT_IDS) -> list[torch.Tensor]:
    """The raw residual stream (1, T, D) after the embeddings and each block, as transformers has it:
    hidden_states[:-1]; the last entry has ln_f applied already, so the last block's raw output comes
    from a hook."""
    raw = {}
    hook = model.transformer.h[-1].register_forward_hook(
        lambda _m, _i, out: raw.setdefault("x", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    with torch.no_grad():
        torch.testing.assert_close(model.transformer.ln_f(raw["x"]), out.hidden_states[-1])  # the hook is right
    return list(out.hidden_states[:-1]) + [raw["x"]]


def reference_rows(model, ids=PROMPT_IDS) -> list[torch.Tensor]:
    """Logits (V,) per layer at the last position the way transformers computes them: ln_f, lm_head."""
    with torch.no_grad():
        return [model.lm_head(model.transformer.ln_f(x[0, -1])) for x in reference_residuals(model, ids)]


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_every_layer_matches_transformers(ckpt, engine):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    lens = lens_prompt(loaded, PROMPT, [" are", " is"])
    ref = reference_rows(model)
    assert [row.layer for row in lens.layers] == list(range(N_LAYER + 1))  # embeddings first, last block last
    for row, ours, theirs in zip(lens.layers, lens.logits, ref):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        logprobs = log_softmax(theirs)
        assert row.top_id == int(theirs.argmax())
        assert row.top_prob == pytest.approx(float(logprobs.max().exp()), abs=1e-6)
        assert row.entropy == pytest.approx(float(-(logprobs.exp() * logprobs).sum()), abs=1e-4)
        for t in row.targets:
            assert_rank(t.rank, theirs, t.id)
            assert t.prob == pytest.approx(float(logprobs[t.id].exp()), abs=1e-7)


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_every_rows_kl_to_final_is_the_kl_from_transformers_last_row(ckpt, engine):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    lens = lens_prompt(loaded, PROMPT)
    ref = [torch.log_softmax(z.double(), -1) for z in reference_rows(model)]
    for row, logq in zip(lens.layers, ref):
        want = float((ref[-1].exp() * (ref[-1] - logq)).sum())
        assert set(row.kl_to_final) == {"logit"} and row.tuned is None
        assert row.kl_to_final["logit"] == pytest.approx(want, abs=1e-5)
    assert lens.layers[-1].kl_to_final["logit"] == 0.0 and lens.tuned_lens is None


def test_each_layer_is_normalised_with_its_own_statistics(ckpt):
    """Reusing the last layer's mean and scale for an earlier vector gives other logits: the lens must not."""
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu")
    lens = lens_prompt(loaded, PROMPT)
    resid = [x[0, -1] for x in loaded.engine.residuals(torch.tensor([PROMPT_IDS]))]
    ln = model.transformer.ln_f
    mu, sigma = resid[-1].mean(), resid[-1].var(unbiased=False).add(ln.eps).sqrt()
    with torch.no_grad():
        cached = model.lm_head((resid[0] - mu) / sigma * ln.weight + ln.bias)
    assert not torch.allclose(lens.logits[0], cached, atol=1e-3)


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_last_row_is_inspect_exactly(ckpt, engine):
    folder, _ = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    lens = lens_prompt(loaded, PROMPT, [" are"])
    result = inspect_prompt(loaded, PROMPT, 5, [" are"])
    assert torch.equal(lens.logits[-1], result.logits)
    last = lens.layers[-1]
    assert (last.top_id, last.top_prob, last.entropy) == (result.top[0].id, result.top[0].prob, result.entropy)
    assert last.targets == result.targets


def test_heat_map_holds_each_layers_probabilities(ckpt):
    folder, _ = ckpt
    loaded = load_model(str(folder), device="cpu")
    lens = lens_prompt(loaded, PROMPT, [" are"], columns=4)
    result = inspect_prompt(loaded, PROMPT, 4)
    assert [c.id for c in lens.columns[:4]] == [t.id for t in result.top]
    assert lens.top_columns == 4
    assert lens.columns[-1].id == loaded.tokenizer.encode(" are")[0]
    assert len(lens.heat) == N_LAYER + 1 and all(len(row) == 5 for row in lens.heat)
    for row, logits in zip(lens.heat, lens.logits):
        expected = log_softmax(logits).exp()[[c.id for c in lens.columns]]
        assert row == pytest.approx(expected.tolist(), abs=1e-9)
    assert lens.peak == max(max(row) for row in lens.heat)


def test_cli_json_layers_and_last_row_equal_inspect(ckpt):
    folder, _ = ckpt
    args = [PROMPT, "--target", " are", "--model", str(folder), "--json"]
    got = cli("lens", *args)
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    layers = doc["layers"]
    assert [layer["layer"] for layer in layers] == list(range(N_LAYER + 1))
    assert set(layers[0]) == {"layer", "top_id", "top_token", "top_prob", "entropy", "targets", "kl_to_final", "tuned"}
    assert layers[0]["targets"][0]["token"] == " are"
    ins = json.loads(cli("inspect", *args).stdout)
    assert layers[-1]["top_id"] == ins["top"][0]["id"]
    assert layers[-1]["top_prob"] == ins["top"][0]["prob"]
    assert layers[-1]["entropy"] == ins["entropy"]
    assert layers[-1]["targets"] == ins["targets"]


def test_cli_table_and_heat_map(ckpt):
    folder, _ = ckpt
    table = cli("lens", PROMPT, "-t", " are", "--model", str(folder))
    assert table.exit_code == 0, table.output
    assert "embeddings" in table.stdout and f"block {N_LAYER}" in table.stdout and "␣are rank" in table.stdout
    heat = cli("lens", PROMPT, "--heat", "-k", "3", "--model", str(folder))
    assert heat.exit_code == 0, heat.output
    assert "███" in heat.stdout and "shades: ░ ≥ 20%" in heat.stdout


@pytest.mark.parametrize("args, message", [
    ([], "give a prompt"),
    (["   "], "the prompt is empty"),
    ([PROMPT, "-k", "0"], "--top-k must be at least 1"),
])
def test_cli_bad_input_exits_2(ckpt, args, message):
    folder, _ = ckpt
    got = cli("lens", *args, "--model", str(folder))
    assert got.exit_code == 2
    assert message in got.stderr


# ---- --position (issue 11): the lens at any position of the prompt ----------------------------------

@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_any_position_matches_transformers(ckpt, engine):
    """The model is causal, so position i of the prompt is the last position of its first i + 1 tokens:
    transformers' rows for that prefix are the oracle."""
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    for position in (0, 2, -2, -len(PROMPT_IDS)):  # -T is the first token, the last one accepted
        at = position % len(PROMPT_IDS)
        lens = lens_prompt(loaded, PROMPT, [" are"], position=position)
        assert lens.position == at
        for row, ours, theirs in zip(lens.layers, lens.logits, reference_rows(model, PROMPT_IDS[: at + 1])):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
            assert row.top_id == int(theirs.argmax())
    assert lens_prompt(loaded, PROMPT).position == len(PROMPT_IDS) - 1  # the default stays the last


def test_cli_position_json_and_range(ckpt, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    folder, _ = ckpt
    got = cli("lens", PROMPT, "--position", "1", "--model", str(folder), "--json")
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc["position"] == 1
    last = json.loads(cli("lens", PROMPT, "--model", str(folder), "--json").stdout)
    assert last["position"] == len(PROMPT_IDS) - 1 and last["layers"] != doc["layers"]
    table = cli("lens", PROMPT, "--position", "1", "--model", str(folder))
    assert "position 1 (␣keys" in table.stdout
    assert "what `lmhead score` reports for token 2" in table.stdout
    for bad in ("5", "-6"):
        got = cli("lens", PROMPT, "--position", bad, "--model", str(folder))
        assert got.exit_code == 2
        assert got.stderr == (f"lmhead: error: --position {bad} is outside the prompt's 5 tokens: give 0 to 4, "
                              "or -1 for the last\n")


def test_lens_carries_the_prompt_and_the_model(ckpt):
    """What the renderers read off a Lens: the prompt's ids, the provenance, the tie, the default columns."""
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu")
    lens = lens_prompt(loaded, PROMPT)
    assert [(t.id, t.text) for t in lens.prompt_tokens] == [(i, loaded.tokenizer.token_text(i)) for i in PROMPT_IDS]
    assert lens.random_weights is False
    tied = model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert tied and lens.tied is True  # with_ln_f's checkpoint ties its head, as transformers loads it
    assert lens.top_columns == len(lens.columns) == 8  # the default heat map: the last layer's top 8


def test_ids_go_to_the_engines_device_not_the_default_one(ckpt):
    """layer_logits puts the prompt's ids on the engine's device: under another default device (a GPU
    session's `torch.set_default_device("cuda")`; here the meta device) the lens reads the same logits."""
    folder, _ = ckpt
    loaded = load_model(str(folder), device="cpu")
    expected = lens_prompt(loaded, PROMPT).logits
    with torch.device("meta"):
        got = lens_prompt(loaded, PROMPT).logits
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens_and_says_how_many_went(tmp_path):
    from helpers import build_checkpoint

    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    folder = tmp_path / "short_ctx"
    build_checkpoint(folder, n_positions=16, n_layer=2)
    prompt = " ".join(f"w{i}" for i in range(20))
    ids = GPT2Tokenizer.bundled().encode(prompt)
    lens = lens_prompt(load_model(str(folder), device="cpu"), prompt)
    assert [t.id for t in lens.prompt_tokens] == ids[-16:] and lens.truncated == len(ids) - 16 > 0
    assert lens.position == 15
    full = lens_prompt(load_model(str(folder), device="cpu"), " ".join(f"w{i}" for i in range(3)))
    assert full.truncated == 0


# ---- the position map: every layer's top token at every prompt position ---------------------------------

def reference_grid(model, ids) -> list[torch.Tensor]:
    """log-probabilities (T, V) float64 per layer at every position, from transformers' residual stream
    through ln_f and the tied lm_head."""
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # the tied head
    with torch.no_grad():
        return [torch.log_softmax(model.lm_head(model.transformer.ln_f(x[0])).double(), -1)
                for x in reference_residuals(model, ids)]


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_the_position_map_is_each_layers_top_token_at_each_position(ckpt, engine):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    lens = lens_prompt(loaded, PROMPT, position=2)
    ref = reference_grid(model, PROMPT_IDS)
    assert lens.grid_start == 0 and len(lens.grid) == N_LAYER + 1
    for row, theirs in zip(lens.grid, ref):
        assert len(row) == len(PROMPT_IDS)
        for p, cell in enumerate(row):
            assert_rank(1, theirs[p], cell.id)  # the top-1 (a near-tie may go either way: assert_rank allows it)
            assert cell.prob == pytest.approx(float(theirs[p].max().exp()), abs=1e-6)
            assert cell.token == loaded.tokenizer.token_text(cell.id)
    # the column read is the layers' own rows
    assert [row[2].id for row in lens.grid] == [layer.top_id for layer in lens.layers]


def test_the_position_map_is_bounded_and_holds_the_position_read(ckpt, monkeypatch):
    """At most GRID_POSITIONS (32) columns, ending at the position read (or from the prompt's start); the head
    runs on at most the chunk's positions at a time, whatever the prompt's length."""
    from lmhead_cli.readings import lens as lens_module

    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu")
    prompt = " ".join(["the keys on the table"] * 20)  # 100 tokens
    T = len(loaded.tokenizer.encode(prompt))
    widest = []
    head = loaded.engine.head
    monkeypatch.setattr(loaded.engine, "head", lambda h: widest.append(h.shape[1]) or head(h))
    monkeypatch.setattr(lens_module, "default_chunk", lambda vocab, buffers: 7)
    W = lens_module.GRID_POSITIONS
    for position, start in ((-1, T - W), (70, 70 - W + 1), (10, 0)):
        lens = lens_prompt(loaded, prompt, position=position)
        assert lens.grid_start == start and all(len(row) == W for row in lens.grid)
        assert start <= lens.position < start + W
        ref = reference_grid(model, [t.id for t in lens.prompt_tokens])
        for row, theirs in zip(lens.grid, ref):
            assert [c.prob for c in row] == pytest.approx(theirs[start:start + W].max(-1).values.exp().tolist(),
                                                          abs=1e-6)
    assert max(widest) == 7


def test_cli_json_has_the_position_map(ckpt):
    folder, _ = ckpt
    got = cli("lens", PROMPT, "--model", str(folder), "--json")
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc["grid_start"] == 0 and len(doc["grid"]) == len(doc["layers"])
    assert all(list(cell) == ["id", "token", "prob"] for row in doc["grid"] for cell in row)
    assert [row[-1]["id"] for row in doc["grid"]] == [layer["top_id"] for layer in doc["layers"]]


def test_cli_grid_shows_the_position_maps_cells(ckpt, monkeypatch):
    """lens --grid: a row per layer, a column per prompt position (as many as fit, ending at the position
    read), each cell the `grid` cell of --json: its shade of the probability and its token."""
    from lmhead_cli.render import show_token
    from lmhead_cli.render.lens import GRID_CELL, SHADES

    def cut(text: str) -> str:  # a cell wider than the column ends in …
        return text if len(text) <= GRID_CELL else text[:GRID_CELL - 1] + "…"

    monkeypatch.setenv("COLUMNS", "200")
    folder, _ = ckpt
    doc = json.loads(cli("lens", PROMPT, "--model", str(folder), "--json").stdout)
    got = cli("lens", PROMPT, "--grid", "--model", str(folder))
    assert got.exit_code == 0, got.output
    lines = got.stdout.splitlines()
    rows = [ln.split() for ln in lines if ln.startswith(("embeddings", "block "))]
    assert len(rows) == len(doc["grid"]) == N_LAYER + 1
    for cells, want in zip(rows, doc["grid"]):
        cells = cells[2:] if cells[0] == "block" else cells[1:]
        level = [min(len(SHADES) - 1, int(c["prob"] * len(SHADES))) for c in want]
        assert cells == [cut((SHADES[lv] if lv else "·") + show_token(c["token"])) for lv, c in zip(level, want)]
    assert cli("lens", PROMPT, "--grid", "--heat", "--model", str(folder)).exit_code == 2


def test_the_position_map_is_made_only_where_it_is_shown(ckpt, monkeypatch):
    """The map costs the head at every position it shows: grid=False (the terminal's table and heat map)
    runs the head at the position read only, and the document says the map is absent (null)."""
    import lmhead_cli

    folder, _ = ckpt
    m = lmhead_cli.load(str(folder), device="cpu")
    doc = m.lens(PROMPT, grid=False).to_dict()
    assert doc["grid"] is None and doc["grid_start"] is None
    assert m.lens(PROMPT).to_dict()["layers"] == doc["layers"]  # the rows are the same either way
    rows = []
    head = m.loaded.engine.head
    monkeypatch.setattr(m.loaded.engine, "head", lambda h: rows.append(h.shape[1]) or head(h))
    m.lens(PROMPT, grid=False)
    assert rows == [1] * (N_LAYER + 1)
    assert "no position map" in m.lens(PROMPT, grid=False)._repr_html_()
    # the command asks for it where it shows it: --json and --grid, not the table or the heat map
    from lmhead_cli.api.model import Model

    asked = []
    lens = Model.lens
    monkeypatch.setattr(Model, "lens", lambda self, *a, **k: asked.append(k["grid"]) or lens(self, *a, **k))
    for flags in ((), ("--heat",), ("--json",), ("--grid",)):
        assert cli("lens", PROMPT, *flags, "--model", str(folder)).exit_code == 0
    assert asked == [False, False, True, True]
