"""The statistics of `llama-perplexity --kl-divergence`, over per-position figures already computed.

Pure arithmetic on four columns of n values (one per scored position), in float64:

* nll_q, nll_base: −log p of the actual next token under Q and under the base;
* kld: KL(base ‖ Q) = Σ_v p_base(v)·(log p_base(v) − log p_Q(v)) at that position;
* same_top: whether both models put the same token first.

The definitions follow llama.cpp's tools/perplexity/perplexity.cpp (`kl_divergence`):

* a mean's uncertainty is √(σ²/(n−1)), σ² = mean(x²) − mean(x)², the population variance;
* PPL = exp(mean nll) ± PPL·u(mean nll);
* Cov(ln PPL(Q), ln PPL(base)) = (mean(a·b) − mean(a)·mean(b))/(n−1) over the two nll columns, and the
  correlation is that covariance over the product of the two means' uncertainties (Pearson's r);
* ln(PPL(Q)/PPL(base)) = mean nll_q − mean nll_base ± √(u_q² + u_base² − 2·Cov): the two means
  are correlated (same text, related models), which makes the ratio far more precise than either PPL;
  PPL(Q)/PPL(base) is its exp (± ratio·u), PPL(Q) − PPL(base) ± √(u(PPL_q)² + u(PPL_base)² −
  2·PPL_q·PPL_base·Cov);
* RMS Δp = √mean(Δp²) ± u(mean Δp²)/(2·RMS);
* "same top p" = the fraction f of positions with the same top token ± √(f(1−f)/(n−1));
* percentiles interpolate linearly between the sorted values at fraction·(n−1) (numpy's "linear").

Where llama.cpp differs by policy, not definition: it prints an uncertainty of 0 for n ≤ 10 and no
summary at all for n < 100; here an uncertainty is None only where the formula has no value (n < 2,
a zero variance in a ratio) and the renderer says when n is small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmhead_cli.head import perplexity

# (label, fraction) of the percentiles llama-perplexity prints, highest first.
KLD_PERCENTILES = (("max", 1.0), ("99.9%", 0.999), ("99%", 0.99), ("95%", 0.95), ("90%", 0.90),
                   ("median", 0.5), ("10%", 0.10), ("5%", 0.05), ("1%", 0.01), ("0.1%", 0.001), ("min", 0.0))
DP_PERCENTILES = (*KLD_PERCENTILES[:5], ("75%", 0.75), ("median", 0.5), ("25%", 0.25), *KLD_PERCENTILES[6:])


@dataclass(frozen=True)
class Estimate:
    """A figure and its standard uncertainty (None where the formula has no value)."""

    value: float
    uncertainty: float | None


@dataclass(frozen=True)
class Statistics:
    """Everything `compare` reports about the whole text, over `positions` scored positions."""

    positions: int
    ppl_q: Estimate
    ppl_base: Estimate
    cor_ln_ppl: float | None  # Pearson correlation of the per-position nll of Q and of the base
    ln_ppl_ratio: Estimate  # ln(PPL(Q)/PPL(base))
    ppl_ratio: Estimate  # PPL(Q)/PPL(base)
    ppl_diff: Estimate  # PPL(Q) − PPL(base)
    kld_mean: Estimate  # nats
    kld_percentiles: dict[str, float]  # KLD_PERCENTILES' labels -> nats
    dp_mean: Estimate  # Δp = p_Q − p_base of the actual next token, a probability (not %)
    dp_rms: Estimate
    dp_percentiles: dict[str, float]  # DP_PERCENTILES' labels -> Δp
    same_top: Estimate  # a fraction in [0, 1]


def mean_and_uncertainty(x: torch.Tensor) -> Estimate:
    """mean(x) ± √((mean(x²) − mean(x)²)/(n−1)); x (n,) float64. The uncertainty is None for n < 2
    and 0 for a variance that rounds to ≤ 0."""
    n = len(x)
    mean = float(x.mean())
    if n < 2:
        return Estimate(mean, None)
    var = float((x * x).mean()) - mean * mean
    return Estimate(mean, math.sqrt(var / (n - 1)) if var > 0 else 0.0)


def covariance_of_means(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """(mean(a·b) − mean(a)·mean(b))/(n−1): the covariance of the two columns' means; None for n < 2."""
    n = len(a)
    if n < 2:
        return None
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1)


