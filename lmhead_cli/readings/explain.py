"""`lmhead inspect --explain TOKEN`: one logit taken apart.

The head scores token k by a dot product with its own row of the output matrix (with tied weights,
the token's embedding row): z_k = e_k · h + b_k = |e_k| · |h| · cos θ_k + b_k. Every token shares
the same h, so between two tokens only |e| and cos θ differ. h is the last position's residual
vector after the final norm: a LayerNorm (GPT-2) removes its mean, divides by its standard
deviation (leaving norm √D) and applies a learned gain and bias; an RMSNorm (Llama, Gemma)
divides by its root mean square (also leaving norm √D) and applies a gain. A model that soft-caps
its own logits (Gemma-2) then turns z into c·tanh(z/c), reported as `own_softcap`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmhead_cli.engine.base import linearise_norm
from lmhead_cli.errors import UnsupportedModel
from lmhead_cli.head import Distribution, check_finite, clamp_top_k, encode_target, encode_targets
from lmhead_cli.readings.inspect import PromptToken, encode_prompt
from lmhead_cli.loading.sources import Loaded


@dataclass(frozen=True)
class LogitParts:
    """One token's logit and the pieces it is made of."""

    rank: int
    id: int
    token: str
    logit: float  # the head's own logit, as `inspect` shows it
    dot: float  # e · h, recomputed here in float64
    bias: float  # the head's bias for this token (0 when the head has none, as in GPT-2)
    row_norm: float  # |e|
    cos: float  # cos θ between e and h
    product: float  # |e| · |h| · cos θ + bias
    prob: float
    margin_to_top: float  # z - z of the rank-1 token
    margin_to_runner_up: float  # z - z of the rank-2 token


@dataclass
class Explanation:
    model: str
    random_weights: bool
    tied: bool  # the row is the token's embedding row (else the head's own row)
    head_has_bias: bool
    prompt_tokens: list[PromptToken]
    truncated: int
    token: str  # the text asked about
    pieces: list[str]  # its tokens; the first is explained
    # The final norm's effect on the last position's vector:
    norm: str  # "LayerNorm" or "RMSNorm": what the final norm does
    norm_before: float  # |x|, the raw residual stream
    mean_before: float  # mean of x's D entries: removed by a LayerNorm, kept by an RMSNorm
    std_before: float  # their standard deviation (with the norm's eps): divided out by a LayerNorm
    rms_before: float  # their root mean square (with the norm's eps): divided out by an RMSNorm
    norm_standardised: float  # |x̂| = |(x - mean) / std| (LayerNorm) or |x / rms| (RMSNorm), ≈ √D
    norm_after: float  # |h| = |γ ⊙ x̂ + β|, what the head sees
    width: int  # D
    vocab: int  # V
    explained: LogitParts
    top_token: str  # rank 1
    runner_up_token: str  # rank 2
    top: list[LogitParts]  # the top few, then any --target outside them
    own_softcap: float | None = None  # c when the model turns e·h + b into c·tanh(z/c) itself (Gemma-2)


@torch.inference_mode()
def explain_logit(loaded: Loaded, prompt: str, token: str, top_k: int = 5,
                  targets: list[str] | None = None) -> Explanation:
    """Take the logit of `token` (its first piece) after `prompt` apart, beside the top `top_k` tokens."""
    eng, tok = loaded.engine, loaded.tokenizer
    pieces = encode_target(tok, token, key="explain")
    extra = [ids[0] for _, ids in encode_targets(tok, targets)]
    k = clamp_top_k(top_k, eng.vocab_size)
    ids, dropped = encode_prompt(loaded, prompt)

    x = torch.tensor([ids], device=eng.device)  # (1, T)
    *_, resid = eng.residuals(x)  # (1, T, D): the last block's output, before ln_f
    h = eng.final_norm(resid)[:, -1:, :]  # (1, 1, D), as `body` gives it
    logits = eng.head(h)[0, 0].float()  # (V,), the very logits `inspect` shows
    check_finite(logits)
    x_last, h_last = resid[0, -1].double(), h[0, 0].double()  # (D,)

    kind, eps = norm_kind(eng.final_norm_module)
    mean, std = x_last.mean(), (x_last.var(unbiased=False) + eps).sqrt()
    rms = (x_last.pow(2).mean() + eps).sqrt()
    standardised = (x_last - mean) / std if kind == "LayerNorm" else x_last / rms

    bias = getattr(eng.head_module, "bias", None)
    order = torch.argsort(logits, descending=True, stable=True)
    z_top, z_second = float(logits[order[0]]), float(logits[order[1]])
    dist = Distribution(logits)
    h_norm = float(h_last.norm())

    def parts(i: int) -> LogitParts:
        e = eng.head_rows([i])[0].double()  # (D,): token i's row of W_out (= E with tied weights)
        b = float(bias[i]) if bias is not None else 0.0
        dot = float(e @ h_last)
        e_norm = float(e.norm())
        cos = float(torch.nn.functional.cosine_similarity(e, h_last, dim=0))  # the angle, measured on its own
        z = float(logits[i])
        return LogitParts(rank=dist.rank(i), id=i, token=tok.token_text(i), logit=z, dot=dot, bias=b,
                          row_norm=e_norm, cos=cos, product=e_norm * h_norm * cos + b, prob=dist.prob(i),
                          margin_to_top=z - z_top, margin_to_runner_up=z - z_second)

    shown = order[:k].tolist()
    shown += [i for i in [pieces[0], *extra] if i not in shown]
    return Explanation(
        model=loaded.source, random_weights=loaded.random_weights, tied=loaded.tie.tied,
        head_has_bias=bias is not None, prompt_tokens=[PromptToken(i, tok.token_text(i)) for i in ids],
        truncated=dropped, token=token, pieces=[tok.token_text(i) for i in pieces],
        norm=kind, norm_before=float(x_last.norm()), mean_before=float(mean), std_before=float(std),
        rms_before=float(rms), norm_standardised=float(standardised.norm()), norm_after=h_norm,
        width=int(x_last.shape[0]), own_softcap=eng.own_stages.get("softcap"),
        vocab=int(logits.shape[-1]),
        explained=parts(pieces[0]), top_token=tok.token_text(int(order[0])),
        runner_up_token=tok.token_text(int(order[1])), top=[parts(i) for i in dict.fromkeys(shown)],
    )


def norm_kind(module) -> tuple[str, float]:
    """("LayerNorm" | "RMSNorm", eps) of a final norm module (engine.base.linearise_norm tells them
    apart); UnsupportedModel for any other."""
    lin = linearise_norm(module) if module is not None else None
    if lin is None:
        raise UnsupportedModel(f"taking a logit apart reads the final norm as a LayerNorm or an RMSNorm; "
                               f"this model's is {type(module).__name__}")
    return ("LayerNorm" if lin.centred else "RMSNorm"), float(lin.eps)
