"""Beam search over the one step function: the beams are a group of rows of a decoding.batch.Batch.

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

import functools
import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from lmhead_cli.decoding.batch import Batch
from lmhead_cli.decoding.record import Step, Top, record, step_of, top_tokens
from lmhead_cli.decoding.rows import Quiet
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


def search(loaded, ids: list[int], s: Settings, max_new: int, stop_at: int | None,
           run: Callable = lambda f: f()) -> tuple[str, list[FinishedBeam], list[Step], float]:
    """Beam search for one prompt (s.beams beams, at most `max_new` tokens, ending on `stop_at`):
    ("eos" | "max_new_tokens" as the best beam ended, the finished beams, best first, the best one's
    Steps, and the time.perf_counter() at which the first step's candidates were known). `run(f)` runs each step
    after the prefill (loaded.execution.run: one position per step chooses the threads)."""
    n, token_text = s.beams, loaded.tokenizer.token_text
    batch = Batch(loaded)
    # one row (its stages rank the candidates), copied into n beams at the first regroup
    batch.add(0, replace(s.row(ids, max_tokens=max_new, eos=None), greedy=True, stop=()))
    running = [_Beam(0.0)]
    with torch.inference_mode():
        batch.prefill(Quiet(), choose=False)  # the prompt's one row only joins
        cands = _candidates(batch, running, s, 0, max_new, stop_at, token_text)
    first = time.perf_counter()
    finished: list[tuple[float, _Beam]] = []
    for t in range(max_new):
        # the best n of the candidates that finished join the finished beams, scored per token
        length = t + 1
        for score, row, st, hit in cands[:n]:
            if hit:
                finished.append((_f32(score / length**LENGTH_PENALTY), _Beam(score, running[row].steps + (st,))))
        finished = sorted(finished, key=lambda f: f[0], reverse=True)[:n]
        if all(c[3] for c in cands):
            break
        # the n best candidates run on; one that finished sinks below every live one
        live = sorted(cands, key=lambda c: c[0] + FINISHED * c[3], reverse=True)[:n]
        running = [_Beam(_f32(score + FINISHED * hit), running[row].steps + (st,)) for score, row, st, hit in live]
        if len(finished) == n and running[0].score / length**LENGTH_PENALTY <= finished[-1][0]:
            break
        rows = [row for _, row, _, _ in live]
        cands = run(functools.partial(_next, batch, rows, running, s, t + 1, max_new, stop_at, token_text))
    done = [_finished(score, beam, stop_at, loaded.tokenizer) for score, beam in finished]
    return done[0].stop, done, list(finished[0][1].steps), first


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
