"""The tuned lens: `lmhead tune-lens` (training), the lens file (save, load, the model's identity, a
damaged or foreign file refused in one line), and `lens --tuned`'s readings against the translators
applied by hand to transformers' hidden states, ln_f and lm_head. The shipped `--tuned bundled`
against the logit lens on held-out text."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, build_checkpoint, cli, with_ln_f

from lmhead_cli.errors import BadValue, CorruptCheckpoint, UsageError
from lmhead_cli.loading.sources import load_model
from lmhead_cli.readings.lens import lens_prompt
from lmhead_cli.readings.tune_lens import TextSource, TuneSettings, tune_lens
from lmhead_cli.readings.tuned_lens import (TunedLens, identity_lens, load_lens, mean_kl_to_final, read_lens,
                                            save_lens)

N_LAYER = 3
# Ruth 1:1-3 and Jonah 1:1-3 (KJV): books that neither bundled:tiny nor its tuned lens was trained on.
HELD_OUT = [
    "Now it came to pass in the days when the judges ruled, that there was a famine in the land. And a certain "
    "man of Bethlehemjudah went to sojourn in the country of Moab, he, and his wife, and his two sons. And the "
    "name of the man was Elimelech, and the name of his wife Naomi, and the name of his two sons Mahlon and "
    "Chilion, Ephrathites of Bethlehemjudah. And they came into the country of Moab, and continued there.",
    "Now the word of the LORD came unto Jonah the son of Amittai, saying, Arise, go to Nineveh, that great city, "
    "and cry against it; for their wickedness is come up before me. But Jonah rose up to flee unto Tarshish "
    "from the presence of the LORD, and went down to Joppa; and he found a ship going to Tarshish: so he paid "
    "the fare thereof, and went down into it, to go with them unto Tarshish from the presence of the LORD.",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return with_ln_f(tmp_path_factory.mktemp("tuned"), seed=5, n_layer=N_LAYER)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_model(str(ckpt[0]), device="cpu")


def random_lens(loaded, seed: int = 0, scale: float = 0.05) -> TunedLens:
    lens = identity_lens(loaded)
    g = torch.Generator().manual_seed(seed)
    return TunedLens(lens.identity, torch.randn(lens.weight.shape, generator=g) * scale,
                     torch.randn(lens.bias.shape, generator=g) * scale, name="random")


def reference(model, lens: TunedLens | None, ids=PROMPT_IDS) -> list[torch.Tensor]:
    """log-probabilities (V,) float64 per layer at the last position, from transformers' hidden states
    (the last block's raw output from a hook), each through the translator by hand, ln_f and lm_head."""
    raw = {}
    hook = model.transformer.h[-1].register_forward_hook(lambda _m, _i, out: raw.setdefault("x", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    rows = []
    with torch.no_grad():
        for layer, x in enumerate(list(out.hidden_states[:-1]) + [raw["x"]]):
            h = x[0, -1]
            if lens is not None and layer < N_LAYER:
                h = h + lens.weight[layer] @ h + lens.bias[layer]
            rows.append(torch.log_softmax(model.lm_head(model.transformer.ln_f(h)).double(), -1))
    return rows


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


# ---- readings --------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_tuned_readings_and_both_kls_match_the_translators_applied_by_hand(ckpt, engine):
    folder, model = ckpt
    loaded = load_model(str(folder), device="cpu", engine=engine)
    lens = random_lens(loaded)
    got = lens_prompt(loaded, PROMPT, [" are"], tuned=lens)
    plain, tuned = reference(model, None), reference(model, lens)
    final = plain[-1]
    for row, p, t, z in zip(got.layers, plain, tuned, got.tuned_logits):
        torch.testing.assert_close(torch.log_softmax(z.double(), -1), t, atol=1e-4, rtol=0)
        assert row.kl_to_final["logit"] == pytest.approx(kl(final, p), abs=1e-5)
        assert row.kl_to_final["tuned"] == pytest.approx(kl(final, t), abs=1e-5)
        assert row.tuned.top_id == int(t.argmax())
        assert row.tuned.top_prob == pytest.approx(float(t.max().exp()), abs=1e-6)
        assert row.tuned.targets[0].prob == pytest.approx(float(t[389].exp()), abs=1e-6)
    assert got.layers[-1].kl_to_final == {"logit": 0.0, "tuned": 0.0}  # the last layer is the final reading
    assert got.layers[0].kl_to_final["tuned"] != got.layers[0].kl_to_final["logit"]


def test_the_identity_translators_are_the_logit_lens_exactly(loaded):
    got = lens_prompt(loaded, PROMPT, [" are"], tuned=identity_lens(loaded))
    for row, z, zt in zip(got.layers, got.logits, got.tuned_logits):
        assert torch.equal(z, zt)
        assert row.kl_to_final["tuned"] == row.kl_to_final["logit"]
        assert (row.tuned.top_id, row.tuned.top_prob, row.tuned.targets) == (row.top_id, row.top_prob, row.targets)


def test_mean_kl_over_positions_is_each_positions_kl_averaged(ckpt, loaded):
    _, model = ckpt
    lens = random_lens(loaded, seed=2)
    got = mean_kl_to_final(loaded, PROMPT_IDS, lens)
    for which, use in (("logit", None), ("tuned", lens)):
        per_position = []
        for t in range(1, len(PROMPT_IDS) + 1):  # a prefix's last position is that position (causal)
            rows = reference(model, use, PROMPT_IDS[:t])
            per_position.append([kl(rows[-1], r) for r in rows])
        want = torch.tensor(per_position).mean(0)
        assert got[which] == pytest.approx(want.tolist(), abs=1e-5)


# ---- training ---------------------------------------------------------------------------------------

def test_the_training_loss_is_the_kl_to_the_final_distribution(loaded):
    """The first step's loss (before any update) is the logit lens's mean KL over the window's positions,
    computed without the loss's shortcut (Σ p z − logsumexp z)."""
    text = "The keys on the table are mine, said the man to the woman by the door."
    ids = loaded.tokenizer.encode(text)
    t = tune_lens(loaded, TextSource(text=text), TuneSettings(steps=1, batch=1, seq=64, warmup=0))
    want = mean_kl_to_final(loaded, ids)["logit"][:N_LAYER]
    # The shortcut cancels terms of the logits' size, so its float32 error is absolute, not relative to
    # the KL: 2.1e-6 on KLs of 0.0017-0.005 on an AVX2 machine (1e-6 passed on AVX-512 ones); the same
    # 1e-5 as the mean KL over positions above.
    assert t.first_kl == pytest.approx(want, abs=1e-5)
    assert t.tokens == len(ids) and t.seq == 64


@pytest.mark.slow
def test_training_lowers_the_kl_and_is_seeded(loaded):
    text = " ".join(f"The {w} on the table is {c}." for w in ("key", "book", "cup", "pen") for c in ("red", "old"))
    a = tune_lens(loaded, TextSource(text=text), TuneSettings(steps=12, batch=2, seq=16, lr=3e-2, warmup=2))
    b = tune_lens(loaded, TextSource(text=text), TuneSettings(steps=12, batch=2, seq=16, lr=3e-2, warmup=2))
    assert torch.equal(a.lens.weight, b.lens.weight) and torch.equal(a.lens.bias, b.lens.bias)
    ids = loaded.tokenizer.encode(text)
    before, after = mean_kl_to_final(loaded, ids), mean_kl_to_final(loaded, ids, a.lens)
    assert sum(after["tuned"]) < sum(before["logit"])


def test_a_file_is_read_a_window_at_a_time(tmp_path, loaded):
    f = tmp_path / "book.txt"
    f.write_text("In the beginning the keys were on the table. " * 2000)
    source = TextSource(file=f)
    import random

    rng = random.Random(0)
    windows = [source.window(loaded.tokenizer, 32, rng) for _ in range(20)]
    assert all(len(w) == 32 for w in windows)
    assert len({tuple(w) for w in windows}) > 1  # drawn from different places


# ---- the file ------------------------------------------------------------------------------------------

def test_save_and_load_round_trip_with_the_models_identity(tmp_path, loaded):
    lens = random_lens(loaded, seed=4)
    lens.trained = {"steps": 3}
    path = save_lens(lens, tmp_path / "lens.safetensors")
    back = load_lens(loaded, path)
    assert torch.equal(back.weight, lens.weight) and torch.equal(back.bias, lens.bias)
    assert back.identity == lens.identity and back.trained == {"steps": 3}
    assert back.identity.n_layer == N_LAYER and back.identity.d_model == 64 and back.identity.vocab == 50257


def test_the_fingerprint_is_the_same_in_every_float_dtype(ckpt):
    ids = {identity_lens(load_model(str(ckpt[0]), device="cpu", dtype=d)).identity.embedding
           for d in ("float32", "bfloat16")}
    assert len(ids) == 1


def test_a_lens_for_another_model_is_refused_by_name(tmp_path, loaded, tiny):
    path = save_lens(random_lens(loaded), tmp_path / "lens.safetensors")
    r = cli("lens", PROMPT, "--tuned", str(path), "--model", str(tiny[0]))
    assert r.exit_code == 1
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1
    assert f"the tuned lens {path} is for " in line and "3 layers, width 64" in line and "2 layers, width 64" in line
    # the same shape, other weights: refused by the embedding table's fingerprint
    other = build_checkpoint(tmp_path / "other", n_layer=N_LAYER, seed=99)
    del other
    r = cli("lens", PROMPT, "--tuned", str(path), "--model", str(tmp_path / "other"))
    assert r.exit_code == 1 and "whose embedding table is not" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_lens_of_another_shape_is_refused_before_its_tensors_are_read(tmp_path, loaded, tiny):
    """The identity is compared with the model's shape first: a NaN in the tensors (found only by reading
    them) is never reached, so a lens file of any size for another model costs its header only."""
    from lmhead_cli.errors import WrongLens

    lens = random_lens(loaded)
    lens.weight[0, 0, 0] = float("nan")
    path = save_lens(lens, tmp_path / "lens.safetensors")
    with pytest.raises(WrongLens, match="is for .* 3 layers, width 64"):
        load_lens(load_model(str(tiny[0]), device="cpu"), path)


def test_a_float_lens_reads_the_same_model_loaded_in_int8(tmp_path, ckpt):
    """The translators are float and the int8 model's residual stream is float: the lens trained on the
    float model applies, and its readings are transformers' (float weights, translators applied by hand)
    up to the int8 weights' rounding."""
    folder, model = ckpt
    path = save_lens(random_lens(load_model(str(folder), device="cpu")), tmp_path / "lens.safetensors")
    int8 = load_model(str(folder), device="cpu", dtype="int8")
    assert not int8.engine.embedding_weight.is_floating_point()  # the int8 engine, its table as codes
    lens = load_lens(int8, path)
    got = lens_prompt(int8, PROMPT, [" are"], tuned=lens)
    want = reference(model, lens)
    for row, z, t in zip(got.layers, got.tuned_logits, want):
        mine = torch.log_softmax(z.double(), -1)
        assert kl(t, mine) < 2e-3, row.layer  # int8's rounding, not another reading
        assert row.tuned.top_id == int(t.argmax())
    assert got.layers[0].tuned.top_prob != got.layers[0].top_prob  # read through the translator
    r = cli("lens", PROMPT, "--tuned", str(path), "--model", str(folder), "--dtype", "int8", "--json")
    assert r.exit_code == 0, r.output
    assert [row["kl_to_final"] for row in json.loads(r.stdout)["layers"]] == [row.kl_to_final for row in got.layers]


def test_a_lens_trained_on_the_int8_load_reads_the_float_model_and_not_another(tmp_path, ckpt):
    folder, _ = ckpt
    int8 = load_model(str(folder), device="cpu", dtype="int8")
    lens = tune_lens(int8, TextSource("The keys on the table are mine. " * 5), TuneSettings(steps=1, batch=1, seq=8)).lens
    path = save_lens(lens, tmp_path / "lens.safetensors")
    assert load_lens(load_model(str(folder), device="cpu"), path).identity == lens.identity  # the same codes
    assert load_lens(int8, path).identity == lens.identity
    other = tmp_path / "other"
    build_checkpoint(other, n_layer=N_LAYER, seed=99)
    r = cli("lens", PROMPT, "--tuned", str(path), "--model", str(other))
    assert r.exit_code == 1 and "whose embedding table is not" in r.stderr


def test_an_int8_model_refuses_a_lens_it_cannot_check_naming_why(tmp_path, ckpt):
    """A lens file without the int8 codes' fingerprint (an older file) cannot be checked against int8
    weights: one line that says so, not "other weights"; another model's lens is still another model's."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, _ = ckpt
    path = save_lens(random_lens(load_model(str(folder), device="cpu")), tmp_path / "lens.safetensors")
    old = tmp_path / "old.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "embedding_int8"}
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(old), metadata=meta)
    r = cli("lens", PROMPT, "--tuned", str(old), "--model", str(folder), "--dtype", "int8")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the tuned lens {old} records no fingerprint of its model's int8 codes" in lines[0]
    assert "other weights" not in lines[0]
    assert cli("lens", PROMPT, "--tuned", str(old), "--model", str(folder)).exit_code == 0  # float: checked as before
    other = tmp_path / "other"
    build_checkpoint(other, n_layer=N_LAYER, seed=99)
    r = cli("lens", PROMPT, "--tuned", str(path), "--model", str(other), "--dtype", "int8")
    assert r.exit_code == 1 and "whose embedding table is not" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _shapes_file(path, weight_shape, bias_shape, meta, dtype=torch.float32) -> None:
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(weight_shape, dtype=dtype), "bias": torch.zeros(bias_shape, dtype=dtype)},
              str(path), metadata=meta)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "huge header", "no identity", "wrong shape",
                                    "not a lens", "nan", "folder", "missing", "I8", "BOOL", "huge values",
                                    "nested record"])
def test_a_damaged_lens_file_is_one_line_naming_it(tmp_path, loaded, ckpt, damage):
    good = save_lens(random_lens(loaded), tmp_path / "good.safetensors")
    path = tmp_path / "bad.safetensors"
    meta = read_lens(good)
    ident = {k: str(v) for k, v in vars(meta.identity).items()}
    if damage == "truncated":
        path.write_bytes(good.read_bytes()[:-100])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 8 + b"not json at all")
    elif damage == "huge header":
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif damage == "no identity":
        _shapes_file(path, (N_LAYER, 64, 64), (N_LAYER, 64), {"format": "lmhead-tuned-lens/1"})
    elif damage == "wrong shape":
        _shapes_file(path, (N_LAYER, 64, 32), (N_LAYER, 64), {"format": "lmhead-tuned-lens/1", **ident})
    elif damage == "not a lens":
        _shapes_file(path, (N_LAYER, 64, 64), (N_LAYER, 64), {"format": "pt"})
    elif damage == "nan":
        lens = random_lens(loaded)
        lens.bias[1, 3] = float("nan")
        save_lens(lens, path)
    elif damage == "folder":
        path.mkdir()
    elif damage in ("I8", "BOOL"):  # read as a float lens before: the dtype was never looked at
        kind = torch.int8 if damage == "I8" else torch.bool
        _shapes_file(path, (N_LAYER, 64, 64), (N_LAYER, 64), {"format": "lmhead-tuned-lens/1", **ident}, kind)
    elif damage == "huge values":  # accepted before, then blamed on the model as non-finite logits
        lens = random_lens(loaded)
        lens.weight[0, 0, 0] = 1e30
        save_lens(lens, path)
    elif damage == "nested record":  # under the header's 1 MiB: json.loads raised RecursionError
        _shapes_file(path, (N_LAYER, 64, 64), (N_LAYER, 64),
                     {"format": "lmhead-tuned-lens/1", **ident, "trained": "[" * 100_000 + "]" * 100_000})
    r = cli("lens", PROMPT, "--tuned", str(path), "--model", str(ckpt[0]))
    assert r.exit_code == (2 if damage in ("folder", "missing") else 1), r.output  # a bad path is a usage error
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmhead: error: the tuned lens {path} cannot be read: "), lines
    says = {"I8": "weight holds I8 values; a lens holds floating-point numbers",
            "BOOL": "weight holds BOOL values", "huge values": "weight holds a value of size 1e+30",
            "nested record": "its training record (metadata 'trained') nests 100,000 deep"}
    assert says.get(damage, "") in lines[0]


def test_a_lens_path_is_named_as_given_and_never_opened_unless_a_file(tmp_path, ckpt):
    """`--tuned ''` was read as '.' ("it is a folder"); a FIFO blocked in open() for ever."""
    import os
    import threading
    import time

    folder = tmp_path / "lenses"
    folder.mkdir()
    for given, says in (("", "the tuned lens path is empty; give a file from lmhead tune-lens, or 'bundled'"),
                        (f"{folder}/", f"the tuned lens {folder}/ cannot be read: it is a folder, not a file")):
        r = cli("lens", PROMPT, "--tuned", given, "--model", str(ckpt[0]))
        assert r.exit_code == 2 and r.stderr.strip() == f"lmhead: error: {says}", r.output
    fifo = tmp_path / "lens.fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def unblock() -> None:  # if lens opened the FIFO, a writer comes after 5 s, so the test fails, not hangs
        deadline = time.monotonic() + 5
        while not done.is_set():
            try:
                if time.monotonic() > deadline:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            time.sleep(0.1)

    writer = threading.Thread(target=unblock, daemon=True)
    writer.start()
    start = time.monotonic()
    try:
        r = cli("lens", PROMPT, "--tuned", str(fifo), "--model", str(ckpt[0]))
    finally:
        done.set()
    assert r.exit_code == 2 and "is a FIFO (named pipe), not a regular file" in r.stderr, r.output
    assert time.monotonic() - start < 5  # refused without waiting for the writer


def test_the_bundled_lens_is_refused_for_another_model(tiny):
    r = cli("lens", PROMPT, "--tuned", "bundled", "--model", str(tiny[0]))
    assert r.exit_code == 1
    assert "the bundled tuned lens is bundled:tiny's" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---- the commands ----------------------------------------------------------------------------------------

def test_tune_lens_writes_a_lens_that_lens_reads(tmp_path, ckpt):
    folder, _ = ckpt
    book = tmp_path / "book.txt"
    book.write_text("The keys on the table are mine. The book on the shelf is old. " * 50)
    out = tmp_path / "lens.safetensors"
    r = cli("tune-lens", "--file", str(book), "--out", str(out), "--steps", "3", "--batch", "2", "--seq", "16",
            "--model", str(folder), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["steps"] == 3 and doc["tokens"] == 3 * 2 * 16 and doc["layers"] == N_LAYER
    assert len(doc["kl_first_step"]) == N_LAYER and doc["out"] == str(out)
    r = cli("lens", PROMPT, "--tuned", str(out), "--model", str(folder), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert all(set(row["kl_to_final"]) == {"logit", "tuned"} for row in doc["layers"])
    assert doc["tuned_lens"].startswith(str(out))
    r = cli("lens", PROMPT, "--tuned", str(out), "--model", str(folder))
    assert r.exit_code == 0 and "KL tuned" in r.stdout


@pytest.mark.parametrize("args, message", [
    ((), "give a text or --file to train the lens on"),
    (("some text",), "give --out PATH"),
    (("some text", "--file", "x.txt", "--out", "l.safetensors"), "give a text or --file, not both"),
    (("some text", "--out", "l.safetensors", "--steps", "0"), "--steps must be at least 1 (got 0)"),
    (("some text", "--out", "l.safetensors", "--lr", "nan"), "--lr must be a positive number"),
    (("--file", "/nonexistent/book.txt", "--out", "l.safetensors"), "cannot read /nonexistent/book.txt"),
    (("--file", "/tmp", "--out", "l.safetensors"), "/tmp is not a regular file"),
    (("--file", "/dev/zero", "--out", "l.safetensors"), "/dev/zero is not a regular file"),
])
def test_tune_lens_bad_input_is_one_line(tiny, args, message):
    r = cli("tune-lens", *args, "--model", str(tiny[0]))
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("out, says", [("folder", "--out '{tmp}/folder' is a folder"),
                                       ("missing/lens.safetensors", "--out needs a file in a folder that exists"),
                                       ("", "--out is empty")])
def test_tune_lens_checks_its_output_before_it_trains(tiny, tmp_path, monkeypatch, out, says):
    """A folder took 7 s of training and left a .tuned-lens-* file; '' failed with 'Device or resource busy'."""
    from lmhead_cli.readings import tune_lens as training

    (tmp_path / "folder").mkdir()
    monkeypatch.setattr(training, "tune_lens", lambda *a, **k: pytest.fail("trained before checking --out"))
    monkeypatch.chdir(tmp_path)
    r = cli("tune-lens", "The keys on the table", "--out", str(tmp_path / out) if out else "", "--steps", "2",
            "--model", str(tiny[0]))
    assert r.exit_code == 2 and says.format(tmp=tmp_path) in r.stderr and r.stderr.count("\n") == 1, r.output
    import lmhead_cli

    with pytest.raises(UsageError, match=says.format(tmp=tmp_path).replace("--out", "out")):
        lmhead_cli.load(str(tiny[0]), device="cpu").tune_lens("The keys", out=str(tmp_path / out) if out else "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # no temporary file left


def test_a_failed_write_leaves_no_temporary_file(tmp_path, loaded, monkeypatch):
    import os

    lens = random_lens(loaded)
    (tmp_path / "lens.safetensors").mkdir()  # appears between the check and the write
    with pytest.raises(CorruptCheckpoint, match="cannot write the tuned lens"):
        save_lens(lens, tmp_path / "lens.safetensors")
    assert os.listdir(tmp_path) == ["lens.safetensors"]


def test_tune_lens_plans_a_steps_memory_and_refuses_a_batch_that_does_not_fit(tiny, monkeypatch):
    """--batch 2000 grew past 2.5 GB with no plan; the refusal names the figures (computed here too)."""
    from lmhead_cli.loading import checks

    monkeypatch.setattr(checks, "available_memory", lambda device: 8 * 10**9)
    r = cli("tune-lens", "The keys on the table", "--out", "x.safetensors", "--batch", "2000", "--model",
            str(tiny[0]))
    V, D, L, seq = 50257, 64, 2, 128
    per_window = 4 * seq * (4 * V + 2 * (L + 1) * D)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == (f"lmhead: error: --batch of 2,000 windows of 128 tokens need about "
                                f"{2000 * per_window / 1e9:.1f} GB a step ({per_window / 1e6:.0f} MB per window: the "
                                "vocabulary's logits and the residual stream), but 8.0 GB is available; at most "
                                f"{8 * 10**9 // per_window:,} windows fit")


def test_tune_lens_takes_generates_seed_rule(tiny):
    import lmhead_cli

    r = cli("tune-lens", "The keys on the table", "--out", "x.safetensors", "--seed", "-1", "--model", str(tiny[0]))
    assert r.exit_code == 2 and "--seed must be between 0 and 2**63 - 1 (got -1)" in r.stderr, r.output
    with pytest.raises(BadValue, match=r"seed must be between 0 and 2\*\*63 - 1 \(got 1180591620717411303424\)"):
        lmhead_cli.load(str(tiny[0]), device="cpu").tune_lens("The keys", seed=2**70)


def test_tune_lens_on_a_model_with_nan_weights_is_one_line_and_writes_nothing(tiny, tmp_path):
    from helpers import nan_checkpoint

    out = tmp_path / "lens.safetensors"
    r = cli("tune-lens", "The keys on the table are here and there", "--out", str(out), "--steps", "2", "--batch",
            "1", "--seq", "4", "--model", str(nan_checkpoint(tiny[0], tmp_path)))
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("lmhead: error: the head produced") and "non-finite logits" in lines[-1]
    assert not out.exists()


# ---- the shipped lens ------------------------------------------------------------------------------------

def test_the_bundled_lens_beats_the_logit_lens_on_held_out_text():
    """bundled:tiny's tuned lens, on passages of books held out from its training and the model's: a smaller
    mean KL to the final distribution than the logit lens at every layer but the last (where both are 0)."""
    loaded = load_model("bundled:tiny", device="cpu")
    lens = load_lens(loaded, "bundled")
    for text in HELD_OUT:
        got = mean_kl_to_final(loaded, loaded.tokenizer.encode(text), lens)
        for layer in range(len(got["logit"]) - 1):
            assert got["tuned"][layer] < got["logit"][layer], (layer, got)
        assert got["tuned"][-1] == got["logit"][-1] == pytest.approx(0.0, abs=1e-9)


def test_the_api_takes_a_trained_lens_without_a_file(ckpt, tiny):
    import lmhead_cli
    from lmhead_cli.errors import WrongLens

    m = lmhead_cli.load(str(ckpt[0]), device="cpu")
    trained = m.tune_lens("The keys on the table are mine. " * 5, steps=1, batch=1, seq=8)
    assert trained.out is None and trained.to_dict()["steps"] == 1
    doc = m.lens(PROMPT, tuned=trained.lens).to_dict()
    assert all("tuned" in row["kl_to_final"] for row in doc["layers"])
    with pytest.raises(WrongLens, match="is for .* 3 layers"):
        lmhead_cli.load(str(tiny[0]), device="cpu").lens(PROMPT, tuned=trained.lens)
