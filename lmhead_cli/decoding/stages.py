"""Decoding: from one logits vector to the next token, one small pure stage at a time.

The order of stages is fixed and documented (STAGES, the registry):

    soft-cap -> temperature -> top-k -> top-p -> min-p -> softmax -> choose

with a row's grammar (a JSON schema or a regex: decoding/grammar.py), when it has one, masking the
logits after temperature and before the filters (BEFORE_GRAMMAR says why).

Each entry of STAGES (and of LOOP, the loop's own settings) declares a setting once: its key (the Knobs
field, the preset key, the JSON key, the API keyword), its type, its rule (bounds, words and advice), its
default, its `off` values, its meaning (help), its command-line options and its column in `inspect
--stages`. `checked` is the one check of a value, for every door; Knobs, presets, the CLI options, the
server's fields and the stage table all derive from the registry.
torch is imported inside the functions, so the command line reads the registry without loading it.

Each stage maps logits (..., V) to logits (..., V): soft-capping and temperature rescale them
(neither changes the ranking), the filters set dropped tokens to -inf (the best token always
survives). Softmax and the choice run in float32 whatever the model's dtype. Nothing here prints,
and transformers is imported only by `softcap_processor`, for people who want the same
soft-capping inside transformers' own `generate()`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, make_dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from lmhead_cli.errors import BadValue, NonFiniteLogits

if TYPE_CHECKING:
    import torch

GEMMA2_CAP = 30.0  # Gemma 2 soft-caps its final logits at 30
# The smallest temperature and soft-cap accepted. Both divide the logits (z / T, z / c) in float32,
# whose largest value is 3.4e38: at 1e-6 that holds for any |z| up to 3.4e32, far beyond any
# model's logits, while a T of 1e-39 overflows (inf - inf = NaN in softmax). Below 1e-6 the
# distribution is already greedy's for any logit gap above 1e-4 (exp(-100) is 0 in float32).
MIN_SCALE = 1e-6
# A soft-cap above this caps nothing a model computes (c·tanh(z/c) = z to float32's precision for
# |z| < c / 1000), and near float32's range c·tanh(z/c) overflows: the bound keeps every figure finite.
MAX_SOFTCAP = 1e6


# ---- the stages: (..., V) -> (..., V) --------------------------------------------------------

def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma-style soft-capping z -> c·tanh(z/c): near z for |z| << c, never reaching ±c.

    tanh is increasing and 1-Lipschitz, so the ranking is kept and every gap shrinks: the top
    token's probability can only fall. float32 tanh rounds to exactly ±1 for |z/c| > ~9, so the
    result is clamped to the largest float32 below c, which keeps every value inside (-c, c).
    """
    import torch

    z = logits.float()
    inside = torch.nextafter(torch.tensor(cap, dtype=z.dtype), torch.tensor(0.0, dtype=z.dtype)).item()
    return (cap * torch.tanh(z / cap)).clamp(-inside, inside)


def temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    """z / T: T < 1 sharpens the distribution, T > 1 flattens it, T = 1 leaves it as it is. T = 0 is
    the limit T -> 0, greedy: the best logit (and any tied with it) kept at 0, every other -inf.
    (Generation takes temperature 0 as greedy with this stage off: decoding.settings.make.)"""
    z = logits.float()
    if t == 0:
        return (z - z.amax(dim=-1, keepdim=True)).masked_fill(z < z.amax(dim=-1, keepdim=True), float("-inf"))
    return z / t


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits (and any tied with the k-th); the rest become -inf."""
    import torch

    z = logits.float()
    if k >= z.shape[-1]:
        return z
    kth = torch.topk(z, k, dim=-1).values[..., -1:]  # (..., 1)
    return z.masked_fill(z < kth, float("-inf"))


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most probable tokens whose probabilities sum to at least p."""
    import torch

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


# ---- the registry: every setting once, with its range, help and command-line names ---------------

