"""`lmhead score`: how the model rates every token of a text the user already has.

For each token: the log-probability the model gave it from the tokens before it, its rank among
all V, how uncertain that prediction was (its entropy, its varentropy: the variance of the surprisal,
and its margin: the log-probability gap between its two best tokens) and the model's own top-1 there; for the text: the total and
mean negative log-likelihood, the perplexity and the bits per byte.

Two things keep the memory bounded by the options, whatever the length of the text:

* **Sliding windows.** A text longer than the context n_ctx is read in windows of n_ctx tokens that
  begin at 0, S, 2S, … (S = `stride`). A window scores the tokens after the previous window's end,
  each predicted from the tokens of its own window before it, so every token is scored once, with
  at least n_ctx − S tokens of context once the first window is past (transformers' guide
  "Perplexity of fixed-length models", summed per token rather than weighted per window).
* **The head in chunks.** The body runs once per window; its hidden states (L, D) then go through
  the head `chunk` positions at a time, and each chunk's (chunk, V) logits are reduced to seven
  figures per position and dropped. The full (T, V) logits never exist.

Shapes: T tokens, L positions in a window, D width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

import torch

from lmhead_cli.errors import BadValue, OneToken, UnsupportedModel, UsageError
from lmhead_cli import inputs
from lmhead_cli.readings.ranks import BUCKETS, ENTROPY_BUCKETS
from lmhead_cli.head import check_top_logprobs, nats_to_bits, ordered_sum, perplexity, score_rows
from lmhead_cli.readings.batch import STDIN
from lmhead_cli.readings.inspect import check_prompt
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.chunks import SCORE_BUFFERS
from lmhead_cli.chunks import default_chunk as _chunk

# Alternatives kept per position for the HTML view (12 bytes each a token: 20 → 240 bytes a token).
MAX_ALTERNATIVES = 20


# ---- the plan: windows and chunks --------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """Sequence positions [begin, end) go through the body; tokens [first, end) are scored."""

    begin: int
    end: int
    first: int

    @property
    def predictors(self) -> slice:
        """The window positions whose hidden states predict tokens [first, end): position p predicts
        token p + 1, so [first - 1, end - 1), counted from begin."""
        return slice(self.first - 1 - self.begin, self.end - 1 - self.begin)

    def chunks(self, chunk: int) -> Iterator[tuple[int, int]]:
        """The scored tokens [first, end) in pieces [lo, hi) of at most `chunk`; piece [lo, hi) is
        predicted by rows [lo - first, hi - first) of the predictors' hidden states."""
        for lo in range(self.first, self.end, chunk):
            yield lo, min(lo + chunk, self.end)


def windows(T: int, n_ctx: int, stride: int) -> Iterator[Window]:
    """The windows over a sequence of T tokens: begin = 0, S, 2S, …, each covering
    [begin, min(begin + n_ctx, T)) and scoring from the previous window's end (from 1 in the first).

    A token needs a token of its own window before it, so with stride = n_ctx (no overlap) a
    window's first token stays unscored, as token 0 does."""
    check_stride(stride, n_ctx)
    prev_end = 1
    for begin in range(0, T, stride):
        end = min(begin + n_ctx, T)
        yield Window(begin, end, max(prev_end, begin + 1))
        prev_end = end
        if end == T:
            return


def check_stride(stride: int, n_ctx: int) -> None:
    if not 0 < stride <= n_ctx:
        raise BadValue("stride", f"must be between 1 and the context of {n_ctx} (got {stride})")


def check_alternatives(k: int) -> None:
    if not 0 <= k <= MAX_ALTERNATIVES:
        raise BadValue("alternatives", f"must be between 0 and {MAX_ALTERNATIVES} (got {k})")


def check_chunk(chunk: int | None) -> None:
    if chunk is not None and chunk < 1:
        raise BadValue("chunk", f"must be at least 1 position (got {chunk})")


def default_chunk(vocab: int) -> int:
    """The most positions whose two (chunk, V) float32 buffers fit in CHUNK_BYTES (lmhead_cli/chunks.py)."""
    return _chunk(vocab, SCORE_BUFFERS)


