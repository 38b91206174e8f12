"""`lmhead neurons`: what each MLP neuron writes into the vocabulary (Geva et al. 2022).

An MLP's output is Σ_i a_i v_i + b: neuron i's activation a_i times its value vector v_i (a row of the
output projection: GPT-2's c_proj weight (4D, D), Llama's down_proj weight transposed). Read the
way `attribute` reads a part, through the final norm's gain and centring and the head,

    r_i[k] = e_k · (γ ⊙ centre(v_i))

is how much writing v_i raises token k's logit (per unit of a_i, before the norm's scale 1/σ): the
tokens with the largest r_i[k] are what the neuron promotes, the smallest what it suppresses.

With a prompt and a target T, neuron i's share of T's logit at the last position is

    a_i · e_T · (γ ⊙ centre(v_i)) / σ

(σ the final norm's scale of the actual final residual, as in attribute), and the shares of a layer's
neurons plus its bias's share add up to that layer's MLP part in `attribute`, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmhead_cli.engine.base import LayerTaps, NormLinearisation, linearise_norm
from lmhead_cli.errors import BadValue, NonFiniteLogits, UnsupportedModel
from lmhead_cli.head import NON_FINITE_ADVICE, check_top_k, clamp_top_k
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.readings.attribute import Asked, _asked, attribute_logit
from lmhead_cli.readings.inspect import PromptToken, encode_prompt

CHUNK = 256  # neurons read at a time in --layer: (V, CHUNK) float32 readouts, 51 MB for GPT-2's vocabulary
# A layer's table holds its neurons × 2 sides × `top` tokens; past this many (~200 bytes each held, more
# as JSON) `top` is refused with the most that fits: GPT-2's 3,072 neurons a layer take top <= 32.
MAX_TABLE_TOKENS = 200_000


@dataclass(frozen=True)
class TokenValue:
    id: int
    token: str
    value: float  # e_k · (γ ⊙ centre(v)): the logit it adds per unit of activation (before 1/σ)


@dataclass(frozen=True)
class NeuronTokens:
    """One neuron's readout: the tokens it raises most and lowers most."""

    layer: int
    index: int
    promotes: list[TokenValue]  # largest first
    suppresses: list[TokenValue]  # most negative first


@dataclass(frozen=True)
class Writer:
    """A neuron that writes the asked token: value = e_T · (γ ⊙ centre(v))."""

    layer: int
    index: int
    value: float


@dataclass(frozen=True)
class Share:
    """A neuron's share of the target's logit after a prompt: activation × readout / σ."""

    layer: int
    index: int
    activation: float  # a_i at the last position
    readout: float  # e_T · (γ ⊙ centre(v_i)) / σ
    value: float  # activation × readout


@dataclass
class Neurons:
    model: str
    random_weights: bool
    mode: str  # "layer", "token" or "prompt"
    n_layer: int
    n_neurons: int  # per layer
    norm: str  # "LayerNorm" or "RMSNorm"
    tied: bool
    top: int
    layer: int | None = None  # --layer
    token: Asked | None = None  # --token, or the prompt's target
    neurons: list = field(default_factory=list)  # NeuronTokens, Writer or Share
    # prompt mode: the check that the neurons add up to attribute's MLP parts
    prompt_tokens: list[PromptToken] = field(default_factory=list)
    truncated: int = 0
    logit: float | None = None  # the head's own logit of the target
    sigma: float | None = None
    mlp_parts: list[float] = field(default_factory=list)  # attribute's mlp.{layer}
    neuron_sums: list[float] = field(default_factory=list)  # per layer, Σ neurons' shares
    bias_parts: list[float] = field(default_factory=list)  # per layer, the MLP output bias's share
    sum: float | None = None  # Σ neurons + Σ biases, all layers
    mlp_sum: float | None = None  # Σ attribute's MLP parts
    error: float | None = None  # sum − mlp_sum


