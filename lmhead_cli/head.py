"""The head's arithmetic: pure functions over a logits vector (V,), each returning data.

Logits are raw, unnormalised scores of any sign; softmax (always in float32) keeps their order,
makes them sum to 1 and gives every token a non-zero share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmhead_cli.errors import NonFiniteLogits, UsageError


@dataclass(frozen=True)
class TokenScore:
    rank: int  # 1 = the highest logit
    id: int
    token: str
    logit: float
    prob: float
    logprob: float


@dataclass(frozen=True)
class TargetScore:
    token: str  # the text the user asked about
    id: int  # its first token
    pieces: list[str]  # all tokens the text splits into (1 for a single token)
    rank: int
    logit: float
    prob: float


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits if any logit is NaN or infinite (safetensors does not check values)."""
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise NonFiniteLogits(f"the head produced {bad} non-finite logits (NaN or inf): the weights "
                              "hold non-finite values or overflowed in this dtype; check the checkpoint "
                              "or try --dtype float32")


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log p = z - logsumexp(z), in float32 whatever the model's dtype. (..., V) -> (..., V)"""
    return torch.log_softmax(logits.float(), dim=-1)


def entropy(logprobs: torch.Tensor) -> float:
    """Shannon entropy in nats of a distribution given by its log-probabilities (V,)."""
    p = logprobs.exp()
    return float(-(p * logprobs).sum())


def nats_to_bits(nats: float) -> float:
    return nats / math.log(2)


def rank_of(logits: torch.Tensor, token_id: int) -> int:
    """1 + the number of tokens scored strictly higher than `token_id`."""
    return 1 + int((logits > logits[token_id]).sum())


def clamp_top_k(k: int, vocab: int) -> int:
    if k < 1:
        raise UsageError(f"--top-k must be at least 1 (got {k})")
    return min(k, vocab)


def top_tokens(logits: torch.Tensor, k: int, token_text) -> list[TokenScore]:
    """The k highest logits (V,) as a ranked table; token_text(id) gives each token's text."""
    logits = logits.float()
    logprobs = log_softmax(logits)
    values, ids = torch.topk(logits, min(k, logits.shape[-1]))
    return [
        TokenScore(rank=i + 1, id=int(t), token=token_text(int(t)), logit=float(v),
                   prob=float(logprobs[t].exp()), logprob=float(logprobs[t]))
        for i, (v, t) in enumerate(zip(values, ids))
    ]


def target_score(logits: torch.Tensor, text: str, ids: list[int], token_text) -> TargetScore:
    """Rank, logit and probability of the first token of `text` (encoded as `ids`)."""
    if not ids:
        raise UsageError(f"--target {text!r} encodes to no tokens")
    logits = logits.float()
    first = ids[0]
    return TargetScore(token=text, id=first, pieces=[token_text(i) for i in ids], rank=rank_of(logits, first),
                       logit=float(logits[first]), prob=float(log_softmax(logits)[first].exp()))


# ---- two distributions compared (`diff`) -------------------------------------------------------
# Divergences are summed in float64 over log-probabilities, so identical inputs give exactly 0 and
# tokens with p = 0 in float32 (a logprob of -inf never arises: softmax of finite logits is > 0) add
# nothing spurious.

def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(p‖q) = Σ p (log p − log q) in nats, for two distributions given by log-probabilities (V,)."""
    logp, logq = logp.double(), logq.double()
    return float((logp.exp() * (logp - logq)).sum())


def js_divergence(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Jensen–Shannon divergence ½ KL(p‖m) + ½ KL(q‖m), m = (p + q)/2, in nats (at most ln 2)."""
    logp, logq = logp.double(), logq.double()
    logm = torch.logaddexp(logp, logq) - math.log(2)
    return 0.5 * kl_divergence(logp, logm) + 0.5 * kl_divergence(logq, logm)


def total_variation(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Total variation distance ½ Σ |p − q|: the most probability any set of tokens gains or loses, in [0, 1]."""
    return float(0.5 * (logp.double().exp() - logq.double().exp()).abs().sum())


def ranks_of(logits: torch.Tensor, ids: torch.Tensor) -> list[int]:
    """rank_of for several tokens at once: logits (V,), ids (N,) -> N ranks (1 = the highest logit)."""
    ascending = torch.sort(logits).values  # (V,): one sort, then a binary search per token
    not_higher = torch.searchsorted(ascending, logits[ids].contiguous(), right=True)  # (N,) counts ≤ z_id
    return [1 + logits.shape[-1] - int(n) for n in not_higher]
