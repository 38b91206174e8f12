"""Generation: the decoding stages in a loop, with every step's choice recorded.

The prompt runs through the body once (prefill), filling the KV cache; after that each step runs
one new position through the model, and the head only ever sees the last position
(engine.last_logits). Per step there is one device-to-host transfer, holding the chosen token and
its figures, so the loop stays close to transformers' generate() in speed.

Greedy and sampled decoding follow one sequence; beam search (beams > 1) follows the N best by
summed log-probability exactly as transformers' `generate(num_beams=N, do_sample=False)` does
(length penalty 1, early_stopping=False). Nothing here prints: text goes to an `on_text` callback.

Every step records the chosen token under two distributions, because they answer different
questions (transformers #17424, llama.cpp #7498, vLLM's --logprobs-mode):
  raw        softmax of the model's logits: what the model believes;
  processed  softmax after the stage chain (soft-cap, temperature, top-k, top-p, min-p): what the
             token was drawn from (greedy and beam search rank by it too).
With no stage active the two are the same distribution.
"""

from __future__ import annotations

import codecs
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from lmhead_cli.decoding import stages
from lmhead_cli.decoding.presets import merge
from lmhead_cli.decoding.stages import Knobs
from lmhead_cli.engine.base import config_value
from lmhead_cli.errors import BadValue, ModeConflict
from lmhead_cli.head import check_finite, check_top_logprobs, entropy, log_softmax, ranks
from lmhead_cli.loading.sources import Loaded

DEFAULT_MAX_NEW_TOKENS = 40
LENGTH_PENALTY = 1.0  # transformers' default: a finished beam scores sum(log p) / length
LENGTH_PENALTY_RULE = ("score = sum(log p) / length ** 1.0, with log p the processed log-probability of each "
                       "token and length the number of generated tokens (end-of-text included): "
                       "transformers' length_penalty = 1.0")
FINISHED = -1.0e9  # transformers' penalty that keeps a finished candidate from running on
# columns of a step record, then K alternative ids and K alternative log-probabilities
ID, LOGPROB, LOGIT, ENTROPY, RANK, FINITE, RAW_LOGPROB, RAW_ENTROPY, REMOVED = range(9)
FIXED = 9
DISTRIBUTIONS = ("raw", "processed")  # which one --top-logprobs (and the OpenAI document) reports


@dataclass(frozen=True)
class Settings:
    """Everything that decides the tokens (with the model, the prompt and the device)."""

    knobs: Knobs = field(default_factory=Knobs)
    greedy: bool = False
    beams: int = 1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    ignore_eos: bool = False
    seed: int | None = None  # drawn when sampling without one
    show_steps: int = 0  # how many alternatives to record per step
    top_logprobs: int = 0  # how many of the most probable tokens to keep per step, 0..V
    logprobs: str = "raw"  # the distribution those come from: raw or processed

    @property
    def mode(self) -> str:
        return "beam" if self.beams > 1 else "greedy" if self.greedy else "sample"


@dataclass(frozen=True)
class Choice:
    id: int
    token: str
    prob: float


@dataclass(frozen=True)
class Top:
    """The N most probable tokens of one step under one distribution, kept compact on the CPU:
    ids (N,) int64, logprobs (N,) float32, best first (processed: -inf for a token the filters
    dropped, those in raw order after the kept ones)."""

    ids: torch.Tensor
    logprobs: torch.Tensor


@dataclass(frozen=True)
class Step:
    """One generated token and why: the raw distribution and the processed one it was drawn from."""

    id: int
    token: str
    prob: float  # its processed probability, exp(logprob): what it was drawn with
    logit: float  # its raw logit
    entropy: float  # nats, of the processed distribution
    rank: int  # 1 + tokens with a higher raw logit
    logprob: float  # log of prob: after the stage chain
    raw_logprob: float  # log softmax of the raw logits
    raw_entropy: float  # nats, of the raw distribution
    removed_mass: float  # raw probability of the tokens the filters set to -inf (0 with no filter)
    alternatives: list[Choice] = field(default_factory=list)  # the K most probable, processed (show_steps)
    top: Top | None = None  # the top_logprobs most probable, raw or processed (Settings.logprobs)

    @property
    def raw_prob(self) -> float:
        return math.exp(self.raw_logprob)


