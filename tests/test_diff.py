"""`lmhead diff`: every figure against transformers' own forward and divergences computed here with torch."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import assert_rank, cli

from lmhead_cli.loading.sources import load_model
from lmhead_cli.readings.diff import diff_prompts

A, B = "The key on the table", "The keys on the table"
A_IDS, B_IDS = [464, 1994, 319, 262, 3084], [464, 8251, 319, 262, 3084]
IS, ARE = 318, 389


def reference(model, ids) -> torch.Tensor:
    """Log-probabilities (V,) float64 at the last position from transformers' full forward."""
    with torch.no_grad():
        z = model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(z.double(), -1)


@pytest.mark.parametrize("engine", ["lean", "transformers"])
def test_divergences_and_ranks_against_transformers(tiny, engine):
    folder, model = tiny
    d = diff_prompts(load_model(str(folder), device="cpu", engine=engine), A, B, top_k=6, targets=[" is", " are"],
                     movers=4)
    lp, lq = reference(model, A_IDS), reference(model, B_IDS)
    p, q = lp.exp(), lq.exp()
    # torch's own KL (input = log q, target = log p gives KL(p‖q)), and JS/TV by their definitions.
    kl_pq = float(torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="sum"))
    kl_qp = float(torch.nn.functional.kl_div(lp, lq, log_target=True, reduction="sum"))
    m = (p + q) / 2
    js = 0.5 * float((p * (p / m).log()).sum()) + 0.5 * float((q * (q / m).log()).sum())
    assert [t.id for t in d.a.prompt_tokens] == A_IDS and [t.id for t in d.b.prompt_tokens] == B_IDS
    # The engines' float32 logits differ from transformers' by ~1e-6: the divergences (~3e-4 here) to 2e-6.
    assert d.kl_ab == pytest.approx(kl_pq, abs=2e-6) and d.kl_ab > 1e-4
    assert d.kl_ba == pytest.approx(kl_qp, abs=2e-6)
    assert d.js == pytest.approx(js, abs=1e-6)
    assert d.tv == pytest.approx(0.5 * float((p - q).abs().sum()), rel=1e-4)
    assert d.kl_ab_bits == pytest.approx(d.kl_ab / math.log(2)) and d.js_bits == pytest.approx(d.js / math.log(2))
    assert 0 < d.js <= math.log(2) and 0 < d.tv <= 1
    assert d.a.entropy == pytest.approx(float(-(p * lp).sum()), rel=1e-4)
    assert d.b.entropy == pytest.approx(float(-(q * lq).sum()), rel=1e-4)

    for side, mine, other in ((d.a, lp, lq), (d.b, lq, lp)):
        assert [t.id for t in side.top] == torch.topk(mine, 6).indices.tolist()
        for t in side.top:
            assert t.logprob == pytest.approx(float(mine[t.id]), abs=1e-4)
            assert_rank(t.other_rank, other, t.id)

    pool = set(torch.topk(lp, 6).indices.tolist()) | set(torch.topk(lq, 6).indices.tolist())
    delta = {i: float(lq[i] - lp[i]) for i in pool}
    up = sorted((i for i in pool if delta[i] > 0), key=lambda i: -delta[i])[:4]
    down = sorted((i for i in pool if delta[i] < 0), key=lambda i: delta[i])[:4]
    assert d.pool == len(pool)
    assert [r.id for r in d.risers] == up and [f.id for f in d.fallers] == down
    for r in d.risers + d.fallers:
        assert r.delta == pytest.approx(delta[r.id], abs=1e-4)
        assert r.delta == pytest.approx(r.logprob_b - r.logprob_a, abs=1e-9)

    for t, i in zip(d.targets, (IS, ARE)):
        assert t.id == i
        assert (t.logprob_a, t.logprob_b) == (pytest.approx(float(lp[i]), abs=1e-4), pytest.approx(float(lq[i]), abs=1e-4))
        assert (t.prob_a, t.prob_b) == (pytest.approx(float(p[i]), rel=1e-4), pytest.approx(float(q[i]), rel=1e-4))
        assert_rank(t.rank_a, lp, i)
        assert_rank(t.rank_b, lq, i)
        assert t.delta == pytest.approx(float(lq[i] - lp[i]), abs=1e-4)


