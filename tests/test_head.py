"""head.py's functions one by one on small tensors, against plain torch in float64 and arithmetic here.

Fast (no checkpoint), so the mutation run (docs/mutation-testing.md) can afford them for every mutant
of head.py; the figures through a real model are checked against transformers in test_inspect,
test_score and test_diff.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmhead_cli import head
from lmhead_cli.errors import BadValue, NonFiniteLogits
from helpers import PROMPT, PROMPT_IDS, build_checkpoint
from lmhead_cli.decoding.generate import generate, make_settings
from lmhead_cli.head import Distribution, RANKS_BY_COMPARISON, rank_of, ranks, score_rows
from lmhead_cli.loading.sources import load_model

G = torch.Generator().manual_seed(0)
Z = torch.randn(3, 50, generator=G) * 3  # (3, 50) logits, no ties
ROW = Z[0]


def ref_logprobs(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z.double(), -1)


# ---- finiteness, log-softmax, entropy --------------------------------------------------------------

def test_check_finite_passes_finite_logits_and_counts_the_bad_ones():
    head.check_finite(Z)
    bad = Z.clone()
    bad[0, 3], bad[1, 4], bad[2, 5] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(NonFiniteLogits) as e:
        head.check_finite(bad)
    assert str(e.value) == f"the head produced 3 non-finite logits (NaN or inf): {head.NON_FINITE_ADVICE}"


@pytest.mark.parametrize("inplace", [False, True])
def test_log_softmax_is_torchs_in_float32_on_both_paths(inplace):
    z = Z.clone()
    got = head.log_softmax(z, inplace=inplace)
    assert got.dtype == torch.float32 and got.shape == Z.shape
    torch.testing.assert_close(got.double(), ref_logprobs(Z), atol=1e-6, rtol=1e-6)
    assert (got.data_ptr() == z.data_ptr()) == inplace  # in place: the logits' own buffer, else a new one
    assert torch.equal(z, got if inplace else Z)


@pytest.mark.parametrize("inplace", [False, True])
def test_log_softmax_takes_each_row_s_own_max(inplace):
    """Rows far apart in level (a row of -200s next to one near 0): each row is shifted by its own max,
    so no row's exp underflows to 0 (mutant: one max over the whole tensor, which gives -inf or NaN)."""
    z = torch.stack([Z[0], Z[1] - 200.0, Z[2] + 150.0])
    got = head.log_softmax(z.clone(), inplace=inplace)
    torch.testing.assert_close(got.double(), ref_logprobs(z), atol=2e-5, rtol=0)


def test_log_softmax_of_lower_precision_is_float32_and_keeps_minus_infinity():
    z = Z[0].to(torch.bfloat16)
    z[7] = float("-inf")
    for inplace in (False, True):
        got = head.log_softmax(z.clone(), inplace=inplace)
        assert got.dtype == torch.float32 and got[7] == float("-inf")
        torch.testing.assert_close(got.double(), ref_logprobs(z.float()), atol=1e-6, rtol=1e-6)


def test_entropy_is_minus_sum_p_log_p_per_row():
    lp = ref_logprobs(Z).float()
    expected = -(lp.double().exp() * lp.double()).sum(-1)
    got = head.entropy(lp)
    assert got.shape == (3,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


def test_entropy_counts_a_dropped_token_as_nothing_and_never_goes_below_zero():
    z = torch.tensor([1.0, 2.0, float("-inf"), 0.5])
    lp = torch.log_softmax(z, -1)
    p = lp[[0, 1, 3]].double().exp()
    assert float(head.entropy(lp)) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)
    one_hot = torch.log_softmax(torch.tensor([0.0, float("-inf"), float("-inf")]), -1)
    h = float(head.entropy(one_hot))
    assert h == 0.0 and math.copysign(1.0, h) == 1.0  # 0, not -0.0
    assert float(head.entropy(torch.log_softmax(torch.zeros(8), -1))) == pytest.approx(math.log(8), abs=1e-6)


def test_entropy_leaves_its_input_alone():
    lp = ref_logprobs(Z).float()
    before = lp.clone()
    head.entropy(lp)
    assert torch.equal(lp, before)