def _taps(loaded: Loaded) -> tuple[list[LayerTaps], NormLinearisation]:
    """Every layer's taps with value vectors, and the final norm linearised; UnsupportedModel otherwise."""
    eng = loaded.engine
    taps = eng.layer_taps()
    if any(t.mlp_out is None for t in taps):  # values are None just then (reading them may dequantise them)
        raise UnsupportedModel(f"lmhead cannot find the MLP output projection (c_proj, down_proj, fc2) of "
                               f"{loaded.source}'s layers, whose rows are the neurons' value vectors")
    norm = eng.final_norm_module
    lin = linearise_norm(norm) if norm is not None else None
    if lin is None:
        raise UnsupportedModel(f"neurons are read through the final norm, which must be a LayerNorm or an RMSNorm; "
                               f"{loaded.source}'s is {'none' if norm is None else type(norm).__name__}")
    return taps, lin


def _check_readouts(r: torch.Tensor, layer: int) -> None:
    """NonFiniteLogits if a readout is NaN or infinite (a NaN in the norm's γ, the head or a value vector):
    a ranking of NaNs would list arbitrary tokens."""
    if not bool(torch.isfinite(r).all()):
        bad = int((~torch.isfinite(r)).sum())
        raise NonFiniteLogits(f"{bad:,} readouts of layer {layer}'s neurons are not finite (NaN or inf): "
                              f"{NON_FINITE_ADVICE}")


def check_layer(layer: int, n_layer: int) -> int:
    if not 0 <= layer < n_layer:
        raise BadValue("layer", f"must be 0 to {n_layer - 1} for this model's {n_layer} layers (got {layer})")
    return layer


def _base(loaded: Loaded, mode: str, taps, lin, top: int, **more) -> Neurons:
    return Neurons(model=loaded.source, random_weights=loaded.random_weights, mode=mode, n_layer=len(taps),
                   n_neurons=int(taps[0].values.shape[0]), norm="LayerNorm" if lin.centred else "RMSNorm",
                   tied=loaded.tie.tied, top=top, **more)


def _head_matrix(loaded: Loaded) -> torch.Tensor:
    """W_out (V, D) float32 (int8 weights dequantised)."""
    eng = loaded.engine
    w = eng.head_weight
    if w.is_floating_point():
        return w.detach().float()
    return eng.head_rows(torch.arange(w.shape[0], device=w.device)).float()


@torch.inference_mode()
def layer_neurons(loaded: Loaded, layer: int, top: int = 5, indices: list[int] | None = None) -> Neurons:
    """Each neuron of `layer` (or those in `indices`): the `top` tokens its value vector promotes and
    suppresses most, r[k] = e_k · (γ ⊙ centre(v)). Memory: CHUNK neurons' (V,) readouts at a time."""
    taps, lin = _taps(loaded)
    check_layer(layer, len(taps))
    values = taps[layer].values
    N = values.shape[0]
    for i in indices or ():
        if not 0 <= i < N:
            raise BadValue("neuron", f"must be 0 to {N - 1} for this model's {N} neurons a layer (got {i})")
    k = clamp_top_k(check_top_k(top), loaded.engine.vocab_size)
    rows = len(indices) if indices else N
    if rows * 2 * k > MAX_TABLE_TOKENS:
        raise BadValue("top", f"must be at most {max(1, MAX_TABLE_TOKENS // (2 * rows)):,} for {rows:,} neurons: "
                              f"each lists its top tokens on both sides, {MAX_TABLE_TOKENS:,} tokens in all "
                              f"at most (got {top:,})")
    W, text = _head_matrix(loaded), loaded.tokenizer.token_text
    chosen = list(indices) if indices else list(range(N))
    out = []
    for start in range(0, len(chosen), CHUNK):
        idx = chosen[start:start + CHUNK]
        g = lin.apply(values[idx].float(), 1.0)  # (n, D): γ ⊙ centre(v)
        r = W @ g.T  # (V, n)
        _check_readouts(r, layer)
        hi, hi_ids = (t.T.tolist() for t in r.topk(k, dim=0))  # (n, k) each, as Python numbers at once
        lo, lo_ids = (t.T.tolist() for t in (-r).topk(k, dim=0))
        for j, i in enumerate(idx):
            out.append(NeuronTokens(layer, i,
                                    [TokenValue(t, text(t), v) for t, v in zip(hi_ids[j], hi[j])],
                                    [TokenValue(t, text(t), -v) for t, v in zip(lo_ids[j], lo[j])]))
    return _base(loaded, "layer", taps, lin, k, layer=layer, neurons=out)