# ---- the result ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScoredToken:
    """One token of the text, as `score --json` lists it. The figures are None when unscored."""

    index: int  # in the text's tokens (a --bos token is not counted)
    id: int
    token: str
    scored: bool
    logprob: float | None  # natural log of the probability the model gave this token
    prob: float | None
    rank: int | None  # 1 = the model's own top-1
    entropy: float | None  # nats, of the whole predicted distribution
    varentropy: float | None  # nats², the variance of -log p under that distribution
    margin: float | None  # nats, log p of its top-1 minus log p of its second (None: no second possible)
    surprisal_bits: float | None  # -log2 p
    top_id: int | None  # the model's own top-1 there
    top_token: str | None
    top_prob: float | None


@dataclass
class Score:
    """Every token of one text, as columns of T values (4 or 8 bytes a token, no (T, V) anywhere)."""

    model: str
    random_weights: bool
    text: str
    bos: bool  # an end-of-text token was put before the text, so its first token is scored too
    window: int  # tokens per window (the model's context)
    stride: int
    chunk: int  # positions per head chunk
    windows: int  # how many windows ran
    ids: torch.Tensor  # (T,) int64, the text's tokens
    scored: torch.Tensor  # (T,) bool
    logprob: torch.Tensor  # (T,) float32, NaN where unscored
    rank: torch.Tensor  # (T,) int64, 0 where unscored
    entropy: torch.Tensor  # (T,) float32 nats, NaN where unscored
    varentropy: torch.Tensor  # (T,) float32 nats², NaN where unscored
    margin: torch.Tensor  # (T,) float32 nats, NaN where unscored
    top_id: torch.Tensor  # (T,) int64, -1 where unscored
    top_logprob: torch.Tensor  # (T,) float32, NaN where unscored
    nll: float  # total negative log-likelihood of the scored tokens, nats (summed in float64)
    bytes: int  # UTF-8 bytes of the scored tokens
    token_text: Callable[[int], str] = field(repr=False)
    token_bytes: Callable[[int], bytes] = field(repr=False)
    # With `alternatives` = K: the model's K most probable tokens at each position, most probable first
    # (rows of unscored tokens: ids -1, log p NaN). K ≤ MAX_ALTERNATIVES, so 12·K bytes a token.
    alt_ids: torch.Tensor | None = None  # (T, K) int64
    alt_logprob: torch.Tensor | None = None  # (T, K) float32

    @property
    def scored_tokens(self) -> int:
        return int(self.scored.sum())

    @property
    def mean_nll(self) -> float:
        return self.nll / self.scored_tokens

    @property
    def perplexity(self) -> float:
        return perplexity(self.mean_nll)

    @property
    def bits_per_byte(self) -> float | None:
        """Total NLL in bits over the UTF-8 bytes of the scored tokens (None if they have none)."""
        return nats_to_bits(self.nll) / self.bytes if self.bytes else None

    @property
    def surprisal_bits(self) -> torch.Tensor:
        """(T,) float32: -log2 p of each token, NaN where unscored."""
        return -self.logprob / math.log(2)

    def token(self, i: int) -> ScoredToken:
        """Token i of the text with its figures."""
        tid = int(self.ids[i])
        if not bool(self.scored[i]):
            return ScoredToken(i, tid, self.token_text(tid), False, *([None] * 10))
        lp, top, gap = float(self.logprob[i]), int(self.top_id[i]), float(self.margin[i])
        return ScoredToken(index=i, id=tid, token=self.token_text(tid), scored=True, logprob=lp,
                           prob=math.exp(lp), rank=int(self.rank[i]), entropy=float(self.entropy[i]),
                           varentropy=float(self.varentropy[i]), margin=gap if math.isfinite(gap) else None,
                           surprisal_bits=-lp / math.log(2), top_id=top, top_token=self.token_text(top),
                           top_prob=math.exp(float(self.top_logprob[i])))

    def tokens(self) -> Iterator[ScoredToken]:
        """Every token in order, made one at a time."""
        return (self.token(i) for i in range(len(self.ids)))

    def bucket_counts(self) -> list[int]:
        """How many scored tokens fall in each of BUCKETS (GLTR's view of a text)."""
        edges = torch.tensor([b for b, _ in BUCKETS[:-1]])
        ranks = self.rank[self.scored]
        return torch.bincount(torch.bucketize(ranks, edges), minlength=len(BUCKETS)).tolist()

    def entropy_counts(self) -> list[int]:
        """How many scored tokens fall in each of ENTROPY_BUCKETS (the entropy of their prediction)."""
        edges = torch.tensor([b for b, _ in ENTROPY_BUCKETS[:-1]])
        return torch.bincount(torch.bucketize(self.entropy[self.scored], edges),
                              minlength=len(ENTROPY_BUCKETS)).tolist()

    def spans(self) -> Iterator[tuple[str, int | None]]:
        """The text as (piece, rank) in order: each piece one token, or the few tokens that share one
        UTF-8 character (byte-level tokens can split one), with the worst rank among them; rank None
        for unscored tokens."""
        buf, worst = b"", 0
        for i in range(len(self.ids)):
            buf += self.token_bytes(int(self.ids[i]))
            r = int(self.rank[i])
            worst = None if worst is None or r == 0 else max(worst, r)
            try:
                piece = buf.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data" and len(buf) - e.start < 4 and i + 1 < len(self.ids):
                    continue  # the character goes on in the next token
                piece = buf.decode("utf-8", errors="backslashreplace")
            yield piece, worst
            buf, worst = b"", 0

    def most_surprising(self, k: int = 5) -> list[ScoredToken]:
        """The k scored tokens with the lowest probability, the most surprising first."""
        lp = self.logprob.nan_to_num(nan=math.inf)
        n = min(k, self.scored_tokens)
        return [self.token(int(i)) for i in torch.topk(lp, n, largest=False).indices]

    def profile(self, width: int) -> tuple[list[float], int]:
        """Surprisal in bits for a sparkline of at most `width` marks: the scored tokens in order,
        each mark the mean of `per` consecutive ones. Returns (values, per)."""
        return run_means(self.surprisal_bits[self.scored], width)


