"""`lmhead calibrate` and Model.calibrate: every bin, the ECE, the Brier score, the NLL and the fitted
temperature against a computation here from transformers' own logits (the temperature against a grid
search), over score's positions (windows, --bos, stride); --generations' entropy rate against
transformers' log-probabilities of the sampled tokens; and the refusals score makes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import cli

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "lmhead_cli" / "data" / "bundled-tiny"
# Ruth 1:1-5 and Jonah 1:1-3 (KJV), books the bundled model's training held out; twice, so that a
# stride of 128 in its context of 256 makes several windows.
RUTH = ("Now it came to pass in the days when the judges ruled, that there was a famine in the land. "
        "And a certain man of Bethlehemjudah went to sojourn in the country of Moab, he, and his wife, "
        "and his two sons. And the name of the man was Elimelech, and the name of his wife Naomi, and "
        "the name of his two sons Mahlon and Chilion, Ephrathites of Bethlehemjudah. And they came into "
        "the country of Moab, and continued there.")
JONAH = ("Now the word of the LORD came unto Jonah the son of Amittai, saying, Arise, go to Nineveh, that "
         "great city, and cry against it; for their wickedness is come up before me. But Jonah rose up to "
         "flee unto Tarshish from the presence of the LORD, and went down to Joppa.")
TEXT = " ".join([RUTH, JONAH, RUTH])
KEYS = ["model", "random_weights", "text", "bos", "window", "stride", "chunk", "positions", "bins", "ece", "brier",
        "nll", "temperature", "ece_at_temperature", "nll_at_temperature"]


@pytest.fixture(scope="module")
def model():
    import lmhead_cli

    return lmhead_cli.load("bundled:tiny", device="cpu")


@pytest.fixture(scope="module")
def oracle():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(FOLDER, torch_dtype=torch.float32).eval()


def oracle_rows(oracle, ids: list[int], n_ctx: int, stride: int, bos: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits (n, V) for every position score scores, and the tokens they predict (n,):
    windows of n_ctx tokens beginning every `stride`, each scoring what the one before did not."""
    seq = ([50256] if bos else []) + ids
    rows, targets, done = [], [], 1
    for begin in range(0, len(seq), stride):
        end = min(begin + n_ctx, len(seq))
        first = max(done, begin + 1)
        with torch.no_grad():
            z = oracle(torch.tensor([seq[begin:end]])).logits[0]  # (end - begin, V)
        rows.append(z[first - 1 - begin:end - 1 - begin])
        targets += seq[first:end]
        done = end
        if end == len(seq):
            break
    return torch.cat(rows).double(), torch.tensor(targets)


def figures(z: torch.Tensor, y: torch.Tensor, T: float = 1.0) -> dict:
    """Bins (lo, hi], ECE, Brier and NLL of logits z (n, V) at temperature T, by their definitions."""
    lp = torch.log_softmax(z / T, -1)
    conf = lp.max(-1).values.exp()
    correct = (z.argmax(-1) == y).double()
    bins = []
    for i in range(15):
        lo, hi = i / 15, (i + 1) / 15
        inside = (conf > lo) & (conf <= hi)
        k = int(inside.sum())
        bins.append((k, float(conf[inside].mean()) if k else None, float(correct[inside].mean()) if k else None))
    n = len(y)
    ece = sum(k / n * abs(a - c) for k, c, a in bins if k)
    return {"bins": bins, "ece": ece, "brier": float(((conf - correct) ** 2).mean()),
            "nll": float(-lp.gather(-1, y[:, None]).mean())}


def nll_at(z: torch.Tensor, y: torch.Tensor, T: float) -> float:
    return float((torch.logsumexp(z / T, -1) - z.gather(-1, y[:, None])[:, 0] / T).mean())


def golden_min(f, a: float, b: float, tol: float) -> float:
    """The x in [a, b] where the unimodal f is least, to within tol: golden-section search (each step
    keeps 0.618 of the bracket and reuses one of its two evaluations)."""
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def test_golden_min_finds_the_least_point_of_a_convex_function():
    assert golden_min(lambda x: (x - 0.3) ** 2 + math.exp(x), -5.0, 5.0, 1e-6) == pytest.approx(-0.136293, abs=1e-5)
    assert golden_min(lambda x: abs(x - 2.5), 0.0, 10.0, 1e-6) == pytest.approx(2.5, abs=1e-6)


