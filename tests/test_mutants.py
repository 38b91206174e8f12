"""Cases that catch realistic one-line bugs (issue 22): each test here was shown to fail on the
mutant its docstring names and to pass on the code.

- ties on every rank path (head.ranks' three ways, rank_of, score's rank, target ranks, a step's rank):
  a tied token shares the better rank, 1 + the tokens scored strictly higher;
- top-p and min-p exactly at their boundary, with probabilities that are exact in binary;
- beam search lets only the best N of its 2N candidates finish (transformers' rule);
- diff's two KL directions on distributions far enough apart that swapping them shows;
- the lean engine on activations large enough to tell gelu_new from exact gelu.

Expected figures come from transformers or from arithmetic here, never from the code under test.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, PROMPT_IDS, build_checkpoint, loud_checkpoint

from lmhead_cli.decoding import stages
from lmhead_cli.decoding.generate import generate, make_settings
from lmhead_cli.head import RANKS_BY_COMPARISON, Distribution, rank_of, ranks, score_rows
from lmhead_cli.loading.sources import load_model

ARE = 389  # " are", the twin of the top token in `twin`


def strictly_higher_plus_one(z: torch.Tensor, i: int) -> int:
    return 1 + int((z > z[i]).sum())


# ---- ties on every rank path ---------------------------------------------------------------------

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


# ---- top-p and min-p exactly at the boundary -----------------------------------------------------

EXACT = torch.log(torch.tensor([0.125, 0.5, 0.125, 0.25]))  # softmax gives these exactly in float32


def kept(z: torch.Tensor) -> list[int]:
    return torch.isfinite(z).nonzero().flatten().tolist()


def test_the_exact_probabilities_are_exact():
    """The boundary cases below mean something only if float32 softmax and cumsum are exact here."""
    p = EXACT.softmax(-1)
    assert p.tolist() == [0.125, 0.5, 0.125, 0.25]
    assert torch.sort(p, descending=True).values.cumsum(-1).tolist() == [0.5, 0.75, 0.875, 1.0]


def test_top_p_stops_at_a_mass_exactly_equal_to_p():
    """0.5 + 0.25 = 0.75 = p: the third token is not needed. Mutant: `mass_before >= p` as `>`."""
    assert kept(stages.top_p(EXACT, 0.75)) == [1, 3]
    assert kept(stages.top_p(EXACT, 0.5)) == [1]
    assert len(kept(stages.top_p(EXACT, 0.875))) == 3  # 0.5 + 0.25 + 0.125 (either of the tied 0.125s)


def test_min_p_keeps_a_token_exactly_at_its_threshold():
    """p = 0.25 = 0.5 × 0.5 stays; 0.125 = 0.25 × 0.5 stays. Mutant: `z - best < log m` as `<=`."""
    assert kept(stages.min_p(EXACT, 0.5)) == [1, 3]
    assert kept(stages.min_p(EXACT, 0.25)) == [0, 1, 2, 3]


@pytest.mark.parametrize("p", [0.5, 0.75, 0.9])
def test_top_p_at_the_boundary_matches_transformers(p):
    from transformers.generation.logits_process import TopPLogitsWarper

    theirs = TopPLogitsWarper(top_p=p)(None, EXACT[None].clone())[0]
    assert kept(stages.top_p(EXACT, p)) == kept(theirs)


@pytest.mark.parametrize("m", [0.25, 0.5, 0.6])
def test_min_p_at_the_boundary_matches_transformers(m):
    from transformers.generation.logits_process import MinPLogitsWarper

    theirs = MinPLogitsWarper(min_p=m)(None, EXACT[None].clone())[0]
    assert kept(stages.min_p(EXACT, m)) == kept(theirs)


# ---- beam search: only the best N candidates may finish ------------------------------------------

STUB_V, STUB_EOS, STUB_PROMPT = 16, 15, 14


def bigram_table() -> torch.Tensor:
    """(V, V) logits of the next token given the last one. After the prompt token: 0 (p .4), 1 (.3),
    end-of-text (.2), 2 (.06), 3 (.04), so with 2 beams end-of-text is the 3rd of the 4 candidates.
    After 0 or 1: nearly flat, the best about 0.09, so any two-token beam averages below log .2 and
    a one-token [end-of-text] (score log .2) would beat them all if it were allowed to finish."""
    table = torch.full((STUB_V, STUB_V), -30.0)
    for t, p in {0: 0.4, 1: 0.3, STUB_EOS: 0.2, 2: 0.06, 3: 0.04}.items():
        table[STUB_PROMPT, t] = math.log(p)
    table[0] = torch.linspace(0.0, -0.6, STUB_V)
    table[1] = table[0].roll(3)
    return table


class BigramEngine:
    """The parts of the engine contract that generate() uses, over a bigram table: the hidden state is
    the one-hot last token and the head multiplies it by the table. No cache is needed."""

    name, n_ctx, device, dtype = "bigram", 64, torch.device("cpu"), torch.float32
    vocab_size, eos_token_id, config = STUB_V, STUB_EOS, {"n_layer": 1, "n_embd": STUB_V}

    def __init__(self, table: torch.Tensor):
        self.table = table

    def new_cache(self, batch, max_len):
        return None

    def reorder_cache(self, cache, rows):
        return cache

    def body(self, ids, cache=None):
        return torch.nn.functional.one_hot(ids, STUB_V).float()  # (R, T, V)

    def head(self, h):
        return h @ self.table  # (R, T, V)

    def last_logits(self, ids, cache=None):
        return self.head(self.body(ids, cache))[:, -1].float()  # (R, V)


def bigram_loaded(table: torch.Tensor):
    text = lambda i: f"<{i}>"  # noqa: E731
    tokenizer = SimpleNamespace(token_text=text, token_bytes=lambda i: text(i).encode(),
                                decode=lambda ids: "".join(map(text, ids)))
    return SimpleNamespace(engine=BigramEngine(table), tokenizer=tokenizer, execution=SimpleNamespace(run=lambda f: f()))


def transformers_bigram_beams(table: torch.Tensor, beams: int, new: int):
    """transformers' own beam search over the same bigram table: (sequences without the prompt, scores)."""
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class BigramConfig(PretrainedConfig):
        model_type = "lmhead_test_bigram"

    class Bigram(PreTrainedModel, GenerationMixin):
        config_class = BigramConfig

        def __init__(self, config):
            super().__init__(config)
            self.table = torch.nn.Parameter(table.clone())

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return CausalLMOutputWithPast(logits=self.table[input_ids])

    model = Bigram(BigramConfig(vocab_size=STUB_V, eos_token_id=STUB_EOS, pad_token_id=STUB_EOS)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([[STUB_PROMPT]]), num_beams=beams, num_return_sequences=beams,
                             do_sample=False, max_new_tokens=new, use_cache=False, eos_token_id=STUB_EOS,
                             pad_token_id=STUB_EOS, return_dict_in_generate=True, output_scores=True)
    return [s[1:].tolist() for s in out.sequences], out.sequences_scores.tolist()


