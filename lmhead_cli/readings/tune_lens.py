"""`lmhead tune-lens`: train a tuned lens's translators (readings/tuned_lens.py) on a text.

As the tuned-lens paper does: the translators start at the identity (where the tuned lens is the
logit lens) and are trained on the KL divergence from the model's final distribution to each layer's
translated reading, KL(final ‖ layer), summed over layers, averaged over positions. The model's
weights are frozen; only A and b move. Adam with a linear warm-up and a linear decay to 0.

Memory is bounded by one step, never by the text: each step reads `batch` windows of `seq` tokens
at seeded random places in the text (a file is read a window's bytes at a time, never whole), and
the layers' logits (batch·seq, V) are made and freed one layer at a time. A step's peak is planned
before training (step_memory) and a batch that does not fit in the memory there is is refused.
"""

from __future__ import annotations

import io
import math
import os
import random
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lmhead_cli.decoding import stages
from lmhead_cli.errors import BadValue, NonFiniteLogits, UsageError
from lmhead_cli.head import check_finite
from lmhead_cli.loading.sources import Loaded
from lmhead_cli.readings.tuned_lens import TunedLens, identity_lens

BYTES_PER_TOKEN = 12  # bytes read per token wanted: GPT-2's BPE averages about 4 bytes a token in English


@dataclass(frozen=True)
class TuneSettings:
    steps: int = 300
    batch: int = 4  # windows per step
    seq: int | None = None  # tokens per window (None: min(n_ctx, 128))
    lr: float = 1e-3
    warmup: int = 20  # steps of linear warm-up
    seed: int = 0

    def check(self) -> None:
        for key in ("steps", "batch"):
            if getattr(self, key) < 1:
                raise BadValue(key, f"must be at least 1 (got {getattr(self, key)})")
        if self.seq is not None and self.seq < 2:
            raise BadValue("seq", f"must be at least 2 (got {self.seq})")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise BadValue("lr", f"must be a positive number (got {self.lr})")
        if self.warmup < 0:
            raise BadValue("warmup", f"must be at least 0 (got {self.warmup})")
        stages.check({"seed": self.seed})  # generate's seed rule: 0 to 2**63 - 1


def step_memory(loaded: Loaded, batch: int, seq: int) -> tuple[int, int]:
    """(bytes, bytes per window) one training step holds at its peak: four (batch·seq, V) float32 tables
    (the final distribution, its log, a layer's logits and their gradient) and the residual stream twice
    ((L + 1) × (batch·seq, D): the engine's and the clone). Measured on bundled:tiny (V 50,257, D 128,
    4 layers): batch 16 × seq 128 grew the peak RSS by 1,592 MiB against 1,581 MiB planned here."""
    eng = loaded.engine
    D = int(eng.head_weight.shape[1])
    per_window = 4 * seq * (4 * eng.vocab_size + 2 * (eng.n_layer + 1) * D)
    return batch * per_window, per_window


def check_step_memory(loaded: Loaded, batch: int, seq: int) -> None:
    """BadValue(batch) when one step needs more memory than there is, with the figures."""
    from lmhead_cli.loading.checks import available_memory, gb

    need, per_window = step_memory(loaded, batch, seq)
    free = available_memory(loaded.engine.device.type)
    if free is not None and need > free:
        raise BadValue("batch", f"of {batch:,} windows of {seq:,} tokens need about {gb(need)} a step ({gb(per_window)} "
                                f"per window: the vocabulary's logits and the residual stream), but {gb(free)} is "
                                f"available; at most {max(1, free // per_window):,} windows fit")


@dataclass
class Tuning:
    """What training did: the lens, and the record that is also written into the file's metadata."""

    lens: TunedLens
    steps: int
    tokens: int  # positions trained on (every position of every window, every step)
    seq: int
    batch: int
    seconds: float
    cpu_seconds: float
    threads: int
    load_average: tuple[float, float]  # the 1-minute load average at the start and at the end
    text_bytes: int
    first_kl: list[float]  # per translated layer, the mean KL (nats) of the first step
    last_kl: list[float]  # per translated layer, the mean KL over the last 10% of steps
    curve: list[float] = field(default_factory=list)  # the mean KL over layers, every step