@dataclass(frozen=True)
class Rule:
    """What a setting's value must be: its bounds (JSON Schema's: ge, gt, le, lt; a float must be finite),
    values allowed outside them (`also`: temperature 0, greedy), the range in words, and advice for a
    common mistake. The server's /openapi.json shows the bounds (`schema`)."""

    must: str  # e.g. "in (0, 1]"; the message names it with the value given
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple = ()
    advice: str = ""  # e.g. temperature 0 -> use greedy

    def ok(self, v) -> bool:
        """Whether the number `v` keeps the rule (NaN and the infinities break every float's)."""
        if any(v == a for a in self.also):
            return True
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def check(self, key: str, value) -> None:
        """Raise BadValue(key, ...) if `value` breaks the rule."""
        if not self.ok(value):
            raise BadValue(key, f"must be {self.must} (got {value})" + (f"; {self.advice}" if self.advice else ""))

    def bounds(self) -> dict:
        """The bounds by JSON Schema's names as pydantic spells them (ge, gt, le, lt), the values allowed
        outside them included (temperature's lowest is 0; top-k's -1, its off value): the server's
        /openapi.json shows them."""
        out = {k: b for k, b in (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt)) if b is not None}
        lowest = min(self.also, default=None)
        if lowest is not None and not self.ok(lowest - 1):
            out = {k: b for k, b in out.items() if k not in ("ge", "gt")} | {"ge": lowest}
        return out


@dataclass(frozen=True)
class Setting:
    """One decoding setting, declared once: the key it has everywhere (Knobs field, preset key, JSON key,
    API keyword), its type, its rule (range, words, advice), its default, the values that turn it off,
    its meaning (`help`) and how the command line offers it."""

    key: str
    type: type  # float or int; an int is fine where a float is asked for
    rule: Rule
    help: str = ""  # its meaning: the command-line help and the server's field description
    options: tuple[str, ...] = ()  # command-line names, the canonical first (default: --key-with-dashes)
    preset: bool = True  # may be set in a preset file
    off: tuple = ()  # values that turn the setting off at every door (top-k 0 or -1, as vLLM's)
    default: Any = None  # a stage's None: off

    @property
    def option(self) -> str:
        return self.options[0] if self.options else "--" + self.key.replace("_", "-")


@dataclass(frozen=True)
class Stage(Setting):
    """A setting that is a stage: `apply(logits, value)` runs while the value is not None."""

    apply: Callable[[torch.Tensor, Any], torch.Tensor] | None = None
    column: str = ""  # its column in the stage table (`inspect --stages`)
    name: str = ""  # for people, in settings lines: "top-k"

    @property
    def knob(self) -> str:  # the Knobs field it reads
        return self.key


# The one documented order. A new stage is one function above plus one entry here (and its test):
# Knobs, presets, the command-line options of generate/greedy/sample/softcap and inspect --stages,
# the server's fields and the stage table's columns all follow from this list.
STAGES: tuple[Stage, ...] = (
    Stage("softcap", float,
          Rule(f"a finite number between {MIN_SCALE:g} and {MAX_SOFTCAP:g}, e.g. 30 as in Gemma 2", ge=MIN_SCALE,
               le=MAX_SOFTCAP),
          help="Squash the logits with c·tanh(z/c) first (Gemma 2: c = 30).", options=("--softcap", "--cap"),
          apply=softcap, column="soft-capped", name="softcap"),
    Stage("temperature", float,
          Rule(f"0 (greedy) or a finite number of at least {MIN_SCALE:g}", ge=MIN_SCALE, also=(0,),
               advice="0 is greedy: the most likely token every time"),
          help="Divide the logits by T > 0 before softmax (1 = as is).",
          apply=temperature, column="tempered", name="temperature"),
    Stage("top_k", int, Rule("at least 1 (0 or -1: off)", ge=1, also=(0, -1)),
          help="Keep only the k most likely tokens (0 or -1: off).",
          apply=top_k, column="filtered", name="top-k", off=(0, -1)),
    Stage("top_p", float, Rule("in (0, 1]", gt=0, le=1),
          help="Keep the most likely tokens until their probability sums to p, in (0, 1].",
          apply=top_p, column="filtered", name="top-p"),
    Stage("min_p", float, Rule("in [0, 1)", ge=0, lt=1),
          help="Drop tokens less likely than min-p × the best one's probability, in [0, 1).",
          apply=min_p, column="filtered", name="min-p"),
)
COLUMNS = ("raw", *dict.fromkeys(s.column for s in STAGES))  # raw, soft-capped, tempered, filtered

MAX_SEED = 2**63 - 1
# The loop's own settings (decoding.generate), checked by the same rules.
LOOP: tuple[Setting, ...] = (
    Setting("max_new_tokens", int, Rule("at least 1", ge=1), default=40, help="How many tokens to make at most."),
    Setting("beams", int, Rule("at least 1", ge=1), preset=False, default=1,
            help="Beam search over N beams, as transformers' num_beams (1: none)."),
    Setting("n", int, Rule("at least 1", ge=1), preset=False, default=1,
            help="Choices per prompt, 1 by default: choice j draws with seed + j."),
    Setting("show_steps", int, Rule("0 or more", ge=0), preset=False, default=0,
            help="The K most probable tokens kept in each step's record."),
    Setting("top_logprobs", int, Rule("0 or more", ge=0), preset=False, default=0,  # <= V: checked by generate
            help="The N most probable tokens at every position, 0 up to the vocabulary size."),
    Setting("seed", int, Rule("between 0 and 2**63 - 1", ge=0, le=MAX_SEED), preset=False,
            help="The seed of the draws (choice j draws with seed + j); drawn when not given."),
)
SETTINGS: dict[str, Setting] = {s.key: s for s in (*STAGES, *LOOP)}