def test_end_of_text_ranked_below_the_best_n_candidates_does_not_finish():
    """End-of-text is the 3rd of 2 × 2 candidates at the first step: transformers lets only the best 2
    finish, so it never becomes a one-token beam; the two-token beams win, in transformers' order.
    Mutant: the finishing loop over `cands` instead of `cands[:n]` returns [end-of-text] first."""
    table = bigram_table()
    expected, scores = transformers_bigram_beams(table, beams=2, new=2)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=2))
    assert [b.ids for b in g.beams] == expected and all(len(ids) == 2 for ids in expected)
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.generated_ids == expected[0] and STUB_EOS not in g.generated_ids
    assert max(scores) < math.log(0.2)  # so a finished [end-of-text] would have won: the case is live


def bigram_table_of(rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """(V, V) bigram logits: log p for the probabilities given after each token, the rest of the mass
    (if any) spread evenly over the other tokens."""
    table = torch.full((STUB_V, STUB_V), -30.0)
    for r, probs in rows.items():
        others = [i for i in range(STUB_V) if i not in probs]
        rest = 1 - sum(probs.values())
        if rest > 1e-9:
            table[r, others] = math.log(rest / len(others))
        for i, p in probs.items():
            table[r, i] = math.log(p)
    return table


def up_to_end_of_text(ids: list[int]) -> list[int]:
    """transformers pads a beam that finished early with the pad token (end-of-text here)."""
    return ids[:ids.index(STUB_EOS) + 1] if STUB_EOS in ids else ids


A, A2, B, C = 4, 7, 5, 6
# After the prompt: end-of-text .5, A .45; after A: A2 .55, end-of-text .44; after A2: end-of-text .9.
RUNNER_UP_TABLE = {STUB_PROMPT: {STUB_EOS: .5, A: .45, B: .03, C: .02}, A: {A2: .55, STUB_EOS: .44}, A2: {STUB_EOS: .9}}


def test_beam_search_runs_on_while_its_best_running_beam_can_still_win():
    """After 2 steps, [end-of-text] (log .5) and [A, end-of-text] have finished; the best running beam
    [A, A2] scores above the worse of them per token, the 2nd running beam far below. transformers runs
    on, and [A, A2, end-of-text] wins. Mutant: judging by the 2nd running beam stops at 2 steps."""
    table = bigram_table_of(RUNNER_UP_TABLE)
    expected, scores = transformers_bigram_beams(table, beams=2, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=3))
    assert [b.ids for b in g.beams] == [up_to_end_of_text(ids) for ids in expected] == [[A, A2, STUB_EOS], [STUB_EOS]]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.generated_ids == [A, A2, STUB_EOS] and g.stop == "eos"
    assert [b.text for b in g.beams] == [f"<{A}><{A2}>", ""]  # a beam's text leaves out its end-of-text