def test_nats_to_bits():
    assert head.nats_to_bits(math.log(2)) == pytest.approx(1.0, abs=1e-15)
    assert head.nats_to_bits(3.0) == pytest.approx(3.0 / math.log(2), abs=1e-15)


# ---- ranks and tables ---------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 5, head.RANKS_BY_COMPARISON, head.RANKS_BY_COMPARISON + 1])
def test_ranks_without_ties_are_one_plus_the_tokens_above(k):
    z = torch.randn(2, 100, generator=torch.Generator().manual_seed(k))
    ids = torch.randperm(100, generator=torch.Generator().manual_seed(k))[:k].expand(2, -1)
    got = head.ranks(z, ids)
    assert got.dtype == torch.int64 and got.shape == (2, k)
    assert got.tolist() == [[1 + int((r > r[i]).sum()) for i in ids[0]] for r in z]
    assert head.rank_of(z[0], int(z[0].argmax())) == 1 and head.rank_of(z[0], int(z[0].argmin())) == 100


def test_check_and_clamp_top_k():
    assert head.check_top_k(1) == 1 and head.check_top_k(7) == 7
    for bad in (0, -3):
        with pytest.raises(BadValue) as e:
            head.check_top_k(bad)
        assert (e.value.key, e.value.problem) == ("top_k", f"must be at least 1 (got {bad})")
    assert head.clamp_top_k(5, 50) == 5 and head.clamp_top_k(50, 50) == 50 and head.clamp_top_k(51, 50) == 50
    with pytest.raises(BadValue):
        head.clamp_top_k(0, 50)


