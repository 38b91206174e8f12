"""`lmhead compare`: every statistic against a computation done here from transformers' own forward and
full-vocabulary log_softmax (two related checkpoints: one is the other plus small noise), with the
window procedure redone over transformers; a model against itself gives 0; mismatched vocabularies or
tokenizers, short texts and NaN are refused in one line; the renderings."""

from __future__ import annotations

import io
import json
import math
import random
import sys

import numpy as np
import pytest
import torch
from helpers import build_checkpoint, elsewhere, loaded_elsewhere, nan_checkpoint
from typer.testing import CliRunner

import lmhead_cli
from lmhead_cli.cli import app

from lmhead_cli.errors import NonFiniteLogits, UsageError
from lmhead_cli.loading.sources import load_model
from lmhead_cli.readings.agreement import DP_PERCENTILES, KLD_PERCENTILES, percentile
from lmhead_cli.readings.compare import Mismatch, compare_text
from lmhead_cli.render import _plain
from lmhead_cli.render import compare as show
from types import SimpleNamespace

N_CTX = 48  # small windows, so that a short text goes through several
WORDS = ("the keys on table are here and dog is asleep a cat sat mat of house by window door it was "
         "not so much that he ran but she said , . yes no").split()


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


TEXT = words(130)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(base folder, base model, Q folder, Q model): Q is the base with N(0, 0.01²) added to every weight.
    initializer_range 0.3 makes the predictions peaked enough that a top-1 can change or not."""
    base_dir, q_dir = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("q")
    base = build_checkpoint(base_dir, n_positions=N_CTX, seed=5, initializer_range=0.3)
    q = build_checkpoint(q_dir, n_positions=N_CTX, seed=5, initializer_range=0.3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in q.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    q.save_pretrained(q_dir)
    return base_dir, base, q_dir, q


def reference_rows(model, ids: list[int], n_ctx: int, stride: int) -> dict[int, torch.Tensor]:
    """{token index: (V,) float64 log-probabilities that predict it}, from transformers' forward over
    each window (begin every `stride` tokens, n_ctx long), each token taken from the first window
    that has a token of its own before it and has not scored it yet."""
    rows, done = {}, 1
    for begin in range(0, len(ids), stride):
        end = min(begin + n_ctx, len(ids))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids[begin:end]])).logits[0].float(), dim=-1).double()
        for i in range(max(done, begin + 1), end):
            rows[i] = lp[i - 1 - begin]
        done = end
        if end == len(ids):
            break
    return rows


def reference_statistics(lq: np.ndarray, lb: np.ndarray, ids: np.ndarray) -> dict:
    """llama-perplexity's statistics recomputed with numpy, from (n, V) log-probabilities of Q and base
    and the n actual tokens; correlations and percentiles from numpy's own functions."""
    n = len(ids)
    nll_q, nll_b = -lq[np.arange(n), ids], -lb[np.arange(n), ids]
    kld = (np.exp(lb) * (lb - lq)).sum(-1)
    dp = np.exp(-nll_q) - np.exp(-nll_b)
    same = (lq.argmax(-1) == lb.argmax(-1)).mean()

    def unc(x):  # the standard error of a mean, with llama.cpp's (n − 1)
        return x.std() / math.sqrt(n - 1)

    cov = np.cov(nll_q, nll_b, bias=True)[0, 1] / (n - 1)
    ratio_u = math.sqrt(unc(nll_q) ** 2 + unc(nll_b) ** 2 - 2 * cov)
    return {"ppl_q": (math.exp(nll_q.mean()), math.exp(nll_q.mean()) * unc(nll_q)),
            "ppl_base": (math.exp(nll_b.mean()), math.exp(nll_b.mean()) * unc(nll_b)),
            "cor": np.corrcoef(nll_q, nll_b)[0, 1],
            "ln_ratio": (nll_q.mean() - nll_b.mean(), ratio_u),
            "kld": (kld.mean(), unc(kld)), "kld_values": kld,
            "dp": (dp.mean(), unc(dp)), "dp_values": dp,
            "rms": (math.sqrt((dp ** 2).mean()), 0.5 / math.sqrt((dp ** 2).mean()) * unc(dp ** 2)),
            "same": (same, math.sqrt(same * (1 - same) / (n - 1)))}


def close(got, want, rel=2e-3, abs=1e-7):  # noqa: A002
    assert got == pytest.approx(want, rel=rel, abs=abs)


# ---- transformers is the oracle -----------------------------------------------------------------