def test_beam_search_stops_as_its_best_beam_did():
    """One step: the best beam is [end-of-text] (stop "eos"), the 2nd [A] ran out of tokens. The
    generation's stop is the best beam's. Mutant: the 2nd beam's."""
    table = bigram_table_of(RUNNER_UP_TABLE)
    expected, scores = transformers_bigram_beams(table, beams=2, new=1)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=1))
    assert [b.ids for b in g.beams] == expected == [[STUB_EOS], [A]]
    assert [b.stop for b in g.beams] == ["eos", "max_new_tokens"] and g.stop == "eos"
    assert [b.text for b in g.beams] == ["", f"<{A}>"]  # only a beam that ended on end-of-text drops it
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)


def test_finished_beams_with_equal_scores_keep_transformers_order():
    """Two tokens of exactly equal probability finish together. Mutant: sorting the (score, beam)
    pairs without a key compares the beams themselves at the tie (a TypeError)."""
    table = bigram_table_of({STUB_PROMPT: {0: .4, 1: .4}})
    expected, scores = transformers_bigram_beams(table, beams=2, new=1)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=1))
    assert [b.ids for b in g.beams] == expected and scores[0] == scores[1]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)


def test_as_many_beams_as_tokens_never_continue_a_finished_one():
    """16 beams over 16 tokens: at the first step every token is a candidate, so the finished
    [end-of-text] is among the beams that run on, its score sunk by transformers' -1e9. Mutant: raised
    by 1e9, its continuations take every beam."""
    table = bigram_table()
    expected, scores = transformers_bigram_beams(table, beams=16, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=16, max_new_tokens=3))
    # the table's rows 0 and 1 tie (one is the other rolled), so beams of equal score may come in either order
    assert sorted(b.ids for b in g.beams) == sorted(up_to_end_of_text(ids) for ids in expected)
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.beams[0].ids == [STUB_EOS] and all(STUB_EOS not in b.ids for b in g.beams[1:])


X, Y, Z = 0, 1, 2


def exact_table(rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """(V, V) bigram logits: the given ones, -1000 elsewhere (exp(-1000) is 0 in float32, so a row of
    k zeros gives each of them log p = -log k exactly, the same bits in every row)."""
    table = torch.full((STUB_V, STUB_V), -1000.0)
    for r, logits in rows.items():
        for i, z in logits.items():
            table[r, i] = z
    return table


def test_beam_search_stops_when_its_best_running_beam_only_ties_the_worst_finished():
    """After 2 steps: [end-of-text] and [X, end-of-text] have finished; the best running beam [Y, Z] has
    exactly [X, end-of-text]'s score (X and Y tie, each continues with p = 1), so it cannot beat it: the
    search stops, as transformers' does (worst finished >= best attainable). Mutant: `<` for `<=` runs
    on, and [Y, Z, end-of-text], scored over 3 tokens, wins."""
    table = exact_table({STUB_PROMPT: {STUB_EOS: 1.0, X: 0.0, Y: 0.0}, X: {STUB_EOS: 0.0}, Y: {Z: 0.0},
                         Z: {STUB_EOS: 0.0}})
    expected, scores = transformers_bigram_beams(table, beams=2, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=3))
    assert [b.ids for b in g.beams] == [up_to_end_of_text(ids) for ids in expected] == [[STUB_EOS], [X, STUB_EOS]]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)