# ---- the computation ---------------------------------------------------------------------------

def run_means(values: torch.Tensor, width: int) -> tuple[list[float], int]:
    """A sparkline's marks: `values` (n,) in order, at most `width` marks, each the mean of `per`
    consecutive values (the last run may be shorter). Returns (means, per)."""
    per = max(1, math.ceil(len(values) / max(width, 1)))
    pad = (-len(values)) % per
    if pad:
        values = torch.cat([values, values.new_full((pad,), math.nan)])
    return values.view(-1, per).nanmean(-1).tolist(), per


def check_text(text: str, source: str = "the text") -> str:
    """The text, or a UsageError when it is empty or not valid Unicode (undecodable bytes in argv
    arrive as lone surrogates)."""
    return inputs.check_text(check_prompt(text), source)


def bos_id(loaded: Loaded) -> int:
    """The token that opens a text for this model: its tokenizer's BOS, else the config's (GPT-2:
    <|endoftext|>, 50256)."""
    cfg = loaded.config
    tid = loaded.tokenizer.bos_id
    tid = cfg.get("bos_token_id", loaded.engine.eos_token_id) if tid is None else tid
    if tid is None:
        raise UsageError(f"{loaded.source} declares no beginning-of-text token to put before the text")
    return int(tid[0] if isinstance(tid, list) else tid)


def text_ids(loaded: Loaded, text: str, bos: bool) -> torch.Tensor:
    """The text's token ids (T,) int64; a UsageError when there is nothing to score."""
    encoded = loaded.tokenizer.encode_long(text)
    if len(encoded) == 0:  # (torch.frombuffer refuses an empty buffer)
        raise UsageError("the text encodes to no tokens")
    ids = torch.frombuffer(encoded, dtype=torch.int32).long()
    if len(ids) == 1 and not bos:
        raise OneToken(loaded.tokenizer.token_text(int(ids[0])))
    return ids


# on_rows(ids (n,), logprob (n,), top ids (n, K) | None, top log p (n, K) | None), on the CPU: the
# scored tokens of one head chunk, in text order, as soon as they are scored.
OnRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None]
# on_hidden(hidden (n, D), ids (n,)): each window's hidden states after the final norm, on the engine's
# device, and the tokens they predict, in text order (calibrate keeps them to refit the head's temperature).
OnHidden = Callable[[torch.Tensor, torch.Tensor], None]