@pytest.mark.parametrize("stride", [16, N_CTX])
def test_statistics_match_transformers(pair, stride, monkeypatch):
    base_dir, base_model, q_dir, q_model = pair
    q, base = load_model(str(q_dir), device="cpu"), load_model(str(base_dir), device="cpu")
    rows = []
    for eng in (q.engine, base.engine):
        head = eng.head
        monkeypatch.setattr(eng, "head", lambda h, head=head: rows.append(h.shape[0]) or head(h))
    c = compare_text(q, base, TEXT, stride=stride, chunk=7)
    assert max(rows) == 7  # the heads never see more than a chunk: no (T, V) tensor
    ids = c.ids.tolist()
    ref_q, ref_b = reference_rows(q_model, ids, N_CTX, stride), reference_rows(base_model, ids, N_CTX, stride)
    assert c.windows > 2 and sorted(ref_q) == [i for i in range(len(ids)) if bool(c.scored[i])]
    order = sorted(ref_q)
    lq, lb = torch.stack([ref_q[i] for i in order]).numpy(), torch.stack([ref_b[i] for i in order]).numpy()
    want = reference_statistics(lq, lb, np.array([ids[i] for i in order]))
    s = c.stats
    assert s.positions == len(order)
    for i, t in zip(order, (c.token(i) for i in order)):  # the per-token rows
        close(t.kld, float((np.exp(lb[order.index(i)]) * (lb[order.index(i)] - lq[order.index(i)])).sum()),
              rel=1e-3, abs=1e-6)
    close(s.ppl_q.value, want["ppl_q"][0], rel=1e-5)
    close(s.ppl_q.uncertainty, want["ppl_q"][1], rel=1e-4)
    close(s.ppl_base.value, want["ppl_base"][0], rel=1e-5)
    close(s.ppl_base.uncertainty, want["ppl_base"][1], rel=1e-4)
    close(s.cor_ln_ppl, want["cor"], rel=1e-5)
    close(s.ln_ppl_ratio.value, want["ln_ratio"][0], rel=1e-3, abs=1e-6)
    close(s.ln_ppl_ratio.uncertainty, want["ln_ratio"][1], rel=1e-3)
    close(s.ppl_ratio.value, math.exp(want["ln_ratio"][0]), rel=1e-5)
    # llama-perplexity's PPL(Q)/PPL(base) uncertainty: exp(ln ratio) times the ln ratio's, to first order
    close(s.ppl_ratio.uncertainty, math.exp(want["ln_ratio"][0]) * want["ln_ratio"][1], rel=1e-3)
    close(s.kld_mean.value, want["kld"][0])
    close(s.kld_mean.uncertainty, want["kld"][1])
    for label, fraction in KLD_PERCENTILES:
        close(s.kld_percentiles[label], np.percentile(want["kld_values"], 100 * fraction), rel=5e-3, abs=1e-6)
    close(s.dp_mean.value, want["dp"][0], rel=1e-3, abs=1e-6)
    close(s.dp_mean.uncertainty, want["dp"][1], rel=1e-3)
    close(s.dp_rms.value, want["rms"][0], rel=1e-3)
    close(s.dp_rms.uncertainty, want["rms"][1], rel=1e-3)
    for label, fraction in DP_PERCENTILES:
        close(s.dp_percentiles[label], np.percentile(want["dp_values"], 100 * fraction), rel=1e-3, abs=1e-6)
    assert s.same_top.value == pytest.approx(want["same"][0])
    assert s.same_top.uncertainty == pytest.approx(want["same"][1])
    # the pair is a real test: the noise moves the distributions, but not beyond recognition
    assert 1e-4 < s.kld_mean.value < 0.5 and 0.5 < s.same_top.value < 1 and s.cor_ln_ppl > 0.9


def test_percentile_interpolates_linearly_as_numpy():
    x = torch.tensor(sorted(random.Random(3).random() for _ in range(37)), dtype=torch.float64)
    for fraction in (0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999, 1):
        assert percentile(x, fraction) == pytest.approx(np.percentile(x.numpy(), 100 * fraction), abs=1e-12)


# ---- a model against itself -------------------------------------------------------------------

def test_a_model_against_itself_gives_zero(pair):
    base_dir = pair[0]
    one, two = load_model(str(base_dir), device="cpu"), load_model(str(base_dir), device="cpu")
    for q, base in ((one, one), (one, two)):  # the same object, and a second load of the same weights
        s = compare_text(q, base, TEXT).stats
        assert s.kld_mean.value == 0 and all(v == 0 for v in s.kld_percentiles.values())
        assert s.same_top.value == 1 and s.same_top.uncertainty == 0
        assert s.ln_ppl_ratio.value == 0 and s.ln_ppl_ratio.uncertainty == 0 and s.ppl_ratio.value == 1
        assert s.dp_mean.value == 0 and s.dp_rms.value == 0 and s.ppl_diff.value == 0
        assert s.cor_ln_ppl == pytest.approx(1)


def test_bfloat16_against_float32_of_one_model(pair):
    base_dir = pair[0]
    q, base = load_model(str(base_dir), device="cpu", dtype="bfloat16"), load_model(str(base_dir), device="cpu")
    c = compare_text(q, base, TEXT)
    s = c.stats
    assert (c.q.dtype, c.base.dtype) == ("bfloat16", "float32")
    assert 0 < s.kld_mean.value < 0.05
    assert s.kld_percentiles["min"] <= s.kld_percentiles["median"] <= s.kld_percentiles["max"]
    assert all(math.isfinite(v) for v in (s.ppl_q.value, s.ppl_base.value, s.dp_rms.value, s.same_top.value))


# ---- refusals -----------------------------------------------------------------------------------

def test_another_vocabulary_is_refused(pair, tmp_path):
    build_checkpoint(tmp_path, n_positions=N_CTX, vocab_size=50304)
    q, base = load_model(str(tmp_path), device="cpu"), load_model(str(pair[0]), device="cpu")
    with pytest.raises(Mismatch, match="another vocabulary: its head has 50,257 rows.* 50,304"):
        compare_text(q, base, TEXT)


def test_another_tokenizer_table_is_refused(pair, tmp_path):
    build_checkpoint(tmp_path, n_positions=N_CTX)
    vocab = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    q, base = load_model(str(pair[0]), device="cpu"), load_model(str(tmp_path), device="cpu")
    with pytest.raises(Mismatch, match="another tokenizer vocabulary .* differ first at id"):
        compare_text(q, base, TEXT)