def test_beam_search_judges_the_best_running_beam_against_the_worst_finished_of_three():
    """3 beams. After 2 steps the finished are [end-of-text], [B, end-of-text] and [C, end-of-text]; the
    best running beam [A, A2] scores per token between the 2nd and the 3rd of them, so it can still win,
    and [A, A2, end-of-text] does. Mutant: judging it against the 2nd finished (`finished[1]`) stops."""
    B_, C_ = 5, 6
    table = bigram_table_of({STUB_PROMPT: {STUB_EOS: .5, A: .2, B_: .15, C_: .1}, A: {A2: .64, STUB_EOS: .35},
                             B_: {STUB_EOS: .9}, C_: {STUB_EOS: .9}, A2: {STUB_EOS: .95}})
    expected, scores = transformers_bigram_beams(table, beams=3, new=3)
    g = generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=3, max_new_tokens=3))
    assert [b.ids for b in g.beams] == [up_to_end_of_text(ids) for ids in expected]
    assert [b.score for b in g.beams] == pytest.approx(scores, abs=1e-6)
    assert g.beams[1].ids == [A, A2, STUB_EOS]  # the case is live: the beam that ran on is among them


def test_each_beam_step_shows_its_own_alternatives_and_the_raw_figures_before_the_temperature():
    """Beam search with a temperature and --show-steps: each step's log p is its beam's processed one
    (the table's row / T), its raw log p the table row's own, and its alternatives the best 3 of the
    processed row. Mutants: no alternatives passed on (`None` for show_steps); the raw figures taken
    from the processed ones (the stage flag lost)."""
    table = bigram_table_of(RUNNER_UP_TABLE)
    temperature = 0.5
    g = generate(bigram_loaded(table), [STUB_PROMPT],
                 make_settings(beams=2, max_new_tokens=3, show_steps=3, temperature=temperature))
    prev, moved = STUB_PROMPT, []
    for step in g.steps:
        raw = torch.log_softmax(table[prev].double(), -1)
        processed = torch.log_softmax(table[prev].double() / temperature, -1)
        assert step.raw_logprob == pytest.approx(float(raw[step.id]), abs=1e-5)
        assert step.logprob == pytest.approx(float(processed[step.id]), abs=1e-5)
        moved.append(abs(step.raw_logprob - step.logprob))
        best = torch.topk(processed, 3)
        assert [c.id for c in step.alternatives] == best.indices.tolist()
        assert [c.prob for c in step.alternatives] == pytest.approx(best.values.exp().tolist(), abs=1e-6)
        prev = step.id
    assert max(moved) > 0.1  # the temperature shows


def test_beam_search_on_non_finite_logits_says_so():
    """A NaN logit: beam search raises NonFiniteLogits with the count, as greedy does. Mutant: the
    logits not passed to the step, which then fails on None."""
    from lmhead_cli.errors import NonFiniteLogits

    table = bigram_table()
    table[STUB_PROMPT, 3] = float("nan")
    with pytest.raises(NonFiniteLogits, match="1 non-finite"):
        generate(bigram_loaded(table), [STUB_PROMPT], make_settings(beams=2, max_new_tokens=2))


def test_the_streamed_pieces_are_the_text_without_end_of_text_and_end_with_a_cut_character():
    """on_text sees each piece that became printable, never an empty one and never end-of-text; an
    answer cut inside a character (max_new_tokens) ends with U+FFFD, streamed last. The timings are
    within the call's own wall time. Mutants: end-of-text streamed as text, the last piece dropped,
    sent empty or as None, or sent when nobody listens; the elapsed time counted from 0."""
    import time

    CUT, A_ = 3, 4  # CUT: the first 2 of the 3 bytes of "€"; A_: "a"
    pieces = {CUT: b"\xe2\x82", A_: b"a", STUB_EOS: b"<|endoftext|>"}
    loaded = bigram_loaded(exact_table({STUB_PROMPT: {CUT: 0.0, A_: 1.0}, A_: {STUB_EOS: 0.0}, CUT: {A_: 0.0}}))
    loaded.tokenizer.token_bytes = lambda i: pieces.get(i, b"?")
    for new, want_ids, want in ((2, [A_, STUB_EOS], ["a"]), (1, [A_], ["a"])):
        got = []
        start = time.perf_counter()
        g = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=new), on_text=got.append)
        wall = time.perf_counter() - start
        assert g.generated_ids == want_ids and got == want and g.text == "a"
        assert 0 < g.first_token_s <= g.elapsed_s <= wall
    loaded.engine.table = exact_table({STUB_PROMPT: {CUT: 0.0}, CUT: {A_: 0.0}})
    got = []
    g = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=1), on_text=got.append)
    assert g.generated_ids == [CUT] and got == ["\ufffd"] and g.text == "\ufffd"
    assert generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=1)).text == "\ufffd"