def test_movers_caps_the_risers_and_fallers(tiny):
    """--movers N lists the N largest rises and falls of the pool (top_k's by default), not all of them."""
    folder, model = tiny
    loaded = load_model(str(folder), device="cpu")
    lp, lq = reference(model, A_IDS), reference(model, B_IDS)
    pool = set(torch.topk(lp, 6).indices.tolist()) | set(torch.topk(lq, 6).indices.tolist())
    up = sorted((i for i in pool if lq[i] > lp[i]), key=lambda i: float(lp[i] - lq[i]))
    down = sorted((i for i in pool if lq[i] < lp[i]), key=lambda i: float(lq[i] - lp[i]))
    assert len(up) >= 2 and len(down) >= 2  # so that a cap of 1 leaves some out
    for movers, cap in ((1, 1), (0, 0), (None, 6)):
        d = diff_prompts(loaded, A, B, top_k=6, movers=movers)
        assert [r.id for r in d.risers] == up[:cap] and [f.id for f in d.fallers] == down[:cap]


def test_divergence_arithmetic_against_torch():
    """head.py's divergences on two clearly different distributions, against torch's kl_div and definitions."""
    from lmhead_cli.head import RANKS_BY_COMPARISON, js_divergence, kl_divergence, log_softmax, ranks, total_variation

    g = torch.Generator().manual_seed(0)
    za, zb = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 2
    lp, lq = log_softmax(za), log_softmax(zb)
    kl = torch.nn.functional.kl_div
    assert kl_divergence(lp, lq) == pytest.approx(float(kl(lq.double(), lp.double(), log_target=True, reduction="sum")), rel=1e-9)
    assert kl_divergence(lq, lp) == pytest.approx(float(kl(lp.double(), lq.double(), log_target=True, reduction="sum")), rel=1e-9)
    assert abs(kl_divergence(lp, lq) - kl_divergence(lq, lp)) > 0.1  # asymmetric: the direction is tested
    p, q = lp.double().exp(), lq.double().exp()
    m = (p + q) / 2
    assert js_divergence(lp, lq) == pytest.approx(float(0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()), rel=1e-9)
    assert js_divergence(lp, lq) == pytest.approx(js_divergence(lq, lp), rel=1e-12)
    assert total_variation(lp, lq) == pytest.approx(float((p - q).abs().sum() / 2), rel=1e-9)
    assert kl_divergence(lp, lp) == js_divergence(lp, lp) == total_variation(lp, lp) == 0.0
    # ranks: a few tokens by comparison, many by a sort; both 1 + the tokens scored strictly higher.
    few = torch.tensor([0, 5, int(za.argmax()), int(za.argmin())])
    many = torch.arange(RANKS_BY_COMPARISON + 1)
    za[7] = za[9]  # a tie shares the better rank on both paths
    for ids in (few, many):
        assert ranks(za, ids).tolist() == [1 + int((za > za[i]).sum()) for i in ids]


def test_the_head_runs_on_each_last_position_only(tiny):
    loaded = load_model(str(tiny[0]), device="cpu")
    seen = []
    hook = loaded.engine.head_module.register_forward_hook(lambda _m, i, o: seen.append((tuple(i[0].shape), tuple(o.shape))))
    try:
        diff_prompts(loaded, A, "The keys on the table, said", top_k=2)
    finally:
        hook.remove()
    assert seen == [((1, 1, 64), (1, 1, 50257))] * 2  # two forwards, one (1, 1, D) row each


def test_untied(tiny_untied):
    folder, model = tiny_untied
    d = diff_prompts(load_model(str(folder), device="cpu"), A, B, top_k=3)
    lp, lq = reference(model, A_IDS), reference(model, B_IDS)
    assert d.kl_ab == pytest.approx(float((lp.exp() * (lp - lq)).sum()), abs=2e-6)