def test_a_tokenizer_that_splits_otherwise_is_refused(pair, tmp_path):
    build_checkpoint(tmp_path, n_positions=N_CTX)
    merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    (tmp_path / "merges.txt").write_text("\n".join(m for m in merges if m != "Ġ t"), encoding="utf-8")
    q, base = load_model(str(pair[0]), device="cpu"), load_model(str(tmp_path), device="cpu")
    with pytest.raises(Mismatch, match="another tokenizer: it splits the text into"):
        compare_text(q, base, TEXT)


@pytest.mark.parametrize("text,bos", [("Hello", False), ("Hello", True)])
def test_a_text_of_one_token_is_refused(pair, text, bos):
    q = load_model(str(pair[0]), device="cpu")
    with pytest.raises(UsageError, match="the text is one token .*'Hello'.* at least 2 tokens"):
        compare_text(q, q, text, bos=bos)


def test_an_empty_text_is_refused(pair):
    q = load_model(str(pair[0]), device="cpu")
    with pytest.raises(UsageError, match="empty"):
        compare_text(q, q, "")


def test_nan_names_the_model_and_the_position(pair, tmp_path):
    good = load_model(str(pair[0]), device="cpu")
    bad = load_model(str(nan_checkpoint(pair[0], tmp_path)), device="cpu")
    with pytest.raises(NonFiniteLogits, match=f"the model {tmp_path} .float32. produced non-finite .* token 1 of"):
        compare_text(bad, good, TEXT)
    with pytest.raises(NonFiniteLogits, match=f"the base {tmp_path} .float32. produced non-finite .* token 1 of"):
        compare_text(good, bad, TEXT)


# ---- the renderings ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compared(pair):
    q, base = load_model(str(pair[2]), device="cpu"), load_model(str(pair[0]), device="cpu")
    return compare_text(q, base, "\x1b[31m[bold]red[/bold] " + TEXT)


def test_the_models_on_two_devices_give_the_figures_of_one(pair, compared):
    """Q on a second device (emulated: tests/helpers.py) and the base on the CPU, and the other way round:
    each window goes to its own model's device, the base's log-probabilities and the targets to Q's
    (mutants: `.to(None)` for any of them, a GPU's device error), and the figures equal one device's."""
    q, base = load_model(str(pair[2]), device="cpu"), load_model(str(pair[0]), device="cpu")
    for there in ((loaded_elsewhere(q), base), (q, loaded_elsewhere(base))):
        with elsewhere():
            got = compare_text(*there, compared.text)
        assert torch.equal(got.top_q, compared.top_q) and torch.equal(got.top_base, compared.top_base)
        for name in ("kld", "logprob_q", "logprob_base"):
            torch.testing.assert_close(getattr(got, name), getattr(compared, name), atol=1e-6, rtol=1e-5,
                                       equal_nan=True)


def _stdout(fn, *args) -> str:
    old, sys.stdout = sys.stdout, io.StringIO()
    try:
        fn(*args)
        return sys.stdout.getvalue()
    finally:
        sys.stdout = old


def test_json_is_the_result_and_lists_every_token(compared):
    doc = json.loads(_stdout(show.write_json, compared))
    assert doc == _plain(show.comparison_json(compared))
    assert len(doc["tokens"]) == len(compared.ids) and doc["positions"] == compared.stats.positions
    assert doc["text"].startswith("\x1b[31m[bold]") and doc["tokens"][0]["scored"] is False
    row = doc["tokens"][5]
    assert row["dp"] == pytest.approx(math.exp(row["logprob_q"]) - math.exp(row["logprob_base"]))
    assert row["same_top"] == (row["top_q_id"] == row["top_base_id"])
    assert doc["statistics"]["kld_mean"]["value"] == pytest.approx(
        sum(t["kld"] for t in doc["tokens"] if t["scored"]) / doc["positions"])


def test_report_shows_llama_perplexity_rows_and_data_inert(compared):
    text = _stdout(show.report, compared)
    s = compared.stats
    for label in ("Mean PPL(Q)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))", "Mean KLD",
                  "Maximum KLD", "99.9% KLD", "Median KLD", "0.1% KLD", "Minimum KLD", "Mean Δp", "75% Δp",
                  "RMS Δp", "Same top p", "KLD  "):
        assert label in text
    assert show.kld_rows(s)[0][1] in text and show.pct(s.same_top.value) in text


def test_hostile_tokens_are_shown_inert(pair):
    q, base = load_model(str(pair[2]), device="cpu"), load_model(str(pair[0]), device="cpu")
    c = compare_text(q, base, "x\x1b[b]")  # few tokens: every one is among the worst shown
    assert any("\x1b" in t.token for t in c.worst())
    text = _stdout(show.report, c)
    assert "\x1b" not in text and "\\x1b" in text


# ---- the command and the API ----------------------------------------------------------------------

runner = CliRunner()


@pytest.mark.slow  # 66 s under load
def test_cli_json_is_the_api_document(pair, tmp_path):
    q_dir, base_dir = str(pair[2]), str(pair[0])
    got = runner.invoke(app, ["compare", TEXT, "--model", q_dir, "--base", base_dir, "--json", "--chunk", "9"])
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    want = lmhead_cli.load(q_dir, device="cpu").compare(TEXT, base=base_dir, chunk=9).to_dict()
    assert doc == want and doc["q"]["model"] == q_dir and doc["base"]["dtype"] == "float32"
    path = tmp_path / "text.txt"
    path.write_text(TEXT + "\n", encoding="utf-8")
    for args, stdin in ((["--file", str(path)], None), (["-"], TEXT + "\n")):  # the same text, two other ways
        other = runner.invoke(app, ["compare", *args, "--model", q_dir, "--base", base_dir, "--json", "--chunk", "9"],
                              input=stdin)
        assert json.loads(other.stdout) == doc


