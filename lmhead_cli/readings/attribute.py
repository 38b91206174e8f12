"""`lmhead attribute PROMPT --target T [--vs U]`: direct logit attribution.

The final residual x at the last position is a sum of parts: the token and position embeddings,
each layer's attention output (its heads plus the output projection's bias) and each layer's MLP
output. The final norm divides by a scale σ computed from x itself; holding σ at that value (the
standard linearisation, exact for this prompt) makes the norm linear, so the logit

    z_T = e_T · N(x) = Σ_parts e_T · (γ ⊙ centre(part)) / σ  +  e_T · β

splits exactly into one number per part, where e_T is the target's row of the head (with --vs U,
e_T − e_U and the logit difference z_T − z_U). RMSNorm has no centring and no β; the same holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmhead_cli.errors import UnsupportedModel
from lmhead_cli.head import encode_target
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.readings.inspect import PromptToken, check_prompt, encode_prompt, last_logits

# The parts must add up to the residual the forward computed, and the linearised norm must give the
# model's own norm, up to rounding in the model's dtype; a miss beyond this (relative to the largest
# entry: 1e-3 in float32, 16 units of the last place in bfloat16/float16, whose sums round far more)
# means the model adds something else to its stream, and attribution would be wrong.
SUM_TOLERANCE = 1e-3
ROUNDING_ULPS = 16


@dataclass(frozen=True)
class Part:
    name: str  # "embed.token", "embed.position", "attn.3", "mlp.3", "ln_f.bias", "head.bias"
    layer: int | None  # None for the embeddings and the biases after the last layer
    kind: str  # "embed", "attn", "mlp", "ln_f_bias" (and "head_bias" for a head with a bias)
    value: float  # its share of the logit (or the logit difference)


@dataclass(frozen=True)
class HeadPart:
    layer: int
    head: int
    value: float


@dataclass(frozen=True)
class BiasPart:
    layer: int
    value: float  # the attention output projection's bias: attn.{layer} = Σ heads + this


@dataclass(frozen=True)
class Asked:
    """A token the user asked about: the text, and the first of the tokens it encodes to (the one used)."""

    token: str
    id: int
    pieces: list[str]


@dataclass
class Attribution:
    model: str
    random_weights: bool
    engine: str
    tied: bool
    prompt_tokens: list[PromptToken]
    truncated: int
    target: Asked
    vs: Asked | None
    logit: float  # the head's own z_T (or z_T − z_U), from inspect's forward
    parts: list[Part]  # model order: embeddings, attn and mlp of each layer, then the final norm's β
    heads: list[HeadPart]  # layer by layer, head by head
    attn_bias: list[BiasPart]
    heads_sum: list[float]  # per layer, Σ of its heads: attn.{layer} = heads_sum + attn_bias
    sum: float  # Σ parts
    error: float  # sum − logit
    sigma: float  # the final norm's scale σ, from the actual final residual
    norm: str  # "LayerNorm" or "RMSNorm"
    n_layer: int
    n_head: int


def _asked(loaded: Loaded, text: str, key: str) -> Asked:
    pieces = encode_target(loaded.tokenizer, text, key)
    return Asked(token=text, id=pieces[0], pieces=[loaded.tokenizer.token_text(i) for i in pieces])


def check_attribute(prompt: str | None, target: str, vs: str | None) -> None:
    """Usage errors of `attribute` (a target is given), raised before any model is loaded."""
    check_prompt(prompt)
    for key, text in (("target", target), ("vs", vs)):
        if text is not None and not text:
            encode_target(None, text, key)  # raises BadValue: "" has no token, no tokenizer needed


def _check_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """UnsupportedModel when `got` misses `want` (…, D) by more than rounding in `dtype`."""
    miss = float((got - want).abs().max())
    tolerance = max(SUM_TOLERANCE, ROUNDING_ULPS * torch.finfo(dtype).eps)
    if miss > tolerance * max(1.0, float(want.abs().max())):
        raise UnsupportedModel(f"{what} (off by {miss:.3g}), so its logit cannot be split into parts")


@torch.inference_mode()
def attribute_logit(loaded: Loaded, prompt: str, target: str, vs: str | None = None) -> Attribution:
    """Decompose the last position's logit of `target` (minus that of `vs`) after `prompt` into parts."""
    eng, tok = loaded.engine, loaded.tokenizer
    asked_t = _asked(loaded, target, "target")
    asked_u = _asked(loaded, vs, "vs") if vs is not None else None
    ids, dropped = encode_prompt(loaded, prompt)

    logits, _ = last_logits(loaded, ids)  # (V,) float32: inspect's own forward and head
    t, u = asked_t.id, (asked_u.id if asked_u is not None else None)
    logit = float(logits[t]) - (float(logits[u]) if u is not None else 0.0)

    c = eng.components(torch.tensor([ids], device=eng.device))
    embed = {name: p[0].double() for name, p in c.embed.items()}  # (D,) each
    heads, attn_bias, mlp = c.heads[0].double(), c.attn_bias.double(), c.mlp[0].double()  # (L, H, D), (L, D), (L, D)
    resid = c.resid[0].double()  # (D,)
    L, H = heads.shape[0], heads.shape[1]
    _check_close(sum(embed.values()) + heads.sum((0, 1)) + attn_bias.sum(0) + mlp.sum(0), resid, eng.dtype,
                 "this model's residual stream is not the sum of its embeddings, attention and MLP outputs")
    norm = c.norm
    beta = norm.beta.double() if norm.beta is not None else None
    sigma = norm.sigma(resid)  # (1,): from the actual final residual
    _check_close(norm.apply(resid, sigma) + (beta if beta is not None else 0), eng.final_norm(c.resid)[0].double(),
                 eng.dtype, "its final norm is not γ ⊙ centre(x) / σ + β")

    W = eng.head_rows([t] if u is None else [t, u]).double()  # W_out's rows (int8 weights: dequantised)
    e = W[0] - (W[1] if u is not None else 0)  # (D,): the row (or the difference of rows)

    def share(part: torch.Tensor) -> torch.Tensor:  # (..., D) -> (...): e · (γ ⊙ centre(part)) / σ
        return norm.apply(part, sigma) @ e

    head_values, bias_values, mlp_values = share(heads), share(attn_bias), share(mlp)  # (L, H), (L,), (L,)
    parts = [Part(f"embed.{name}", None, "embed", float(share(p))) for name, p in embed.items()]
    for layer in range(L):
        parts.append(Part(f"attn.{layer}", layer, "attn", float(head_values[layer].sum() + bias_values[layer])))
        parts.append(Part(f"mlp.{layer}", layer, "mlp", float(mlp_values[layer])))
    if beta is not None:
        parts.append(Part("ln_f.bias", None, "ln_f_bias", float(beta @ e)))
    head_bias = getattr(eng.head_module, "bias", None)
    if head_bias is not None:
        b = float(head_bias[t]) - (float(head_bias[u]) if u is not None else 0.0)
        parts.append(Part("head.bias", None, "head_bias", b))
    total = sum(p.value for p in parts)

    return Attribution(
        model=loaded.source, random_weights=loaded.random_weights, engine=eng.name, tied=loaded.tie.tied,
        prompt_tokens=[PromptToken(i, tok.token_text(i)) for i in ids], truncated=dropped,
        target=asked_t, vs=asked_u, logit=logit, parts=parts,
        heads=[HeadPart(layer, h, float(head_values[layer, h])) for layer in range(L) for h in range(H)],
        attn_bias=[BiasPart(layer, float(bias_values[layer])) for layer in range(L)],
        heads_sum=[float(v) for v in head_values.sum(1)],
        sum=total, error=total - logit, sigma=float(sigma), norm="LayerNorm" if norm.centred else "RMSNorm",
        n_layer=L, n_head=H,
    )
