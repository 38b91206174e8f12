"""The step's record: what one decoding step chose and why, for every row, in one transfer.

Each generated token is recorded under two distributions, because they answer different questions
(transformers #17424, llama.cpp #7498, vLLM's --logprobs-mode):
  raw        softmax of the model's logits: what the model believes;
  processed  softmax after the row's stages (soft-cap, temperature, top-k, top-p, min-p, ...): what
             the token was drawn from (greedy and beam search rank by it too).
With no stage active the two are the same distribution.

`record` makes every row's figures on the device as one (R, 11 + 2k) table, so a step has one
device-to-host transfer; `greedy_record` makes the same rows for plain greedy rows from the compiled
row kernel (or takes the ones the engine made with the logits); `step_of` turns a row of the table
into a `Step`; `top_tokens` gives the top-N (logprobs, echo's and a step's); `spread` the entropy,
varentropy and margin. The batch (decoding/batch.py) and beam search (decoding/beams.py) both read
their steps through here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lmhead_cli.decoding.grammar import forced
from lmhead_cli.head import check_finite, entropy, margin, ordered_sum, ranks, varentropy

# columns of a step record, then K alternative ids and K alternative log-probabilities
ID, LOGPROB, LOGIT, ENTROPY, RANK, FINITE, RAW_LOGPROB, RAW_ENTROPY, REMOVED, GRAMMAR, FORCED = range(11)
FIXED = 11
NO_GRAMMAR = -1.0  # the grammar column of a row without one (a mass is never negative)


@dataclass(frozen=True)
class Choice:
    id: int
    token: str
    prob: float


@dataclass(frozen=True)
class Top:
    """The N most probable tokens of one step under one distribution, kept compact on the CPU:
    ids (N,) int64, logprobs (N,) float32, best first (processed: -inf for a token the filters
    dropped, those in raw order after the kept ones)."""

    ids: torch.Tensor
    logprobs: torch.Tensor


@dataclass(frozen=True)
class Step:
    """One generated token and why: the raw distribution and the processed one it was drawn from."""

    id: int
    token: str
    prob: float  # its processed probability, exp(logprob): what it was drawn with
    logit: float  # its raw logit
    entropy: float  # nats, of the processed distribution
    rank: int  # 1 + tokens with a higher raw logit
    logprob: float  # log of prob: after the stage chain
    raw_logprob: float  # log softmax of the raw logits
    raw_entropy: float  # nats, of the raw distribution
    removed_mass: float  # raw probability of the tokens the stages set to -inf (0 with no filter nor grammar)
    alternatives: list[Choice] = field(default_factory=list)  # the K most probable, processed (show_steps)
    top: Top | None = None  # the top_logprobs most probable, raw or processed (Settings.logprobs)
    grammar_removed: float | None = None  # raw probability of the tokens the grammar forbade; None: no grammar
    forced: bool = False  # the grammar allowed this token alone (no draw; the forward still ran)

    @property
    def raw_prob(self) -> float:
        return math.exp(self.raw_logprob)


def record(logits: torch.Tensor, raw: torch.Tensor, logprobs: torch.Tensor, chosen: torch.Tensor,
            k: int, processed: bool = True, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """(R, 11 + 2k) float64 on the device: id, log p, raw logit, entropy, rank, finite, raw log p, raw
    entropy, removed mass, the grammar's removed mass (NO_GRAMMAR: no grammar), forced (1: the grammar
    allowed one token), then the k most probable ids and their log p (processed). allowed (R, V) bool:
    the rows' grammar masks (None: no row has a grammar; a row without one allows every token).
    logits, raw (their log-softmax), logprobs (processed) (R, V); chosen (R,). `processed` False: no
    stage ran, logprobs are raw's, and what is raw's is not computed twice (nothing was removed)."""
    idx = chosen[:, None]
    picked, lp_entropy = logprobs.gather(-1, idx), entropy(logprobs)[:, None]
    if processed:
        # what the filters took away, in the model's own probabilities: the raw mass of every -inf token
        removed = ordered_sum(raw.exp().masked_fill(torch.isfinite(logprobs), 0.0), keepdim=True)  # (R, 1)
        raw_lp, raw_entropy = raw.gather(-1, idx), entropy(raw)[:, None]
    else:
        removed, raw_lp, raw_entropy = torch.zeros_like(lp_entropy), picked, lp_entropy
    cols = [idx.double(), picked.double(), logits.gather(-1, idx).double(),
            lp_entropy.double(), ranks(logits, idx).double(),
            torch.isfinite(logits).all(-1, keepdim=True).double(), raw_lp.double(),
            raw_entropy.double(), removed.double()]
    if allowed is None:
        cols += [torch.full_like(removed, NO_GRAMMAR).double(), torch.zeros_like(removed).double()]
    else:
        free = allowed.all(-1, keepdim=True)  # rows without a grammar
        # (R, 1) raw mass it forbade, summed in the order `removed` is: with no filter after the grammar
        # the two masks are the same, so what the filters removed is exactly 0, not a rounding residue
        by_grammar = ordered_sum(raw.exp().masked_fill(allowed, 0.0), keepdim=True)
        cols += [by_grammar.masked_fill(free, NO_GRAMMAR).double(), forced(allowed)[:, None].double()]
    if k:
        alt_lp, alt_ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        cols += [alt_ids.double(), alt_lp.double()]
    return torch.cat(cols, dim=-1)


def top_tokens(raw: torch.Tensor, processed: torch.Tensor, which: str, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The n most probable tokens of each row under `which` distribution ("raw" or "processed"), on
    the CPU: ids (R, n) int64 and log p (R, n) float32; None when n = 0. raw, processed (R, V) log p.

    Processed ranks the tokens the filters kept first; any the filters dropped (log p = -inf) follow
    in raw order, so asking for more than survive still lists the next-best tokens, not arbitrary
    ones. Only n per row leaves the device."""
    if n == 0:
        return None
    if which == "raw":
        lp, ids = torch.topk(raw, n, dim=-1)
        return ids.cpu(), lp.float().cpu()
    kept = torch.isfinite(processed)
    # float64 keys: a dropped token's key sits below the row's lowest kept one, however low (a
    # temperature of 1e-6 puts kept tokens 1e6 apart per unit of logit), and keeps its raw order
    floor = torch.where(kept, processed, torch.inf).amin(-1, keepdim=True).double()  # (R, 1)
    key = torch.where(kept, processed.double(), floor - 1 + (raw - raw.amax(-1, keepdim=True)).double())  # (R, V)
    ids = torch.topk(key, n, dim=-1).indices
    return ids.cpu(), processed.gather(-1, ids).float().cpu()