@torch.inference_mode()
def score_ids(loaded: Loaded, ids: torch.Tensor, *, bos: bool = False, stride: int | None = None,
              chunk: int | None = None, progress: Callable[[int, int], None] | None = None,
              top_logprobs: int = 0, on_rows: OnRows | None = None, alternatives: int = 0,
              on_hidden: OnHidden | None = None) -> dict:
    """Score token ids (T,) window by window, the head in chunks. Returns the Score's columns.

    `progress(done, total)` is called after each chunk with the tokens scored so far. With
    `on_rows`, each chunk's scored tokens are also handed over with their `top_logprobs` most
    probable tokens, which are not kept: the memory stays chunk × top_logprobs, whatever T is.
    With `alternatives` = K (≤ MAX_ALTERNATIVES), the K most probable tokens of every position are
    kept, as the columns alt_ids and alt_logprob (T, K). `on_hidden` hears each window's hidden states."""
    check_alternatives(alternatives)
    loaded.execution.bound_heap()  # the chunks' buffers go back to the OS, not into a growing heap (engine/heap.py)
    eng = loaded.engine
    n_ctx = eng.n_ctx
    if n_ctx < 2:  # not the user's stride: a window of one position predicts nothing
        raise UnsupportedModel(f"the model's context of {n_ctx} token is too short to score: a token is predicted "
                               "from the tokens before it in its window, so the context must hold at least 2")
    stride = n_ctx // 2 if stride is None else stride
    check_chunk(chunk)
    chunk = chunk or default_chunk(eng.vocab_size)
    seq = torch.cat([ids.new_tensor([bos_id(loaded)]), ids]) if bos else ids  # (T + bos,)
    T = len(seq)
    plan = list(windows(T, n_ctx, stride))
    logprob = torch.full((T,), math.nan)
    entropy, top_logprob, varentropy, margin = logprob.clone(), logprob.clone(), logprob.clone(), logprob.clone()
    rank = torch.zeros(T, dtype=torch.long)
    top_id = torch.full((T,), -1, dtype=torch.long)
    alt_ids = torch.full((T, alternatives), -1, dtype=torch.long)
    alt_logprob = torch.full((T, alternatives), math.nan)
    top = max(top_logprobs, alternatives)
    total, done = sum(w.end - w.first for w in plan), 0
    kernel = loaded.execution.row_kernel()
    for w in plan:
        pred = eng.body(seq[None, w.begin:w.end].to(eng.device))[0][w.predictors]  # (n, D), after the final norm
        if on_hidden is not None:
            on_hidden(pred, seq[w.first:w.end])
        for lo, hi in w.chunks(chunk):
            # (chunk, V) logits, dropped here
            rows = score_rows(eng.head(pred[lo - w.first:hi - w.first]), seq[lo:hi].to(eng.device), top, kernel)
            logprob[lo:hi], rank[lo:hi], entropy[lo:hi] = rows.logprob.cpu(), rows.rank.cpu(), rows.entropy.cpu()
            top_id[lo:hi], top_logprob[lo:hi] = rows.top_id.cpu(), rows.top_logprob.cpu()
            varentropy[lo:hi], margin[lo:hi] = rows.varentropy.cpu(), rows.margin.cpu()
            if alternatives:
                alt_ids[lo:hi] = rows.top_ids[:, :alternatives].cpu()
                alt_logprob[lo:hi] = rows.top_logprobs[:, :alternatives].cpu()
            if on_rows is not None:
                on_rows(seq[lo:hi], logprob[lo:hi], *((rows.top_ids[:, :top_logprobs].cpu(),
                                                       rows.top_logprobs[:, :top_logprobs].cpu())
                                                      if top_logprobs else (None, None)))
            done += hi - lo
            if progress is not None:
                progress(done, total)
        del pred
    keep = slice(1, None) if bos else slice(None)  # back to the text's own tokens
    return {"windows": len(plan), "stride": stride, "chunk": chunk, "logprob": logprob[keep], "rank": rank[keep],
            "entropy": entropy[keep], "top_id": top_id[keep], "top_logprob": top_logprob[keep],
            "varentropy": varentropy[keep], "margin": margin[keep], "scored": rank[keep] > 0,
            **({"alt_ids": alt_ids[keep], "alt_logprob": alt_logprob[keep]} if alternatives else {})}


def scored_bytes(loaded: Loaded, ids: torch.Tensor) -> int:
    """UTF-8 bytes of these tokens: GPT-2's byte-level tokens map to bytes exactly."""
    uniq, counts = torch.unique(ids, return_counts=True)
    return sum(len(loaded.tokenizer.token_bytes(int(i))) * int(n) for i, n in zip(uniq, counts))