def percentile(ascending: torch.Tensor, fraction: float) -> float:
    """The value at `fraction` of sorted values (n,): linear interpolation between the values at
    floor and ceil of fraction·(n−1)."""
    n = len(ascending)
    if fraction <= 0:
        return float(ascending[0])
    if fraction >= 1:
        return float(ascending[-1])
    p = fraction * (n - 1)
    i = int(p)
    w = p - i
    return (1 - w) * float(ascending[i]) + w * float(ascending[min(i + 1, n - 1)])


def percentiles(x: torch.Tensor, which) -> dict[str, float]:
    ascending = torch.sort(x).values
    return {label: percentile(ascending, fraction) for label, fraction in which}


def _sqrt(v: float | None) -> float | None:
    return None if v is None else math.sqrt(max(v, 0.0))


def statistics(nll_q: torch.Tensor, nll_base: torch.Tensor, kld: torch.Tensor, same_top: torch.Tensor) -> Statistics:
    """The statistics of n ≥ 1 positions from their columns (n,) (see the module's docstring)."""
    a, b, k = nll_q.double(), nll_base.double(), kld.double()
    n = len(a)
    lq, lb = mean_and_uncertainty(a), mean_and_uncertainty(b)
    cov = covariance_of_means(a, b)
    ppl_q, ppl_b = perplexity(lq.value), perplexity(lb.value)

    def times(scale: float, u: float | None) -> float | None:
        return None if u is None else scale * u

    cor = None
    if cov is not None and lq.uncertainty and lb.uncertainty:
        cor = cov / (lq.uncertainty * lb.uncertainty)
    # u_q² + u_base² − 2·Cov is, term for term, the uncertainty² of the mean of nll_q − nll_base: taken
    # that way, it does not lose its digits to cancellation (and a model against itself gets exactly 0).
    ratio = mean_and_uncertainty(a - b)
    ln_ratio, ratio_u = ratio.value, ratio.uncertainty
    diff_u = None if cov is None else _sqrt((ppl_q * lq.uncertainty) ** 2 + (ppl_b * lb.uncertainty) ** 2
                                            - 2 * ppl_q * ppl_b * cov)

    dp = (-a).exp() - (-b).exp()  # p_Q − p_base of the actual next token
    mse = mean_and_uncertainty(dp * dp)
    rms = math.sqrt(mse.value)
    rms_u = None if mse.uncertainty is None else (0.5 / rms * mse.uncertainty if rms > 0 else 0.0)

    same = float(same_top.double().mean())
    same_u = math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else None
    return Statistics(
        positions=n,
        ppl_q=Estimate(ppl_q, times(ppl_q, lq.uncertainty)),
        ppl_base=Estimate(ppl_b, times(ppl_b, lb.uncertainty)),
        cor_ln_ppl=cor,
        ln_ppl_ratio=Estimate(ln_ratio, ratio_u),
        ppl_ratio=Estimate(perplexity(ln_ratio), times(perplexity(ln_ratio), ratio_u)),
        ppl_diff=Estimate(ppl_q - ppl_b, diff_u),
        kld_mean=mean_and_uncertainty(k),
        kld_percentiles=percentiles(k, KLD_PERCENTILES),
        dp_mean=mean_and_uncertainty(dp),
        dp_rms=Estimate(rms, rms_u),
        dp_percentiles=percentiles(dp, DP_PERCENTILES),
        same_top=Estimate(same, same_u),
    )