def test_cli_dtype_alone_compares_with_the_same_source_in_float32(pair):
    got = runner.invoke(app, ["compare", TEXT, "--model", str(pair[0]), "--dtype", "bfloat16"])
    assert got.exit_code == 0, got.output
    assert f"Q:    {pair[0]} (bfloat16)" in got.stdout and f"base: {pair[0]} (float32)" in got.stdout
    assert "Mean KLD" in got.stdout and "Same top p" in got.stdout


def test_api_base_same_is_the_model_itself(pair):
    m = lmhead_cli.load(str(pair[0]), device="cpu")
    r = m.compare(TEXT, base="same")
    assert r.stats.kld_mean.value == 0 and r.stats.same_top.value == 1
    assert "<table>" in r._repr_html_() and r.to_dict()["statistics"]["kld_mean"]["value"] == 0


@pytest.mark.parametrize("args,message", [
    (["compare", "Hello"], "the text is one token ('Hello'); compare needs a text of at least 2 tokens"),
    (["compare", ""], "empty"),
    (["compare"], "give a text"),
    (["compare", TEXT, "--file", "x.txt"], "not both"),
    (["compare", "--file", "/nonexistent/x.txt"], "no such text file"),
    (["compare", TEXT, "--base", ""], "--base is empty"),
    (["compare", TEXT, "--stride", "49"], "between 1 and the context of 48"),
    (["compare", TEXT, "--base-dtype", "float8"], "unknown --base-dtype"),
])
def test_cli_bad_input_is_one_line_exit_2(pair, args, message):
    got = runner.invoke(app, [*args, "--model", str(pair[0])])
    assert got.exit_code == 2, got.output
    assert message in got.stderr and got.stderr.count("\n") == 1 and "Traceback" not in got.output


def test_cli_file_that_is_a_fifo_is_refused_without_waiting_for_a_writer(pair, tmp_path):
    import os

    from helpers import launch

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = launch("compare", "--file", str(fifo), "--model", str(pair[0]), timeout=120, text=True)
    assert got.returncode == 2, got.stderr
    assert got.stderr == (f"lmhead: error: {fifo} is a FIFO (named pipe), not a regular file; give a regular file, "
                          "or give - and pipe the text file in (a FIFO with no writer would wait for ever)\n")


def test_cli_file_that_is_a_pipe_already_open_is_read(pair):
    """bash's `--file <(cmd)` names a pipe the process holds (/dev/fd/N), whose writer exists: it is read,
    as the same text given as an argument is."""
    import os

    read, write = os.pipe()
    os.write(write, TEXT.encode())
    os.close(write)
    try:
        got = runner.invoke(app, ["compare", "--file", f"/dev/fd/{read}", "--model", str(pair[0]), "--json"])
    finally:
        os.close(read)
    assert got.exit_code == 0, got.output
    same = runner.invoke(app, ["compare", TEXT, "--model", str(pair[0]), "--json"])
    assert json.loads(got.stdout)["tokens"] == json.loads(same.stdout)["tokens"]


def test_cli_another_vocabulary_is_one_line_exit_2(pair, tmp_path):
    build_checkpoint(tmp_path, n_positions=N_CTX, vocab_size=50304)
    got = runner.invoke(app, ["compare", TEXT, "--model", str(pair[0]), "--base", str(tmp_path)])
    assert got.exit_code == 2 and "has another vocabulary" in got.stderr and got.stderr.count("\n") == 1


def test_cli_nan_is_one_line_exit_1(pair, tmp_path):
    bad = str(nan_checkpoint(pair[0], tmp_path))
    got = runner.invoke(app, ["compare", TEXT, "--model", str(pair[0]), "--base", bad])
    assert got.exit_code == 1 and f"the base {bad} (float32) produced non-finite logits" in got.stderr
    assert got.stderr.count("\n") == 1 and "Traceback" not in got.output


# ---- the mutants' tests (docs/mutation-testing.md) -------------------------------------------------

def test_statistics_of_columns_match_numpy_and_one_position_has_no_uncertainty():
    from lmhead_cli.readings.agreement import statistics
    g = torch.Generator().manual_seed(4)
    a, b = torch.rand(40, generator=g, dtype=torch.float64) * 5, torch.rand(40, generator=g, dtype=torch.float64) * 5
    b = 0.7 * a + 0.3 * b  # correlated, as two models of one text are
    s = statistics(a, b, torch.rand(40, generator=g), torch.rand(40, generator=g) > 0.3)
    x, y, n = a.numpy(), b.numpy(), 40
    pq, pb = math.exp(x.mean()), math.exp(y.mean())
    uq, ub = x.std() / math.sqrt(n - 1), y.std() / math.sqrt(n - 1)
    cov = np.cov(x, y, bias=True)[0, 1] / (n - 1)
    assert s.ppl_diff.value == pytest.approx(pq - pb, rel=1e-12)
    assert s.ppl_diff.uncertainty == pytest.approx(math.sqrt((pq * uq) ** 2 + (pb * ub) ** 2 - 2 * pq * pb * cov),
                                                   rel=1e-9)
    one = statistics(a[:1], b[:1], torch.ones(1), torch.ones(1, dtype=torch.bool))
    assert one.positions == 1 and one.ppl_q.value == pytest.approx(math.exp(float(a[0])))
    assert (one.ppl_q.uncertainty, one.ppl_base.uncertainty, one.cor_ln_ppl, one.ppl_diff.uncertainty,
            one.ppl_ratio.uncertainty, one.same_top.uncertainty) == (None,) * 6


