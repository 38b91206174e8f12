"""`lmhead score`: every token's figures against transformers' own forward and log_softmax, the window
procedure recomputed independently with transformers, chunked = unchunked, bits per byte from the
token bytes, the renderings (colour, marks, table, JSON, --file), and bad input."""

from __future__ import annotations

import io
import json
import math
import random
import re

import pytest
import torch
from helpers import ELSEWHERE, PROMPT, assert_rank, build_checkpoint, cli, elsewhere, loaded_elsewhere, nan_checkpoint
from rich.console import Console

from lmhead_cli.errors import UsageError
from lmhead_cli.loading.sources import load_model
from lmhead_cli.readings import ranks
from lmhead_cli.readings.score import Corpus, Line, score_lines, score_text, windows
from lmhead_cli.render.score import MARKS, UNSCORED_MARK, Progress

TEXT = "The keys on the table are on the table. The keys on the table are here, and the dog is asleep."
WORDS = ("the keys on table are here and dog is asleep a cat sat mat of house by window door it was "
         "not so much that he ran but she said , . yes no").split()
ATOL = 1e-4


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def oracle(model, ids: list[int]) -> torch.Tensor:
    """transformers' own forward and log_softmax: (T, V) float32 log-probabilities."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches_oracle(score, lp: torch.Tensor, first: int) -> None:
    """Token i of the text is predicted by row i - 1 + first of the oracle's (T, V) log-probabilities
    (first = 1 with a BOS before the text). Unscored tokens are the ones before `first`'s offset."""
    for t in score.tokens():
        row = t.index - 1 + first
        if row < 0:
            assert not t.scored and t.logprob is None and t.rank is None and t.top_token is None
            continue
        ref = lp[row]
        assert t.scored
        assert t.logprob == pytest.approx(float(ref[t.id]), abs=ATOL)
        assert t.prob == pytest.approx(math.exp(float(ref[t.id])), abs=ATOL)
        assert t.surprisal_bits == pytest.approx(-float(ref[t.id]) / math.log(2), abs=ATOL)
        assert t.entropy == pytest.approx(float(-(ref.exp() * ref).sum()), abs=ATOL)
        h, two = -(ref.double().exp() * ref.double()).sum(), ref.double().topk(2).values
        assert t.varentropy == pytest.approx(float((ref.double().exp() * (ref.double() + h) ** 2).sum()), abs=ATOL)
        assert t.margin == pytest.approx(float(two[0] - two[1]), abs=ATOL)
        assert_rank(t.rank, ref, t.id)
        assert t.top_id == int(ref.argmax()) and t.top_prob == pytest.approx(float(ref.max().exp()), abs=ATOL)


# ---- transformers is the oracle -----------------------------------------------------------------

@pytest.mark.parametrize("engine", ["lean", "transformers"])
@pytest.mark.parametrize("bos", [False, True])
def test_every_token_matches_transformers_tiny(tiny, engine, bos):
    folder, model = tiny
    loaded = load_model(str(folder), device="cpu", engine=engine)
    score = score_text(loaded, TEXT, bos=bos, chunk=7)  # several chunks, the last one short
    ids = loaded.tokenizer.encode(TEXT)
    assert score.ids.tolist() == ids
    lp = oracle(model, [50256] + ids if bos else ids)
    assert_matches_oracle(score, lp, first=1 if bos else 0)
    assert score.scored_tokens == len(ids) - (not bos)
    assert score.nll == pytest.approx(-sum(float(lp[t.index - 1 + bos, t.id]) for t in score.tokens() if t.scored),
                                      abs=1e-3)
    assert score.perplexity == pytest.approx(math.exp(score.nll / score.scored_tokens), rel=1e-9)


def test_every_token_matches_transformers_full_size():
    """GPT-2 small's shapes (12 layers, D 768, V 50,257), seeded random weights, on the transformers
    engine: our windows and chunks against the same GPT2LMHeadModel's own forward and log_softmax.
    (The lean engine against transformers on the same weights: the tiny cases above and test_engine_parity.)"""
    hf = load_model("random:gpt2", device="cpu", engine="transformers")
    text = PROMPT + " are on the shelf, and the dog is asleep by the door."
    ids = hf.tokenizer.encode(text)
    for bos in (False, True):
        score = score_text(hf, text, bos=bos, chunk=10)
        assert_matches_oracle(score, oracle(hf.engine.model, [50256] + ids if bos else ids), first=int(bos))


def reference_windows(model, ids: list[int], n_ctx: int, stride: int) -> dict[int, float]:
    """The window procedure as the issue words it, on transformers' own forward: windows begin at
    0, S, 2S, … and cover [begin, min(begin + n_ctx, T)); each scores the tokens after the previous
    window's end (the first from token 1) that have a token of their window before them."""
    T, out, prev_end, begin = len(ids), {}, 1, 0
    while True:
        end = min(begin + n_ctx, T)
        lp = oracle(model, ids[begin:end])  # (end - begin, V)
        for t in range(max(prev_end, begin + 1), end):
            assert t not in out
            out[t] = float(lp[t - 1 - begin, ids[t]])
        if end == T:
            return out
        prev_end, begin = end, begin + stride


