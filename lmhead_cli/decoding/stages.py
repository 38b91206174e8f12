"""Decoding: from one logits vector to the next token, one small pure stage at a time.

The order of stages is fixed and documented (STAGES):

    soft-cap -> temperature -> top-k -> top-p -> min-p -> softmax -> choose

Each stage maps logits (..., V) to logits (..., V): soft-capping and temperature rescale them
(neither changes the ranking), the filters set dropped tokens to -inf (the best token always
survives). Softmax and the choice run in float32 whatever the model's dtype. Nothing here prints,
and transformers is imported only by `softcap_processor`, for people who want the same
soft-capping inside transformers' own `generate()`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Callable

import torch

from lmhead_cli.errors import UsageError

GEMMA2_CAP = 30.0  # Gemma 2 soft-caps its final logits at 30


# ---- the stages: (..., V) -> (..., V) --------------------------------------------------------

def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma-style soft-capping z -> c·tanh(z/c): near z for |z| << c, never reaching ±c.

    tanh is increasing and 1-Lipschitz, so the ranking is kept and every gap shrinks: the top
    token's probability can only fall. float32 tanh rounds to exactly ±1 for |z/c| > ~9, so the
    result is clamped to the largest float32 below c, which keeps every value inside (-c, c).
    """
    z = logits.float()
    inside = torch.nextafter(torch.tensor(cap, dtype=z.dtype), torch.tensor(0.0, dtype=z.dtype)).item()
    return (cap * torch.tanh(z / cap)).clamp(-inside, inside)


def temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    """z / T: T < 1 sharpens the distribution, T > 1 flattens it, T = 1 leaves it as it is."""
    return logits.float() / t


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits (and any tied with the k-th); the rest become -inf."""
    z = logits.float()
    if k >= z.shape[-1]:
        return z
    kth = torch.topk(z, k, dim=-1).values[..., -1:]  # (..., 1)
    return z.masked_fill(z < kth, float("-inf"))


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most probable tokens whose probabilities sum to at least p."""
    z = logits.float()
    if p >= 1.0:
        return z
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    probs = sorted_z.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False  # the best token always stays
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def min_p(logits: torch.Tensor, m: float) -> torch.Tensor:
    """Keep tokens at least m times as probable as the best one: p_i >= m·p_max.

    In logits that is z_i - z_max >= log m, so no softmax is needed.
    """
    z = logits.float()
    if m <= 0.0:
        return z
    best = z.max(dim=-1, keepdim=True).values
    return z.masked_fill(z - best < math.log(m), float("-inf"))


@dataclass(frozen=True)
class Stage:
    knob: str  # the field of Knobs it reads; the stage is off while that is None
    column: str  # its column in the stage table
    apply: Callable[[torch.Tensor, float], torch.Tensor]


# The one documented order. A new stage is one function above plus one line here.
STAGES: tuple[Stage, ...] = (
    Stage("softcap", "soft-capped", softcap),
    Stage("temperature", "tempered", temperature),
    Stage("top_k", "filtered", top_k),
    Stage("top_p", "filtered", top_p),
    Stage("min_p", "filtered", min_p),
)
COLUMNS = ("raw", "soft-capped", "tempered", "filtered")


# ---- the knobs, and what each may be ----------------------------------------------------------

