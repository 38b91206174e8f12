"""The four-word head, small enough to check by hand: h -> logits -> softmax -> a word.

Pure Python (math, random): no torch, so `lmhead toy` starts instantly. Every figure is computed
from the table below; nothing printed is typed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lmhead_cli.errors import BadValue

WORDS = ("cat", "dog", "fish", "run")
# The toy embedding matrix W_e, one row per word: (V, d) = (4, 3). Tied: the head scores with these rows.
ROWS = ((1.0, 0.0, 1.0), (1.0, 0.0, 0.0), (0.0, 1.0, 1.0), (0.0, 1.0, 0.0))
HIDDEN = (1.0, 0.0, 1.0)  # (d,)
SHIFT = 10.0  # added to every logit in the shift demo
SCALES = (2.0, 0.5)  # h x 2 sharpens, h x 0.5 flattens
CAP = 1.0  # a small soft cap, so that it visibly flattens
SAME = 1e-12  # probabilities closer than this count as unchanged
# Bounds that keep every figure finite: |z| <= 3e6 (x 2 in the scale demo), / T >= 1e-6, all far
# inside a double's range, so exp, fsum and the ratios never overflow.
MAX_HIDDEN = 1e6
MAX_DRAWS = 100_000  # the draws are kept, one word each


@dataclass(frozen=True)
class Sample:
    """Words chosen ``len(draws)`` times, and how often each came up. ``seed`` None: argmax, no randomness."""

    seed: Optional[int]
    draws: tuple[str, ...]
    counts: dict[str, int]


@dataclass(frozen=True)
class Variant:
    """A change to the logits and what it did to the distribution."""

    name: str  # shift, scale, softcap
    amount: float  # the shift c, the factor k on h, or the cap c
    logits: tuple[float, ...]  # (V,) after the change, before temperature
    probs: tuple[float, ...]  # (V,)
    entropy_bits: float
    max_change: float  # max |p - p_base| over the words
    effect: str  # unchanged, sharper or flatter
    order_kept: bool  # every pair of words keeps its order (ties stay ties)
    scale: Optional[float] = None  # scale only: the factor on h
    equivalent_temperature: Optional[float] = None  # scale only: the temperature that does the same
    equivalence_gap: Optional[float] = None  # scale only: max |p - softmax(z / equivalent_temperature)|


@dataclass(frozen=True)
class ToyExample:
    words: tuple[str, ...]
    rows: tuple[tuple[float, ...], ...]  # (V, d)
    hidden: tuple[float, ...]  # (d,)
    temperature: float
    logits: tuple[float, ...]  # (V,) = rows @ hidden
    probs: tuple[float, ...]  # (V,) = softmax(logits / temperature)
    prob_sum: float
    entropy_bits: float
    greedy: str  # the argmax word
    argmax: Sample  # argmax asked as many times as sample draws: the same word each time
    sample: Sample
    variants: tuple[Variant, ...]


def logits(hidden: Sequence[float], rows: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """One dot product per word: (V, d) @ (d,) -> (V,)."""
    return tuple(math.fsum(h * w for h, w in zip(hidden, row)) for row in rows)


def softmax(values: Sequence[float], temperature: float = 1.0) -> tuple[float, ...]:
    """exp(z_i / T) / sum_j exp(z_j / T), with the max subtracted first so exp cannot overflow. T = 0 is
    the limit T -> 0, greedy: all the probability on the largest logit (shared evenly by any tied with it)."""
    if temperature == 0:
        best = max(values)
        ties = sum(v == best for v in values)
        return tuple(1.0 / ties if v == best else 0.0 for v in values)
    scaled = [v / temperature for v in values]
    top = max(scaled)
    exps = [math.exp(v - top) for v in scaled]
    total = math.fsum(exps)
    return tuple(e / total for e in exps)


def entropy_bits(probs: Sequence[float]) -> float:
    """-sum p log2 p: 2 bits for four equal words, 0 for a certain one."""
    return -math.fsum(p * math.log2(p) for p in probs if p > 0)


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on a tie."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def sample(probs: Sequence[float], words: Sequence[str], n: int, seed: int) -> Sample:
    """``n`` draws by inverse CDF from a seeded generator: the same seed gives the same draws."""
    rng = random.Random(seed)
    cumulative, running = [], 0.0
    for p in probs:
        running += p
        cumulative.append(running)
    draws = []
    for _ in range(n):
        u = rng.random() * running
        draws.append(words[next((i for i, c in enumerate(cumulative) if u < c), len(words) - 1)])
    return _counted(seed, draws, words)


def repeat_argmax(values: Sequence[float], words: Sequence[str], n: int) -> Sample:
    """Argmax asked ``n`` times: deterministic, so the same word every time."""
    return _counted(None, [words[argmax(values)] for _ in range(n)], words)


def _counted(seed: Optional[int], draws: Sequence[str], words: Sequence[str]) -> Sample:
    return Sample(seed=seed, draws=tuple(draws), counts={w: draws.count(w) for w in words})


def _same_order(a: Sequence[float], b: Sequence[float]) -> bool:
    sign = lambda x: (x > 0) - (x < 0)  # noqa: E731
    return all(sign(a[i] - a[j]) == sign(b[i] - b[j]) for i in range(len(a)) for j in range(len(a)))


def _variant(name: str, amount: float, base: Sequence[float], changed: Sequence[float], temperature: float,
             **extra) -> Variant:
    p_base, p = softmax(base, temperature), softmax(changed, temperature)
    max_change = max(abs(x - y) for x, y in zip(p, p_base))
    h, h_base = entropy_bits(p), entropy_bits(p_base)
    effect = "unchanged" if max_change < SAME else ("sharper" if h < h_base else "flatter")
    return Variant(name=name, amount=amount, logits=tuple(changed), probs=p, entropy_bits=h, max_change=max_change,
                   effect=effect, order_kept=_same_order(base, changed), **extra)


def shift_demo(values: Sequence[float], shift: float = SHIFT, temperature: float = 1.0) -> Variant:
    """z + c for every logit: softmax divides the common factor exp(c) away, so nothing changes."""
    return _variant("shift", shift, values, [v + shift for v in values], temperature)


def scale_demo(hidden: Sequence[float], rows: Sequence[Sequence[float]], factor: float,
               temperature: float = 1.0) -> Variant:
    """h x k makes every logit k times larger: the same as dividing the temperature by k."""
    base = logits(hidden, rows)
    changed = logits([h * factor for h in hidden], rows)
    equivalent = temperature / factor
    gap = max(abs(x - y) for x, y in zip(softmax(changed, temperature), softmax(base, equivalent)))
    return _variant("scale", factor, base, changed, temperature, scale=factor, equivalent_temperature=equivalent,
                    equivalence_gap=gap)


def softcap_demo(values: Sequence[float], cap: float = CAP, temperature: float = 1.0) -> Variant:
    """c * tanh(z / c): squeezes the logits into (-c, c). tanh only rises, so the order stays."""
    capped = [cap * math.tanh(v / cap) for v in values]
    return _variant("softcap", cap, values, capped, temperature)


def parse_hidden(text: str, dims: int = len(HIDDEN)) -> tuple[float, ...]:
    """'0.5,1,2' -> (0.5, 1.0, 2.0): ``dims`` finite numbers, one per column of the toy table."""
    parts = [p.strip() for p in text.strip().strip("[]()").split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise BadValue("hidden", f"must be {dims} comma-separated numbers, like 1,0,1; got {text!r}") from None
    if len(values) != dims:
        raise BadValue("hidden", f"needs {dims} numbers, one per column of the toy table; got {len(values)} "
                       f"in {text!r}")
    if not all(math.isfinite(v) for v in values):
        raise BadValue("hidden", f"must be finite numbers (no nan or inf); got {text!r}")
    if any(abs(v) > MAX_HIDDEN for v in values):
        raise BadValue("hidden", f"numbers must lie within ±{MAX_HIDDEN:g}, so every figure stays finite; got {text!r}")
    return values


def check_temperature(temperature: float) -> float:
    """The decoding registry's rule for temperature (0 is greedy), as at every other door."""
    from lmhead_cli.decoding.stages import SETTINGS

    SETTINGS["temperature"].rule.check("temperature", temperature)
    return temperature


def check_draws(draws: int) -> int:
    if not 1 <= draws <= MAX_DRAWS:
        raise BadValue("draws", f"must be between 1 and {MAX_DRAWS:,}; got {draws}")
    return draws


def toy_example(hidden: Sequence[float] = HIDDEN, temperature: float = 1.0, seed: int = 0,
                draws: int = 20) -> ToyExample:
    """The whole last step on the four-word table, and what shifting, scaling and capping do to it."""
    z = logits(hidden, ROWS)
    p = softmax(z, temperature)
    variants = (
        shift_demo(z, SHIFT, temperature),
        *(scale_demo(hidden, ROWS, k, temperature) for k in SCALES),
        softcap_demo(z, CAP, temperature),
    )
    return ToyExample(
        words=WORDS, rows=ROWS, hidden=tuple(hidden), temperature=temperature, logits=z, probs=p,
        prob_sum=math.fsum(p), entropy_bits=entropy_bits(p), greedy=WORDS[argmax(z)],
        argmax=repeat_argmax(z, WORDS, draws), sample=sample(p, WORDS, draws, seed), variants=variants,
    )