def test_a_finished_beam_adds_up_up_to_its_tolerance_inclusive():
    """FinishedBeam.adds_up allows float32 rounding: |Σ transition scores − log p| up to 1e-6 per token of
    the total's size, the bound itself included (mutant: `<`)."""
    from lmhead_cli.decoding.generate import FinishedBeam

    def beam(logprob: float) -> FinishedBeam:  # two tokens of log p 0 each, said to add up to `logprob`
        return FinishedBeam(ids=[1, 2], text="", transition_scores=[0.0, 0.0], logprob=logprob, score=logprob / 2,
                            stop="eos")

    bound = 1e-6 * 1.0 * 2  # |log p| below 1 counts as 1; 2 tokens
    assert beam(-bound).sum_error == bound and beam(-bound).adds_up
    assert not beam(-math.nextafter(bound, 1.0)).adds_up


# ---- diff: the two KL directions ----------------------------------------------------------------

@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    """(folder, transformers model) of loud_checkpoint: peaked distributions, MLPs in gelu's curved range."""
    folder = tmp_path_factory.mktemp("loud")
    return folder, loud_checkpoint(folder)


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


# ---- the lean engine: gelu_new, not exact gelu ----------------------------------------------------

def test_lean_engine_matches_transformers_where_gelu_new_and_gelu_differ(loud):
    """On loud_checkpoint, transformers' logits under exact gelu differ from its gelu_new ones by more than
    10 × the parity tolerance; the lean engine matches gelu_new within it, for the whole prompt and for
    one-position cached steps (the blocked products). Mutant: F.gelu without approximate="tanh"."""
    from transformers import GPT2LMHeadModel

    folder, model = loud
    ids = torch.tensor([list(range(100, 2000, 97))])  # (1, 20)
    exact = GPT2LMHeadModel.from_pretrained(folder, activation_function="gelu").eval()
    with torch.no_grad():
        expected = model(ids).logits[0]  # (20, V) gelu_new, GPT-2's activation
        gap = float((exact(ids).logits[0] - expected).abs().max())
    atol = 1e-4
    assert gap > 10 * atol
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean").engine
    torch.testing.assert_close(eng.head(eng.body(ids))[0], expected, atol=atol, rtol=0)
    cache = eng.new_cache(1, ids.shape[1])
    eng.body(ids[:, :-3], cache)
    for t in range(ids.shape[1] - 3, ids.shape[1]):  # the last three positions one at a time
        step = eng.head(eng.body(ids[:, t:t + 1], cache))[0, 0]
        torch.testing.assert_close(step, expected[t], atol=atol, rtol=0)


class DeviceCheckingEngine(BigramEngine):
    """A bigram engine that refuses ids and cache rows on any device but its own."""

    def __init__(self, table):
        super().__init__(table)
        self.seen = []

    def _check(self, t):
        self.seen.append(t.device)
        assert t.device == self.device, f"handed a tensor on {t.device}, the engine is on {self.device}"

    def reorder_cache(self, cache, rows):
        self._check(rows)
        return cache

    def last_logits(self, ids, cache=None):
        self._check(ids)
        return super().last_logits(ids, cache)


@pytest.mark.parametrize("settings", [dict(greedy=True, max_new_tokens=3), dict(beams=2, max_new_tokens=3)],
                         ids=["one sequence", "beams"])
def test_generate_hands_the_engine_tensors_on_its_own_device(settings):
    """The prompt, each step's ids and the beams' cache rows are made on the engine's device, not on
    torch's default one: here the default is the meta device (as a GPU would differ from the CPU)."""
    loaded = bigram_loaded(bigram_table())
    loaded.engine = DeviceCheckingEngine(bigram_table())
    with torch.device("meta"):
        g = generate(loaded, [STUB_PROMPT], make_settings(**settings))
    assert g.generated_ids and set(loaded.engine.seen) == {torch.device("cpu")}
    if "beams" in settings:
        assert len(loaded.engine.seen) > 3  # the reorders were checked too