class TextSource:
    """A text to draw windows from: a file read a window at a time, or a string. Bounded: a window
    reads seq × BYTES_PER_TOKEN bytes, whatever the text's size."""

    def __init__(self, text: str | None = None, file: str | Path | None = None):
        if (text is None) == (file is None):
            raise UsageError("give a text or a file to train the lens on, not both")
        if file is not None:
            self.name = str(file)
            try:
                info = os.stat(file)
                if stat.S_ISREG(info.st_mode):  # a folder, a FIFO, a device: no size to draw windows from
                    with open(file, "rb"):
                        pass
            except OSError as e:
                raise UsageError(f"cannot read {file}: {e.strerror or type(e).__name__}") from None
            if not stat.S_ISREG(info.st_mode):
                raise UsageError(f"{file} is not a regular file; give a text file to train the lens on")
            self.size = info.st_size
            self._open = lambda: open(file, "rb")
        else:
            data = text.encode("utf-8", "surrogatepass")
            self.name, self.size = "the text", len(data)
            self._open = lambda: io.BytesIO(data)

    def window(self, tokenizer, seq: int, rng: random.Random) -> list[int]:
        """`seq` token ids (fewer if the text is shorter) from a random place: read from a byte offset,
        the first partial word dropped, the rest tokenised."""
        span = seq * BYTES_PER_TOKEN
        offset = rng.randrange(0, max(1, self.size - span))
        with self._open() as f:
            f.seek(offset)
            raw = f.read(span)
        text = raw.decode("utf-8", "ignore")
        if offset > 0:  # a word cut in two would tokenise as another word
            cut = min((i for i in (text.find(" "), text.find("\n")) if i >= 0), default=-1)
            text = text[cut:] if cut >= 0 else text
        return tokenizer.encode(text)[:seq]


def _norm_and_head(loaded: Loaded):
    """The model's final norm and head as differentiable functions of float32 vectors (the engine's own
    run under inference mode): norm(x) = γ ⊙ C(x)/σ(x) + β, head(h) = h · W_outᵀ (+ bias, soft-cap)."""
    from lmhead_cli.engine.base import linearise_norm

    eng = loaded.engine
    lin = linearise_norm(eng.final_norm_module)
    beta = lin.beta.detach().float() if lin.beta is not None else 0.0
    W = eng.head_rows(torch.arange(eng.vocab_size, device=eng.device)).detach().float()  # (V, D)
    bias = getattr(eng.head_module, "bias", None)
    bias = bias.detach().float() if bias is not None else None
    cap = eng.own_stages.get("softcap")

    def norm(x: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, D): the norm is its linearisation at σ(x)
        return lin.apply(x, lin.sigma(x)) + beta

    def head(h: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, V)
        z = h @ W.T
        if bias is not None:
            z = z + bias
        return torch.tanh(z / cap) * cap if cap else z

    # (readout, bias) when the logits are linear in the normed vector (no soft-cap): the loss's shortcut
    return norm, head, (W if not cap else None), bias