@pytest.fixture(scope="module")
def long_text(tiny):
    """About 2,500 tokens: longer than two contexts of 1,024."""
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    text = words(2500, seed=1)
    n = len(loaded.tokenizer.encode(text))
    assert 2400 <= n <= 2600
    return loaded, text


@pytest.mark.parametrize("stride", [512, 1024])
@pytest.mark.slow
def test_windows_match_the_procedure_on_transformers(tiny, long_text, stride, monkeypatch):
    loaded, text = long_text
    eng, rows, lengths = loaded.engine, [], []
    head, body = eng.head, eng.body
    monkeypatch.setattr(eng, "head", lambda h: rows.append(h.shape[0]) or head(h))
    monkeypatch.setattr(eng, "body", lambda ids, *a, **k: lengths.append(ids.shape[1]) or body(ids, *a, **k))
    score = score_text(loaded, text, stride=stride, chunk=200)
    # The head never sees more than a chunk, nor the body more than a window.
    assert max(rows) == 200 and sum(rows) == score.scored_tokens
    assert max(lengths) == 1024 and len(lengths) == score.windows
    ids = score.ids.tolist()
    ref = reference_windows(tiny[1], ids, 1024, stride)
    scored = {t.index: t.logprob for t in score.tokens() if t.scored}
    assert scored.keys() == ref.keys()
    for i, lp in ref.items():
        assert scored[i] == pytest.approx(lp, abs=ATOL)
    nll = -sum(ref.values())
    assert score.nll == pytest.approx(nll, rel=1e-6)
    assert score.perplexity == pytest.approx(math.exp(nll / len(ref)), rel=1e-6)
    assert score.windows == len(list(windows(len(ids), 1024, stride)))
    if stride == 512:  # overlapping windows: every token after the first is scored exactly once
        assert len(ref) == len(ids) - 1
    else:  # no overlap: each later window's first token has nothing of its window before it
        assert len(ref) == len(ids) - 1 - (score.windows - 1)


@pytest.mark.parametrize("T,n_ctx,stride", [(2500, 1024, 512), (2500, 1024, 1024), (2500, 1024, 1), (5, 1024, 512),
                                            (1024, 1024, 512), (1025, 1024, 300)])
def test_window_plan(T, n_ctx, stride):
    plan = list(windows(T, n_ctx, stride))
    scored = [t for w in plan for t in range(w.first, w.end)]
    assert len(scored) == len(set(scored)) and plan[-1].end == T and plan[0].first == 1
    assert all(w.end - w.begin <= n_ctx and w.begin % stride == 0 and w.first > w.begin for w in plan)
    if stride < n_ctx:
        assert scored == list(range(1, T))
        assert all(w.first - w.begin >= n_ctx - stride for w in plan[1:])  # the context a later window keeps


@pytest.mark.parametrize("T,n_ctx,stride", [(2500, 1024, 512), (1025, 1024, 300), (5, 1024, 512)])
def test_window_predictors_are_the_positions_before_the_scored_tokens(T, n_ctx, stride):
    """Position p predicts token p + 1: tokens [first, end) are predicted by [first - 1, end - 1), from begin."""
    for w in windows(T, n_ctx, stride):
        assert range(w.end - w.begin)[w.predictors] == range(w.first - 1 - w.begin, w.end - 1 - w.begin)


def test_chunked_and_unchunked_heads_agree(tiny):
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    text = words(150, seed=1)
    whole = score_text(loaded, text, chunk=100_000)  # the whole window's logits at once
    for chunk in (1, 5, 64, 166):
        other = score_text(loaded, text, chunk=chunk)
        assert other.chunk == chunk
        assert torch.equal(other.rank, whole.rank) and torch.equal(other.top_id, whole.top_id)
        for name in ("logprob", "entropy", "top_logprob"):
            a, b = getattr(other, name), getattr(whole, name)
            if chunk >= 64:  # the same BLAS kernel as the whole window: bit for bit
                assert torch.equal(a.nan_to_num(), b.nan_to_num())
            else:  # a handful of rows take other kernels (and the lean engine's blocked product)
                torch.testing.assert_close(a, b, atol=1e-5, rtol=2e-6, equal_nan=True)


def test_bits_per_byte_from_the_token_bytes(tiny):
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")
    text = "Naïve café, 日本語 and <b>tags</b>: 3.14!"
    plain = score_text(loaded, text)
    first = len(loaded.tokenizer.token_bytes(int(plain.ids[0])))
    assert plain.bytes == len(text.encode("utf-8")) - first  # the unscored first token's bytes are left out
    assert plain.bits_per_byte == pytest.approx(plain.nll / math.log(2) / plain.bytes, rel=1e-12)
    with_bos = score_text(loaded, text, bos=True)
    assert with_bos.bytes == len(text.encode("utf-8"))