def test_percentile_of_an_infinite_maximum_is_infinite():
    x = torch.tensor([0.0, 1.0, math.inf], dtype=torch.float64)
    assert percentile(x, 1.0) == math.inf and percentile(x, 0.0) == 0.0


def test_a_text_of_two_tokens_is_compared(pair):
    q = load_model(str(pair[0]), device="cpu")
    c = compare_text(q, q, "Hello world")
    assert len(c.ids) == 2 and c.positions == 1 and c.stats.positions == 1
    assert c.stats.ppl_q.uncertainty is None


def test_bos_scores_the_first_token_as_transformers_and_stride_is_half_the_context(pair):
    base_dir, base_model = pair[0], pair[1]
    q = load_model(str(base_dir), device="cpu")
    c = compare_text(q, q, TEXT, bos=True)
    assert c.stride == N_CTX // 2 and c.window == N_CTX
    ids = c.ids.tolist()
    assert len(c.kld) == len(c.scored) == len(ids) and bool(c.scored.all())
    ref = reference_rows(base_model, [50256, *ids], N_CTX, N_CTX // 2)  # GPT-2's <|endoftext|> opens the text
    want = [float(ref[i + 1][t]) for i, t in enumerate(ids)]
    assert c.logprob_q.tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_a_top_token_of_id_0_is_scored(pair, monkeypatch):
    q = load_model(str(pair[0]), device="cpu")
    head = q.engine.head
    monkeypatch.setattr(q.engine, "head", lambda h: head(h).index_add(-1, torch.tensor([0]),
                                                                       torch.full((h.shape[0], 1), 50.0)))
    c = compare_text(q, q, TEXT)
    assert c.positions == len(c.ids) - 1 and bool((c.top_q[1:] == 0).all())


class _OnAnotherDevice:
    """An engine that says it is on the meta device; its body records where its input is and reads the
    window the other model last read (the same tokens, on the CPU)."""

    device = torch.device("meta")

    def __init__(self, engine, windows: list):
        self._engine, self.windows, self.seen = engine, windows, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def body(self, x, *args, **kwargs):
        self.seen.append(x.device)
        return self._engine.body(self.windows[-1], *args, **kwargs)


def test_the_window_goes_to_the_bases_device(pair):
    import dataclasses
    q, base = load_model(str(pair[2]), device="cpu"), load_model(str(pair[0]), device="cpu")
    windows, body = [], q.engine.body
    q.engine.body = lambda x, *a, **k: windows.append(x) or body(x, *a, **k)
    other = dataclasses.replace(base, engine=_OnAnotherDevice(base.engine, windows))
    want = compare_text(q, base, TEXT).stats
    got = compare_text(q, other, TEXT).stats
    assert other.engine.seen and set(other.engine.seen) == {torch.device("meta")}
    assert got == want


def test_dtype_of_an_engine_without_weight_format_and_random_weights_are_as_given(pair):
    from types import SimpleNamespace

    from lmhead_cli.readings.compare import dtype_name
    assert dtype_name(SimpleNamespace(engine=SimpleNamespace(dtype=torch.bfloat16))) == "bfloat16"
    q = load_model(str(pair[0]), device="cpu")
    c = compare_text(q, q, "Hello world")
    assert c.q.random_weights is False and c.base.random_weights is False


def own_tokenizer(loaded):
    """`loaded` with a tokenizer of its own: models loaded from the same files share one parsed
    tokenizer (loading/tokenizer.py), and these tests change one side's."""
    from tokenizers import Tokenizer

    loaded.tokenizer.tok = Tokenizer.from_str(loaded.tokenizer.tok.to_str())
    return loaded


def test_another_tokenizer_table_names_the_first_token_that_differs(pair, monkeypatch):
    q, base = load_model(str(pair[0]), device="cpu"), own_tokenizer(load_model(str(pair[0]), device="cpu"))
    table = base.tokenizer.tok.get_vocab(with_added_tokens=True)
    del table["Hello"]  # one token fewer, only on the base's side
    monkeypatch.setattr(base.tokenizer.tok, "get_vocab", lambda with_added_tokens=True: dict(table))
    with pytest.raises(Mismatch, match=rf"differ first at id {q.tokenizer.tok.get_vocab()['Hello']}, 'Hello'"):
        compare_text(q, base, TEXT)


def test_profile_means_per_consecutive_positions(compared):
    kld = compared.kld[compared.scored].double().numpy()
    for width in (1, 7, 40, 10_000):
        values, per = compared.profile(width)
        assert per == max(1, math.ceil(len(kld) / width)) and len(values) == math.ceil(len(kld) / per)
        want = [kld[i:i + per].mean() for i in range(0, len(kld), per)]
        assert values == pytest.approx(want, rel=1e-5)


def test_a_mean_nll_beyond_a_floats_exp_gives_an_infinite_perplexity_not_an_error():
    """A model with huge logits can average more than ~709.8 nats a token: exp overflows a float there.
    compare's statistics and score's perplexity then say inf (the JSON writer makes it finite), not crash."""
    import torch

    from lmhead_cli.readings.agreement import statistics
    from lmhead_cli.readings.score import Corpus

    nll_q = torch.tensor([800.0, 820.0, 810.0])
    nll_b = torch.tensor([2.0, 3.0, 2.5])
    s = statistics(nll_q, nll_b, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([False, True, False]))
    assert s.ppl_q.value == math.inf and s.ppl_ratio.value == math.inf
    assert s.ppl_base.value == pytest.approx(math.exp(2.5))
    assert s.ln_ppl_ratio.value == pytest.approx(810.0 - 2.5)
    corpus = Corpus()
    corpus.nll, corpus.tokens = 800.0 * 3, 3
    assert corpus.perplexity == math.inf


def test_two_positions_already_have_uncertainties():
    """n = 2 is the first n with an uncertainty (n − 1 = 1): mean ± √(var/1), the covariance of the
    means, and same-top's √(p(1−p)/1)."""
    from lmhead_cli.readings.agreement import Estimate, covariance_of_means, mean_and_uncertainty, statistics

    a, b = torch.tensor([1.0, 3.0], dtype=torch.float64), torch.tensor([2.0, 6.0], dtype=torch.float64)
    assert mean_and_uncertainty(a) == Estimate(2.0, 1.0)  # var = (1 + 9)/2 − 4 = 1
    assert mean_and_uncertainty(a[:1]).uncertainty is None and covariance_of_means(a[:1], b[:1]) is None
    assert covariance_of_means(a, b) == pytest.approx(2.0)  # (mean(a·b) = 10) − 2·4
    s = statistics(a, b, torch.tensor([0.1, 0.3]), torch.tensor([True, False]))
    assert s.same_top.value == 0.5 and s.same_top.uncertainty == pytest.approx(0.5)
    assert s.positions == 2 and s.kld_mean.uncertainty == pytest.approx(0.1)


def test_progress_counts_the_scored_positions_up_to_the_total(pair):
    q = load_model(str(pair[0]), device="cpu")
    seen = []
    compare_text(q, q, TEXT, chunk=5, progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 1 and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1][0] == seen[-1][1] and len({t for _, t in seen}) == 1


def test_bos_is_reported_as_asked_and_int8_by_its_storage(pair):
    from types import SimpleNamespace

    from lmhead_cli.readings.compare import dtype_name

    q = load_model(str(pair[0]), device="cpu")
    assert compare_text(q, q, TEXT).bos is False and compare_text(q, q, TEXT, bos=True).bos is True
    int8 = SimpleNamespace(engine=SimpleNamespace(weight_format="int8", dtype=torch.float32))
    assert dtype_name(int8) == "int8"


# ---- from the full mutation run of readings/compare.py and agreement.py: each fails on its mutant ----

def test_the_statistics_edge_cases_keep_their_definitions():
    from lmhead_cli.readings.agreement import _sqrt, mean_and_uncertainty, statistics

    assert _sqrt(None) is None and _sqrt(0.25) == 0.5 and _sqrt(-1e-18) == 0.0
    x = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)  # mean(x²) − mean(x)² rounds below 0 here
    assert float((x * x).mean()) - float(x.mean()) ** 2 < 0
    assert mean_and_uncertainty(x).uncertainty == 0.0
    assert percentile(torch.tensor([1.0, math.inf]), 0.0) == 1.0  # not 0·inf
    nll_q = torch.full((4,), 2.0)  # Q as sure of every token: its log-PPL has no spread
    nll_b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    s = statistics(nll_q, nll_b, torch.rand(4), torch.ones(4, dtype=torch.bool))
    assert s.cor_ln_ppl is None and s.ppl_q.uncertainty == 0.0
    same = statistics(nll_b, nll_b, torch.zeros(4), torch.ones(4, dtype=torch.bool))  # Δp is 0 everywhere
    assert (same.dp_rms.value, same.dp_rms.uncertainty) == (0.0, 0.0)