def score_text(loaded: Loaded, text: str, *, bos: bool = False, stride: int | None = None,
               chunk: int | None = None, progress: Callable[[int, int], None] | None = None,
               top_logprobs: int = 0, on_rows: OnRows | None = None, alternatives: int = 0) -> Score:
    """Score every token of one text. The one function a caller needs per text (`--file` runs it
    on each line). `top_logprobs`, `on_rows` and `alternatives`: see score_ids."""
    ids = text_ids(loaded, check_text(text), bos)
    check_top_logprobs(top_logprobs, loaded.engine.vocab_size)
    return _score(loaded, text, bos, ids, score_ids(loaded, ids, bos=bos, stride=stride, chunk=chunk,
                                                    progress=progress, top_logprobs=top_logprobs,
                                                    on_rows=on_rows, alternatives=alternatives))


def _score(loaded: Loaded, text: str, bos: bool, ids: torch.Tensor, cols: dict) -> Score:
    """The Score of `text` from its ids (T,) and the columns score_ids returned."""
    scored = cols["scored"]
    return Score(model=loaded.source, random_weights=loaded.random_weights, text=text, bos=bos,
                 window=loaded.engine.n_ctx, ids=ids, nll=-float(ordered_sum(cols["logprob"][scored].double())),
                 bytes=scored_bytes(loaded, ids[scored]), token_text=loaded.tokenizer.token_text,
                 token_bytes=loaded.tokenizer.token_bytes, **cols)


# ---- many texts: --file ----------------------------------------------------------------------

@dataclass
class Corpus:
    """Running totals over the texts of a file; nothing per text is kept."""

    texts: int = 0
    skipped_empty: int = 0
    skipped_short: int = 0  # one-token lines without --bos
    tokens: int = 0
    nll: float = 0.0
    bytes: int = 0

    @staticmethod
    def merged(every: list[Corpus]) -> Corpus:
        """The totals of several runs over parts of one file (torchrun's ranks), as one."""
        return Corpus(**{f.name: sum(getattr(c, f.name) for c in every) for f in fields(Corpus)})

    def add(self, score: Score) -> None:
        self.texts += 1
        self.tokens += score.scored_tokens
        self.nll += score.nll
        self.bytes += score.bytes

    @property
    def mean_nll(self) -> float | None:
        return self.nll / self.tokens if self.tokens else None

    @property
    def perplexity(self) -> float | None:
        """exp(total NLL / total scored tokens): every token weighs the same, whatever its line."""
        return perplexity(self.mean_nll) if self.tokens else None

    @property
    def bits_per_byte(self) -> float | None:
        return nats_to_bits(self.nll) / self.bytes if self.bytes else None


@dataclass(frozen=True)
class Line:
    number: int  # 1-based line number in the file
    text: str | None  # None: empty or white space only, skipped
    end: int = 0  # bytes of the file read up to the end of this line (for progress)


def read_lines(stream, name: str) -> Iterator[Line]:
    """The lines of a file one at a time (constant memory: each line read with a limit), each checked
    as UTF-8 (inputs.bounded_lines)."""
    for number, end, line in inputs.bounded_lines(stream, "stdin" if name == STDIN else name):
        yield Line(number, line if line.strip() else None, end)


@dataclass(frozen=True)
class FileItem:
    line: int
    score: Score | None  # None: skipped (see `skipped`)
    skipped: str | None = None  # "empty" or "one token"
    end: int = 0  # bytes of the file read so far


def score_lines(loaded: Loaded, lines: Iterator[Line], corpus: Corpus, *, bos: bool = False,
                stride: int | None = None, chunk: int | None = None) -> Iterator[FileItem]:
    """Score each line lazily with `score_text`, one at a time, adding it to `corpus`; empty lines and
    one-token lines without `bos` are skipped and counted."""
    for line in lines:
        if line.text is None:
            corpus.skipped_empty += 1
            yield FileItem(line.number, None, "empty", line.end)
            continue
        try:
            score = score_text(loaded, line.text, bos=bos, stride=stride, chunk=chunk)
        except OneToken:
            corpus.skipped_short += 1
            yield FileItem(line.number, None, "one token", line.end)
            continue
        corpus.add(score)
        yield FileItem(line.number, score, end=line.end)