def tune_lens(loaded: Loaded, source: TextSource, settings: TuneSettings = TuneSettings(),
              progress: Callable[[int, int, float], None] | None = None) -> Tuning:
    """Train the translators of `loaded` on windows of `source`. `progress(step, steps, mean_kl)` hears
    every step."""
    settings.check()
    lens = identity_lens(loaded)
    eng, tok = loaded.engine, loaded.tokenizer
    L, D = lens.weight.shape[0], lens.weight.shape[1]
    seq = min(settings.seq or 128, eng.n_ctx)
    check_step_memory(loaded, settings.batch, seq)
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    weight = torch.zeros(L, D, D, device=eng.device, requires_grad=True)
    bias = torch.zeros(L, D, device=eng.device, requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=settings.lr)
    warm = min(settings.warmup, settings.steps - 1)
    lr_at = lambda s: (s + 1) / (warm + 1) if s < warm else max(0.0, (settings.steps - s) / (settings.steps - warm))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    norm, head, readout, head_bias = _norm_and_head(loaded)

    first: list[float] = []
    tail = max(1, settings.steps // 10)
    tail_sum = torch.zeros(L, dtype=torch.float64)
    curve, tokens = [], 0
    load_start = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(settings.steps):
        rows = [source.window(tok, seq, rng) for _ in range(settings.batch)]
        rows = [r for r in rows if len(r) >= 2]
        if not rows:
            raise UsageError(f"{source.name} has fewer than 2 tokens to train on")
        T = min(len(r) for r in rows)
        ids = torch.tensor([r[:T] for r in rows], device=eng.device)  # (B, T)
        with torch.no_grad():
            # cloned: an engine may run under inference mode, whose tensors autograd cannot save
            resid = [x.float().reshape(-1, D).clone() for x in eng.residuals(ids)]  # L + 1 × (B·T, D)
            final = head(norm(resid[-1]))  # (B·T, V) logits: the model's own, which the lens is fitted to
            check_finite(final)
            final = torch.log_softmax(final, -1)
            p = final.exp()
            neg_entropy = (p * final).sum(-1).mean()  # Σ p log p
            expected = p @ readout if readout is not None else None  # (B·T, D): Σ_k p_k W_k
            expected_bias = p @ head_bias if readout is not None and head_bias is not None else 0.0
            if readout is not None:
                del final, p
        kls = []
        opt.zero_grad(set_to_none=True)
        for layer in range(L):  # one layer's (B·T, V) logits at a time
            h = resid[layer]
            n = norm(h + h @ weight[layer].T + bias[layer])  # (B·T, D)
            if expected is not None:
                # Σ p log q = Σ p z − logsumexp z, and Σ p z = n · Σ p W (+ Σ p b): the (B·T, V) products
                # of log q and p are never made.
                cross = (n * expected).sum(-1) + expected_bias - torch.logsumexp(head(n), -1)
            else:  # a soft-capped head is not linear in n
                cross = (p * torch.log_softmax(head(n), -1)).sum(-1)
            kl = neg_entropy - cross.mean()  # KL(final ‖ layer), nats per position
            kl.backward()
            kls.append(float(kl.detach()))
            del n, cross, kl
        if not all(math.isfinite(v) for v in kls):
            raise NonFiniteLogits(f"training diverged at step {step + 1}: a layer's KL is {kls} (NaN or infinite); "
                                  "nothing was written: try a smaller --lr")
        opt.step()
        sched.step()
        tokens += ids.numel()
        if step == 0:
            first = kls
        if step >= settings.steps - tail:
            tail_sum += torch.tensor(kls, dtype=torch.float64)
        curve.append(sum(kls) / L)
        if progress is not None:
            progress(step + 1, settings.steps, curve[-1])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise NonFiniteLogits("training diverged: the translators hold NaN or infinite values; nothing was "
                              "written: try a smaller --lr")
    tuned = TunedLens(lens.identity, weight.detach().cpu(), bias.detach().cpu(), name="trained")
    record = Tuning(lens=tuned, steps=settings.steps, tokens=tokens, seq=seq, batch=settings.batch, seconds=seconds,
                    cpu_seconds=cpu, threads=torch.get_num_threads(), load_average=(load_start, os.getloadavg()[0]),
                    text_bytes=source.size, first_kl=first, last_kl=(tail_sum / tail).tolist(), curve=curve)
    tuned.trained = {"steps": record.steps, "tokens": record.tokens, "seq": seq, "batch": settings.batch,
                     "lr": settings.lr, "seed": settings.seed, "seconds": round(seconds, 1),
                     "cpu_seconds": round(cpu, 1), "threads": record.threads,
                     "load_average": [round(v, 2) for v in record.load_average]}
    return record