def test_top_names_the_first_position_whose_prediction_is_not_finite():
    from lmhead_cli.readings.compare import _top

    lp = torch.log_softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert _top(lp, "the model m", 10).tolist() == lp.argmax(-1).tolist()
    lp[1, 3] = -math.inf  # a -inf logit: the row's max is finite, its min is not
    lp[2, 0] = -math.inf
    lp[4, 6] = math.nan
    with pytest.raises(NonFiniteLogits) as e:
        _top(lp, "the model m", 10)
    assert str(e.value).startswith("the model m produced non-finite logits (NaN or inf) predicting token 11 of "
                                   "the text (3 positions in that chunk): ")


def test_nan_with_bos_names_the_first_text_token(pair, tmp_path):
    good = load_model(str(pair[0]), device="cpu")
    bad = load_model(str(nan_checkpoint(pair[0], tmp_path)), device="cpu")
    for q, base, who in ((bad, good, "model"), (good, bad, "base")):
        with pytest.raises(NonFiniteLogits, match=f"the {who} {tmp_path} .float32. produced non-finite .* token 0 of"):
            compare_text(q, base, TEXT, bos=True)


@pytest.mark.parametrize("side", ["q", "base"])
def test_a_tokenizer_with_an_added_token_of_its_own_is_refused(pair, monkeypatch, side):
    """Tokens added to a tokenizer (beyond its BPE table) are tokens too: one side with an extra one
    cannot be compared token by token, whichever side it is."""
    q, base = load_model(str(pair[0]), device="cpu"), load_model(str(pair[0]), device="cpu")
    own = own_tokenizer(q if side == "q" else base).tokenizer.tok
    table = own.get_vocab(with_added_tokens=True)
    extra = {**table, "<|extra|>": len(table)}
    monkeypatch.setattr(own, "get_vocab", lambda with_added_tokens=True: dict(extra if with_added_tokens else table))
    with pytest.raises(Mismatch, match=rf"differ first at id {len(table)}, '<\|extra\|>'"):
        compare_text(q, base, TEXT)


