"""Generation: the decoding stages in a loop, with every step's choice recorded.

The prompt runs through the body once (prefill), filling the KV cache; after that each step runs
one new position through the model, and the head only ever sees the last position
(engine.last_logits). Per step there is one device-to-host transfer, holding the chosen token and
its figures, so the loop stays close to transformers' generate() in speed.

Greedy and sampled decoding follow one sequence, one row of decoding.loop's Batch; beam search
(beams > 1, decoding/beams.py) runs the N best by summed log-probability as a group of rows of the
same batch, exactly as transformers' `generate(num_beams=N, do_sample=False)` does (length penalty 1,
early_stopping=False). This module holds what both report: the Generation, its Steps and the
finished beams, and each step's record (`_record`, `_step`, `_top`). Nothing here prints: text goes
to an `on_text` callback.

Every step records the chosen token under two distributions, because they answer different
questions (transformers #17424, llama.cpp #7498, vLLM's --logprobs-mode):
  raw        softmax of the model's logits: what the model believes;
  processed  softmax after the stage chain (soft-cap, temperature, top-k, top-p, min-p): what the
             token was drawn from (greedy and beam search rank by it too).
With no stage active the two are the same distribution.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lmhead_cli.decoding.settings import DEFAULT_MAX_NEW_TOKENS, DISTRIBUTIONS, Settings, make, resolve  # noqa: F401
from lmhead_cli.engine.base import config_value
from lmhead_cli.errors import BadValue
from lmhead_cli.head import check_finite, check_top_logprobs, entropy, ranks
from lmhead_cli.loading.sources import Loaded

LENGTH_PENALTY = 1.0  # transformers' default: a finished beam scores sum(log p) / length
LENGTH_PENALTY_RULE = ("score = sum(log p) / length ** 1.0, with log p the processed log-probability of each "
                       "token and length the number of generated tokens (end-of-text included): "
                       "transformers' length_penalty = 1.0")
# columns of a step record, then K alternative ids and K alternative log-probabilities
ID, LOGPROB, LOGIT, ENTROPY, RANK, FINITE, RAW_LOGPROB, RAW_ENTROPY, REMOVED = range(9)
FIXED = 9


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


def make_settings(**values) -> Settings:
    """Checked settings (decoding.settings.make, the one check)."""
    return make(**values)


def room(n_ctx: int, n_prompt: int) -> int:
    """How many tokens fit after the prompt: the model reads the prompt and every new token but the
    last, so n_prompt + new - 1 <= n_ctx."""
    return n_ctx - n_prompt + 1


def check_fits(eng, n_prompt: int, s: Settings, prompts: int = 1) -> None:
    """The checks of `s` that need the model: top_logprobs within its vocabulary, and the memory of the
    rows (the beams of one prompt, or `prompts` × s.n choices) for the longest prompt (`n_prompt` tokens)
    and the tokens that fit after it. BadValue before any work; api.checks runs them before a front end
    prints anything."""
    check_top_logprobs(s.top_logprobs, eng.vocab_size)
    positions = n_prompt + min(s.max_new_tokens, room(eng.n_ctx, n_prompt))
    if s.mode == "beam":
        check_beam_memory(eng, s.beams, positions)
    elif prompts * s.n > 1:
        check_rows_memory(eng, "n" if s.n > 1 else "prompt", prompts * s.n,
                          f"{prompts:,} prompts × {s.n:,} choices" if prompts > 1 else f"{s.n:,} choices", positions)


def generate(loaded: Loaded, ids: list[int], s: Settings, on_text: Callable[[str], None] | None = None,
             eos_token_id: int | None = None) -> Generation:
    """Generate after the prompt `ids`; `on_text(piece)` sees the text as it is made.

    Each piece is what became printable with the latest token: a character split across tokens
    (Chinese, emoji) arrives once all its bytes are there. A final end-of-text is not text.
    """
    return generate_many(loaded, [ids], s, on_text, eos_token_id)[0]


def generate_many(loaded: Loaded, prompts: list[list[int]], s: Settings,
                  on_text: Callable[[str], None] | None = None, eos_token_id: int | None = None) -> list[Generation]:
    """Every prompt's s.n choices, one row each, as one batch (decoding.loop.Batch): prompt i's choices
    are generations i·n … i·n + n - 1, and choice j draws with seed + j (the server's rule), so each
    is what the same settings with its own seed give alone. Beam search runs one prompt's beams at a
    time. `on_text` hears the text of a single generation (one prompt, n = 1) as it is made."""
    eng = loaded.engine
    check_fits(eng, max(len(ids) for ids in prompts), s, len(prompts))
    eos = eng.eos_token_id if eos_token_id is None else eos_token_id
    rooms = [min(s.max_new_tokens, room(eng.n_ctx, len(ids))) for ids in prompts]
    if s.mode == "beam":
        return [_beams(loaded, ids, s, max_new, None if s.ignore_eos else eos, on_text)
                for ids, max_new in zip(prompts, rooms)]
    from lmhead_cli.decoding.loop import Batch

    seeds = s.choice_seeds()  # one draw for the whole call: prompt i's choice j draws with seed + j
    keys = [(ids, max_new, seed) for ids, max_new in zip(prompts, rooms) for seed in seeds]
    sink = _Collect(on_text if len(keys) == 1 else None, len(keys))
    batch = Batch(loaded)
    for k, (ids, max_new, seed) in enumerate(keys):
        batch.add(k, s.row(ids, max_tokens=max_new, eos=eos, seed=seed))
    batch.round(sink)  # the prefills and each row's first token
    while batch.live:  # one position per row and step: these steps choose the thread count
        loaded.execution.run(lambda: batch.step(sink), units=len(batch.live))
    elapsed = time.perf_counter() - sink.start
    out = []
    for k, (ids, max_new, seed) in enumerate(keys):
        reason = sink.reason[k]
        stop = reason if reason in ("eos", "stop") else "max_new_tokens"
        if stop == "max_new_tokens" and max_new < s.max_new_tokens:
            stop = "context"
        steps = sink.steps[k]
        out.append(Generation(mode=s.mode, settings=s, seed=seed, prompt_ids=list(ids),
                              generated_ids=[st.id for st in steps], text=sink.text[k], steps=steps, stop=stop,
                              elapsed_s=elapsed, first_token_s=sink.first[k] or elapsed))
    return out


class _Collect:
    """decoding.loop's Sink for rows 0 … rows - 1: their Steps, texts, why each ended and when its first
    token came (seconds from `start`); `on_text` hears each piece."""

    def __init__(self, on_text: Callable[[str], None] | None, rows: int = 1):
        self.on_text, self.start = on_text, time.perf_counter()
        self.steps: list[list[Step]] = [[] for _ in range(rows)]
        self.text: list[str] = [""] * rows
        self.reason: list[str | None] = [None] * rows  # "eos", "stop" or "length" once the row ends
        self.first: list[float | None] = [None] * rows

    def echo(self, key, echo) -> None:
        pass

    def token(self, key, token) -> None:
        if self.first[key] is None:
            self.first[key] = time.perf_counter() - self.start
        self.steps[key].append(token.step)
        self._piece(key, token.text)

    def finish(self, key, reason: str, tail: str) -> None:
        self.reason[key] = reason
        self._piece(key, tail)

    def cancelled(self, key) -> bool:
        return False

    def _piece(self, key, piece: str) -> None:
        if piece:
            self.text[key] += piece
            if self.on_text is not None:
                self.on_text(piece)


def _beams(loaded: Loaded, ids: list[int], s: Settings, max_new: int, stop_at: int | None,
           on_text: Callable[[str], None] | None) -> Generation:
    """Beam search (beams > 1, decoding.beams): the best beam's text streamed once the search ends."""
    from lmhead_cli.decoding.beams import search
    from lmhead_cli.decoding.loop import Text

    start = time.perf_counter()
    stop, beams, steps, first = search(loaded, ids, s, max_new, stop_at, loaded.execution.run)
    sink, text = _Collect(on_text), Text(loaded.tokenizer)
    for st in steps:
        if st.id != stop_at:  # a final end-of-text is not text
            text.add(st.id)
            sink._piece(0, text.piece())
    sink._piece(0, text.piece(final=True, flush=True))
    elapsed = time.perf_counter() - start
    if stop == "max_new_tokens" and max_new < s.max_new_tokens:
        stop = "context"
    return Generation(mode=s.mode, settings=s, seed=None, prompt_ids=list(ids),
                      generated_ids=[st.id for st in steps], text=sink.text[0], steps=steps, stop=stop,
                      elapsed_s=elapsed, first_token_s=first - start, beam_score=beams[0].score, beams=beams)


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
    check_rows_memory(eng, "beams", beams, f"{beams:,}", positions, "beam")


def check_rows_memory(eng, key: str, rows: int, what: str, positions: int, row: str = "row") -> None:
    """BadValue(key) when `rows` rows of `positions` positions (beam_memory's arithmetic: each row's
    KV cache and BEAM_ROWS rows of the vocabulary) need more memory than there is, with the figures."""
    from lmhead_cli.loading.checks import available_memory, gb

    need, per_row = beam_memory(eng, rows, positions)
    free = available_memory(eng.device.type)
    if free is not None and need > free:
        raise BadValue(key, f"of {what} need about {gb(need)} ({gb(per_row)} of cache and logits per {row}), "
                            f"but {gb(free)} is available; at most {max(1, free // per_row):,} {row}s fit")


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


def _greedy_record(logits: torch.Tensor, kernel, made: tuple | None = None) -> tuple[torch.Tensor, list[list[float]]] | None:
    """Greedy rows with no stage and no alternatives: the choice (R,) and `_record`'s rows (as lists),
    from the compiled row kernel (head.score_rows's: the top-1, its log p and the entropy in two passes
    over each row, where torch's log-softmax, argmax, entropy and rank take some ten). The greedy choice
    is the top-1 (the first of equal maxima, as argmax), so its rank is 1 and its log p the top's; no
    stage ran, so raw and processed are one. None where the kernel does not take the rows (no kernel,
    not on the CPU, a logit not finite, -inf too): the caller runs `_record`, which reports what is wrong.
    The kernel finds the logits not finite in its first pass (strict): a check of its own in torch read
    the fresh logits once more, 0.13-0.22 ms of an 8 ms int8 step. `made`: the same kernel's record,
    made by the engine with these logits (Engine.step_logits: top_id (R,), (3, R) the top-1's log p,
    the entropy and its logit), which saves the call and its Python."""
    if made is not None:
        top_id, (top_logprob, h, logit) = made[0], made[1].tolist()
    else:
        if kernel is None or not logits.is_cpu or logits.dim() != 2:
            return None
        z = logits.float().contiguous()
        try:
            _, _, h, top_id, top_logprob, _, _, bad = kernel(z, torch.zeros(z.shape[0], dtype=torch.long), strict=True)
        except ValueError:
            return None
        if bad:
            return None
        top_logprob, h = top_logprob.tolist(), h.tolist()
        logit = z.numpy()[range(z.shape[0]), top_id.numpy()].tolist()
    rows = [[float(i), lp, zz, e, 1.0, 1.0, lp, e, 0.0]
            for i, lp, zz, e in zip(top_id.tolist(), top_logprob, logit, h)]
    return top_id, rows


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