@pytest.mark.parametrize("bos,stride", [(False, 128), (True, 200)])
@pytest.mark.slow
def test_every_bin_ece_brier_nll_and_temperature_match_transformers(model, oracle, bos, stride):
    ids = model.encode(TEXT)
    assert len(ids) > 256  # several windows
    r = model.calibrate(TEXT, bos=bos, stride=stride, chunk=50)
    z, y = oracle_rows(oracle, ids, model.n_ctx, stride, bos)
    assert r.positions == len(y) == len(ids) - (not bos)
    want = figures(z, y)
    got = r.to_dict()
    assert [b["count"] for b in got["bins"]] == [k for k, _, _ in want["bins"]]
    assert sum(b["count"] for b in got["bins"]) == r.positions and sum(1 for k, _, _ in want["bins"] if k) >= 4
    for b, (k, c, a) in zip(got["bins"], want["bins"]):
        assert (b["confidence"] is None) == (k == 0) and (b["accuracy"] is None) == (k == 0)
        if k:
            assert b["confidence"] == pytest.approx(c, abs=1e-5) and b["accuracy"] == pytest.approx(a, abs=1e-12)
    assert [(b["lo"], b["hi"]) for b in got["bins"]] == [(i / 15, (i + 1) / 15) for i in range(15)]
    assert got["ece"] == pytest.approx(want["ece"], abs=1e-5) and got["ece"] > 0.01
    assert got["brier"] == pytest.approx(want["brier"], abs=1e-5)
    assert got["nll"] == pytest.approx(want["nll"], abs=1e-4)
    # the temperature: a golden-section search here over log T in [0.1, 10] (the NLL is convex in 1/T,
    # so one minimum), to 0.05% of T; lmhead takes Newton steps in 1/T
    u = golden_min(lambda u: nll_at(z, y, math.exp(u)), math.log(0.1), math.log(10), 5e-4)
    best = math.exp(u)
    T = got["temperature"]
    assert abs(math.log(T) - u) <= 1e-3, (T, best)
    assert nll_at(z, y, T) <= nll_at(z, y, best) + 1e-9
    assert got["nll_at_temperature"] == pytest.approx(nll_at(z, y, T), abs=1e-4) and got["nll_at_temperature"] < got["nll"]
    assert got["ece_at_temperature"] == pytest.approx(figures(z, y, T)["ece"], abs=1e-5)
    assert list(got) == KEYS


def test_json_is_to_dict_and_the_terminal_chart_shows_each_bin(model, tmp_path):
    got = cli("calibrate", TEXT, "--model", "bundled:tiny", "--json", "--stride", "100")
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc == model.calibrate(TEXT, stride=100).to_dict()
    human = cli("calibrate", TEXT, "--model", "bundled:tiny", "--stride", "100")
    assert human.exit_code == 0, human.output
    for b in doc["bins"]:
        if b["count"]:
            assert f"({b['lo']:.2f}, {b['hi']:.2f}]" in human.stdout and f"{b['accuracy']:.3f}" in human.stdout
    assert f"ECE {doc['ece']:.4f}" in human.stdout and f"temperature {doc['temperature']:.4f}" in human.stdout
    page = tmp_path / "cal.html"
    written = cli("calibrate", TEXT, "--model", "bundled:tiny", "--stride", "100", "--html", str(page))
    assert written.exit_code == 0 and f"wrote {page}" in written.stderr
    text = page.read_text()
    assert "Content-Security-Policy" in text and text.count("<svg") == 2
    as_given = text.split("<svg")[1]  # the first diagram: the bins as the model gives them
    bars = [b for b in doc["bins"] if b["count"]]
    assert as_given.count('class="bar"') == len(bars)
    assert all(f"{b['count']:,} positions, confidence {b['confidence']:.4f}, accuracy {b['accuracy']:.4f}" in as_given
               for b in bars)


def test_generations_entropy_rate_is_transformers_mean_surprisal_of_the_samples(model, oracle):
    r = model.calibrate(JONAH, generations=3, max_new_tokens=12, seed=5, top_k=20)
    g = r.to_dict()["generations"]
    assert (g["count"], g["seed"], g["settings"], g["max_new_tokens"]) == (3, 5, {"top_k": 20}, 12)
    surprisal = []
    for i, text in enumerate(g["texts"]):
        again = model.generate("<|endoftext|>", max_new_tokens=12, seed=5 + i, top_k=20, ignore_eos=True)
        assert again.reading.text == text  # seeds seed, seed + 1, ...
        ids = [50256] + again.reading.generated_ids
        with torch.no_grad():
            lp = torch.log_softmax(oracle(torch.tensor([ids])).logits[0].double(), -1)
        surprisal += [-float(lp[j, ids[j + 1]]) for j in range(len(ids) - 1)]  # raw: before top-k
    assert g["tokens"] == len(surprisal) == 36
    assert g["entropy_rate"] == pytest.approx(sum(surprisal) / len(surprisal), abs=1e-4)
    assert g["cross_entropy"] == r.nll and g["gap"] == pytest.approx(g["entropy_rate"] - r.nll, abs=1e-12)