def test_two_tokenizer_differences_are_named_by_the_lowest_id(pair, monkeypatch):
    """'z' (id 89) sorts after 'Hello' (id 15496) as text: the first difference is the lowest id's."""
    q, base = load_model(str(pair[0]), device="cpu"), own_tokenizer(load_model(str(pair[0]), device="cpu"))
    table = base.tokenizer.tok.get_vocab(with_added_tokens=True)
    assert table["z"] < table["Hello"] and "Hello" < "z"
    del table["z"], table["Hello"]
    monkeypatch.setattr(base.tokenizer.tok, "get_vocab", lambda with_added_tokens=True: dict(table))
    with pytest.raises(Mismatch, match=rf"differ first at id {q.tokenizer.tok.get_vocab()['z']}, 'z'"):
        compare_text(q, base, TEXT)


def test_compare_ids_takes_no_bos_and_refuses_a_chunk_of_0_unless_asked(pair):
    from lmhead_cli.errors import BadValue
    from lmhead_cli.readings.compare import compare_ids, default_chunk

    q = load_model(str(pair[0]), device="cpu")
    ids = torch.tensor(q.tokenizer.encode(TEXT))
    got = compare_ids(q, q, ids)
    assert len(got["kld"]) == len(ids) and not bool(got["scored"][0]) and bool(got["scored"][1:].all())
    with pytest.raises(BadValue, match="at least 1 position"):
        compare_ids(q, q, ids, chunk=0)
    assert default_chunk(50257) == 41  # COMPARE_BUFFERS (chunk, V) float32 buffers within score's budget


def test_each_token_record_carries_its_ids(compared):
    c = compared
    first = c.token(0)
    assert (first.index, first.id, first.token, first.scored) == (0, int(c.ids[0]), c.token_text(int(c.ids[0])), False)
    for i in (1, 5, len(c.ids) - 1):
        t = c.token(i)
        assert t.id == int(c.ids[i]) and t.token == c.token_text(t.id)
        assert (t.top_q_id, t.top_base_id) == (int(c.top_q[i]), int(c.top_base[i]))
        assert t.top_q_token == c.token_text(t.top_q_id) and t.top_base_token == c.token_text(t.top_base_id)


def test_worst_lists_five_scored_tokens_by_default_and_never_an_unscored_one(pair, compared):
    assert len(compared.worst()) == 5 and all(t.scored for t in compared.worst())
    q = load_model(str(pair[0]), device="cpu")
    itself = compare_text(q, q, "the keys on")  # every KL divergence 0: ties with nothing unscored
    assert [t.index for t in itself.worst()] == [1, 2]


def test_compare_lists_each_token_at_its_own_index(tmp_path):
    """compare --json's per-token rows carry their index in the text. Mutant: index None."""
    from lmhead_cli.readings.compare import compare_text

    build_checkpoint(tmp_path, seed=3)
    q = load_model(str(tmp_path), device="cpu")
    c = compare_text(q, q, "The keys on the table are lost.")
    assert [c.token(i).index for i in range(len(c.ids))] == list(range(len(c.ids)))


def test_another_tokenizer_that_only_adds_tokens_is_named_where_the_shorter_split_ends():
    """The base splits the text into Q's tokens and then more: they first differ at the token after the
    shorter split. Mutant: no position given (None) when no token within both differs."""
    import numpy as np

    from lmhead_cli.errors import UsageError
    from lmhead_cli.readings.compare import check_same_tokens

    longer = bytearray(np.array([5, 6, 7, 8, 9], dtype=np.int32).tobytes())
    base = SimpleNamespace(source="other", tokenizer=SimpleNamespace(encode_long=lambda text: longer, token_text=str))
    q = SimpleNamespace(source="q", tokenizer=SimpleNamespace(token_text=str))
    with pytest.raises(UsageError, match="into 5 tokens against 3, differing first at token 3; there q reads "
                                         r"nothing \(its split has ended\) and the base '8' \(id 8\)"):
        check_same_tokens(q, base, torch.tensor([5, 6, 7]), "text")


# ---- across formats: a GGUF file against its original; llama-perplexity's positions --------------