def test_identical_prompts_give_zero(tiny):
    r = cli("diff", B, B, "--model", str(tiny[0]), "--json", "-t", " are")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kl_ab"] == doc["kl_ba"] == doc["js"] == doc["tv"] == 0.0
    assert doc["risers"] == doc["fallers"] == []
    assert doc["targets"][0]["delta"] == 0.0 and doc["targets"][0]["rank_a"] == doc["targets"][0]["rank_b"]
    assert [t["other_rank"] for t in doc["a"]["top"]] == [t["rank"] for t in doc["a"]["top"]]


def test_json_has_exactly_the_documented_fields(tiny):
    r = cli("diff", A, B, "--model", str(tiny[0]), "--json", "-k", "3", "-t", " is", "-t", " keys on")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) == {"model", "random_weights", "a", "b", "kl_ab", "kl_ba", "js", "tv", "risers", "fallers",
                        "targets"}
    assert doc["model"] == str(tiny[0]) and doc["random_weights"] is False
    assert set(doc["a"]) == set(doc["b"]) == {"prompt", "prompt_tokens", "top", "entropy"}
    assert doc["a"]["prompt"] == A and doc["b"]["prompt_tokens"][1] == {"id": 8251, "text": " keys"}
    assert set(doc["a"]["top"][0]) == {"rank", "id", "token", "logit", "prob", "logprob", "other_rank"}
    for m in doc["risers"] + doc["fallers"]:
        assert set(m) == {"id", "token", "logprob_a", "logprob_b", "delta"}
    assert set(doc["targets"][0]) == {"token", "id", "logprob_a", "logprob_b", "rank_a", "rank_b", "delta"}
    # A target of several tokens: a notice, and its first token is used, as in inspect.
    assert doc["targets"][1]["token"] == " keys on" and doc["targets"][1]["id"] == 8251
    assert "is 2 tokens" in r.stderr


def test_table_shows_data_literally(tiny):
    r = cli("diff", "[bold]x[/]", "\x1b[31mred", "--model", str(tiny[0]), "-k", "3", "-t", " is",
                            "-t", " are")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for text in ("KL(A‖B)", "KL(B‖A)", "Jensen–Shannon", "total variation", "and its rank on the other side", "risers", "fallers",
                 "targets", "␣is", "␣are", 'A: "[bold]x[/]"', 'B: "\\x1b[31mred"'):
        assert text in out, text
    assert "\x1b" not in out


@pytest.mark.parametrize("args, message", [
    ([A], "give two prompts"),
    ([], "give two prompts"),
    ([A, ""], "the prompt is empty"),
    ([A, B, "-k", "0"], "--top-k must be at least 1"),
    ([A, B, "--movers", "-1"], "--movers must be at least 0"),
    ([A, B, "--target", ""], "encodes to no tokens"),
])
def test_bad_input_exits_2(tiny, args, message):
    r = cli("diff", *args, "--model", str(tiny[0]))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0]


def test_each_top_token_is_ranked_on_the_other_distributions_device():
    """_side makes the ids it ranks on the other distribution's device, not on torch's default one
    (here the meta device, as a GPU would differ from the CPU)."""
    from types import SimpleNamespace

    from lmhead_cli.head import Distribution
    from lmhead_cli.readings.diff import _side

    loaded = SimpleNamespace(tokenizer=SimpleNamespace(token_text=lambda i: f"<{i}>"))
    a, b = Distribution(torch.tensor([3.0, 1.0, 2.0, 0.0])), Distribution(torch.tensor([0.0, 3.0, 1.0, 2.0]))
    with torch.device("meta"):
        side = _side(loaded, "p", [1, 2], 0, a, b, 3)
    assert [(t.id, t.other_rank) for t in side.top] == [(0, 4), (2, 3), (1, 1)]


# ---- from the full mutation run of readings/diff.py: each test fails on the mutant it names --------

def _crafted(monkeypatch, za: torch.Tensor, zb: torch.Tensor) -> None:
    """diff_prompts reads these logits for its two prompts instead of the model's."""
    from lmhead_cli.readings import diff as diff_module

    given = iter([(za, None), (zb, None)])
    monkeypatch.setattr(diff_module, "last_logits", lambda loaded, ids: next(given))


