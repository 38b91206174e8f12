"""Beam search over the one step function: the beams are a group of rows of a decoding.batch.Batch, and
the decoder (decoding/decoder.py) drives the search a step at a time (BeamSearch).

The prompt is prefilled once by the batch (as any row's); each step then takes the batch's
distributions (its head half: raw and processed log-probabilities per row, decoding/batch.py), ranks
every beam's candidates by summed processed log p, regroups the rows to the survivors (a beam kept
twice is copied with its cache: engine.reorder_cache) and advances them by one position each, all
beams in one forward. It needs no scheduler: a beam group runs alone, to its end.

The search is transformers' `generate(num_beams=N, do_sample=False)` (length_penalty 1,
early_stopping False): keep 2N candidates per step, let the best N of them that hit end-of-text (or
the last step) finish, scored sum(log p) / length, continue the N best that did not, and stop once no
running beam can beat the worst of N finished. Scores are rounded to float32 as transformers' are, so
ties break the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from lmhead_cli.decoding.batch import Batch
from lmhead_cli.decoding.record import Step, Top, record, step_of, top_tokens
from lmhead_cli.decoding.rows import Quiet
from lmhead_cli.decoding.request import Request
from lmhead_cli.decoding.settings import Settings

FINISHED = -1.0e9  # transformers' penalty that keeps a finished candidate from running on
LENGTH_PENALTY = 1.0  # transformers' default: a finished beam scores sum(log p) / length
LENGTH_PENALTY_RULE = ("score = sum(log p) / length ** 1.0, with log p the processed log-probability of each "
                       "token and length the number of generated tokens (end-of-text included): "
                       "transformers' length_penalty = 1.0")


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


@dataclass(frozen=True)
class _Beam:
    score: float  # sum of log p (with FINISHED added if it finished in the step it was picked)
    steps: tuple[Step, ...] = ()


class BeamSearch:
    """Beam search for one prompt (s.beams beams, at most `max_new` tokens, ending on `stop_at`), one step
    at a time: `start` reads the prompt and ranks the first candidates, each `step` advances the beams by
    one position; the decoder (decoding/decoder.py) drives both. Once `done`: `stop` ("eos" or
    "max_new_tokens", as the best beam ended), `beams` (the finished beams, best first), `steps` (the best
    one's Steps) and `first` (the time.perf_counter() at which the first step's candidates were known)."""

    def __init__(self, loaded, ids: list[int], s: Settings, max_new: int, stop_at: int | None):
        self.loaded, self.s, self.max_new, self.stop_at = loaded, s, max_new, stop_at
        self.token_text = loaded.tokenizer.token_text
        self.batch = Batch(loaded)
        # one row (its stages rank the candidates), copied into n beams at the first regroup
        row = Request.of(s, [ids], max_new).rows()[0]  # the one Settings -> Row conversion, the decoder's too
        self.batch.add(0, replace(row, greedy=True, stop=()))
        self.running = [_Beam(0.0)]
        self.finished: list[tuple[float, _Beam]] = []
        self.t, self.rows, self.cands = 0, [], []
        self.started = self.done = False
        self.first = 0.0

    def start(self) -> None:
        """The prompt's prefill (its one row only joins) and the first step's candidates."""
        with torch.inference_mode():
            self.batch.prefill(Quiet(), choose=False)
            self.cands = _candidates(self.batch, self.running, self.s, 0, self.max_new, self.stop_at, self.token_text)
        self.first = time.perf_counter()
        self.started = True
        self._settle()

    def step(self) -> None:
        """The rows regrouped to the survivors and advanced by one position, all beams in one forward, then
        the next step's candidates."""
        self.t += 1
        self.cands = _next(self.batch, self.rows, self.running, self.s, self.t, self.max_new, self.stop_at,
                           self.token_text)
        self._settle()

    def _settle(self) -> None:
        """Step t's candidates: the best n that finished join the finished beams, scored per token; the n
        best run on (one that finished sinks below every live one), unless the search is over."""
        n, cands, length = self.s.beams, self.cands, self.t + 1
        for score, row, st, hit in cands[:n]:
            if hit:
                self.finished.append((_f32(score / length**LENGTH_PENALTY), _Beam(score, self.running[row].steps + (st,))))
        self.finished = sorted(self.finished, key=lambda f: f[0], reverse=True)[:n]
        if all(c[3] for c in cands):
            return self._end()
        live = sorted(cands, key=lambda c: c[0] + FINISHED * c[3], reverse=True)[:n]
        self.running = [_Beam(_f32(score + FINISHED * hit), self.running[row].steps + (st,))
                        for score, row, st, hit in live]
        if len(self.finished) == n and self.running[0].score / length**LENGTH_PENALTY <= self.finished[-1][0]:
            return self._end()
        self.rows = [row for _, row, _, _ in live]

    def _end(self) -> None:
        self.beams = [_finished(score, beam, self.stop_at, self.loaded.tokenizer) for score, beam in self.finished]
        self.stop, self.steps = self.beams[0].stop, list(self.finished[0][1].steps)
        self.done, self.batch = True, None


@torch.inference_mode()
def _next(batch: Batch, rows: list[int], running: list[_Beam], s: Settings, t: int, max_new: int,
          stop_at: int | None, token_text) -> list[tuple[float, int, Step, bool]]:
    """The rows regrouped to the survivors (`rows`, the beam each continues), each advanced by its
    beam's last token in one forward, then step t's candidates."""
    batch.regroup(rows)
    batch.advance(torch.tensor([b.steps[-1].id for b in running], device=batch.eng.device))
    return _candidates(batch, running, s, t, max_new, stop_at, token_text)


@torch.inference_mode()
def _candidates(batch: Batch, running: list[_Beam], s: Settings, t: int, max_new: int, stop_at: int | None,
                token_text) -> list[tuple[float, int, Step, bool]]:
    """The 2n best continuations of the running beams (the batch's rows), best first: (summed log p,
    the beam it continues, its Step, whether it finishes: end-of-text or the last step)."""
    logits = batch.logits  # (R, V), R = 1 at the first step, then n
    raw, logprobs, piped = batch.distributions()  # (R, V) each: processed log p ranks the beams
    scores = logprobs + torch.tensor([b.score for b in running], device=logprobs.device)[:, None]
    top, flat = scores.view(-1).topk(min(2 * s.beams, scores.numel()))  # (2n,) best over all beams
    rows, tokens = flat // logits.shape[-1], flat % logits.shape[-1]
    rec = record(logits[rows], raw[rows], logprobs[rows], tokens, s.show_steps, piped)
    table = torch.cat([top[:, None].double(), rows[:, None].double(), rec], dim=-1).tolist()  # one transfer
    alts = top_tokens(raw, logprobs, s.logprobs, s.top_logprobs)  # per beam, not per candidate
    cands = []
    for score, row, *rec in table:
        st = step_of(rec, token_text, logits, Top(alts[0][int(row)], alts[1][int(row)]) if alts else None)
        cands.append((score, int(row), st, st.id == stop_at or t + 1 == max_new))
    return cands


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