def llama_rows(model, seq: list[int], n: int, bos: int | None = None) -> dict[int, torch.Tensor]:
    """{index in seq: (V,) float64 log-probabilities that predict it} on llama-perplexity's positions,
    redone from perplexity.cpp's loop: chunk c is seq[c·n:(c+1)·n] (BOS in place of its first token
    when `bos`), run alone; its logits at positions n/2 … n − 2 predict its tokens n/2 + 1 … n − 1."""
    rows = {}
    for c in range(len(seq) // n):
        tokens = seq[c * n:(c + 1) * n]
        if bos is not None:
            tokens = [bos] + tokens[1:]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1).double()
        for j in range(n // 2, n - 1):
            rows[c * n + j + 1] = lp[j]
    return rows


@pytest.fixture(scope="module")
def gguf_pair(pair, tmp_path_factory):
    """(Q8_0 GGUF of the base checkpoint, transformers' model on its dequantised weights)."""
    import copy

    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    from helpers import from_gguf_layout, write_gguf

    base_dir, base_model = pair[0], pair[1]
    path = tmp_path_factory.mktemp("gguf") / "base-Q8_0.gguf"
    written = write_gguf(base_model, path, "Q8_0")
    twin = copy.deepcopy(base_model)
    state = from_gguf_layout(base_model, {k: torch.from_numpy(np.array(dequantize(d, GGMLQuantizationType[t])))
                                          for k, (t, d) in written.items()})
    with torch.no_grad():
        for name, t in state.items():
            twin.get_parameter(name).copy_(t)
    return path, twin


@pytest.mark.parametrize("bos", [False, True])
def test_a_gguf_against_its_original_on_llama_perplexitys_positions(pair, gguf_pair, bos):
    base_dir, base_model = pair[0], pair[1]
    path, twin = gguf_pair
    n = 20
    got = CliRunner().invoke(app, ["compare", TEXT, "--model", str(path), "--base", str(base_dir),
                                   "--llama-chunks", str(n), "--json", *(["--bos"] if bos else [])])
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc["llama_chunks"] == n and doc["window"] == n and doc["stride"] == n
    ids = [t["id"] for t in doc["tokens"]]
    seq = ([50256] if bos else []) + ids
    ref_q, ref_b = llama_rows(twin, seq, n, 50256 if bos else None), llama_rows(base_model, seq, n, 50256 if bos else None)
    order = sorted(ref_q)  # indices in seq; the document's tokens are seq without its BOS
    assert [t["index"] for t in doc["tokens"] if t["scored"]] == [i - bos for i in order]
    assert doc["windows"] == len(seq) // n and len(order) == doc["windows"] * (n - 1 - n // 2)
    lq, lb = torch.stack([ref_q[i] for i in order]).numpy(), torch.stack([ref_b[i] for i in order]).numpy()
    want = reference_statistics(lq, lb, np.array([seq[i] for i in order]))
    s = doc["statistics"]
    close(s["ppl_q"]["value"], want["ppl_q"][0], rel=1e-5)
    close(s["ppl_base"]["value"], want["ppl_base"][0], rel=1e-5)
    close(s["ln_ppl_ratio"]["value"], want["ln_ratio"][0], rel=1e-3, abs=1e-6)
    close(s["kld_mean"]["value"], want["kld"][0], rel=1e-3, abs=1e-8)
    close(s["kld_mean"]["uncertainty"], want["kld"][1], rel=1e-3, abs=1e-9)
    close(s["same_top"]["value"], want["same"][0])
    assert want["kld"][0] > 0  # Q8_0 really moved the distributions: the test can tell a wrong side


def test_compare_names_the_first_token_where_a_ggufs_tokenizer_splits_otherwise(pair, tmp_path):
    """A GGUF whose merges lack "Ġ t" against the original folder: transformers' tokenizers on both
    files say where the splits part, and compare names that token as each side reads it, and stops."""
    from helpers import gpt2_tokens, write_gguf
    from transformers import GPT2Tokenizer as ReferenceTokenizer

    base_dir, base_model = pair[0], pair[1]
    tokens, merges, _ = gpt2_tokens()
    path = tmp_path / "other-merges.gguf"
    write_gguf(base_model, path, "F32", meta={"tokenizer.ggml.merges": [m for m in merges if m != "Ġ t"]})
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "vocab.json").write_text((base_dir / "vocab.json").read_text(encoding="utf-8"), encoding="utf-8")
    lines = (base_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    (folder / "merges.txt").write_text("\n".join(m for m in lines if m != "Ġ t"), encoding="utf-8")
    mine = ReferenceTokenizer.from_pretrained(str(folder)).encode(TEXT)
    theirs = ReferenceTokenizer.from_pretrained(str(base_dir)).encode(TEXT)
    at = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
    got = CliRunner().invoke(app, ["compare", TEXT, "--model", str(path), "--base", str(base_dir)])
    assert got.exit_code == 2
    line = got.stderr.strip().splitlines()[-1]
    q_tok = ReferenceTokenizer.from_pretrained(str(folder)).convert_ids_to_tokens(mine[at]).replace("Ġ", " ")
    b_tok = ReferenceTokenizer.from_pretrained(str(base_dir)).convert_ids_to_tokens(theirs[at]).replace("Ġ", " ")
    assert (f"differing first at token {at}; there {path} reads {q_tok!r} (id {mine[at]}) and the base "
            f"{b_tok!r} (id {theirs[at]}); compare needs one tokenizer") in line
    assert "perplexity" not in got.stdout  # stopped there: no statistics


@pytest.mark.parametrize("args, says", [
    (["--llama-chunks", "3"], f"--llama-chunks must be between 4 and the context of {N_CTX} (got 3)"),
    (["--llama-chunks", str(N_CTX + 1)], f"--llama-chunks must be between 4 and the context of {N_CTX}"),
    (["--llama-chunks", "8", "--stride", "4"], "give --stride or --llama-chunks, not both"),
])
def test_llama_chunks_refusals(pair, args, says):
    got = CliRunner().invoke(app, ["compare", TEXT, "--model", str(pair[2]), "--base", str(pair[0]), *args])
    assert got.exit_code == 2 and says in got.stderr and got.stderr.count("\n") == 1, got.output


def test_a_text_shorter_than_one_llama_chunk_is_refused(pair):
    q = load_model(str(pair[0]), device="cpu")
    with pytest.raises(UsageError, match="the text is 6 tokens, fewer than one chunk of 8"):
        compare_text(q, q, "the keys on the table are", llama=8)
