"""The head's arithmetic: pure functions over logits (..., V), each written once and returning data.

Every reading of one distribution builds a `Distribution` (log-softmax once; probabilities, entropy,
ranks, top-k, targets); `score_rows` and the decoding loop do the same on (N, V) rows.

Logits are raw, unnormalised scores of any sign; softmax (always in float32) keeps their order,
makes them sum to 1 and gives every token a non-zero share.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from lmhead_cli.errors import BadValue, NonFiniteLogits


@dataclass(frozen=True)
class TokenScore:
    """One token's row in any reading's table (inspect, lens, diff, explore, the stage table). The last
    three fields are set only by the readings that have them; to_dict() leaves out those unset."""

    rank: int  # 1 = the highest logit
    id: int
    token: str
    logit: float  # raw, from the head
    prob: float
    logprob: float
    other_rank: int | None = None  # diff: its rank after the other prompt
    scaled: float | None = None  # explore: the logit after soft-cap and temperature
    cells: list | None = None  # the stage table: one decoding.stages.StageCell per column

    def to_dict(self) -> dict:
        """The row as JSON: the six fields, then whichever of the optional ones are set."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in OPTIONAL_ROW_FIELDS}


OPTIONAL_ROW_FIELDS = ("other_rank", "scaled", "cells")


@dataclass(frozen=True)
class TargetScore:
    token: str  # the text the user asked about
    id: int  # its first token
    pieces: list[str]  # all tokens the text splits into (1 for a single token)
    rank: int
    logit: float
    prob: float