def test_real_gpt2_perplexity_is_sane(real_gpt2):
    loaded = load_model(str(real_gpt2), device="cpu", engine="lean")
    passage = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks "
               "were striking thirteen. The history of the world is the history of a few people who had faith "
               "in themselves.")
    score = score_text(loaded, passage, bos=True)
    assert 5 < score.perplexity < 150
    assert score.bucket_counts()[0] > score.scored_tokens / 5  # real weights often rank the next token first


# ---- the long-text machinery --------------------------------------------------------------------

def test_long_texts_are_encoded_in_pieces_with_the_same_ids(tiny, monkeypatch):
    tok = load_model(str(tiny[0]), device="cpu", engine="lean").tokenizer
    text = words(3000, seed=2) + "  \n\n x <|endoftext|> 日本語\ty  " + words(500, seed=3)
    whole = tok.encode(text)
    seen = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda t: seen.append(len(t)) or encode(t))
    assert list(tok.encode_long(text, piece_chars=300)) == whole
    assert len(seen) > 10 and max(seen) < 400


def test_file_lines_are_scored_lazily(tiny):
    loaded = load_model(str(tiny[0]), device="cpu", engine="lean")

    def lines():
        yield Line(1, "The keys on the table")
        raise AssertionError("read past the first line before it was used")

    items = score_lines(loaded, lines(), Corpus())
    first = next(items)
    assert first.line == 1 and first.score.scored_tokens == 4


def test_progress_appears_only_after_a_second_and_only_on_a_terminal():
    now = [0.0]
    shown = Progress("scoring", clock=lambda: now[0], console=Console(file=io.StringIO(), force_terminal=True))
    shown(10, 100)
    assert not shown.shown
    now[0] = 1.5
    shown(20, 100)
    assert shown.shown
    shown.close()
    piped = Progress("scoring", clock=lambda: now[0], console=Console(file=io.StringIO(), force_terminal=False))
    now[0] = 5.0
    piped(20, 100)
    assert not piped.shown


# ---- the command ---------------------------------------------------------------------------------

def score_json(folder, *args: str, **kwargs) -> dict:
    got = cli("score", *args, "--model", str(folder), "--json", **kwargs)
    assert got.exit_code == 0, got.output
    return json.loads(got.stdout)


def test_json_has_exactly_the_documented_fields(tiny):
    doc = score_json(tiny[0], TEXT, "--chunk", "9", "--stride", "300")
    assert list(doc) == ["model", "random_weights", "text", "bos", "window", "stride", "chunk", "tokens",
                         "scored_tokens", "nll", "mean_nll", "perplexity", "bytes", "bits_per_byte"]
    assert (doc["text"], doc["bos"], doc["window"], doc["stride"], doc["chunk"]) == (TEXT, False, 1024, 300, 9)
    fields = ["index", "id", "token", "scored", "logprob", "prob", "rank", "entropy", "varentropy", "margin",
              "surprisal_bits", "top_id", "top_token", "top_prob"]
    assert all(list(t) == fields for t in doc["tokens"])
    first, rest = doc["tokens"][0], doc["tokens"][1:]
    assert first["scored"] is False and all(first[k] is None for k in fields[4:])
    assert all(t["scored"] for t in rest) and doc["scored_tokens"] == len(rest)
    assert "".join(t["token"] for t in doc["tokens"]) == TEXT
    assert doc["nll"] == pytest.approx(-sum(t["logprob"] for t in rest), rel=1e-9)
    assert doc["mean_nll"] == pytest.approx(doc["nll"] / len(rest), rel=1e-12)
    assert doc["perplexity"] == pytest.approx(math.exp(doc["mean_nll"]), rel=1e-12)
    assert doc["bits_per_byte"] == pytest.approx(doc["nll"] / math.log(2) / doc["bytes"], rel=1e-12)
    with_bos = score_json(tiny[0], TEXT, "--bos")
    assert with_bos["bos"] is True and all(t["scored"] for t in with_bos["tokens"])


def test_stdin_text_and_the_same_figures(tiny):
    doc = score_json(tiny[0], "-", input=TEXT + "\n")
    assert doc["text"] == TEXT  # the one line break a shell adds is not part of the text
    assert doc == score_json(tiny[0], TEXT)