@torch.inference_mode()
def token_writers(loaded: Loaded, token: str, top: int = 10, layer: int | None = None) -> Neurons:
    """The `top` neurons anywhere in the model (or in `layer`) whose value vectors write `token` (its
    first piece) most: e_T · (γ ⊙ centre(v)), largest first. Memory: one layer's (N,) values at a time."""
    taps, lin = _taps(loaded)
    if layer is not None:
        check_layer(layer, len(taps))
    asked = _asked(loaded, token, "token")
    k = check_top_k(top)
    e = loaded.engine.head_rows([asked.id]).float()[0]  # (D,)
    best: list[Writer] = []
    for li, tap in enumerate(taps):
        if layer is not None and li != layer:
            continue
        v = lin.apply(tap.values.float(), 1.0) @ e  # (N,)
        _check_readouts(v, li)
        vals, ids = v.topk(min(k, v.shape[0]))
        best = sorted(best + [Writer(li, int(i), float(x)) for i, x in zip(ids, vals)], key=lambda w: -w.value)[:k]
    return _base(loaded, "token", taps, lin, k, layer=layer, token=asked, neurons=best)


@torch.inference_mode()
def neuron_shares(loaded: Loaded, prompt: str, target: str, top: int = 10, layer: int | None = None) -> Neurons:
    """attribute at neuron grain: each neuron's share a_i · e_T · (γ ⊙ centre(v_i)) / σ of `target`'s
    logit at the last position of `prompt`; the `top` largest in size (of `layer`, or all), and the
    check that every layer's neurons plus its bias add up to attribute's MLP part."""
    taps, lin = _taps(loaded)
    if layer is not None:
        check_layer(layer, len(taps))
    k = check_top_k(top)
    eng = loaded.engine
    attribution = attribute_logit(loaded, prompt, target)  # the parts the neurons must add up to
    ids, dropped = encode_prompt(loaded, prompt)

    acts: dict[int, torch.Tensor] = {}
    handles = [t.mlp_out.register_forward_pre_hook(lambda _m, args, i=i: acts.__setitem__(i, args[0][..., -1, :].reshape(-1)))
               for i, t in enumerate(taps)]
    try:
        c = eng.components(torch.tensor([ids], device=eng.device))
    finally:
        for h in handles:
            h.remove()
    resid = c.resid[0].double()
    norm = c.norm
    sigma = norm.sigma(resid)  # (1,)
    e = eng.head_rows([attribution.target.id]).double()[0]  # (D,)

    shares, neuron_sums, bias_parts = [], [], []
    for li, tap in enumerate(taps):
        readout = norm.apply(tap.values.double(), sigma) @ e  # (N,)
        value = acts[li].double() * readout  # (N,)
        neuron_sums.append(float(value.sum()))
        bias_parts.append(float(norm.apply(tap.mlp_bias.double(), sigma) @ e) if tap.mlp_bias is not None else 0.0)
        if layer is None or li == layer:
            n = min(k, value.shape[0])
            _, order = value.abs().topk(n)
            shares += [Share(li, int(i), float(acts[li][i]), float(readout[i]), float(value[i])) for i in order]
    shares = sorted(shares, key=lambda s: -abs(s.value))[:k]
    mlp_parts = [p.value for p in attribution.parts if p.kind == "mlp"]
    total = sum(neuron_sums) + sum(bias_parts)
    return _base(loaded, "prompt", taps, lin, k, layer=layer, token=attribution.target, neurons=shares,
                 prompt_tokens=attribution.prompt_tokens, truncated=dropped, logit=attribution.logit,
                 sigma=float(sigma), mlp_parts=mlp_parts, neuron_sums=neuron_sums, bias_parts=bias_parts,
                 sum=total, mlp_sum=sum(mlp_parts), error=total - sum(mlp_parts))