def greedy_record(logits: torch.Tensor, kernel, made: tuple | None = None) -> tuple[torch.Tensor, list[list[float]]] | None:
    """Greedy rows with no stage and no alternatives: the choice (R,) and `record`'s rows (as lists),
    from the compiled row kernel (head.score_rows's: the top-1, its log p and the entropy in two passes
    over each row, where torch's log-softmax, argmax, entropy and rank take some ten). The greedy choice
    is the top-1 (the first of equal maxima, as argmax), so its rank is 1 and its log p the top's; no
    stage ran, so raw and processed are one. None where the kernel does not take the rows (no kernel,
    not on the CPU, a logit not finite, -inf too): the caller runs `record`, which reports what is wrong.
    The kernel finds the logits not finite in its first pass (strict): a check of its own in torch read
    the fresh logits once more, 0.13-0.22 ms of an 8 ms int8 step. `made`: the same kernel's record,
    made by the engine with these logits (Engine.step_logits: top_id (R,), (3, R) the top-1's log p,
    the entropy and its logit), which saves the call and its Python."""
    if made is not None:
        top_id, (top_logprob, h, logit) = made[0], made[1].tolist()
    else:
        if kernel is None or not logits.is_cpu or logits.dim() != 2:
            return None
        z = logits.float().contiguous()
        try:
            _, _, h, top_id, top_logprob, _, _, bad = kernel(z, torch.zeros(z.shape[0], dtype=torch.long), strict=True)
        except ValueError:
            return None
        if bad:
            return None
        top_logprob, h = top_logprob.tolist(), h.tolist()
        logit = z.numpy()[range(z.shape[0]), top_id.numpy()].tolist()
    return top_id, greedy_rows(top_id.tolist(), top_logprob, h, logit)


def greedy_rows(top_id: list[int], top_logprob: list[float], h: list[float], logit: list[float]) -> list[list[float]]:
    """`record`'s rows for plain greedy choices from their greedy records (each the top-1's id, its log p,
    the entropy, its logit): rank 1, finite, raw and processed one, nothing removed, no grammar."""
    return [[float(i), lp, zz, e, 1.0, 1.0, lp, e, 0.0, NO_GRAMMAR, 0.0]
            for i, lp, zz, e in zip(top_id, top_logprob, logit, h)]


def step_of(row: list[float], token_text, logits: torch.Tensor | None, top: Top | None = None) -> Step:
    """A Step from one row of `record` (logits only to explain non-finite values: needed where the row is
    not finite, else may be None)."""
    if not row[FINITE]:
        check_finite(logits)  # raises NonFiniteLogits with the count
    i, k = int(row[ID]), (len(row) - FIXED) // 2
    alts = [Choice(int(a), token_text(int(a)), math.exp(lp))
            for a, lp in zip(row[FIXED:FIXED + k], row[FIXED + k:])]
    return Step(id=i, token=token_text(i), prob=math.exp(row[LOGPROB]), logit=row[LOGIT],
                entropy=row[ENTROPY], rank=int(row[RANK]), logprob=row[LOGPROB], raw_logprob=row[RAW_LOGPROB],
                raw_entropy=row[RAW_ENTROPY], removed_mass=row[REMOVED], alternatives=alts, top=top,
                grammar_removed=None if row[GRAMMAR] == NO_GRAMMAR else row[GRAMMAR], forced=bool(row[FORCED]))


def spread(logprobs: torch.Tensor) -> torch.Tensor:
    """(N, V) log-probabilities -> (N, 3) float32: entropy (nats), varentropy (nats²) and margin (nats,
    inf with one possible token) of each row: head.py's, once."""
    h = entropy(logprobs)
    return torch.stack([h, varentropy(logprobs, h), margin(logprobs)], dim=-1)