NON_FINITE_ADVICE = ("the weights hold non-finite values or overflowed in this dtype; check the checkpoint "
                     "or try float32")


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits if any logit is NaN or infinite (safetensors does not check values)."""
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise NonFiniteLogits(f"the head produced {bad} non-finite logits (NaN or inf): {NON_FINITE_ADVICE}")


SUM_BLOCK = 4096  # the elements of a row that ordered_sum adds as one block (16 KiB of float32)


def ordered_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Σ over the last dimension, (..., V) -> (...), in an order set by V alone: the thread count never
    changes a bit of it.

    torch splits a sum whose result is one number among its threads once the row holds 32,768 elements
    (GPT-2's 50,257 logits): each thread count adds the same numbers in another order, and the last bits
    of an entropy or a KL divergence differ with --threads. Here each row is cut into blocks of
    SUM_BLOCK elements; torch adds each block whole (its threads share out blocks, never split one), then
    the block sums and the tail's, a few numbers a row, in one pass no thread splits."""
    V = x.shape[-1]
    whole = V - V % SUM_BLOCK
    if whole == 0:  # one short row is summed by one thread; many rows are shared out whole
        return x.sum(-1, keepdim=keepdim)
    total = x[..., :whole].unflatten(-1, (whole // SUM_BLOCK, SUM_BLOCK)).sum(-1).sum(-1, keepdim=keepdim)
    return total + x[..., whole:].sum(-1, keepdim=keepdim) if whole < V else total


def log_sum_exp(z: torch.Tensor) -> torch.Tensor:
    """log Σ exp z over the last dimension, (..., V) -> (...), through ordered_sum (torch.logsumexp's sum
    of one row depends on the thread count). z finite: the largest is taken out first, so nothing
    overflows."""
    top = z.amax(-1, keepdim=True)
    return ordered_sum((z - top).exp_()).log_() + top[..., 0]


def log_softmax(logits: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """log p = z - logsumexp(z), in float32 whatever the model's dtype. (..., V) -> (..., V);
    a filtered token (-inf) gets -inf. `inplace` overwrites float32 logits with their log-probabilities,
    so that no second (..., V) buffer is held (`score`'s chunks)."""
    if inplace:  # z - max, then - log Σ exp: one temporary (..., V) buffer (torch.logsumexp takes two)
        z = logits.float()
        z.sub_(z.amax(dim=-1, keepdim=True))
        return z.sub_(ordered_sum(z.exp(), keepdim=True).log_())
    return torch.log_softmax(logits.float(), dim=-1)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats per distribution, (..., V) log-probabilities -> (...) float32.

    A dropped token (p = 0, log p = -inf) adds nothing: its 0·(-inf) = NaN is counted as 0
    (torch.special.entr is ~10x slower on CPU). p is multiplied in place, so a (N, V) input needs one
    more (N, V) buffer, not three (`score` runs this on chunks of logits). Entropy is never negative:
    a one-hot distribution's -0.0 (or a rounding speck below 0) is 0, never "-0.0000" in a table.
    """
    p = logprobs.exp()
    return (-ordered_sum(p.mul_(logprobs).nan_to_num_(nan=0.0))).clamp_min(0.0) + 0.0


def varentropy(logprobs: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """The variance of the surprisal -log p under p, in nats², (..., V) log-probabilities -> (...) float32:
    Σ p (log p + H)², H the entropy (`h` when the caller has it). Centred on H rather than E[(log p)²] - H²,
    which loses every digit to cancellation on a flat distribution (both terms near (log V)²). 0 for a
    one-hot or uniform distribution; a dropped token (p = 0) adds nothing."""
    h = entropy(logprobs) if h is None else h
    p = logprobs.exp()
    centred = (logprobs + h[..., None]).square_()
    return ordered_sum(p.mul_(centred).nan_to_num_(nan=0.0)).clamp_min(0.0) + 0.0


def margin(logprobs: torch.Tensor) -> torch.Tensor:
    """The log-probability gap between the two most probable tokens, (..., V) -> (...) float32 nats (the
    same as their logit gap): 0 for a tie, inf where one token alone is possible (V = 1, or the stages
    dropped every other), which JSON documents show as null."""
    if logprobs.shape[-1] < 2:
        return torch.full(logprobs.shape[:-1], math.inf, device=logprobs.device)
    two = torch.topk(logprobs, 2, dim=-1).values
    gap = two[..., 0] - two[..., 1]
    return gap.masked_fill_(gap.isnan(), math.inf)  # -inf - -inf: the top-1 alone is possible


def perplexity(mean_nll: float) -> float:
    """exp(mean negative log-likelihood), inf where that overflows a float (a mean above ~709.8 nats, which a
    model with huge logits reaches) instead of OverflowError."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def nats_to_bits(nats: float) -> float:
    return nats / math.log(2)


RANKS_BY_COMPARISON = 64  # up to this many tokens, (K, V) booleans beat a sort of V


def ranks(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rank of each token in `ids` among `logits`: 1 + the tokens scored strictly higher.

    logits (..., V), ids (..., K) long -> (..., K) long. Ties share the better rank. A handful of
    tokens (a table's rows) take one comparison of (..., K, V) booleans; more (`diff -k 50000` ranks
    every row on the other side) take one sort and a binary search each, so memory stays O(V).
    """
    picked = logits.gather(-1, ids)  # (..., K)
    if ids.shape[-1] == 1:  # one token per row (`score`): a plain comparison, counted through int32, not int64
        return 1 + (logits > picked).sum(-1, keepdim=True, dtype=torch.int32).long()
    if ids.shape[-1] <= RANKS_BY_COMPARISON:
        return 1 + (logits[..., None, :] > picked[..., :, None]).sum(-1)
    ascending = torch.sort(logits, dim=-1).values  # (..., V)
    not_higher = torch.searchsorted(ascending, picked.contiguous(), right=True)  # (..., K): how many ≤ z
    return 1 + logits.shape[-1] - not_higher


def rank_of(logits: torch.Tensor, token_id: int) -> int:
    """`ranks` for one token of one logits vector (V,)."""
    return int(ranks(logits, torch.tensor([token_id], device=logits.device))[0])


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k highest of `logits` (V,), highest first, ties lowest id first: (k,) long."""
    kth = torch.topk(logits, k).values[-1]
    candidates = torch.nonzero(logits >= kth).squeeze(1)  # ascending ids, at least k of them
    order = torch.sort(logits[candidates], descending=True, stable=True).indices[:k]
    return candidates[order]


def check_top_k(k: int) -> int:
    """A top-k table's size as asked: BadValue unless at least 1."""
    if k < 1:
        raise BadValue("top_k", f"must be at least 1 (got {k})")
    return k


def clamp_top_k(k: int, vocab: int) -> int:
    """How many rows a top-k table can have: k, at most the vocabulary."""
    return min(check_top_k(k), vocab)


class Distribution:
    """One next-token distribution, from logits (V,): the log-softmax is taken once, in float32, and
    probabilities, entropy, ranks, the top-k table and targets are read off it.

    Every reading of a single distribution (inspect, diff, explain, lens, explore, the stage table)
    builds one of these; `score_rows` and the decoding loop do the same arithmetic on (N, V) batches
    with the buffers reused in place.
    """

    __slots__ = ("logits", "logprobs")

    def __init__(self, logits: torch.Tensor):
        self.logits = logits.float()  # (V,) float32
        self.logprobs = log_softmax(self.logits)  # (V,) float32, -inf where a stage filtered a token

    @property
    def probs(self) -> torch.Tensor:
        return self.logprobs.exp()  # (V,)

    @property
    def vocab(self) -> int:
        return int(self.logits.shape[-1])

    @property
    def entropy(self) -> float:
        """Shannon entropy in nats."""
        return float(entropy(self.logprobs))

    @property
    def entropy_bits(self) -> float:
        return nats_to_bits(self.entropy)

    @property
    def varentropy(self) -> float:
        """The variance of -log p under p, nats²."""
        return float(varentropy(self.logprobs))

    @property
    def margin(self) -> float:
        """log p of the top-1 minus log p of the second, nats (inf if no second token is possible)."""
        return float(margin(self.logprobs))

    def prob(self, token_id: int) -> float:
        return float(self.logprobs[token_id].exp())

    def ranks(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank (1 = the highest logit) of each id in `ids` (K,) long -> (K,) long."""
        return ranks(self.logits, ids)

    def rank(self, token_id: int) -> int:
        return rank_of(self.logits, token_id)

    def top(self, k: int, token_text) -> list[TokenScore]:
        """The k highest logits as a ranked table; token_text(id) gives each token's text. Tied logits
        come lowest id first, as greedy decoding's argmax takes them, whatever k is (torch.topk alone
        orders ties differently for different k)."""
        ids = top_ids(self.logits, min(k, self.vocab))
        values = self.logits[ids]
        return [TokenScore(rank=i + 1, id=int(t), token=token_text(int(t)), logit=float(v),
                           prob=float(self.logprobs[t].exp()), logprob=float(self.logprobs[t]))
                for i, (v, t) in enumerate(zip(values, ids))]

    def target(self, text: str, ids: list[int], token_text) -> TargetScore:
        """Rank, logit and probability of the first token of `text` (encoded as `ids`, see encode_targets)."""
        first = ids[0]
        return TargetScore(token=text, id=first, pieces=[token_text(i) for i in ids], rank=self.rank(first),
                           logit=float(self.logits[first]), prob=self.prob(first))


def encode_target(tokenizer, text: str, key: str = "target") -> list[int]:
    """The token ids of a token asked about (a --target, an --explain); BadValue(key) if none."""
    ids = tokenizer.encode(text) if text else []
    if not ids:
        raise BadValue(key, f"{text!r} encodes to no tokens; give a token such as ' are'")
    return ids


def encode_targets(tokenizer, texts: list[str] | None) -> list[tuple[str, list[int]]]:
    """[(text, its token ids)] for the targets asked about, in order."""
    return [(t, encode_target(tokenizer, t)) for t in texts or []]


@dataclass(frozen=True)
class RowScores:
    """How a distribution rated a given token, row by row; every field has the rows' shape (N,)."""

    logprob: torch.Tensor  # log p(id), float32
    rank: torch.Tensor  # 1 = the model's own top-1, int64
    entropy: torch.Tensor  # nats, float32
    top_id: torch.Tensor  # the model's own top-1 token, int64
    top_logprob: torch.Tensor  # its log-probability, float32
    varentropy: torch.Tensor  # Var_p[-log p], nats², float32
    margin: torch.Tensor  # log p(top-1) - log p(top-2), nats, float32 (inf with one possible token)
    top_ids: torch.Tensor | None = None  # (N, K) the K most probable when asked (score --top-logprobs), int64
    top_logprobs: torch.Tensor | None = None  # (N, K) their log-probabilities, float32


def score_rows(logits: torch.Tensor, ids: torch.Tensor, top: int = 0, kernel=None) -> RowScores:
    """Score token ids (N,) under logits (N, V): log-probability, rank, entropy, varentropy, margin and the
    top-1 of each row, and with `top` = K the K most probable of each row too.

    One pass per reduction, over buffers the (N, V) rows already need: the logits are overwritten with
    d = z - max z, and e = exp(d) is the one other (N, V) float32 buffer (the rank's comparison, a
    boolean one, comes and goes before it). With S = Σ e: log p = d - log S, and the entropy
    H = log S - Σ e·d / S (e·d in e's place, no third buffer), which stays exact near 0 because
    it is computed from d, not from the large log-sum-exp. The varentropy is the variance of d under p
    (-log p is d shifted by log S): Σ e·d² / S - (Σ e·d / S)², e·d² in e's place once more; the margin
    is the gap between the two highest logits (the log-probabilities' gap: log S cancels). A caller bounds
    the memory by how many rows it passes (`lmhead score --chunk`).

    `kernel`: the engine's compiled row kernel where it has one (engine/execution.py `row_kernel`: the
    seven figures from the same sums in two passes over the rows and no temporaries, on the CPU), else
    torch's."""
    z = logits.float()
    fast = _compiled_rows(kernel, z, ids, top) if kernel is not None else None
    if fast is not None:
        return fast
    picked = z.gather(-1, ids.unsqueeze(-1))  # (N, 1)
    rank = 1 + (z > picked).sum(-1, dtype=torch.int32).long()
    top_z, top_id = z.max(-1)
    if not bool(torch.isfinite(top_z).all()):  # a NaN or +inf logit makes its row's max NaN or inf: O(N)
        raise _non_finite(int((~torch.isfinite(top_z)).sum()))
    best = torch.topk(z, top, dim=-1) if top else None  # before z becomes d below
    gap = margin(z)  # (N,): the logits' gap is the log-probabilities'
    d = z.sub_(top_z[:, None])  # (N, V), ≤ 0, in the logits' place
    e = d.exp()
    log_s = ordered_sum(e).log_()  # (N,)
    spread = ordered_sum(e.mul_(d))  # Σ e·d, in e's place; a dropped token (-inf) makes 0·(-inf) = NaN
    dropped = not bool(torch.isfinite(spread).all())
    if dropped:
        spread = ordered_sum(e.nan_to_num_(nan=0.0))
    square = e.mul_(d)  # e·d², in e's place
    if dropped:
        square.nan_to_num_(nan=0.0)
    s = log_s.exp()
    h = (log_s - spread / s).clamp_min_(0.0) + 0.0  # never -0.0 or a rounding speck below 0
    var = (ordered_sum(square) / s - (spread / s).square()).clamp_min_(0.0) + 0.0
    return _row_scores((picked[:, 0] - top_z) - log_s, rank, h, top_id, -log_s, top_z, best, var, gap)


def _non_finite(positions: int) -> NonFiniteLogits:
    return NonFiniteLogits(f"the head produced non-finite logits (NaN or inf) at {positions} positions: "
                           + NON_FINITE_ADVICE)


def _row_scores(logprob, rank, entropy, top_id, top_logprob, top_z, best, varentropy, margin) -> RowScores:
    """RowScores from the seven figures, each row's max logit top_z (N,) and torch.topk's `best` (or
    None): the top-K log-probabilities are best's logits less the max, plus the top-1's log p."""
    return RowScores(logprob=logprob, rank=rank, entropy=entropy, top_id=top_id, top_logprob=top_logprob,
                     varentropy=varentropy, margin=margin, top_ids=best.indices if best else None,
                     top_logprobs=(best.values - top_z[:, None]) + top_logprob[:, None] if best else None)


def _compiled_rows(kernel, z: torch.Tensor, ids: torch.Tensor, top: int) -> RowScores | None:
    """score_rows on the compiled `kernel`; None where it does not take these rows (not on the CPU, or
    an id outside the vocabulary, which the torch path then reports)."""
    if z.device.type != "cpu" or ids.device.type != "cpu" or z.dim() != 2 or ids.shape != z.shape[:1]:
        return None
    z = z.contiguous()
    try:
        logprob, rank, h, top_id, top_logprob, var, gap, bad = kernel(z, ids)
    except ValueError:
        return None
    if bad:
        raise _non_finite(bad)
    best = torch.topk(z, top, dim=-1) if top else None
    return _row_scores(logprob, rank, h, top_id, top_logprob, z.gather(-1, top_id[:, None])[:, 0], best, var, gap)


def check_top_logprobs(n: int, vocab: int) -> None:
    """How many of the most probable tokens to list per position: 0 up to the whole vocabulary."""
    if not 0 <= n <= vocab:
        raise BadValue("top_logprobs", f"must be between 0 and the vocabulary size, {vocab} (got {n})")


# ---- two distributions compared (`diff`) -------------------------------------------------------
# Divergences are summed in float64 over log-probabilities, so identical inputs give exactly 0 and
# tokens with p = 0 in float32 (a logprob of -inf never arises: softmax of finite logits is > 0) add
# nothing spurious.

def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(p‖q) = Σ p (log p − log q) in nats, for two distributions given by log-probabilities (V,)."""
    logp, logq = logp.double(), logq.double()
    return float(ordered_sum(logp.exp() * (logp - logq)))


def js_divergence(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Jensen–Shannon divergence ½ KL(p‖m) + ½ KL(q‖m), m = (p + q)/2, in nats (at most ln 2)."""
    logp, logq = logp.double(), logq.double()
    logm = torch.logaddexp(logp, logq) - math.log(2)
    return 0.5 * kl_divergence(logp, logm) + 0.5 * kl_divergence(logq, logm)


def total_variation(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Total variation distance ½ Σ |p − q|: the most probability any set of tokens gains or loses, in [0, 1]."""
    return float(0.5 * ordered_sum((logp.double().exp() - logq.double().exp()).abs()))

