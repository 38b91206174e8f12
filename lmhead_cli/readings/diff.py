"""`lmhead diff PROMPT_A PROMPT_B`: two next-token distributions side by side.

Each prompt runs through the body and the head on its last position only (two forwards, each
exactly `inspect`'s), then the two distributions p (after A) and q (after B) are compared:
KL(p‖q), KL(q‖p), Jensen–Shannon and total variation, each token's rank on the other side, and the
tokens whose log-probability moved most among the union of both sides' top tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lmhead_cli.head import (Distribution, TargetScore, TokenScore, clamp_top_k, encode_targets, js_divergence,
                             kl_divergence, nats_to_bits, total_variation)
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.readings.inspect import PromptToken, encode_prompt, last_logits


@dataclass(frozen=True)
class Side:
    prompt: str
    prompt_tokens: list[PromptToken]
    truncated: int  # tokens dropped from the front to fit the context
    top: list[TokenScore]  # each with other_rank, its rank after the other prompt
    entropy: float  # nats
    entropy_bits: float


@dataclass(frozen=True)
class Mover:
    """A token whose log-probability changed from A to B."""

    id: int
    token: str
    logprob_a: float
    logprob_b: float
    delta: float  # logprob_b − logprob_a: > 0 rose, < 0 fell


@dataclass(frozen=True)
class DiffTarget:
    token: str  # the text asked about
    id: int  # its first token
    pieces: list[str]  # every token it encodes to
    logprob_a: float
    logprob_b: float
    prob_a: float
    prob_b: float
    rank_a: int
    rank_b: int
    delta: float  # logprob_b − logprob_a


@dataclass
class Diff:
    model: str
    random_weights: bool
    a: Side
    b: Side
    kl_ab: float  # KL(A‖B), nats
    kl_ba: float  # KL(B‖A), nats
    js: float  # Jensen–Shannon divergence, nats (≤ ln 2)
    tv: float  # total variation distance, a probability in [0, 1]
    pool: int  # how many tokens the movers were chosen from: the union of both top-N
    risers: list[Mover]  # largest delta first, delta > 0
    fallers: list[Mover]  # most negative delta first, delta < 0
    targets: list[DiffTarget]

    @property
    def kl_ab_bits(self) -> float:
        return nats_to_bits(self.kl_ab)

    @property
    def kl_ba_bits(self) -> float:
        return nats_to_bits(self.kl_ba)

    @property
    def js_bits(self) -> float:
        return nats_to_bits(self.js)


def _side(loaded: Loaded, prompt: str, ids: list[int], dropped: int, dist: Distribution,
          other: Distribution, k: int) -> Side:
    """One prompt's reading: its top k (each with its rank under the `other` distribution) and entropy."""
    text = loaded.tokenizer.token_text
    top: list[TokenScore] = dist.top(k, text)
    other_ranks = other.ranks(torch.tensor([t.id for t in top], device=other.logits.device)).tolist()
    return Side(prompt=prompt, prompt_tokens=[PromptToken(i, text(i)) for i in ids], truncated=dropped,
                top=[replace(t, other_rank=r) for t, r in zip(top, other_ranks)],
                entropy=dist.entropy, entropy_bits=dist.entropy_bits)


def _target(a: TargetScore, b: TargetScore, logp: torch.Tensor, logq: torch.Tensor) -> DiffTarget:
    la, lb = float(logp[a.id]), float(logq[a.id])
    return DiffTarget(token=a.token, id=a.id, pieces=a.pieces, logprob_a=la, logprob_b=lb, prob_a=a.prob,
                      prob_b=b.prob, rank_a=a.rank, rank_b=b.rank, delta=lb - la)


def diff_prompts(loaded: Loaded, prompt_a: str, prompt_b: str, top_k: int = 10,
                 targets: list[str] | None = None, movers: int | None = None) -> Diff:
    """Compare the next-token distributions after `prompt_a` and `prompt_b`.

    top_k: rows per side, and N for the movers' pool (the union of both sides' top N);
    movers: how many risers and fallers to list (default top_k).
    """
    k = clamp_top_k(top_k, loaded.engine.vocab_size)
    n_movers = k if movers is None else movers
    text = loaded.tokenizer.token_text
    ids_a, cut_a = encode_prompt(loaded, prompt_a)
    ids_b, cut_b = encode_prompt(loaded, prompt_b)
    za, _ = last_logits(loaded, ids_a)  # (V,) float32
    zb, _ = last_logits(loaded, ids_b)
    p, q = Distribution(za), Distribution(zb)
    logp, logq = p.logprobs, q.logprobs  # (V,) each

    pool = torch.unique(torch.cat([torch.topk(za, k).indices, torch.topk(zb, k).indices]))  # (≤ 2k,)
    delta = logq[pool] - logp[pool]  # (≤ 2k,)
    order = torch.argsort(delta, descending=True, stable=True)

    def mover(i: int) -> Mover:
        t = int(pool[i])
        return Mover(id=t, token=text(t), logprob_a=float(logp[t]), logprob_b=float(logq[t]), delta=float(delta[i]))

    risers = [mover(int(i)) for i in order if delta[i] > 0][:n_movers]
    fallers = [mover(int(i)) for i in order.flip(0) if delta[i] < 0][:n_movers]

    scored = [_target(p.target(t, pieces, text), q.target(t, pieces, text), logp, logq)
              for t, pieces in encode_targets(loaded.tokenizer, targets)]

    return Diff(model=loaded.source, random_weights=loaded.random_weights,
                a=_side(loaded, prompt_a, ids_a, cut_a, p, q, k), b=_side(loaded, prompt_b, ids_b, cut_b, q, p, k),
                kl_ab=kl_divergence(logp, logq), kl_ba=kl_divergence(logq, logp), js=js_divergence(logp, logq),
                tv=total_variation(logp, logq), pool=int(pool.numel()), risers=risers, fallers=fallers,
                targets=scored)