def test_marks_without_colour_rebuild_the_text(tiny, monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")
    text = "The keys on the table\nare here."
    got = cli("score", text, "--model", str(tiny[0]))
    assert got.exit_code == 0
    shown = got.stdout.split("rank buckets:")[0].rstrip("\n")
    doc = score_json(tiny[0], text)
    marks = [UNSCORED_MARK if not t["scored"] else MARKS[ranks.bucket(t["rank"])] for t in doc["tokens"]]
    expected = "".join(t["token"].rstrip("\n") + m + t["token"][len(t["token"].rstrip("\n")):]
                       for t, m in zip(doc["tokens"], marks))
    assert shown == expected
    assert "\x1b[" not in got.stdout
    counts = [sum(1 for t in doc["tokens"] if t["scored"] and ranks.bucket(t["rank"]) == b) for b in range(5)]
    legend = got.stdout.split("rank buckets:")[1]
    for (_, name), n in zip(ranks.BUCKETS, counts):
        assert re.search(rf"{name} {n}( \(|\s)", legend)


@pytest.mark.parametrize("no_color", [False, True])
def test_colour_on_a_terminal_and_marks_under_no_color(tiny, monkeypatch, no_color):
    monkeypatch.setenv("FORCE_COLOR", "1")
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    got = cli("score", TEXT, "--model", str(tiny[0]))
    assert got.exit_code == 0
    text_part = got.stdout.split("rank buckets:")[0]
    has_marks = any(m in text_part for m in (*MARKS, UNSCORED_MARK))
    assert has_marks == no_color
    assert ("\x1b[3" in text_part) != no_color  # a foreground colour code


def test_table_long_text_shows_first_and_last_rows(tiny, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    got = cli("score", words(200), "--model", str(tiny[0]), "--table")
    assert got.exit_code == 0
    lines = got.stdout.splitlines()
    first_col = [ln.split()[0] for ln in lines if ln.strip() and ln.split()[0].isdigit()]
    T = int(next(ln for ln in lines if ln.startswith("scored ")).split()[3].replace(",", ""))
    table_rows = first_col[: 2 * 10]
    assert table_rows == [str(i) for i in range(10)] + [str(i) for i in range(T - 10, T)]
    assert f"{T - 20:,} rows not shown" in got.stdout
    assert "surprisal" in got.stdout and "perplexity" in got.stdout and "most surprising" in got.stdout


def test_table_shows_varentropy_and_margin_beside_entropy_as_the_json_has_them(tiny, monkeypatch):
    """Each row's entropy, varentropy and margin columns are score --json's figures, rounded."""
    monkeypatch.setenv("COLUMNS", "200")
    got = cli("score", TEXT, "--model", str(tiny[0]), "--table")
    assert got.exit_code == 0
    lines = got.stdout.splitlines()
    header = next(ln.split() for ln in lines if ln.split()[:3] == ["#", "id", "token"])
    assert header[header.index("entropy"):header.index("entropy") + 3] == ["entropy", "varentropy", "margin"]
    at = header.index("entropy")
    doc = score_json(tiny[0], TEXT)
    rows = {int(ln.split()[0]): ln.split() for ln in lines[:lines.index(next(ln for ln in lines if ln.startswith(
        "logprob, entropy")))] if ln.split() and ln.split()[0].isdigit()}
    checked = 0
    for t in doc["tokens"]:
        if not t["scored"] or t["index"] not in rows:  # the middle rows of a long text are not shown
            continue
        cells = rows[t["index"]]
        assert cells[at:at + 3] == [f"{t['entropy']:.3f}", f"{t['varentropy']:.3f}", f"{t['margin']:.3f}"]
        checked += 1
    assert checked == len(rows) - 1 >= 18  # every shown row but the unscored first
    assert "varentropy (the variance of -log p) in nats²" in got.stdout


def test_hostile_text_is_shown_inert_and_kept_exact_in_json(tiny):
    text = "[bold red]x[/] \x1b[31mred\x07 done"
    got = cli("score", text, "--model", str(tiny[0]), "--table")
    assert got.exit_code == 0
    assert "\x1b" not in got.stdout and "\x07" not in got.stdout
    shown = got.stdout.split("\nrank buckets:")[0]
    for mark in (*MARKS, UNSCORED_MARK):
        shown = shown.replace(mark, "")
    assert shown == "[bold red]x[/] \\x1b[31mred\\x07 done"  # markup literal, control characters escaped
    assert score_json(tiny[0], text)["text"] == text


def test_file_streams_json_lines_and_a_corpus_summary(tiny, tmp_path):
    path = tmp_path / "texts.txt"
    lines = ["The keys on the table.", "", "   ", "Hello", "The dog is asleep by the door."]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    got = cli("score", "--file", str(path), "--model", str(tiny[0]), "--json")
    assert got.exit_code == 0, got.output
    docs = [json.loads(ln) for ln in got.stdout.splitlines()]
    assert [d["text"] for d in docs] == [lines[0], lines[4]]
    for d in docs:
        assert d == score_json(tiny[0], d["text"])  # each line is scored as its own text
    tokens, nll = sum(d["scored_tokens"] for d in docs), sum(d["nll"] for d in docs)
    assert "2 texts scored" in got.stderr and "2 empty lines" in got.stderr and "1 line of one token" in got.stderr
    assert f"corpus perplexity {math.exp(nll / tokens):,.4f}" in got.stderr
    human = cli("score", "--file", str(path), "--model", str(tiny[0]))
    assert human.exit_code == 0 and "skipped: empty" in human.stdout and "corpus perplexity" in human.stdout
    with_bos = cli("score", "--file", str(path), "--model", str(tiny[0]), "--json", "--bos")
    assert [json.loads(ln)["text"] for ln in with_bos.stdout.splitlines()] == [lines[0], lines[3], lines[4]]


@pytest.mark.parametrize("args,stdin,message", [
    (["score", ""], None, "empty"),
    (["score", "Hello"], None, "add --bos"),
    (["score", TEXT, "--stride", "0"], None, "--stride"),
    (["score", TEXT, "--stride", "1025"], None, "between 1 and the context of 1024"),
    (["score", TEXT, "--chunk", "0"], None, "--chunk"),
    (["score", "-"], b"caf\xe9 au lait", "not UTF-8"),
    (["score", "-"], b"", "empty"),
    (["score", "bad \udce9 bytes"], None, "the text is not UTF-8 text (byte 0xe9 at byte 4)"),
    (["score", TEXT, "--file", "x.txt"], None, "not both"),
    (["score", "--file", "/nonexistent/texts.txt"], None, "no such text file"),
    (["score", "--file", "-", "--table"], None, "--table"),
    (["score"], None, "give a text"),
])
def test_bad_input_exits_2_with_one_line(tiny, args, stdin, message):
    got = cli(*args, "--model", str(tiny[0]), input=stdin)
    assert got.exit_code == 2, got.output
    assert message in got.stderr and got.stderr.count("\n") == 1 and "Traceback" not in got.output


def test_a_file_line_that_is_not_utf8_names_the_line(tiny, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"The keys on the table\ncaf\xe9\n")
    got = cli("score", "--file", str(path), "--model", str(tiny[0]), "--json")
    assert got.exit_code == 2 and "line 2" in got.stderr


def test_stride_check_needs_no_model():
    with pytest.raises(UsageError, match="between 1 and the context of 1024"):
        list(windows(10, 1024, 2000))


def test_nan_weight_is_one_line_exit_1(tmp_path, tiny):
    got = cli("score", TEXT, "--model", str(nan_checkpoint(tiny[0], tmp_path)))
    assert got.exit_code == 1 and "non-finite logits" in got.stderr and "Traceback" not in got.output


# ---- the figures around the scores: defaults, totals, spans, profile --------------------------------

@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(str(tiny[0]), device="cpu", engine="lean")


def test_bos_id_takes_the_first_of_a_list():
    from types import SimpleNamespace

    from lmhead_cli.readings.score import bos_id

    engine, tok = SimpleNamespace(eos_token_id=50256), SimpleNamespace(bos_id=None)
    assert bos_id(SimpleNamespace(config={"bos_token_id": [7, 9]}, engine=engine, tokenizer=tok, source="m")) == 7
    assert bos_id(SimpleNamespace(config={"bos_token_id": 11}, engine=engine, tokenizer=tok, source="m")) == 11
    assert bos_id(SimpleNamespace(config={}, engine=engine, tokenizer=tok, source="m")) == 50256
    # the tokenizer's own BOS (tokenizer_config.json's bos_token, a GGUF's tokenizer.ggml.bos_token_id) first
    assert bos_id(SimpleNamespace(config={"bos_token_id": 11}, engine=engine, tokenizer=SimpleNamespace(bos_id=1),
                                  source="m")) == 1


def test_alternatives_up_to_the_limit_itself():
    from lmhead_cli.errors import BadValue
    from lmhead_cli.readings.score import MAX_ALTERNATIVES, check_alternatives

    check_alternatives(0)
    check_alternatives(MAX_ALTERNATIVES)
    with pytest.raises(BadValue) as e:
        check_alternatives(MAX_ALTERNATIVES + 1)
    assert e.value.problem == f"must be between 0 and {MAX_ALTERNATIVES} (got {MAX_ALTERNATIVES + 1})"


def test_a_text_that_is_not_utf8_is_named_the_text(loaded):
    with pytest.raises(UsageError) as e:
        score_text(loaded, "bad \udce9 bytes")
    assert str(e.value) == "the text is not UTF-8 text (byte 0xe9 at byte 4); pass text in UTF-8"


def test_default_chunk_holds_two_float32_buffers_in_32_mib(loaded):
    V = loaded.engine.vocab_size
    assert score_text(loaded, TEXT).chunk == (32 * 2**20) // (2 * V * 4)


def test_stdin_lines_that_are_not_utf8_name_stdin(tiny):
    got = cli("score", "--file", "-", "--model", str(tiny[0]), "--json", input=b"The keys on the table\ncaf\xe9\n")
    assert got.exit_code == 2
    assert got.stderr == "lmhead: error: stdin is not UTF-8 text (byte 0xe9 on line 2, at byte 25); save it as UTF-8\n"


def test_score_lines_items_and_corpus_totals(loaded):
    """Each line's item (its number, what was skipped, the bytes read so far, the chunk asked for) and the
    corpus totals, against the texts' own scores."""
    lines = [Line(1, "The keys on the table.", 23), Line(2, None, 24), Line(3, "Hello", 30),
             Line(4, "The dog is asleep by the door.", 61)]
    corpus = Corpus()
    items = list(score_lines(loaded, iter(lines), corpus, chunk=3))
    assert [(i.line, i.skipped, i.end) for i in items] == [(1, None, 23), (2, "empty", 24), (3, "one token", 30),
                                                            (4, None, 61)]
    scores = [items[0].score, items[3].score]
    assert items[1].score is None and items[2].score is None and all(s.chunk == 3 for s in scores)
    assert (corpus.texts, corpus.skipped_empty, corpus.skipped_short) == (2, 1, 1)
    assert corpus.tokens == sum(s.scored_tokens for s in scores) and corpus.bytes == sum(s.bytes for s in scores)
    assert corpus.nll == pytest.approx(sum(s.nll for s in scores), rel=1e-12)
    assert corpus.perplexity == pytest.approx(math.exp(corpus.nll / corpus.tokens), rel=1e-12)
    assert corpus.bits_per_byte == pytest.approx(corpus.nll / math.log(2) / corpus.bytes, rel=1e-12)


def test_score_of_a_model_on_another_device_gives_the_cpu_s_figures(loaded):
    """The model on a second device (emulated: tests/helpers.py), the text's ids on the CPU: each window
    and each chunk's ids go to the model's device (mutants: `.to(None)`, a GPU's device error), and the
    figures come back to the CPU's columns, the same as the model's on the CPU."""
    want = score_text(loaded, TEXT, chunk=7)
    with elsewhere():
        got = score_text(loaded_elsewhere(loaded), TEXT, chunk=7, alternatives=3)
    assert torch.equal(got.rank, want.rank) and torch.equal(got.top_id, want.top_id) and not got.logprob.is_meta
    for name in ("logprob", "entropy", "top_logprob"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=2e-6, rtol=2e-6, equal_nan=True)
    assert got.alt_ids.device.type == "cpu" and torch.equal(got.alt_ids[:, 0], got.top_id)


def test_the_emulated_device_fails_as_a_gpu_does_beside_the_cpu():
    """What the test above rests on: a tensor on the emulated device does not mix with a CPU tensor."""
    with elsewhere():
        z = torch.zeros(2, 5).to(ELSEWHERE)
        assert z.device == ELSEWHERE and torch.equal(z.gather(-1, torch.ones(2, 1, dtype=torch.long).to(z.device)).cpu(),
                                                     torch.zeros(2, 1))
        with pytest.raises(RuntimeError, match="same device"):
            z.gather(-1, torch.ones(2, 1, dtype=torch.long))
        with pytest.raises(RuntimeError, match="same device"):
            z + torch.ones(5)


def test_bucket_counts_and_most_surprising(loaded):
    from dataclasses import replace

    s = score_text(loaded, TEXT)
    ranks_ = [int(r) for r in s.rank[s.scored]]
    assert s.bucket_counts() == [sum(ranks.bucket(r) == b for r in ranks_) for b in range(len(ranks.BUCKETS))]
    # every bucket is listed, also the empty ones at the end
    few = replace(s, rank=torch.tensor([0, 1, 7, 1, 50]), scored=torch.tensor([False, True, True, True, True]))
    assert few.bucket_counts() == [2, 1, 1, 0, 0]
    lowest = sorted((t for t in s.tokens() if t.scored), key=lambda t: t.logprob)[:5]
    assert [t.index for t in s.most_surprising()] == [t.index for t in lowest]  # 5 by default
    # a model sure of every token (log p exactly 0): the unscored first token (NaN) is never among them
    sure = replace(s, logprob=torch.where(s.scored, 0.0, float("nan")))
    assert not bool(sure.scored[0]) and s.scored_tokens < len(s.ids)
    assert sorted(t.index for t in sure.most_surprising(len(s.ids))) == s.scored.nonzero()[:, 0].tolist()


def test_profile_is_the_mean_surprisal_of_each_run_of_tokens(loaded):
    s = score_text(loaded, TEXT)
    bits = [-t.logprob / math.log(2) for t in s.tokens() if t.scored]
    padded = False
    for width in (1, 5, 7, 10, len(bits), 1000):
        per = max(1, math.ceil(len(bits) / width))
        padded |= len(bits) % per != 0
        values, got_per = s.profile(width)
        assert got_per == per
        assert values == pytest.approx([sum(bits[i:i + per]) / len(bits[i:i + per]) for i in range(0, len(bits), per)],
                                       rel=1e-5)
    assert padded  # some width leaves a last run shorter than the others


def test_spans_join_the_bytes_of_a_character_cut_across_tokens(loaded):
    """A character whose bytes two tokens share is one piece, with the worse of their ranks."""
    text = "The café 日本 🎉 ok"
    s = score_text(loaded, text)
    pieces = [loaded.tokenizer.token_bytes(int(i)) for i in s.ids]
    assert b"\xe6\x9c" in pieces and b" \xf0\x9f" in pieces  # cut characters, one after a whole space
    expected, buf, worst = [], b"", []
    for i, b in enumerate(pieces):
        buf += b
        worst.append(int(s.rank[i]) if bool(s.scored[i]) else None)
        try:
            piece = buf.decode("utf-8")
        except UnicodeDecodeError:
            continue
        expected.append((piece, None if None in worst else max(worst)))
        buf, worst = b"", []
    assert list(s.spans()) == expected
    assert "".join(p for p, _ in expected) == text and len(expected) < len(pieces)


def test_score_columns_have_their_documented_dtypes(tiny):
    """Ranks and top ids are integers (JSON writes 3, not 3.0), log p and entropy float32; unscored
    positions hold rank 0 and top id -1."""
    score = score_text(load_model(str(tiny[0]), device="cpu"), TEXT, alternatives=2)
    assert score.rank.dtype == score.top_id.dtype == score.ids.dtype == torch.int64
    assert score.logprob.dtype == score.entropy.dtype == score.top_logprob.dtype == torch.float32
    assert int(score.rank[0]) == 0 and int(score.top_id[0]) == -1 and bool(score.rank[1:].ge(1).all())


def test_a_text_of_no_tokens_and_an_alternatives_count_out_of_range_are_refused(tiny):
    from lmhead_cli.errors import BadValue
    from lmhead_cli.readings.score import MAX_ALTERNATIVES, check_alternatives, text_ids

    with pytest.raises(UsageError) as e:
        text_ids(load_model(str(tiny[0]), device="cpu"), "", bos=True)
    assert str(e.value) == "the text encodes to no tokens"
    for k in (-1, MAX_ALTERNATIVES + 1):
        with pytest.raises(BadValue) as e:
            check_alternatives(k)
        assert str(e.value) == f"alternatives must be between 0 and {MAX_ALTERNATIVES} (got {k})"
    check_alternatives(MAX_ALTERNATIVES)


def test_file_lines_carry_the_bytes_read_so_far():
    """read_lines: each line's `end` is the file's byte offset after it (what --file's progress shows)."""
    from lmhead_cli.readings.score import read_lines

    data = "one two\n\ncafé au lait\nlast".encode()
    lines = list(read_lines(io.BytesIO(data), "f.txt"))
    assert [(li.number, li.text) for li in lines] == [(1, "one two"), (2, None), (3, "café au lait"), (4, "last")]
    assert [li.end for li in lines] == [8, 9, 23, len(data)]


def test_spans_show_bytes_that_are_no_character_escaped(tiny):
    """Ids that are not a UTF-8 text (here the lone byte 0xff, GPT-2's token 187) come out as the
    backslash escape of their bytes, not as an error."""
    import dataclasses

    score = score_text(load_model(str(tiny[0]), device="cpu"), TEXT)
    odd = dataclasses.replace(score, ids=torch.tensor([464, 187, 8251]), rank=torch.tensor([0, 5, 2]))
    assert list(odd.spans()) == [("The", None), ("\\xff", 5), (" keys", 2)]


def test_an_empty_corpus_has_no_perplexity():
    corpus = Corpus()
    assert corpus.tokens == 0 and corpus.mean_nll is None and corpus.perplexity is None


# ---- from the full mutation run of readings/score.py, ranks.py, chunks.py: each fails on its mutant ----

def test_rank_buckets_include_their_upper_edge():
    assert [ranks.bucket(r) for r in (1, 2, 10, 11, 100, 101, 1000, 1001)] == [0, 1, 1, 2, 2, 3, 3, 4]


def test_the_default_chunk_fits_the_budget_and_is_never_below_1():
    from lmhead_cli import chunks

    assert chunks.default_chunk(50257) == 83  # two (83, V) float32 buffers within 32 MiB
    assert chunks.default_chunk(10**9) == 1  # a vocabulary too large for two rows still gets one


def test_scoring_checks_name_the_option_and_stride_0_is_refused(tiny):
    from lmhead_cli.errors import BadValue
    from lmhead_cli.readings.score import check_chunk, check_stride, score_ids

    for call, key, message in ((lambda: check_chunk(0), "chunk", "must be at least 1 position (got 0)"),
                               (lambda: check_stride(0, 8), "stride", "must be between 1 and the context of 8 (got 0)"),
                               (lambda: score_ids(load_model(str(tiny[0]), device="cpu"), torch.tensor([464, 8251]),
                                                  chunk=0), "chunk", "must be at least 1 position (got 0)")):
        with pytest.raises(BadValue) as e:
            call()
        assert (e.value.key, e.value.problem) == (key, message)


def test_a_score_says_whether_its_weights_are_random_and_keeps_its_defaults(tiny):
    from lmhead_cli.readings.score import score_ids

    loaded = load_model(str(tiny[0]), device="cpu")
    tops = []
    s = score_text(loaded, PROMPT, on_rows=lambda ids, lp, top_ids, top_lp: tops.append(top_ids))
    assert s.random_weights is False and s.stride == loaded.engine.n_ctx // 2
    assert s.alt_ids is None and tops and all(t is None for t in tops)  # none asked for: none computed
    tops.clear()
    cols = score_ids(loaded, s.ids, on_rows=lambda ids, lp, top_ids, top_lp: tops.append(top_ids))
    assert cols.get("alt_ids") is None and tops and all(t is None for t in tops)


def test_a_model_without_a_beginning_of_text_token_says_so(tiny, monkeypatch):
    from lmhead_cli.readings.score import bos_id

    loaded = load_model(str(tiny[0]), device="cpu")
    monkeypatch.setattr(type(loaded.engine), "eos_token_id", property(lambda self: None))
    monkeypatch.setitem(loaded.config, "bos_token_id", None)
    with pytest.raises(UsageError) as e:
        bos_id(loaded)
    assert str(e.value) == f"{loaded.source} declares no beginning-of-text token to put before the text"


@pytest.mark.parametrize("n_positions", [1, 2])
def test_a_context_of_one_position_cannot_score_and_two_can(tmp_path, n_positions):
    from helpers import build_checkpoint

    from lmhead_cli.errors import UnsupportedModel

    build_checkpoint(tmp_path, n_positions=n_positions, n_layer=1)
    loaded = load_model(str(tmp_path), device="cpu")
    if n_positions == 2:
        assert score_text(loaded, PROMPT).scored_tokens == len(loaded.tokenizer.encode(PROMPT)) - 1
        return
    with pytest.raises(UnsupportedModel) as e:
        score_text(loaded, PROMPT)
    assert str(e.value) == ("the model's context of 1 token is too short to score: a token is predicted from the "
                            "tokens before it in its window, so the context must hold at least 2")


def test_lines_are_scored_with_the_stride_asked_and_short_lines_counted(tiny):
    loaded = load_model(str(tiny[0]), device="cpu")
    corpus = Corpus()
    lines = [Line(1, "Hello"), Line(2, words(40)), Line(3, "Hi")]
    items = list(score_lines(loaded, iter(lines), corpus, stride=7))
    assert [i.skipped for i in items] == ["one token", None, "one token"] and corpus.skipped_short == 2
    assert items[1].score.stride == 7


def test_score_text_reports_progress_and_an_empty_corpus_has_no_bits_per_byte(tiny):
    seen = []
    score_text(load_model(str(tiny[0]), device="cpu"), words(30), progress=lambda done, total: seen.append(done))
    assert seen  # the callback reached score_ids
    assert Corpus().bits_per_byte is None


def test_a_file_s_lines_are_named_by_the_file_in_errors(tmp_path):
    from lmhead_cli.readings.score import read_lines

    f = tmp_path / "lines.txt"
    f.write_bytes(b"fine\n\xff bad\n")
    with open(f, "rb") as stream, pytest.raises(UsageError) as e:
        list(read_lines(stream, str(f)))
    assert str(f) in str(e.value) and "stdin" not in str(e.value)


def _byte_token(tok, b: bytes) -> int:
    return next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b)


def test_a_character_split_across_tokens_is_one_span_and_a_cut_one_is_shown_as_bytes(tiny):
    """'é' is the bytes C3 A9: as two byte-level tokens it is one span; ending after C3 alone, the last
    span is the byte escaped, not dropped."""
    from lmhead_cli.readings.score import _score, score_ids

    loaded = load_model(str(tiny[0]), device="cpu")
    tok = loaded.tokenizer
    c3, a9, hello = _byte_token(tok, b"\xc3"), _byte_token(tok, b"\xa9"), tok.encode("Hello")[0]

    def spans(ids):
        ids = torch.tensor(ids)
        return [p for p, _ in _score(loaded, "", False, ids, score_ids(loaded, ids)).spans()]

    assert spans([hello, c3, a9]) == ["Hello", "é"]
    assert spans([hello, c3]) == ["Hello", "\\xc3"]
    assert spans([hello, c3, a9, hello]) == ["Hello", "é", "Hello"]


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