def test_an_end_of_text_id_given_to_generate_is_the_one_it_stops_at():
    """generate(eos_token_id=…) overrides the engine's own: greedy's first pick from the stub prompt is
    token 0, so asking to stop at 0 ends the answer there, while the engine's end-of-text would not."""
    loaded = bigram_loaded(bigram_table())
    own = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=4))
    assert own.generated_ids[0] == 0 and own.stop == "max_new_tokens"
    g = generate(loaded, [STUB_PROMPT], make_settings(greedy=True, max_new_tokens=4), eos_token_id=0)
    assert g.generated_ids == [0] and g.stop == "eos"


# ---- a fresh sample's first pass (seed 2027): what its survivors showed untested ----------------------

def test_a_left_padded_batch_through_body_gives_transformers_logits_at_the_real_positions(tiny):
    """body(ids, attention_mask=…) with left padding: each row's logits are transformers' with the same
    mask and positions, so no real position attends to a pad. Mutant: the body's blocks given no mask."""
    folder, reference = tiny
    eng = load_model(str(folder), device="cpu", dtype="float32", engine="lean").engine
    ids = torch.tensor([[50256, 50256, 464, 8251, 319], [464, 8251, 319, 262, 3084]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        got = eng.head(eng.body(ids, attention_mask=mask))
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)


def test_a_config_s_n_inner_sets_the_mlp_width(tmp_path):
    """n_inner given (96, not 4 · 64): the lean engine builds MLPs that wide and gives transformers'
    logits. Mutant: n_inner read under another key (the 4·d default, and the checkpoint then does not fit)."""
    reference = build_checkpoint(tmp_path, n_inner=96, seed=5)
    eng = load_model(str(tmp_path), device="cpu", dtype="float32", engine="lean").engine
    assert eng.gpt.h[0].mlp.c_fc.weight.shape == (64, 96)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT_IDS])).logits
    torch.testing.assert_close(eng.head(eng.body(torch.tensor([PROMPT_IDS]))), want, atol=1e-4, rtol=0)


def test_a_generation_of_no_steps_reports_zero_rates_and_entropy():
    """No steps (nothing generated) and no time: mean entropy and tokens/s are 0, not a made-up 1.
    Mutants: either fallback changed."""
    from lmhead_cli.decoding.generate import Generation

    g = Generation(mode="greedy", settings=make_settings(greedy=True), seed=None, prompt_ids=[1], generated_ids=[],
                   text="", steps=[], stop="max_new_tokens", elapsed_s=0.0, first_token_s=0.0)
    assert g.mean_entropy == 0.0 and g.tokens_per_second == 0.0 and g.decode_tokens_per_second == 0.0


def test_beam_search_top_logprobs_come_from_the_distribution_asked_for(tiny):
    """Beams with top_k = 2 and 4 top logprobs per step: raw ones are all finite (log softmax of the
    logits), processed ones -inf beyond the two the filter kept. Mutant: the beams' alternatives always
    taken from the processed distribution."""
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    for which in ("raw", "processed"):
        g = generate(loaded, PROMPT_IDS, make_settings(beams=2, max_new_tokens=3, top_k=2, top_logprobs=4,
                                                       logprobs=which))
        tops = [s.top.logprobs for s in g.steps]
        assert tops and all(t.shape == (4,) for t in tops)
        finite = [int(torch.isfinite(t).sum()) for t in tops]
        assert finite == ([4] * len(tops) if which == "raw" else [2] * len(tops)), (which, finite)


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
    base = SimpleNamespace(source="other", tokenizer=SimpleNamespace(encode_long=lambda text: longer))
    with pytest.raises(UsageError, match="into 5 tokens against 3, differing first at token 3;"):
        check_same_tokens(None, base, torch.tensor([5, 6, 7]), "text")


def test_the_attribution_check_is_relative_only_above_one():
    """_check_close allows rounding times max(1, |want|): for values below 1 the absolute tolerance itself.
    Mutant: max(2, |want|), twice as lenient there."""
    from lmhead_cli.errors import UnsupportedModel
    from lmhead_cli.readings.attribute import ROUNDING_ULPS, SUM_TOLERANCE, _check_close

    tolerance = max(SUM_TOLERANCE, ROUNDING_ULPS * torch.finfo(torch.float32).eps)
    want = torch.full((4,), 0.5)
    _check_close(want + 0.9 * tolerance, want, torch.float32, "the parts' sum")
    with pytest.raises(UnsupportedModel, match="off by"):
        _check_close(want + 1.5 * tolerance, want, torch.float32, "the parts' sum")