def option(key: str) -> str:
    """The command-line name of a setting (`top_k` -> `--top-k`; `softcap` -> `--softcap`)."""
    return SETTINGS[key].option if key in SETTINGS else "--" + key.replace("_", "-")


def checked(key: str, value):
    """THE check of one setting's value, for every door: its type (BadType: an int for an int setting,
    never a bool or a float, even 2.0; any real number but a bool for a float one), then its `off`
    values, then its rule (BadValue naming the value and the range). Returns the value as Settings holds
    it: None when unset (None) or off, a float setting's number as a float."""
    s = SETTINGS[key]
    if value is None:
        return None
    _check_type(key, value, s.type)
    if _is_off(s, value):
        return None
    s.rule.check(key, value)
    if s.type is int:
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an int past float's range: no finite number
        raise BadValue(key, f"must be {s.rule.must} (got {value})") from None


def check(values: dict) -> dict:
    """Each value of `values` checked (`checked`), in order; returns them as Settings holds them (a
    stage's off values as None). Keys that are not settings pass unchanged."""
    return {key: checked(key, value) if key in SETTINGS else value for key, value in values.items()}


def from_text(text):
    """A value typed as text (a command-line option, explore's :temp) as the number it spells, so that
    `checked` sees what a program would pass: "3" -> 3, "0.5" -> 0.5, "nan" -> nan; text that spells no
    number stays text (`checked` then says what the setting must be). Not text: as it is."""
    if not isinstance(text, str):
        return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _is_off(s: Setting, v) -> bool:
    return any(v == off and type(v) is not bool for off in s.off)


def _check_type(key: str, value, kind) -> None:
    """BadType (a BadValue and a TypeError) unless `value` is of the setting's type: an int (never a bool or
    a float, even 2.0), or for a float any real number but a bool (NaN is left to the range)."""
    import numbers

    from lmhead_cli.errors import BadType

    if isinstance(value, bool) or not isinstance(value, numbers.Integral if kind is int else numbers.Real):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
        raise BadType(key, f"must be {'an integer' if kind is int else 'a number'} (got {shown})")


# ---- the knobs: one optional field per stage, in order ----------------------------------------

def _pipeline(self, grammar: bool = False) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """The active stages, in order, with their settings bound; with `grammar`, the grammar's mask in its
    place (`grammar_mask`, which `process` gives each step's mask)."""
    bound = [(s.key, _bind(s.apply, getattr(self, s.key))) for s in STAGES if getattr(self, s.key) is not None]
    if grammar:
        at = sum(key in BEFORE_GRAMMAR for key, _ in bound)
        bound.insert(at, ("grammar", grammar_mask))
    return [fn for _, fn in bound]


def _active(self) -> dict[str, float]:
    """{key: value} of the stages that are on, in order."""
    return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


# Knobs is built from STAGES at run time, so that a stage added to the registry is a field everywhere
# with no other edit. A type checker cannot run the registry, so it reads the declaration below: the
# same fields, types and defaults, written out. tests/test_settings.py holds the two equal field for
# field (names, order, types, defaults), so a stage added to STAGES alone fails that test until its
# line is added here too; the program never reads this class.
if TYPE_CHECKING:
    @dataclass(frozen=True)
    class Knobs:
        """The settings of the stages (one field per entry of STAGES); None means the stage is off."""

        softcap: float | None = None
        temperature: float | None = None
        top_k: int | None = None
        top_p: float | None = None
        min_p: float | None = None

        def pipeline(self, grammar: bool = False) -> list[Callable[[torch.Tensor], torch.Tensor]]: ...

        def active(self) -> dict[str, float]: ...
else:
    Knobs = make_dataclass(
        "Knobs", [(s.key, Optional[s.type], None) for s in STAGES], frozen=True,
        namespace={"__doc__": "The settings of the stages (one field per entry of STAGES); None means the stage "
                              "is off.", "pipeline": _pipeline, "active": _active},
    )
    Knobs.__module__ = __name__  # make_dataclass's `module=` needs Python 3.12