def test_movers_default_to_top_k_when_more_rise_and_tied_rises_list_lowest_id_first(tiny, monkeypatch):
    """top_k 2: the pool is both sides' top 2, and three of its four tokens rise; by default the movers
    are capped at top_k (two), and tokens 2 and 3, which rise by exactly as much, come lowest id first."""
    za, zb = torch.zeros(50257), torch.zeros(50257)
    za[0] = za[1] = 5.0
    zb[0], zb[2], zb[3] = 6.0, 9.0, 9.0  # 0 rises a little, 2 and 3 a lot (equally), 1 falls
    _crafted(monkeypatch, za, zb)
    d = diff_prompts(load_model(str(tiny[0]), device="cpu"), A, B, top_k=2)
    assert d.pool == 4 and d.risers[0].delta == d.risers[1].delta
    assert [r.id for r in d.risers] == [2, 3] and [f.id for f in d.fallers] == [1]


def test_equal_rises_keep_the_pools_id_order(tiny, monkeypatch):
    """One token of forty tied at the top falls away: the other 39 rise by exactly the same amount and
    are listed lowest id first (a stable sort; an unstable one shuffles ties this many)."""
    za = torch.zeros(50257)
    za[:40] = 5.0
    zb = za.clone()
    zb[7] = -10.0
    _crafted(monkeypatch, za, zb)
    d = diff_prompts(load_model(str(tiny[0]), device="cpu"), A, B, top_k=40, movers=40)
    rise = next(r.delta for r in d.risers if r.id == 0)  # tokens 0-39 but 7 share one rise
    tied = [r.id for r in d.risers if r.delta == rise]
    assert tied == [i for i in range(40) if i != 7]
    assert [f.id for f in d.fallers] == [7]


def test_each_side_keeps_its_prompt_and_how_many_tokens_it_dropped(tmp_path):
    """Prompts longer than the context keep their last tokens, and each side says its own prompt and
    its own count of dropped tokens; top_k defaults to 10 rows a side."""
    from helpers import build_checkpoint

    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    folder = tmp_path / "short_ctx"
    build_checkpoint(folder, n_positions=16, n_layer=2)
    a, b = " ".join(f"w{i}" for i in range(20)), " ".join(f"v{i}" for i in range(30))
    tok = GPT2Tokenizer.bundled()
    d = diff_prompts(load_model(str(folder), device="cpu"), a, b)
    assert (d.a.prompt, d.b.prompt) == (a, b)
    assert (d.a.truncated, d.b.truncated) == (len(tok.encode(a)) - 16, len(tok.encode(b)) - 16)
    assert d.a.truncated != d.b.truncated and d.a.truncated > 0
    assert len(d.a.top) == len(d.b.top) == 10


DIFF_A, DIFF_B = "The key on the table", "The keys on the table"


KL_ATOL = 1e-5  # engine vs transformers logits differ by ~5e-6 here (logits up to ~16)


def test_diff_kl_directions_are_each_right_where_they_differ_clearly(loud):
    """KL(p‖q) and KL(q‖p) against torch's kl_div on transformers' logits, on prompts whose two
    directions differ by over 100 × the tolerance. Mutant: kl_ab and kl_ba swapped (or p, q swapped
    inside kl_divergence)."""
    from lmhead_cli.readings.diff import diff_prompts

    folder, model = loud
    with torch.no_grad():
        lp, lq = (torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
                  for ids in ([464, 1994, 319, 262, 3084], [464, 8251, 319, 262, 3084]))
    kl = torch.nn.functional.kl_div
    kl_pq = float(kl(lq, lp, log_target=True, reduction="sum"))  # input log q, target log p: KL(p‖q)
    kl_qp = float(kl(lp, lq, log_target=True, reduction="sum"))
    assert abs(kl_pq - kl_qp) > 100 * KL_ATOL  # the directions are told apart
    for engine in ("lean", "transformers"):
        d = diff_prompts(load_model(str(folder), device="cpu", dtype="float32", engine=engine), DIFF_A, DIFF_B, top_k=3)
        assert d.kl_ab == pytest.approx(kl_pq, abs=KL_ATOL) and d.kl_ba == pytest.approx(kl_qp, abs=KL_ATOL)