def test_generations_past_the_context_report_the_tokens_each_held(model, capsys, monkeypatch):
    """Issue 50: --max-new-tokens 300 on a 256-token model was reported as "generations of 300 tokens"."""
    from lmhead_cli.render import calibrate as show

    r = model.calibrate(JONAH, generations=2, max_new_tokens=300, seed=1)
    g = r.to_dict()["generations"]
    each = model.n_ctx  # after the one <|endoftext|> token: room(n_ctx, 1) = n_ctx new tokens
    assert (g["max_new_tokens"], g["tokens"]) == (300, 2 * each)
    monkeypatch.setenv("COLUMNS", "400")
    show.report(r.reading)
    assert f"2 generations of {each} tokens (all the context holds; 300 asked) after" in capsys.readouterr().out


def test_generations_that_cannot_fit_are_refused_naming_generations_before_scoring(model, monkeypatch):
    """Issue 50: --generations 1000000000 was refused as "--n of ... choices", after the text was scored."""
    import lmhead_cli.readings.calibrate as reading

    monkeypatch.setattr(reading, "calibrate_text", lambda *a, **k: pytest.fail("the text was scored first"))
    got = cli("calibrate", "x y z", "--generations", "1000000000", "--model", "bundled:tiny")
    assert got.exit_code == 2 and got.stderr.count("\n") == 1, got.output
    assert got.stderr.startswith("lmhead: error: --generations of 1,000,000,000 continuations need about ")


@pytest.mark.parametrize("args,stdin,message,code", [
    (["calibrate", "Hello"], None, "add --bos", 2),
    (["calibrate", ""], None, "empty", 2),
    (["calibrate"], None, "give a text", 2),
    (["calibrate", "-"], b"caf\xe9", "not UTF-8", 2),
    (["calibrate", "x y z", "--file", "t.txt"], None, "not both", 2),
    (["calibrate", "--file", "/nonexistent/t.txt"], None, "no such text file", 2),
    (["calibrate", "x y z", "--stride", "300"], None, "between 1 and the context of 256", 2),
    (["calibrate", "x y z", "--chunk", "0"], None, "--chunk", 2),
    (["calibrate", "x y z", "--generations", "-1"], None, "--generations", 2),
    (["calibrate", "x y z", "--top-k", "5"], None, "give --generations N", 2),
    (["calibrate", "x y z", "--generations", "1", "--top-p", "2"], None, "--top-p", 2),
    (["calibrate", "x y z", "--html", "/nonexistent/dir/c.html"], None, "--html needs a file", 2),
])
def test_refusals_are_score_s_one_line(args, stdin, message, code):
    got = cli(*args, "--model", "bundled:tiny", input=stdin)
    assert got.exit_code == code, got.output
    assert message in got.stderr and got.stderr.count("\n") == 1 and "Traceback" not in got.output


def test_a_file_too_large_is_refused_and_a_file_is_one_text(tmp_path, monkeypatch, model):
    from lmhead_cli import inputs

    path = tmp_path / "t.txt"
    path.write_text(JONAH + "\n")
    got = cli("calibrate", "--file", str(path), "--model", "bundled:tiny", "--json")
    assert got.exit_code == 0 and json.loads(got.stdout)["positions"] == len(model.encode(JONAH)) - 1
    monkeypatch.setattr(inputs, "MAX_STDIN_BYTES", 100)
    big = cli("calibrate", "--file", str(path), "--model", "bundled:tiny")
    assert big.exit_code == 2 and big.stderr.count("\n") == 1 and "100" in big.stderr, big.output


def test_the_bin_of_a_confidence_is_lo_exclusive_hi_inclusive():
    from lmhead_cli.readings.calibrate import bin_index, reliability

    c = torch.tensor([1 / 15, 1 / 15 + 1e-9, 1.0, 1e-6, 0.5], dtype=torch.float64)
    assert bin_index(c).tolist() == [0, 1, 14, 0, 7]
    bins, ece, brier = reliability(torch.tensor([0.9, 0.9, 0.2]), torch.tensor([True, False, False]))
    assert (bins[13].count, bins[13].confidence, bins[13].accuracy) == (2, pytest.approx(0.9), 0.5)
    assert ece == pytest.approx((2 * 0.4 + 0.2) / 3) and brier == pytest.approx((0.01 + 0.81 + 0.04) / 3)


@pytest.mark.parametrize("args,stdin", [(["Hello"], None), ([""], None), (["-"], "x" * 200), (["-"], "Hello\n")])
def test_calibrate_refuses_what_score_refuses_word_for_word(args, stdin, monkeypatch):
    """A text of fewer than 2 tokens, an empty one, one over the size limit: score's own line and exit code."""
    from lmhead_cli import inputs

    monkeypatch.setattr(inputs, "MAX_STDIN_BYTES", 100)
    score = cli("score", *args, "--model", "bundled:tiny", input=stdin)
    got = cli("calibrate", *args, "--model", "bundled:tiny", input=stdin)
    assert got.exit_code == score.exit_code == 2
    same = got.stderr.replace("lmhead calibrate", "lmhead score")  # an example names its own command
    assert same == score.stderr and got.stderr.count("\n") == 1, (got.stderr, score.stderr)