@dataclass(frozen=True)
class FinishedBeam:
    """One of the N finished beams: its tokens, the score of each, and the arithmetic of its score."""

    ids: list[int]
    text: str  # decoded, without a final end-of-text
    transition_scores: list[float]  # processed log p of each token, as compute_transition_scores gives
    logprob: float  # the cumulative log p the search carried (float32, as transformers)
    score: float  # logprob / length ** LENGTH_PENALTY
    stop: str  # "eos" or "max_new_tokens"

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def sum_error(self) -> float:
        """|sum(transition_scores) - logprob|: float32 rounding only, if the bookkeeping is right."""
        return abs(math.fsum(self.transition_scores) - self.logprob)

    @property
    def adds_up(self) -> bool:
        # the search adds float32 numbers, one per step: allow their rounding, ~1e-7 of the total per step
        return self.sum_error <= 1e-6 * max(1.0, abs(self.logprob)) * max(1, self.length)


@dataclass
class Generation:
    mode: str  # greedy, sample or beam
    settings: Settings
    seed: int | None
    prompt_ids: list[int]
    generated_ids: list[int]
    text: str  # what was streamed: the generated bytes decoded, without a final end-of-text
    steps: list[Step]
    stop: str  # "eos", "max_new_tokens" or "context"
    elapsed_s: float  # prefill and every step
    first_token_s: float
    beam_score: float | None = None  # sum(log p) / length of the chosen beam
    beams: list[FinishedBeam] = field(default_factory=list)  # beam search: the N finished, best first

    @property
    def tokens_per_second(self) -> float:
        return len(self.generated_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second after the first: the steady one-position-per-step rate."""
        rest = self.elapsed_s - self.first_token_s
        return (len(self.generated_ids) - 1) / rest if len(self.generated_ids) > 1 and rest > 0 else 0.0

    @property
    def mean_entropy(self) -> float:
        return sum(s.entropy for s in self.steps) / len(self.steps) if self.steps else 0.0


def make_settings(*, greedy: bool = False, beams: int = 1, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                  ignore_eos: bool = False, seed: int | None = None, show_steps: int = 0, top_logprobs: int = 0,
                  logprobs: str = "raw", **knobs) -> Settings:
    """Checked settings: BadValue names the first value out of range (top_logprobs' upper bound, the
    vocabulary size, is checked by `generate`, which knows the model)."""
    stages.check({"beams": beams, "max_new_tokens": max_new_tokens, "seed": seed, "show_steps": show_steps,
                  "top_logprobs": top_logprobs, **knobs})
    if logprobs not in DISTRIBUTIONS:
        raise BadValue("logprobs", f"must be raw or processed (got {logprobs!r})")
    return Settings(knobs=Knobs(**knobs), greedy=greedy, beams=beams, max_new_tokens=max_new_tokens,
                    ignore_eos=ignore_eos, seed=seed, show_steps=show_steps, top_logprobs=top_logprobs,
                    logprobs=logprobs)


def resolve(*, defaults: dict | None = None, draws: bool = False, preset: str | None = None,
            greedy: bool = False, beams: int = 1, ignore_eos: bool = False, seed: int | None = None,
            show_steps: int = 0, top_logprobs: int = 0, logprobs: str = "raw", **flags) -> Settings:
    """Settings from three layers: the caller's `defaults` (e.g. softcap 30) < the preset < the flags
    given (None = not given). With `draws` the tokens must be drawn at random: asking for greedy or
    beams is a ModeConflict."""
    if draws and (greedy or beams > 1):
        raise ModeConflict({"greedy": True} if greedy else {"beams": beams})
    values = merge(preset, {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **(defaults or {})}, flags)
    return make_settings(greedy=greedy, beams=beams, ignore_eos=ignore_eos, seed=seed, show_steps=show_steps,
                         top_logprobs=top_logprobs, logprobs=logprobs, **values)


def room(n_ctx: int, n_prompt: int) -> int:
    """How many tokens fit after the prompt: the model reads the prompt and every new token but the
    last, so n_prompt + new - 1 <= n_ctx."""
    return n_ctx - n_prompt + 1


def check_fits(eng, n_prompt: int, s: Settings) -> None:
    """The checks of `s` that need the model: top_logprobs within its vocabulary, and the beams'
    memory for the prompt and the tokens that fit after it. BadValue before any work; api.checks
    runs them before a front end prints anything."""
    check_top_logprobs(s.top_logprobs, eng.vocab_size)
    if s.mode == "beam":
        check_beam_memory(eng, s.beams, n_prompt + min(s.max_new_tokens, room(eng.n_ctx, n_prompt)))


def generate(loaded: Loaded, ids: list[int], s: Settings, on_text: Callable[[str], None] | None = None,
             eos_token_id: int | None = None) -> Generation:
    """Generate after the prompt `ids`; `on_text(piece)` sees the text as it is made.

    Each piece is what became printable with the latest token: a character split across tokens
    (Chinese, emoji) arrives once all its bytes are there. A final end-of-text is not text.
    """
    eng = loaded.engine
    check_fits(eng, len(ids), s)
    eos = eng.eos_token_id if eos_token_id is None else eos_token_id
    stop_at = None if s.ignore_eos else eos
    max_new = min(s.max_new_tokens, room(eng.n_ctx, len(ids)))
    seed = s.seed if s.seed is not None or s.mode != "sample" else secrets.randbelow(2**32)
    text = _Text(loaded.tokenizer)
    steps: list[Step] = []

    start = time.perf_counter()
    first = None
    if s.mode == "beam":
        loop = _beam_search(eng, ids, s, max_new, stop_at, loaded.tokenizer)
    else:
        generator = None
        if s.mode == "sample":
            generator = torch.Generator(device=eng.device).manual_seed(seed)
        loop = _one_sequence(eng, ids, s, max_new, stop_at, generator, loaded.tokenizer.token_text)
    stop, beams = "max_new_tokens", []
    while True:
        try:
            # One position per step after the first (the prefill): those steps choose the thread count.
            step = next(loop) if first is None else loaded.execution.run(lambda: next(loop))
        except StopIteration as done:
            stop, beams = done.value
            break
        if first is None:
            first = time.perf_counter() - start
        steps.append(step)
        piece = "" if step.id == stop_at else text.add(step.id)
        if piece and on_text is not None:
            on_text(piece)
    tail = text.flush()
    if tail and on_text is not None:
        on_text(tail)
    elapsed = time.perf_counter() - start
    if stop == "max_new_tokens" and max_new < s.max_new_tokens:
        stop = "context"
    return Generation(mode=s.mode, settings=s, seed=seed, prompt_ids=list(ids),
                      generated_ids=[st.id for st in steps], text=text.text, steps=steps, stop=stop,
                      elapsed_s=elapsed, first_token_s=first or elapsed,
                      beam_score=beams[0].score if beams else None, beams=beams)


# Per beam and step, beam search holds about this many (V,) float32 rows: the logits, the stages'
# output, the log-probabilities, the scores, and the copies gather/topk make of them.
BEAM_ROWS = 8


def beam_memory(eng, beams: int, positions: int) -> tuple[int, int]:
    """(bytes for `beams` beams, bytes per beam): each beam's KV cache for `positions` positions,
    2 x layers x width x positions, plus BEAM_ROWS float32 rows of the vocabulary."""
    layers, width = config_value(eng.config, "n_layer", 1), config_value(eng.config, "n_embd", 1)
    per_beam = 2 * layers * width * positions * eng.dtype.itemsize + BEAM_ROWS * eng.vocab_size * 4
    return beams * per_beam, per_beam


def check_beam_memory(eng, beams: int, positions: int) -> None:
    """BadValue for more beams than the memory there is can hold, with the figures."""
    from lmhead_cli.loading.checks import available_memory, gb

    need, per_beam = beam_memory(eng, beams, positions)
    free = available_memory(eng.device.type)
    if free is not None and need > free:
        raise BadValue("beams", f"of {beams:,} need about {gb(need)} ({gb(per_beam)} of cache and logits per beam), "
                                f"but {gb(free)} is available; at most {max(1, free // per_beam):,} beams fit")


class _Text:
    """The generated text, decoded incrementally from the tokens' bytes (UTF-8 split across tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def add(self, token_id: int) -> str:
        piece = self.decoder.decode(self.tokenizer.token_bytes(token_id))
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self.decoder.decode(b"", final=True)
        self.text += piece
        return piece


# ---- one step's figures, in one transfer ---------------------------------------------------------

def _record(logits: torch.Tensor, raw: torch.Tensor, logprobs: torch.Tensor, chosen: torch.Tensor,
            k: int, processed: bool = True) -> torch.Tensor:
    """(R, 9 + 2k) float64 on the device: id, log p, raw logit, entropy, rank, finite, raw log p, raw
    entropy, removed mass, then the k most probable ids and their log p (processed).
    logits, raw (their log-softmax), logprobs (processed) (R, V); chosen (R,). `processed` False: no
    stage ran, logprobs are raw's, and what is raw's is not computed twice (nothing was removed)."""
    idx = chosen[:, None]
    picked, lp_entropy = logprobs.gather(-1, idx), entropy(logprobs)[:, None]
    if processed:
        # what the filters took away, in the model's own probabilities: the raw mass of every -inf token
        removed = raw.exp().masked_fill(torch.isfinite(logprobs), 0.0).sum(-1, keepdim=True)  # (R, 1)
        raw_lp, raw_entropy = raw.gather(-1, idx), entropy(raw)[:, None]
    else:
        removed, raw_lp, raw_entropy = torch.zeros_like(lp_entropy), picked, lp_entropy
    cols = [idx.double(), picked.double(), logits.gather(-1, idx).double(),
            lp_entropy.double(), ranks(logits, idx).double(),
            torch.isfinite(logits).all(-1, keepdim=True).double(), raw_lp.double(),
            raw_entropy.double(), removed.double()]
    if k:
        alt_lp, alt_ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        cols += [alt_ids.double(), alt_lp.double()]
    return torch.cat(cols, dim=-1)


def _top(raw: torch.Tensor, processed: torch.Tensor, which: str, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The n most probable tokens of each row under `which` distribution ("raw" or "processed"), on
    the CPU: ids (R, n) int64 and log p (R, n) float32; None when n = 0. raw, processed (R, V) log p.

    Processed ranks the tokens the filters kept first; any the filters dropped (log p = -inf) follow
    in raw order, so asking for more than survive still lists the next-best tokens, not arbitrary
    ones. Only n per row leaves the device."""
    if n == 0:
        return None
    if which == "raw":
        lp, ids = torch.topk(raw, n, dim=-1)
        return ids.cpu(), lp.float().cpu()
    kept = torch.isfinite(processed)
    # float64 keys: a dropped token's key sits below the row's lowest kept one, however low (a
    # temperature of 1e-6 puts kept tokens 1e6 apart per unit of logit), and keeps its raw order
    floor = torch.where(kept, processed, torch.inf).amin(-1, keepdim=True).double()  # (R, 1)
    key = torch.where(kept, processed.double(), floor - 1 + (raw - raw.amax(-1, keepdim=True)).double())  # (R, V)
    ids = torch.topk(key, n, dim=-1).indices
    return ids.cpu(), processed.gather(-1, ids).float().cpu()


def _step(row: list[float], token_text, logits: torch.Tensor, top: Top | None = None) -> Step:
    """A Step from one row of `_record` (logits only to explain non-finite values)."""
    if not row[FINITE]:
        check_finite(logits)  # raises NonFiniteLogits with the count
    i, k = int(row[ID]), (len(row) - FIXED) // 2
    alts = [Choice(int(a), token_text(int(a)), math.exp(lp))
            for a, lp in zip(row[FIXED:FIXED + k], row[FIXED + k:])]
    return Step(id=i, token=token_text(i), prob=math.exp(row[LOGPROB]), logit=row[LOGIT],
                entropy=row[ENTROPY], rank=int(row[RANK]), logprob=row[LOGPROB], raw_logprob=row[RAW_LOGPROB],
                raw_entropy=row[RAW_ENTROPY], removed_mass=row[REMOVED], alternatives=alts, top=top)


# ---- greedy and sampled -------------------------------------------------------------------------

def _one_sequence(eng, ids: list[int], s: Settings, max_new: int, stop_at: int | None,
                  generator: torch.Generator | None, token_text) -> Iterator[Step]:
    pipeline = s.knobs.pipeline()
    greedy = s.mode == "greedy"
    cache = eng.new_cache(1, len(ids) + max_new)
    x = torch.tensor([ids], device=eng.device)  # (1, T) the prompt, then (1, 1) each step
    for _ in range(max_new):
        logits = eng.last_logits(x, cache)  # (1, V)
        raw = log_softmax(logits)  # (1, V) the model's own distribution
        # the one drawn from (raw's own when no stage runs: each step's (1, V) passes are most of its own work)
        logprobs = log_softmax(stages.process(logits, pipeline)) if pipeline else raw
        chosen = stages.choose(logprobs, greedy, generator)  # (1,)
        row = _record(logits, raw, logprobs, chosen, s.show_steps, bool(pipeline))[0].tolist()  # one sync per step
        top = _top(raw, logprobs, s.logprobs, s.top_logprobs)  # a second transfer, only when asked
        step = _step(row, token_text, logits, Top(top[0][0], top[1][0]) if top else None)
        yield step
        if step.id == stop_at:
            return "eos", []
        x = chosen[:, None]
    return "max_new_tokens", []


# ---- beam search --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Beam:
    score: float  # sum of log p (with FINISHED added if it finished in the step it was picked)
    steps: tuple[Step, ...] = ()


def _beam_search(eng, ids: list[int], s: Settings, max_new: int, stop_at: int | None, tokenizer):
    """transformers' beam search for one prompt: keep 2N candidates per step, continue the N best that
    did not finish, and keep the N best finished (scored sum(log p) / length) until no running beam
    can beat the worst of them. Returns ("eos" | "max_new_tokens", the finished beams, best first)
    after yielding the best one's steps."""
    token_text = tokenizer.token_text
    n = s.beams
    pipeline = s.knobs.pipeline()
    cache = eng.new_cache(1, len(ids) + max_new)  # prefill once; the first reorder copies it n times
    x = torch.tensor([ids], device=eng.device)
    running = [_Beam(0.0)]
    finished: list[tuple[float, _Beam]] = []
    for t in range(max_new):
        logits = eng.last_logits(x, cache)  # (R, V), R = 1 at the first step, then n
        raw = log_softmax(logits)  # (R, V)
        logprobs = log_softmax(stages.process(logits, pipeline)) if pipeline else raw  # (R, V) what ranks beams
        scores = logprobs + torch.tensor([b.score for b in running], device=logprobs.device)[:, None]
        top, flat = scores.view(-1).topk(min(2 * n, scores.numel()))  # (2n,) best over all beams
        rows, tokens = flat // logits.shape[-1], flat % logits.shape[-1]
        record = _record(logits[rows], raw[rows], logprobs[rows], tokens, s.show_steps, bool(pipeline))
        table = torch.cat([top[:, None].double(), rows[:, None].double(), record], dim=-1).tolist()
        alts = _top(raw, logprobs, s.logprobs, s.top_logprobs)  # per beam, not per candidate
        cands = []
        for score, row, *rec in table:
            step = _step(rec, token_text, logits, Top(alts[0][int(row)], alts[1][int(row)]) if alts else None)
            hit = step.id == stop_at or t + 1 == max_new
            cands.append((score, int(row), step, hit))
        # the best n of the candidates that finished join the finished beams, scored per token
        length = t + 1
        for score, row, step, hit in cands[:n]:
            if hit:
                finished.append((_f32(score / length**LENGTH_PENALTY), _Beam(score, running[row].steps + (step,))))
        finished = sorted(finished, key=lambda f: f[0], reverse=True)[:n]
        if all(c[3] for c in cands):
            break
        # the n best candidates run on; one that finished sinks below every live one
        live = sorted(cands, key=lambda c: c[0] + FINISHED * c[3], reverse=True)[:n]
        running = [_Beam(_f32(score + FINISHED * hit), running[row].steps + (step,)) for score, row, step, hit in live]
        best_possible = running[0].score / length**LENGTH_PENALTY
        if len(finished) == n and best_possible <= finished[-1][0]:
            break
        cache = eng.reorder_cache(cache, torch.tensor([row for _, row, _, _ in live], device=eng.device))
        x = torch.tensor([[b.steps[-1].id] for b in running], device=eng.device)
    done = [_finished(score, beam, stop_at, tokenizer) for score, beam in finished]
    yield from finished[0][1].steps
    return done[0].stop, done


def _finished(score: float, beam: _Beam, stop_at: int | None, tokenizer) -> FinishedBeam:
    ids = [st.id for st in beam.steps]
    stop = "eos" if ids[-1] == stop_at else "max_new_tokens"
    return FinishedBeam(ids=ids, text=tokenizer.decode(ids[:-1] if stop == "eos" else ids),
                        transition_scores=[st.logprob for st in beam.steps], logprob=beam.score, score=score,
                        stop=stop)


def _f32(v: float) -> float:
    """Round as transformers' float32 score tensors do, so ties break the same way (on the CPU, whatever
    torch's default device is)."""
    return float(torch.tensor(v, dtype=torch.float32, device="cpu"))