def test_score_progress_counts_every_scored_token_once_up_to_the_total(tmp_path):
    """Two windows (a 24-position model, stride 12) and chunks of 5: progress(done, total) rises by each
    chunk's tokens and ends at total = the tokens scored. Mutants: done moved by hi + lo or down, total
    summed over window ends plus starts."""
    from lmhead_cli.readings.score import score_ids

    build_checkpoint(tmp_path, n_positions=24, seed=4)
    loaded = load_model(str(tmp_path), device="cpu")
    ids = torch.arange(100, 140)
    seen = []
    cols = score_ids(loaded, ids, stride=12, chunk=5, progress=lambda done, total: seen.append((done, total)))
    scored = int(torch.isfinite(cols["logprob"]).sum())
    assert cols["windows"] > 1 and scored == len(ids) - 1
    assert {t for _, t in seen} == {scored} and seen[-1][0] == scored
    steps = [b - a for (a, _), (b, _) in zip([(0, 0)] + seen, seen)]
    assert all(0 < s <= 5 for s in steps)


def test_f32_rounds_to_float32_whatever_torch_s_default_dtype():
    """A notebook may set torch's default dtype to float64; generate's scores still round as float32 does.
    Mutant: torch.tensor(v) in the default dtype."""
    import numpy as np

    from lmhead_cli.decoding.generate import _f32

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _f32(0.1) == float(np.float32(0.1)) != 0.1
    finally:
        torch.set_default_dtype(before)


def test_a_damaged_bundled_preset_file_is_named_in_its_error(tmp_path, monkeypatch):
    """An installed package whose presets file is not TOML: the one-line error names that file.
    Mutant: the error names None."""
    from lmhead_cli.decoding import presets
    from lmhead_cli.errors import UsageError

    broken = tmp_path / "presets.toml"
    broken.write_text("[greedy\n", encoding="utf-8")
    monkeypatch.setattr(presets, "_bundled_file", lambda: broken)
    with pytest.raises(UsageError, match=f"^{broken} is not valid TOML"):
        presets.bundled()


def test_more_positions_than_a_few_never_take_the_few_row_products(tiny, monkeypatch):
    """The head over many positions is one GEMM (F.linear), not the few-row forms. Mutant: the few-row
    path taken whenever the engine has forms."""
    from lmhead_cli.engine import lean
    from lmhead_cli.engine.products import BLOCKED_MAX_ROWS

    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    assert eng.forms
    taken = []
    plain = lean.few_rows_product
    monkeypatch.setattr(lean, "few_rows_product", lambda *a: taken.append(a[1].shape[0]) or plain(*a))
    h = eng.body(torch.tensor([PROMPT_IDS[:BLOCKED_MAX_ROWS + 1]]))
    taken.clear()
    eng.head(h)
    assert taken == []
    eng.head(h[:, -1:])
    assert taken == [1]


def test_int8_head_rows_are_made_on_the_engine_s_device(tiny):
    """head_rows on an int8 engine indexes its table with ids on the engine's device, whatever torch's
    default device (here meta, as a GPU would differ from the CPU). Mutant: ids on the default device."""
    loaded = load_model(str(tiny[0]), device="cpu", dtype="int8")
    want = loaded.engine.head_rows([5, 7])
    with torch.device("meta"):
        got = loaded.engine.head_rows([5, 7])
    assert got.device.type == "cpu" and torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_lean_engine_names_how_its_weights_are_stored(tiny, dtype):
    """weight_format is the stored format: float32, bfloat16 or int8. Mutant: always "int8"."""
    assert load_model(str(tiny[0]), device="cpu", dtype=dtype, engine="lean").engine.weight_format == dtype


def test_the_kv_cache_keeps_the_attention_dtype_whatever_torch_s_default(tiny):
    """A notebook may set torch's default dtype to float64; the cache is still made in the dtype
    attention runs in (float32 here). Mutant: the cache in torch's default dtype."""
    eng = load_model(str(tiny[0]), device="cpu", engine="lean").engine
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cache = eng.new_cache(1, 8)
    finally:
        torch.set_default_dtype(before)
    assert cache.k.dtype == cache.v.dtype == torch.float32 == eng.attention_dtype
