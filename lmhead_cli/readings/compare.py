"""`lmhead compare`: how far a cheaper model Q (another dtype, a quantisation) moves the next-token
distribution away from a base, over every token of a text: the statistics of
`llama-perplexity --kl-divergence` (readings/agreement.py defines each one).

Both models read the text in lockstep through `score`'s plan, so the memory is score's:

* the same sliding windows (readings/score.py): each token is scored once, with the same context under
  both models, and each window's body runs once per model;
* the head in chunks: a chunk of positions goes through both heads, each (chunk, V) block of logits
  becomes float32 log-probabilities in place, and is reduced to a few figures per position (KL
  divergence over the full vocabulary, both models' log p of the actual token, both top-1s) before
  the next chunk. No (T, V) tensor exists; what grows with the text is a handful of (T,) columns.

Shapes: T tokens, L positions in a window, D width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from lmhead_cli.errors import BadValue, NonFiniteLogits, OneToken, UsageError
from lmhead_cli.head import NON_FINITE_ADVICE, log_softmax, ordered_sum
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.readings.agreement import Statistics, statistics
from lmhead_cli.chunks import COMPARE_BUFFERS
from lmhead_cli.chunks import default_chunk as _chunk
from lmhead_cli.readings.score import (Window, bos_id, check_chunk, check_stride, check_text, run_means,
                                       text_ids, windows)


def default_chunk(vocab: int) -> int:
    """The most positions whose COMPARE_BUFFERS (chunk, V) float32 buffers fit in score's CHUNK_BYTES
    (41 positions for GPT-2's 50,257 tokens): compare's chunk costs what score's does."""
    return _chunk(vocab, COMPARE_BUFFERS)


class Mismatch(UsageError):
    """Q and the base do not read the text the same way (vocabulary or tokenizer): KL is undefined."""


@dataclass(frozen=True)
class Side:
    """Which model one side of the comparison is."""

    model: str
    dtype: str
    random_weights: bool


def dtype_name(loaded: Loaded) -> str:
    """The dtype the model was loaded in, as --dtype spells it: how its weights are stored where the
    engine says (int8 weights compute in float32), else the dtype it computes in."""
    stored = getattr(loaded.engine, "weight_format", None)
    return stored if isinstance(stored, str) else str(loaded.engine.dtype).removeprefix("torch.")


def side(loaded: Loaded) -> Side:
    return Side(loaded.source, dtype_name(loaded), loaded.random_weights)


def check_same_vocabulary(q: Loaded, base: Loaded) -> None:
    """A Mismatch naming what differs when the two models cannot be compared token by token: the
    head's rows, or the tokenizer's table of tokens."""
    vq, vb = q.engine.vocab_size, base.engine.vocab_size
    if vq != vb:
        raise Mismatch(f"the base {base.source} has another vocabulary: its head has {vb:,} rows, {q.source}'s "
                       f"{vq:,}; KL divergence needs the same tokens on both sides")
    tq, tb = q.tokenizer.tok.get_vocab(with_added_tokens=True), base.tokenizer.tok.get_vocab(with_added_tokens=True)
    if tq != tb:
        differ = sorted(set(tq.items()) ^ set(tb.items()), key=lambda kv: kv[1])
        token, tid = differ[0]
        raise Mismatch(f"the base {base.source} has another tokenizer vocabulary ({len(tb):,} tokens against "
                       f"{len(tq):,}; they differ first at id {tid}, {token!r}); compare needs one tokenizer")


def check_same_tokens(q: Loaded, base: Loaded, ids: torch.Tensor, text: str) -> None:
    """A Mismatch when the base's tokenizer splits the text otherwise than Q's (same table, other merges,
    or a GGUF's tokenizer against its original's), naming the first token where they differ as each
    side reads it; nothing is run before this check."""
    other = torch.frombuffer(base.tokenizer.encode_long(text), dtype=torch.int32).long()
    if not torch.equal(other, ids):
        n = min(len(other), len(ids))
        at = next((i for i in range(n) if int(other[i]) != int(ids[i])), n)
        mine = _token_at(q, ids, at)
        theirs = _token_at(base, other, at)
        raise Mismatch(f"the base {base.source} has another tokenizer: it splits the text into {len(other):,} "
                       f"tokens against {len(ids):,}, differing first at token {at}; there {q.source} reads "
                       f"{mine} and the base {theirs}; compare needs one tokenizer")


def _token_at(side: Loaded, ids: torch.Tensor, at: int) -> str:
    """Token `at` of `ids` as `side` reads it: its text and id, or that the split has ended."""
    if at >= len(ids):
        return "nothing (its split has ended)"
    tid = int(ids[at])
    return f"{side.tokenizer.token_text(tid)!r} (id {tid})"


# ---- the result ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ComparedToken:
    """One token of the text, as `compare --json` lists it. The figures are None when unscored."""

    index: int
    id: int
    token: str
    scored: bool
    kld: float | None  # KL(base ‖ Q) of the prediction of this token, nats
    logprob_q: float | None
    logprob_base: float | None
    dp: float | None  # p_Q − p_base of this token
    top_q_id: int | None
    top_q_token: str | None
    top_base_id: int | None
    top_base_token: str | None
    same_top: bool | None


@dataclass
class Comparison:
    """Every token of one text under both models, as (T,) columns, and the statistics over them."""

    q: Side
    base: Side
    text: str
    bos: bool
    window: int
    stride: int
    chunk: int
    windows: int
    llama_chunks: bool  # llama-perplexity's positions: windows of `window` tokens, the second half of each scored
    ids: torch.Tensor  # (T,) int64
    scored: torch.Tensor  # (T,) bool
    kld: torch.Tensor  # (T,) float32 nats, NaN where unscored
    logprob_q: torch.Tensor  # (T,) float32, NaN where unscored
    logprob_base: torch.Tensor  # (T,) float32, NaN where unscored
    top_q: torch.Tensor  # (T,) int64, -1 where unscored
    top_base: torch.Tensor  # (T,) int64, -1 where unscored
    token_text: Callable[[int], str] = field(repr=False)
    stats: Statistics = field(init=False)

    def __post_init__(self) -> None:
        s = self.scored
        self.stats = statistics(-self.logprob_q[s], -self.logprob_base[s], self.kld[s],
                                self.top_q[s] == self.top_base[s])

    @property
    def positions(self) -> int:
        return int(self.scored.sum())

    def token(self, i: int) -> ComparedToken:
        tid = int(self.ids[i])
        if not bool(self.scored[i]):
            return ComparedToken(i, tid, self.token_text(tid), False, *([None] * 9))
        lq, lb = float(self.logprob_q[i]), float(self.logprob_base[i])
        tq, tb = int(self.top_q[i]), int(self.top_base[i])
        return ComparedToken(index=i, id=tid, token=self.token_text(tid), scored=True, kld=float(self.kld[i]),
                             logprob_q=lq, logprob_base=lb, dp=math.exp(lq) - math.exp(lb),
                             top_q_id=tq, top_q_token=self.token_text(tq), top_base_id=tb,
                             top_base_token=self.token_text(tb), same_top=tq == tb)

    def tokens(self) -> Iterator[ComparedToken]:
        return (self.token(i) for i in range(len(self.ids)))

    def worst(self, k: int = 5) -> list[ComparedToken]:
        """The k scored tokens with the largest KL divergence, the largest first."""
        kld = self.kld.nan_to_num(nan=-math.inf)
        return [self.token(int(i)) for i in torch.topk(kld, min(k, self.positions)).indices]

    def profile(self, width: int) -> tuple[list[float], int]:
        """KL divergence along the text for a sparkline of at most `width` marks, each the mean of
        `per` consecutive scored positions. Returns (values, per)."""
        return run_means(self.kld[self.scored], width)


# ---- the computation ---------------------------------------------------------------------------

def _top(lp: torch.Tensor, who: str, first: int) -> torch.Tensor:
    """Each row's top token (n,), or NonFiniteLogits naming the model and the first text token whose
    prediction is not finite. lp (n, V) float32 log-probabilities of tokens first, first + 1, …: a NaN
    or +inf logit makes its row's max NaN, a -inf logit its min -inf, so two (n,) reductions find them
    (no (n, V) mask); the max's indices are the top tokens."""
    top, top_id = lp.max(-1)
    bad = ~(torch.isfinite(top) & torch.isfinite(lp.amin(-1)))
    if bool(bad.any()):
        at = first + int(bad.nonzero()[0])
        raise NonFiniteLogits(f"{who} produced non-finite logits (NaN or inf) predicting token {at} of the text"
                              f" ({int(bad.sum())} positions in that chunk): " + NON_FINITE_ADVICE)
    return top_id


def llama_chunks(T: int, n: int) -> Iterator[Window]:
    """llama-perplexity's plan over T tokens: ⌊T / n⌋ chunks of n tokens, no overlap, the rest of the text
    unread; in each, positions n/2 … n − 2 predict tokens n/2 + 1 … n − 1 (perplexity.cpp: `first =
    n_ctx/2`, logits from `first` on, `n_ctx - 1 - first` tokens scored a chunk)."""
    for c in range(T // n):
        yield Window(c * n, (c + 1) * n, c * n + n // 2 + 1)


def check_llama_chunks(n: int | None, n_ctx: int, T: int | None = None) -> None:
    if n is None:
        return
    if not (isinstance(n, int) and not isinstance(n, bool)) or not 4 <= n <= n_ctx:
        raise BadValue("llama_chunks", f"must be between 4 and the context of {n_ctx} (got {n!r})")
    if T is not None and T < n:
        raise UsageError(f"the text is {T:,} tokens, fewer than one chunk of {n:,}; llama-perplexity scores whole "
                         "chunks only")


@torch.inference_mode()
def compare_ids(q: Loaded, base: Loaded, ids: torch.Tensor, *, bos: bool = False, stride: int | None = None,
                chunk: int | None = None, progress: Callable[[int, int], None] | None = None,
                llama: int | None = None) -> dict:
    """Both models over token ids (T,), window by window, the heads chunk by chunk. Returns the columns.

    `llama` = n: llama-perplexity's positions instead of score's windows (`llama_chunks`); with `bos`
    each chunk begins with BOS in place of its first token, as llama-perplexity does when the
    tokenizer adds one."""
    q.execution.bound_heap()  # as score: freed chunk buffers go back to the OS (engine/heap.py)
    n_ctx = min(q.engine.n_ctx, base.engine.n_ctx)
    if llama is not None:
        if stride is not None:
            raise UsageError("give a stride or llama-perplexity's chunks, not both")
        check_llama_chunks(llama, n_ctx, len(ids) + bos)
        stride = llama
    stride = n_ctx // 2 if stride is None else stride
    check_stride(stride, n_ctx)
    check_chunk(chunk)
    chunk = chunk or default_chunk(q.engine.vocab_size)
    first_id = bos_id(q) if bos else None
    seq = torch.cat([ids.new_tensor([first_id]), ids]) if bos else ids  # (T + bos,)
    T = len(seq)
    plan = list(llama_chunks(T, llama) if llama else windows(T, n_ctx, stride))
    kld, lp_q, lp_b = (torch.full((T,), math.nan) for _ in range(3))
    top_q, top_b = (torch.full((T,), -1, dtype=torch.long) for _ in range(2))
    who = (f"the model {q.source} ({dtype_name(q)})", f"the base {base.source} ({dtype_name(base)})")
    total, done = sum(w.end - w.first for w in plan), 0
    for w in plan:
        window = seq[None, w.begin:w.end]
        if llama and bos and w.begin:  # llama-perplexity: BOS in place of each chunk's first token
            window = window.clone()
            window[0, 0] = first_id
        pred_q = q.engine.body(window.to(q.engine.device))[0][w.predictors]  # (n, D)
        pred_b = pred_q if base is q else base.engine.body(window.to(base.engine.device))[0][w.predictors]  # (n, D)
        for lo, hi in w.chunks(chunk):
            rows, tgt = slice(lo - w.first, hi - w.first), seq[lo:hi, None]
            lq = log_softmax(q.engine.head(pred_q[rows]), inplace=True)  # (n, V) float32
            top_q[lo:hi] = _top(lq, who[0], lo - bos).cpu()
            lb = log_softmax(base.engine.head(pred_b[rows]), inplace=True).to(lq.device)  # (n, V)
            top_b[lo:hi] = _top(lb, who[1], lo - bos).cpu()
            lp_q[lo:hi] = lq.gather(-1, tgt.to(lq.device))[:, 0].cpu()
            lp_b[lo:hi] = lb.gather(-1, tgt.to(lq.device))[:, 0].cpu()
            diff = lq.neg_().add_(lb)  # log p_base − log p_Q, in lq's place
            kld[lo:hi] = ordered_sum(diff.mul_(lb.exp_())).cpu()  # Σ_v p_base (log p_base − log p_Q), float32
            del lq, lb, diff
            done += hi - lo
            if progress is not None:
                progress(done, total)
        del pred_q, pred_b
    keep = slice(1, None) if bos else slice(None)
    return {"windows": len(plan), "window": llama or n_ctx, "stride": stride, "llama_chunks": llama is not None,
            "chunk": chunk, "kld": kld[keep], "logprob_q": lp_q[keep], "logprob_base": lp_b[keep], "top_q": top_q[keep], "top_base": top_b[keep],
            "scored": top_q[keep] >= 0}


def compare_text(q: Loaded, base: Loaded, text: str, *, bos: bool = False, stride: int | None = None,
                 chunk: int | None = None, progress: Callable[[int, int], None] | None = None,
                 llama: int | None = None) -> Comparison:
    """Compare Q with the base over every token of one text (or llama-perplexity's positions: `llama`
    = n, see compare_ids). The text must be at least 2 tokens, and both models must share the
    vocabulary and split the text into the same tokens (Mismatch otherwise, before anything runs)."""
    check_same_vocabulary(q, base)
    text = check_text(text)
    try:
        ids = text_ids(q, text, bos)
    except OneToken as e:
        ids = None
        token = e.token
    if ids is None or len(ids) < 2:
        token = token if ids is None else q.tokenizer.token_text(int(ids[0]))
        raise UsageError(f"the text is one token ({token!r}); compare needs a text of at least 2 tokens")
    check_same_tokens(q, base, ids, text)
    cols = compare_ids(q, base, ids, bos=bos, stride=stride, chunk=chunk, progress=progress, llama=llama)
    return Comparison(q=side(q), base=side(base), text=text, bos=bos, ids=ids, token_text=q.tokenizer.token_text,
                      **cols)