@dataclass(frozen=True)
class Knobs:
    """The settings of the stages; None means the stage is off."""

    softcap: float | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def pipeline(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """The active stages, in order, with their settings bound."""
        return [_bind(s.apply, getattr(self, s.knob)) for s in STAGES if getattr(self, s.knob) is not None]

    def active(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _bind(fn, value):
    return lambda z: fn(z, value)


# key: (test, what the value must be[, advice]). Shared by the command line, presets and explore.
RULES: dict[str, tuple] = {
    "temperature": (lambda v: math.isfinite(v) and v > 0, "a finite number greater than 0",
                    "for the most likely token every time, use lmhead greedy"),
    "top_k": (lambda v: v >= 1, "at least 1"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "softcap": (lambda v: math.isfinite(v) and v > 0, "a finite number greater than 0, e.g. 30 as in Gemma 2"),
    "max_new_tokens": (lambda v: v >= 1, "at least 1"),
    "beams": (lambda v: v >= 1, "at least 1"),
    "show_steps": (lambda v: v >= 0, "0 or more"),
    "top_logprobs": (lambda v: v >= 0, "0 or more"),
    "seed": (lambda v: 0 <= v < 2**63, "between 0 and 2**63 - 1"),
}


def flag(key: str) -> str:
    """The command-line spelling of a setting: top_k -> --top-k."""
    return "--" + key.replace("_", "-")


def check(values: dict, name: Callable[[str], str] = flag) -> None:
    """Raise UsageError naming the first value outside its range (None values are unset)."""
    for key, value in values.items():
        if value is None or key not in RULES:
            continue
        ok, must, *advice = RULES[key]
        if not ok(value):
            raise UsageError(f"{name(key)} must be {must} (got {value})" + "".join(f"; {a}" for a in advice))


# ---- all stages, softmax, choose ----------------------------------------------------------------

def process(logits: torch.Tensor, pipeline) -> torch.Tensor:
    """Run the active stages in order: (..., V) -> (..., V) float32."""
    z = logits.float()
    for stage in pipeline:
        z = stage(z)
    return z


def log_probs(z: torch.Tensor) -> torch.Tensor:
    """log softmax in float32: (..., V) -> (..., V); filtered tokens get -inf."""
    return torch.log_softmax(z.float(), dim=-1)


def choose(logprobs: torch.Tensor, greedy: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token per row: (R, V) -> (R,). Greedy takes the most probable (the first on ties);
    otherwise one draw from exactly these probabilities with the seeded `generator`."""
    if greedy:
        return logprobs.argmax(dim=-1)
    return torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats per row, (..., V) -> (...); dropped tokens (p = 0) add nothing.

    -inf is clamped to the lowest finite float so 0·log 0 counts as 0 (torch.special.entr is
    ~10x slower on CPU).
    """
    return -(logprobs.exp() * logprobs.clamp_min(torch.finfo(logprobs.dtype).min)).sum(dim=-1)


# ---- the stage table (`lmhead inspect --stages`) ---------------------------------------------

@dataclass(frozen=True)
class StageCell:
    value: float | None  # logit after this column's stages; None = filtered out
    rank: int | None  # 1 + tokens strictly higher at this column; None = filtered out


@dataclass(frozen=True)
class StageRow:
    id: int
    token: str
    cells: list[StageCell]  # one per column: raw, soft-capped, tempered, filtered
    prob: float  # the final probability
    logprob: float


@dataclass(frozen=True)
class StageTable:
    columns: list[str]  # COLUMNS: raw, soft-capped, tempered, filtered
    rows: list[StageRow]
    kept: int  # tokens that survive the filters
    vocab: int
    entropy: float  # nats, of the final distribution
    knobs: Knobs


def stage_table(logits: torch.Tensor, knobs: Knobs, rows: int, token_text) -> StageTable:
    """Follow the `rows` highest raw logits (V,) through every column of stages to the final probability."""
    z = logits.float()
    snapshots = {"raw": z}
    for s in STAGES:
        if getattr(knobs, s.knob) is not None:
            z = s.apply(z, getattr(knobs, s.knob))
        snapshots[s.column] = z  # the last stage of a column leaves its value
    lp = log_probs(z)
    ids = torch.topk(logits.float(), min(rows, logits.shape[-1])).indices.tolist()
    table = []
    for i in ids:
        cells = []
        for col in COLUMNS:
            v = snapshots[col]
            kept = bool(torch.isfinite(v[i]))
            cells.append(StageCell(float(v[i]) if kept else None, 1 + int((v > v[i]).sum()) if kept else None))
        table.append(StageRow(id=i, token=token_text(i), cells=cells, prob=float(lp[i].exp()), logprob=float(lp[i])))
    return StageTable(columns=list(COLUMNS), rows=table,
                      kept=int(torch.isfinite(z).sum()), vocab=int(z.shape[-1]), entropy=float(entropy(lp)),
                      knobs=knobs)


# ---- soft-capping inside transformers' generate() --------------------------------------------

@functools.cache
def _softcap_processor_class():
    from transformers import LogitsProcessor

    class SoftCapLogitsProcessor(LogitsProcessor):
        """transformers LogitsProcessor: scores -> cap·tanh(scores/cap), lmhead's `softcap` stage.

        Example: model.generate(ids, logits_processor=LogitsProcessorList([softcap_processor(30.0)]))
        """

        def __init__(self, cap: float = GEMMA2_CAP):
            check({"softcap": cap}, name=lambda _: "cap")
            self.cap = cap

        def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
            return softcap(scores, self.cap).to(scores.dtype)

    SoftCapLogitsProcessor.__qualname__ = "SoftCapLogitsProcessor"
    return SoftCapLogitsProcessor


def softcap_processor(cap: float = GEMMA2_CAP):
    """A `SoftCapLogitsProcessor` (a transformers LogitsProcessor) capping at `cap`."""
    return _softcap_processor_class()(cap)


def __getattr__(name: str):
    # `from lmhead_cli.decoding.stages import SoftCapLogitsProcessor` imports transformers only then.
    if name == "SoftCapLogitsProcessor":
        return _softcap_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