def _bind(fn, value):
    return lambda z: fn(z, value)


# ---- all stages, and the choice -----------------------------------------------------------------

def process(logits: torch.Tensor, pipeline, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Run the active stages in order: (..., V) -> (..., V) float32; `allowed` (..., V) bool is the
    grammar's mask for this step, where the pipeline holds `grammar_mask`."""
    z = logits.float()
    for stage in pipeline:
        z = stage(z) if stage is not grammar_mask else grammar_mask(z, allowed)
    return z


# The grammar's mask (decoding/grammar.py: a JSON schema or a regex) runs after these stages and before the
# filters: soft-capping after it would lift its -inf to -c, and a filter before it could keep only tokens
# the grammar forbids, leaving nothing to choose. Temperature commutes with it.
BEFORE_GRAMMAR = ("softcap", "temperature")


def grammar_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The grammar stage: tokens the grammar does not allow next become -inf. (..., V), (..., V) bool."""
    return logits.float().masked_fill(~allowed, float("-inf"))


def choose(logprobs: torch.Tensor, greedy: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token per row: (R, V) -> (R,). Greedy takes the most probable (the first on ties);
    otherwise one draw from exactly these probabilities with the seeded `generator`."""
    import torch

    if greedy:
        return logprobs.argmax(dim=-1)  # a NaN row: the step's record raises NonFiniteLogits (record.step_of)
    probs = logprobs.exp()  # (R, V)
    if bool(probs.isnan().any()):  # before the draw: torch.multinomial's RuntimeError (a device assert on CUDA)
        from lmhead_cli.head import NON_FINITE_ADVICE

        raise NonFiniteLogits(f"the head produced non-finite logits (NaN or inf) in {int(probs.isnan().any(-1).sum())} "
                              f"of {len(probs)} rows, so there is no distribution to sample from: {NON_FINITE_ADVICE}")
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---- the stage table (`lmhead inspect --stages`) ---------------------------------------------

@dataclass(frozen=True)
class StageCell:
    value: float | None  # logit after this column's stages; None = filtered out
    rank: int | None  # 1 + tokens strictly higher at this column; None = filtered out


@dataclass(frozen=True)
class StageTable:
    columns: list[str]  # COLUMNS: raw, soft-capped, tempered, filtered
    rows: list  # head.TokenScore: raw rank and logit, the final prob and logprob, `cells` one per column
    kept: int  # tokens that survive the filters
    vocab: int
    entropy: float  # nats, of the final distribution
    knobs: Knobs


def stage_table(logits: torch.Tensor, knobs: Knobs, rows: int, token_text) -> StageTable:
    """Follow the `rows` highest raw logits (V,) through every column of stages to the final probability."""
    import torch

    from lmhead_cli.head import Distribution, TokenScore, ranks

    z = logits.float()
    snapshots = {"raw": z}
    for s in STAGES:
        if getattr(knobs, s.key) is not None:
            z = s.apply(z, getattr(knobs, s.key))
        snapshots[s.column] = z  # the last stage of a column leaves its value
    if bool(torch.isnan(z).any() | torch.isposinf(z).any()):  # only logits beyond 3.4e32 get here
        from lmhead_cli.errors import NonFiniteLogits

        raise NonFiniteLogits("the stages pushed the logits past float32's range (NaN or inf); a larger "
                              "temperature, or a smaller soft-cap first (c·tanh(z/c) stays within ±c), keeps them "
                              "finite")
    final = Distribution(z)
    lp = final.logprobs
    ids = torch.topk(logits.float(), min(rows, logits.shape[-1])).indices  # (rows,)
    columns = torch.stack([snapshots[c] for c in COLUMNS])  # (C, V)
    values = columns[:, ids]  # (C, rows)
    at = ranks(columns, ids.expand(len(COLUMNS), -1))  # (C, rows)
    kept = torch.isfinite(values)
    table = [TokenScore(rank=int(at[0, r]), id=int(i), token=token_text(int(i)), logit=float(values[0, r]),
                        prob=float(lp[i].exp()), logprob=float(lp[i]),
                        cells=[StageCell(float(values[c, r]) if kept[c, r] else None,
                                         int(at[c, r]) if kept[c, r] else None) for c in range(len(COLUMNS))])
             for r, i in enumerate(ids.tolist())]
    return StageTable(columns=list(COLUMNS), rows=table,
                      kept=int(torch.isfinite(z).sum()), vocab=int(z.shape[-1]), entropy=final.entropy,
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
            check({"softcap": cap})
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