def test_top_tokens_is_the_k_highest_with_their_figures():
    lp = ref_logprobs(ROW)
    rows = head.Distribution(ROW).top(4, lambda i: f"<{i}>")
    order = torch.argsort(ROW, descending=True)[:4].tolist()
    assert [r.id for r in rows] == order and [r.rank for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r.token == f"<{r.id}>" and r.logit == float(ROW[r.id])
        assert r.logprob == pytest.approx(float(lp[r.id]), abs=1e-6)
        assert r.prob == pytest.approx(math.exp(float(lp[r.id])), abs=1e-7)
    assert len(head.Distribution(ROW).top(99, str)) == 50  # k beyond the vocabulary: all of it
    half = head.Distribution(ROW.half()).top(2, str)
    assert [r.id for r in half] == order[:2] and isinstance(half[0].logit, float)


class Tok:
    """Encodes each character as its code point; '' and '#' (a text with no token) to nothing."""

    def encode(self, text):
        return [] if text in ("", "#") else [ord(c) for c in text]


def test_encode_target_and_targets():
    assert head.encode_target(Tok(), "ab") == [97, 98]
    for text in ("", "#"):
        with pytest.raises(BadValue) as e:
            head.encode_target(Tok(), text)
        assert (e.value.key, e.value.problem) == ("target", f"{text!r} encodes to no tokens; give a token such as ' are'")
    with pytest.raises(BadValue) as e:
        head.encode_target(Tok(), "#", key="explain")
    assert e.value.key == "explain"
    assert head.encode_targets(Tok(), None) == [] and head.encode_targets(Tok(), []) == []
    assert head.encode_targets(Tok(), ["a", "bc"]) == [("a", [97]), ("bc", [98, 99])]
    with pytest.raises(BadValue):
        head.encode_targets(Tok(), ["a", "#"])


def test_a_distribution_reads_everything_off_one_log_softmax():
    d = head.Distribution(ROW.half())
    lp = ref_logprobs(ROW.half().float())
    assert d.logits.dtype == d.logprobs.dtype == torch.float32 and d.vocab == 50
    torch.testing.assert_close(d.probs.double(), lp.exp(), atol=1e-7, rtol=1e-6)
    assert d.entropy == pytest.approx(float(-(lp.exp() * lp).sum()), abs=1e-5)
    assert d.entropy_bits == pytest.approx(d.entropy / math.log(2), rel=1e-12)
    best = int(ROW.argmax())
    assert d.prob(best) == pytest.approx(math.exp(float(lp[best])), rel=1e-6) and d.rank(best) == 1
    z = ROW.half().float()
    assert d.ranks(torch.tensor([best, 3])).tolist() == [1, 1 + int((z > z[3]).sum())]


def test_a_table_row_lists_only_the_optional_fields_that_are_set():
    row = head.TokenScore(rank=1, id=2, token="t", logit=0.5, prob=0.25, logprob=-1.0)
    assert row.to_dict() == {"rank": 1, "id": 2, "token": "t", "logit": 0.5, "prob": 0.25, "logprob": -1.0}
    assert head.TokenScore(1, 2, "t", 0.5, 0.25, -1.0, other_rank=3).to_dict()["other_rank"] == 3
    assert "scaled" not in head.TokenScore(1, 2, "t", 0.5, 0.25, -1.0, other_rank=3).to_dict()


def test_target_score_reads_the_first_token_of_the_text():
    z = ROW.half()  # any dtype: the figures come out in float32
    first = int(torch.argsort(ROW, descending=True)[2])
    t = head.Distribution(z).target(" xy", [first, 9], lambda i: f"<{i}>")
    lp = ref_logprobs(z.float())
    assert (t.token, t.id, t.pieces, t.rank) == (" xy", first, [f"<{first}>", "<9>"], 3)
    assert t.logit == float(z[first].float()) and t.prob == pytest.approx(math.exp(float(lp[first])), rel=1e-6)


# ---- rows of a text (score) ---------------------------------------------------------------------

@pytest.fixture(params=["compiled", "torch"])
def rows_path(request, monkeypatch):
    """score_rows' two paths: lmhead's compiled kernel where it loads (the CPU), and torch's alone (a
    GPU's, or a machine with no compiler), each against the same float64 references below."""
    if request.param == "torch":
        from lmhead_cli.engine import kernels

        monkeypatch.setattr(kernels, "load", lambda: None)
    return request.param


def test_score_rows_against_torch(rows_path):
    ids = torch.tensor([4, 17, 30])
    z = Z.clone()
    rows = head.score_rows(z, ids)
    lp = ref_logprobs(Z)
    assert rows.logprob.dtype == torch.float32 and rows.rank.dtype == torch.int64
    torch.testing.assert_close(rows.logprob.double(), lp.gather(-1, ids[:, None])[:, 0], atol=1e-6, rtol=1e-6)
    assert rows.rank.tolist() == [1 + int((r > r[i]).sum()) for r, i in zip(Z, ids.tolist())]
    torch.testing.assert_close(rows.entropy.double(), -(lp.exp() * lp).sum(-1), atol=1e-5, rtol=0)
    assert rows.top_id.tolist() == Z.argmax(-1).tolist()
    torch.testing.assert_close(rows.top_logprob.double(), lp.max(-1).values, atol=1e-6, rtol=1e-6)
    assert rows.top_ids is None and rows.top_logprobs is None  # none asked for


def test_score_rows_with_dropped_tokens(rows_path):
    """A logit of -inf (a token the head rules out) has p = 0: it adds nothing to the entropy (its
    0·(-inf) = NaN is counted as 0), its log-probability is -inf and every other token ranks above it."""
    z = Z.clone()
    z[0, 5] = z[2, 7] = z[2, 9] = float("-inf")
    ids = torch.tensor([5, 17, 30])
    rows = head.score_rows(z.clone(), ids)
    lp = ref_logprobs(z)
    torch.testing.assert_close(rows.entropy.double(), -(lp.exp() * lp).nan_to_num(nan=0.0).sum(-1), atol=1e-5, rtol=0)
    assert rows.logprob[0] == float("-inf") and rows.rank.tolist() == [1 + int((r > r[i]).sum()) for r, i in zip(z, ids.tolist())]
    torch.testing.assert_close(rows.logprob[1:].double(), lp.gather(-1, ids[:, None])[1:, 0], atol=1e-6, rtol=1e-6)


def test_score_rows_top_k_most_probable(rows_path):
    rows = head.score_rows(Z.clone(), torch.tensor([0, 0, 0]), top=3)
    lp = ref_logprobs(Z)
    best = torch.topk(lp, 3, dim=-1)
    assert rows.top_ids.tolist() == best.indices.tolist()
    torch.testing.assert_close(rows.top_logprobs.double(), best.values, atol=1e-6, rtol=1e-6)


def test_score_rows_refuses_non_finite_rows_naming_how_many(rows_path):
    z = Z.clone()
    z[0, 1], z[2, 2] = float("nan"), float("inf")
    with pytest.raises(NonFiniteLogits) as e:
        head.score_rows(z, torch.tensor([0, 0, 0]))
    assert str(e.value) == ("the head produced non-finite logits (NaN or inf) at 2 positions: "
                            + head.NON_FINITE_ADVICE)


def ref_uncertainty(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy, varentropy, margin) by their definitions in float64: H = E[-log p], Var[-log p] =
    E[(-log p - H)²] under p, and the gap between the two best log-probabilities."""
    lp = ref_logprobs(z)
    p = lp.exp()
    h = -(p * lp).nan_to_num(nan=0.0).sum(-1)
    var = (p * (-lp - h[..., None]) ** 2).nan_to_num(nan=0.0).sum(-1)
    two = lp.sort(-1, descending=True).values
    return h, var, two[..., 0] - two[..., 1]


def test_score_rows_varentropy_and_margin_by_their_definitions(rows_path):
    z = Z.clone()
    z[1, 7] = z[1].max()  # a tie for the top: margin 0
    h, var, gap = ref_uncertainty(z)
    rows = head.score_rows(z.clone(), torch.tensor([4, 17, 30]))
    assert rows.varentropy.dtype == rows.margin.dtype == torch.float32
    torch.testing.assert_close(rows.varentropy.double(), var, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows.margin.double(), gap, atol=1e-5, rtol=1e-6)
    assert float(rows.margin[1]) == 0.0 and float(var.min()) > 0.1  # not a trivial 0 anywhere else


def test_score_rows_varentropy_and_margin_with_dropped_tokens_and_one_survivor(rows_path):
    """A -inf logit adds nothing to the varentropy; a row with one possible token has varentropy 0
    and no second token: margin inf (JSON documents show null)."""
    z = Z.clone()
    z[0, 5] = z[0].max() + 1  # the top-1, and a dropped token beside it
    z[0, 9] = float("-inf")
    z[2, :] = float("-inf")
    z[2, 3] = 1.0
    h, var, _ = ref_uncertainty(z)
    rows = head.score_rows(z.clone(), torch.tensor([5, 17, 3]))
    torch.testing.assert_close(rows.varentropy[:2].double(), var[:2], atol=1e-5, rtol=1e-5)
    assert float(rows.varentropy[2]) == 0.0 and not torch.signbit(rows.varentropy).any()
    assert float(rows.margin[2]) == math.inf


def test_varentropy_and_margin_of_log_probabilities():
    """head.varentropy / head.margin over log-probabilities (what the server and Distribution read),
    against the definitions: a flat distribution of 50,257 tokens keeps its digits (centred on H), a
    uniform one has varentropy 0, dropped tokens add nothing."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 50257, generator=g) * 0.05  # nearly flat: E[(log p)²] and H² both near 117
    z[3, 100:] = float("-inf")  # the stages kept 100 tokens
    lp = head.log_softmax(z)
    h, var, gap = ref_uncertainty(z)
    torch.testing.assert_close(head.varentropy(lp).double(), var, atol=1e-6, rtol=1e-3)
    torch.testing.assert_close(head.margin(lp).double(), gap, atol=1e-5, rtol=1e-4)
    assert float(head.varentropy(head.log_softmax(torch.zeros(10)))) == pytest.approx(0.0, abs=1e-9)
    assert float(head.margin(head.log_softmax(torch.tensor([1.0, float("-inf")])))) == math.inf
    assert float(head.margin(torch.zeros(1))) == math.inf  # V = 1
    d = head.Distribution(Z[0])
    assert d.varentropy == pytest.approx(float(ref_uncertainty(Z[0])[1]), rel=1e-5)
    assert d.margin == pytest.approx(float(ref_uncertainty(Z[0])[2]), rel=1e-5)


def test_check_top_logprobs_bounds():
    head.check_top_logprobs(0, 50)
    head.check_top_logprobs(50, 50)
    for bad in (-1, 51):
        with pytest.raises(BadValue) as e:
            head.check_top_logprobs(bad, 50)
        assert (e.value.key, e.value.problem) == (
            "top_logprobs", f"must be between 0 and the vocabulary size, 50 (got {bad})")


# ---- divergences --------------------------------------------------------------------------------

def test_divergences_by_their_definitions():
    lp, lq = ref_logprobs(Z[0]).float(), ref_logprobs(Z[1]).float()
    p, q = lp.double().exp(), lq.double().exp()
    kl_pq = float((p * (lp.double() - lq.double())).sum())
    kl_qp = float((q * (lq.double() - lp.double())).sum())
    assert abs(kl_pq - kl_qp) > 0.1
    assert head.kl_divergence(lp, lq) == pytest.approx(kl_pq, rel=1e-12)
    assert head.kl_divergence(lq, lp) == pytest.approx(kl_qp, rel=1e-12)
    m = (p + q) / 2
    js = 0.5 * float((p * (p / m).log()).sum()) + 0.5 * float((q * (q / m).log()).sum())
    assert head.js_divergence(lp, lq) == pytest.approx(js, rel=1e-9) and 0 < js < math.log(2)
    assert head.total_variation(lp, lq) == pytest.approx(0.5 * float((p - q).abs().sum()), rel=1e-12)
    assert head.kl_divergence(lp, lp) == head.js_divergence(lp, lp) == head.total_variation(lp, lp) == 0.0


def test_rank_of_builds_its_index_on_the_logits_device_not_the_default_one():
    """Under another default device (a GPU session's `torch.set_default_device("cuda")`; here the meta
    device) rank_of's index still goes where the logits are, and every rank is the definition's."""
    expected = [1 + int((ROW > ROW[i]).sum()) for i in range(ROW.shape[-1])]
    with torch.device("meta"):
        assert [head.rank_of(ROW, i) for i in range(ROW.shape[-1])] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: on the CPU every tensor is on one device")
def test_rank_of_and_target_score_on_the_gpu():
    """rank_of builds its index on the logits' device (an index left on the CPU fails on a GPU)."""
    z = ROW.cuda()
    assert head.rank_of(z, int(ROW.argmax())) == 1
    assert head.Distribution(z).target("x", [int(ROW.argmin())], str).rank == 50


def test_top_k_orders_ties_lowest_id_first_for_every_k():
    """torch.topk alone puts tied logits in an order that depends on k (ids 3 and 2 tied at the top of
    1,000: topk(1) gives 2, topk(2) gives 3 first); the table gives 2 first for every k, as argmax does."""
    from lmhead_cli.head import Distribution

    logits = torch.zeros(1000)
    logits[[3, 2, 999, 5]] = torch.tensor([2.0, 2.0, 1.0, 1.0])
    d = Distribution(logits)
    for k in (1, 2, 3, 4, 7):
        got = [t.id for t in d.top(k, str)]
        assert got == [2, 3, 5, 999, 0, 1, 4][:k], k
    assert [t.rank for t in d.top(4, str)] == [1, 2, 3, 4] and int(logits.argmax()) == 2
    assert [t.id for t in Distribution(torch.zeros(50257)).top(3, str)] == [0, 1, 2]


ARE = 389  # " are", the twin of the top token in `twin`


def strictly_higher_plus_one(z: torch.Tensor, i: int) -> int:
    return 1 + int((z > z[i]).sum())


TIED = torch.tensor([0.5, 2.0, -1.0, 2.0, 0.25, 3.0, 0.5, -1.0])  # 1 and 3 tie below 5; 0 and 6, 2 and 7 tie


@pytest.mark.parametrize("k", [1, 2, RANKS_BY_COMPARISON, RANKS_BY_COMPARISON + 1])
def test_ranks_of_tied_tokens_share_the_better_rank_on_each_path(k):
    """ranks() has three ways (one id per row, up to 64 by comparison, more by a sort); each counts only
    the tokens strictly higher. Mutants: `>` as `>=` (without the 1 +) on the first two, searchsorted's
    right=True as right=False on the third."""
    z = TIED.repeat(12)  # (96,): every value tied with 11 others at least
    rows = torch.stack([z, -z])  # (2, 96): two rows, so the paths' (..., K) shapes are exercised
    ids = torch.tensor([[1, 3, 0, 6, 2, 7, 5, 4] * 9][0][:k]).expand(2, -1)  # (2, k)
    got = ranks(rows, ids)
    expected = [[strictly_higher_plus_one(r, int(i)) for i in ids[0]] for r in rows]
    assert got.tolist() == expected
    assert got[0, 0] == 1 + 12 and (k < 3 or got[0, 2] == 1 + 12 * 3)  # 3.0 ×12 above 2.0; then 2.0 ×24 too


def test_rank_of_a_tied_token_is_the_better_rank():
    """rank_of (explain, targets): mutant `>` as `>=` on the one-id path gives 3 and 6 below."""
    assert rank_of(TIED, 1) == rank_of(TIED, 3) == 2
    assert rank_of(TIED, 0) == rank_of(TIED, 6) == 4


def test_target_score_of_a_tied_token_is_the_better_rank():
    t = Distribution(TIED).target(" x", [3, 9], str)
    assert (t.id, t.rank) == (3, 2)


def test_score_rows_rank_of_a_tied_token_is_the_better_rank():
    """score's per-token rank (score_rows, one id per row): a tie with the top token is rank 1."""
    logits = torch.stack([TIED, TIED.flip(0), torch.zeros(8)])  # row 2: all eight tied
    ids = torch.tensor([1, 4, 4])  # 2.0 tied with 2.0 below 3.0, in each order; 0 among eight zeros
    rows = score_rows(logits.clone(), ids)
    assert rows.rank.tolist() == [strictly_higher_plus_one(z, int(i)) for z, i in zip(logits, ids)] == [2, 2, 1]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """(loaded lean engine, transformers model, top id): a tiny untied GPT-2 whose head row for " are"
    is a copy of the row of the prompt's top token, so the two tie exactly after PROMPT."""
    folder = tmp_path_factory.mktemp("twin")
    model = build_checkpoint(folder, tied=False, seed=7)
    with torch.no_grad():
        top = int(model(torch.tensor([PROMPT_IDS])).logits[0, -1].argmax())
        assert top != ARE
        model.lm_head.weight[ARE] = model.lm_head.weight[top]
    model.save_pretrained(folder)
    with torch.no_grad():
        z = model(torch.tensor([PROMPT_IDS])).logits[0, -1]
    third = float(torch.topk(z, 3).values[2])
    assert z[ARE] == z[top] and float(z[top]) - third > 1e-3  # an exact tie at the top, nothing near it
    return load_model(str(folder), device="cpu", dtype="float32", engine="lean"), model, top


def test_a_twin_tie_in_real_logits_is_rank_one_on_every_reading(twin):
    """The same tie through score, inspect's targets, diff (its targets and its other-side ranks) and a
    generated step: every one says rank 1 for both twins, as transformers' logits do."""
    from lmhead_cli.readings.diff import diff_prompts
    from lmhead_cli.readings.inspect import inspect_prompt
    from lmhead_cli.readings.score import score_text

    loaded, model, top = twin
    with torch.no_grad():
        z = model(torch.tensor([PROMPT_IDS])).logits[0, -1]
    assert strictly_higher_plus_one(z, ARE) == strictly_higher_plus_one(z, top) == 1
    logits = loaded.engine.head(loaded.engine.body(torch.tensor([PROMPT_IDS]))[:, -1:])[0, 0]
    assert logits[ARE] == logits[top]  # the engine ties them exactly too

    s = score_text(loaded, PROMPT + " are")
    assert [t.id for t in s.tokens()][-1] == ARE and list(s.tokens())[-1].rank == 1

    i = inspect_prompt(loaded, PROMPT, top_k=3, targets=[" are"])
    assert i.targets[0].rank == 1

    d = diff_prompts(loaded, PROMPT, PROMPT, top_k=3, targets=[" are"])
    assert (d.targets[0].rank_a, d.targets[0].rank_b) == (1, 1)
    assert {t.id: t.other_rank for t in d.a.top if t.id in (ARE, top)} == {ARE: 1, top: 1}

    g = generate(loaded, PROMPT_IDS, make_settings(greedy=True, max_new_tokens=1))
    assert g.generated_ids[0] in (ARE, top) and g.steps[0].rank == 1
