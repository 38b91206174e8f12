"""`lmhead calibrate`: is the model's top-1 probability honest on this text?

At every position `score` scores (the same windows, `--bos` and stride), the model's confidence is the
probability of its own top-1 token, and it is correct when that token is the text's next one. Then:

* **Reliability** (Guo et al. 2017): the positions in 15 equal-width bins of confidence, each bin
  (lo, hi] with its count, mean confidence and accuracy; the expected calibration error
  ECE = Σ_b (n_b / n) |accuracy_b - confidence_b|; the Brier score of the top-1 event,
  mean (confidence - correct)²; and the NLL, the mean -log p of the text's tokens, in nats.
* **Temperature scaling.** The one T > 0 that minimises the NLL of softmax(z / T) over the text, and
  the NLL and ECE at that T (the top-1, and so correctness, does not change with T). With β = 1/T the
  NLL, Σ logsumexp(β z) - β z_y, is convex in β, with derivative Σ E_β[z] - z_y and second derivative
  Σ Var_β[z]: Newton's method on β, kept inside a bracket that shrinks every step (bisection where a
  Newton step would leave it), finds it in a few passes. Each pass recomputes the logits through the
  head from the positions' hidden states (D numbers a position, kept in a temporary file, never the
  (T, V) logits), `chunk` positions at a time.

Memory: score's (one window's hidden states, one (chunk, V) chunk), a few numbers a position, and the
hidden states on disk. Shapes: n scored positions, D width, V vocabulary.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmhead_cli.head import ordered_sum
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.readings.score import check_text, score_ids, text_ids

BINS = 15  # Guo et al.'s equal-width bins
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # the fitted temperature's range
MAX_PASSES = 60  # Newton with bisection needs a handful; this bounds a pathological text


@dataclass(frozen=True)
class Bin:
    """Positions whose confidence is in (lo, hi]; confidence and accuracy are None for an empty bin."""

    lo: float
    hi: float
    count: int
    confidence: float | None  # mean top-1 probability
    accuracy: float | None  # share of them whose top-1 is the next token


@dataclass(frozen=True)
class Generations:
    """`--generations N`: N sampled continuations and their entropy rate (Braverman et al. 2020): the
    mean -log p the model gives its own sampled tokens (raw: the softmax of its logits, whatever the
    stages drew them from), against its cross-entropy on the text (the text's NLL)."""

    count: int
    prompt: str  # what each continuation follows
    max_new_tokens: int
    seed: int  # continuation i drew with seed + i
    settings: dict  # the decoding stages that were on ({} for plain sampling)
    tokens: int  # generated, all continuations together
    entropy_rate: float  # nats a token
    cross_entropy: float  # nats a token: the text's NLL
    texts: list[str]

    @property
    def gap(self) -> float:
        """entropy_rate - cross_entropy: above 0, the samples are less sure than the text."""
        return self.entropy_rate - self.cross_entropy


@dataclass
class Calibration:
    model: str
    random_weights: bool
    text: str
    bos: bool
    window: int
    stride: int
    chunk: int
    windows: int
    positions: int  # the scored positions (score's)
    bins: list[Bin]
    ece: float
    brier: float
    nll: float  # mean over the positions, nats
    temperature: float
    passes: int  # head passes the temperature's fit took
    bins_at_temperature: list[Bin]
    ece_at_temperature: float
    nll_at_temperature: float
    generations: Generations | None = None

    @property
    def accuracy(self) -> float:
        return sum(b.count * b.accuracy for b in self.bins if b.count) / self.positions

    @property
    def confidence(self) -> float:
        return sum(b.count * b.confidence for b in self.bins if b.count) / self.positions


# ---- the arithmetic ----------------------------------------------------------------------------

def bin_index(confidence: torch.Tensor, bins: int = BINS) -> torch.Tensor:
    """The bin (lo, hi] of each confidence (n,) in (0, 1], (n,) int64: compared with the edges i / bins
    themselves (c · bins rounds: (1/15) · 15 is above 1 in floating point)."""
    edges = torch.tensor([i / bins for i in range(1, bins)], dtype=confidence.dtype)
    return torch.bucketize(confidence, edges, right=False)


def reliability(confidence: torch.Tensor, correct: torch.Tensor, bins: int = BINS) -> tuple[list[Bin], float, float]:
    """Bins, ECE and Brier score of confidences (n,) and whether each top-1 was right (n,) bool."""
    c, ok = confidence.double(), correct.double()
    n = len(c)
    at = bin_index(c, bins)
    count = torch.bincount(at, minlength=bins)
    conf_sum = torch.bincount(at, weights=c, minlength=bins)
    ok_sum = torch.bincount(at, weights=ok, minlength=bins)
    out = [Bin(lo=i / bins, hi=(i + 1) / bins, count=int(k),
               confidence=float(conf_sum[i] / k) if k else None, accuracy=float(ok_sum[i] / k) if k else None)
           for i, k in enumerate(count.tolist())]
    ece = float((ok_sum - conf_sum).abs().sum() / n)
    brier = float((c - ok).square().mean())
    return out, ece, brier


class HiddenSpool:
    """The scored positions' hidden states (n, D), appended window by window into a temporary file,
    and the tokens they predict (n,) in memory; read back `rows` at a time."""

    def __init__(self):
        self.file = tempfile.TemporaryFile()
        self.dtype: torch.dtype | None = None
        self.width = 0
        self.targets: list[torch.Tensor] = []
        self.n = 0

    def add(self, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        h = hidden.detach().to("cpu").contiguous()
        self.dtype, self.width = h.dtype, h.shape[-1]
        self.file.write(h.view(torch.uint8).numpy().tobytes())
        self.targets.append(ids.cpu())
        self.n += len(ids)

    def chunks(self, rows: int):
        """(hidden (r, D), targets (r,)) in order, r ≤ rows."""
        target = torch.cat(self.targets)
        size = self.width * torch.empty((), dtype=self.dtype).element_size()
        self.file.seek(0)
        for lo in range(0, self.n, rows):
            r = min(rows, self.n - lo)
            buf = bytearray(r * size)
            self.file.readinto(buf)
            yield torch.frombuffer(buf, dtype=self.dtype).view(r, self.width), target[lo:lo + r]

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True)
class AtBeta:
    """The NLL of softmax(β z) over every position, its first two derivatives in β, and each position's
    top-1 probability under it (n,)."""

    nll: float  # mean, nats
    slope: float  # d nll / dβ
    curve: float  # d² nll / dβ² ≥ 0
    confidence: torch.Tensor


@torch.inference_mode()
def at_beta(loaded: Loaded, spool: HiddenSpool, beta: float, chunk: int,
            tick: Callable[[], None] | None = None) -> AtBeta:
    """One pass of the head over the spooled positions at inverse temperature β; `tick()` after each chunk."""
    eng = loaded.engine
    nll = slope = curve = 0.0
    conf = []
    for h, y in spool.chunks(chunk):
        d = eng.head(h.to(eng.device)).float()  # (r, V) logits
        d.sub_(d.amax(-1, keepdim=True))  # d = z - max z ≤ 0, in place: the statistics are shift-free in z
        dy = d.gather(-1, y.to(d.device)[:, None])[:, 0]  # (r,)
        e = torch.mul(d, beta).exp_()  # (r, V), the one other buffer: exp(β d), its max exactly 1
        s = ordered_sum(e)  # (r,)
        lse = s.log()
        pd = e.div_(s[:, None]).mul_(d)  # p·d in e's place
        mean = ordered_sum(pd)  # E_β[d]
        square = ordered_sum(pd.mul_(d))  # E_β[d²], p·d² in e's place: no third (r, V) buffer
        nll += float(ordered_sum((lse - beta * dy).double()))
        slope += float(ordered_sum((mean - dy).double()))
        curve += float(ordered_sum((square - mean.square()).clamp_min(0.0).double()))  # Var_β[z]
        conf.append(s.reciprocal().cpu())  # the top-1's probability: exp(β·0) / s
        del d, e, pd
        if tick is not None:
            tick()
    n = spool.n
    return AtBeta(nll / n, slope / n, curve / n, torch.cat(conf))


def fit_temperature(loaded: Loaded, spool: HiddenSpool, chunk: int,
                    tick: Callable[[], None] | None = None) -> tuple[float, AtBeta, int]:
    """The β in [1/MAX_TEMPERATURE, 1/MIN_TEMPERATURE] that minimises the NLL: safeguarded Newton
    on the convex NLL(β). Returns (T = 1/β, the figures at β, head passes taken)."""
    lo, hi = 1 / MAX_TEMPERATURE, 1 / MIN_TEMPERATURE
    beta = 1.0
    for passes in range(1, MAX_PASSES + 1):
        at = at_beta(loaded, spool, beta, chunk, tick)
        if at.slope > 0:
            hi = beta  # the NLL rises here: its minimum is at a smaller β
        else:
            lo = beta
        step = beta - at.slope / at.curve if at.curve > 0 else math.nan
        if not lo < step < hi:
            step = 0.5 * (lo + hi)  # bisection where Newton would leave the bracket
        if abs(step - beta) <= 1e-7 * beta or passes == MAX_PASSES:
            return 1 / beta, at, passes
        beta = step
    raise AssertionError("unreachable")


# ---- the reading ------------------------------------------------------------------------------

@torch.inference_mode()
def calibrate_text(loaded: Loaded, text: str, *, bos: bool = False, stride: int | None = None,
                   chunk: int | None = None, progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Reliability, ECE, Brier, NLL and the fitted temperature over `text`'s scored positions.
    `progress(done, total)` hears each chunk of the scoring, then (done = total) each chunk of the
    temperature's passes: a caller that stops or pauses there (the server's page) can at every chunk."""
    ids = text_ids(loaded, check_text(text), bos)
    spool = HiddenSpool()
    try:
        heard = [0]  # score's total, which the fit's ticks repeat

        def scoring(done: int, total: int) -> None:
            heard[0] = total
            progress(done, total)

        cols = score_ids(loaded, ids, bos=bos, stride=stride, chunk=chunk, progress=progress and scoring,
                         on_hidden=spool.add)
        scored = cols["scored"]
        confidence = cols["top_logprob"][scored].exp()
        correct = (cols["top_id"] == ids)[scored]
        bins, ece, brier = reliability(confidence, correct)
        nll = -float(cols["logprob"][scored].double().mean())
        tick = None if progress is None else (lambda: progress(heard[0], heard[0]))
        temperature, at, passes = fit_temperature(loaded, spool, cols["chunk"], tick)
    finally:
        spool.close()
    bins_t, ece_t, _ = reliability(at.confidence, correct)
    return Calibration(model=loaded.source, random_weights=loaded.random_weights, text=text, bos=bos,
                       window=loaded.engine.n_ctx, stride=cols["stride"], chunk=cols["chunk"], windows=cols["windows"],
                       positions=int(scored.sum()), bins=bins, ece=ece, brier=brier, nll=nll,
                       temperature=temperature, passes=passes, bins_at_temperature=bins_t, ece_at_temperature=ece_t,
                       nll_at_temperature=at.nll)


def entropy_rate(generations) -> tuple[int, float]:
    """(tokens, mean -log p) of the generated tokens of decoding.generate.Generation's, under the raw
    distribution (the model's own, before any stage)."""
    lps = [s.raw_logprob for g in generations for s in g.steps]
    return len(lps), (-math.fsum(lps) / len(lps) if lps else math.nan)

