"""Rows joining a running batch: their prompts read (prefill), echo scored, caches joined.

`Joining` is the half of decoding.batch.Batch that takes rows in between two steps. `add` queues a
row; `prefill` runs the queued prompts through the body, each prompt alone (rows with the same prompt,
a request's `n` choices, share one prefill and copy its cache), at most `budget` positions per call,
in chunks of PREFILL_CHUNK, so a long prompt is read over several calls while the running rows go on
stepping; prompts waiting together at the head of the queue are read in one left-padded pass
(`_together`). A prefilled row scores its prompt (echo, `score_echo`), its cache joins the batch's
(engine.join_caches: rows right-aligned, left-padded, an attention mask hides the padding, positions
come from the mask, so each row reads exactly what it would alone, up to float rounding) and its
first token is chosen at once from its prompt's logits and handed out (as vLLM and llama.cpp's server
do): its time to first token does not wait for the next step, which runs that token with everyone
else's. Rows already running are never recomputed.

Shapes: R rows, S cache columns, T prompt positions, D width, V vocabulary, K top tokens.
"""

from __future__ import annotations

import math

import torch

from lmhead_cli.decoding import stages
from lmhead_cli.decoding.record import spread, top_tokens
from lmhead_cli.decoding.rows import Echo, Live, Row, Sink, check_finite_rows
from lmhead_cli.head import log_softmax

# Prompt positions read per forward while prefilling: bounds attention's (T, T) scores and lets a long
# prompt be read over several rounds, between the running rows' steps.
PREFILL_CHUNK = 512


class _Prefill:
    """Rows with one prompt, while the prompt is read: its own cache, how far it has got, echo so far;
    once read, its rows (`live`) and their first logits (rows, V), ready to join."""

    def __init__(self, eng, ids: tuple[int, ...]):
        self.ids = ids
        self.rows: list[tuple[object, Row]] = []
        self.echo: dict = {}
        self.cache = None
        self.done = 0
        self.live: list[Live] = []
        self.logits: torch.Tensor | None = None

    def add(self, eng, key, row: Row) -> None:
        self.rows.append((key, row))
        if row.echo:
            T, K = len(self.ids), min(row.top, eng.vocab_size)
            self.echo[key] = Echo(torch.full((T,), math.nan), torch.zeros((T, K), dtype=torch.long) if K else None,
                                  torch.zeros((T, K)) if K else None,
                                  torch.full((T, 3), math.nan) if row.uncertainty else None)

    @property
    def read(self) -> bool:
        return self.done == len(self.ids)


def score_echo(eng, hidden: torch.Tensor, start: int, ids: tuple[int, ...], row: Row, echo: Echo, chunk: int) -> None:
    """Score positions start … start + n - 1 of a prompt from their hidden states (n, D): each gives
    the log p of the token after it (the last position of the prompt predicts no prompt token)."""
    T = len(ids)
    n = min(hidden.shape[0], T - 1 - start)
    pipeline = row.knobs.pipeline() if row.mode == "processed" else []
    K = 0 if echo.top_ids is None else echo.top_ids.shape[1]
    for c in range(0, max(n, 0), chunk):
        m = min(chunk, n - c)
        z = eng.head(hidden[c:c + m]).float()  # (m, V), dropped at the end of the chunk
        check_finite_rows(z)
        raw = log_softmax(z)
        used = log_softmax(stages.process(z, pipeline)) if pipeline else raw
        at = start + c
        targets = torch.tensor(ids[at + 1:at + 1 + m], dtype=torch.long, device=z.device)
        sel = used if row.mode == "processed" else raw
        echo.logprob[at + 1:at + 1 + m] = sel.gather(-1, targets[:, None])[:, 0].cpu()
        if K:
            top_ids, top_lps = top_tokens(raw, used, row.mode, K)
            echo.top_ids[at + 1:at + 1 + m], echo.top_logprobs[at + 1:at + 1 + m] = top_ids, top_lps
        if echo.spread is not None:
            echo.spread[at + 1:at + 1 + m] = spread(sel).cpu()
        del z, raw, used, sel


class Joining:
    """decoding.batch.Batch's admission: queued prompts read and their rows joined between two steps
    (the batch's state, `live`, `cache`, `mask`, `logits`, `queued`, is the Batch's)."""

    def add(self, key, row: Row) -> None:
        """Queue a row; it is prefilled by `prefill` (rows with the prompt of a queued one share its prefill)."""
        p = next((p for p in self.queued if p.ids == row.ids and p.done == 0), None)
        if p is None:
            p = _Prefill(self.eng, row.ids)
            self.queued.append(p)
        p.add(self.eng, key, row)

    @torch.inference_mode()
    def prefill(self, sink: Sink, budget: int | None = None, choose: bool = True) -> int:
        """Read queued prompts, at most `budget` positions (None: all of them; at least one chunk),
        first come first; the rows of a prompt read to its end join the batch, their first tokens
        chosen and handed to `sink` at once (`choose` False: not chosen, for a caller that picks
        them from `distributions`, as beam search does). An engine whose caches cannot be joined
        (engine.join_caches gives None) takes new rows only into an empty batch. Returns the prompt
        positions read."""
        left = math.inf if budget is None else max(budget, 1)
        read = 0
        ready: list[_Prefill] = []
        while self.queued and (left > 0 or self.queued[0].read) and (self._joins or not (self.live or ready)):
            group = self._together(left)
            if group:
                n = len(group) * max(len(p.ids) for p in group)
                together = self._read_together(group, sink)
                del self.queued[:len(group)]
                left -= n
                read += sum(len(p.ids) for p in group)
                if together is not None:
                    ready.append(together)
                continue
            p = self.queued[0]
            if not p.read:
                p.rows = [(k, r) for k, r in p.rows if not sink.cancelled(k)]
                if not p.rows:
                    self.queued.pop(0)
                    continue
                if p.cache is None:
                    p.cache = self.eng.new_cache(1, len(p.ids) + max(max(r.max_tokens for _, r in p.rows), 1))
                n = int(min(self.prefill_chunk, len(p.ids) - p.done, left))
                x = torch.tensor([p.ids[p.done:p.done + n]], device=self.eng.device)  # (1, n)
                # after the first chunk, a mask of ones makes the new positions causal among themselves
                mask = () if p.done == 0 else (torch.ones((1, p.done + n), dtype=torch.long, device=self.eng.device),)
                hidden = self.eng.body(x, p.cache, *mask)[0]  # (n, D): positions done … done + n - 1
                for key, r in p.rows:
                    if r.echo:
                        score_echo(self.eng, hidden, p.done, p.ids, r, p.echo[key], self.chunk)
                p.done += n
                left -= n
                read += n
                if not p.read:
                    continue
                self._ready(p, hidden[-1], sink)
                del hidden
            ready.append(self.queued.pop(0))
        ready = [p for p in ready if p.live]
        if ready:
            before = len(self.live)
            self._join(ready)
            if choose:
                self._first_tokens(list(range(before, len(self.live))), sink)
        return read

    def _first_tokens(self, joined: list[int], sink: Sink) -> None:
        """The rows just joined (`joined`, indices into live) choose their first token from their
        prompt's logits and hand it to `sink` now; it runs through the body at the next step. A row
        that ends with it (end-of-text, a stop string, max_tokens 1) leaves at once."""
        if not joined:
            return
        chosen, ended = self._choose(joined, sink)
        for i, token in zip(joined, chosen.tolist()):
            self.live[i].pending = token
        if ended:
            self.regroup([i for i in range(len(self.live)) if i not in ended])

    def _ready(self, p: _Prefill, last: torch.Tensor, sink: Sink) -> None:
        """A prompt read to its end (`last` its last position's hidden state (D,)): echo and rows that
        only score go to `sink`; the rows that generate get their first logits and their cache."""
        for key, r in p.rows:
            if r.echo:
                sink.echo(key, p.echo[key])
            if r.max_tokens == 0:
                sink.finish(key, "length", "")
            else:
                p.live.append(Live(key, r, self.loaded.tokenizer, self.eng.device, self.eng.vocab_size))
        p.echo, p.rows = {}, []
        if not p.live:
            p.cache = None
            return
        p.logits = self.eng.head(last[None]).float().expand(len(p.live), -1)  # (rows, V)
        if len(p.live) > 1 and p.cache is not None:  # the choices of one prompt: one prefill, its cache copied per row
            p.cache = self.eng.reorder_cache(p.cache, torch.zeros(len(p.live), dtype=torch.long, device=self.eng.device))

    def _together(self, left: float) -> list[_Prefill]:
        """The prompts at the head of the queue to read in one padded pass (at least two; else none):
        unread, every row generating and none echoing (echo's per-position scores come from each
        prompt's own pass), their padded positions within `left` and one prefill chunk; an engine
        whose caches join only."""
        if not self._joins or len(self.queued) < 2:
            return []
        group: list[_Prefill] = []
        for p in self.queued:
            if p.done or not p.rows or any(r.echo or not r.max_tokens for _, r in p.rows):
                break  # every prompt of a group generates: the longest one's rows keep the cache's length
            longest = max([len(q.ids) for q in group] + [len(p.ids)])
            if (len(group) + 1) * longest > min(left, self.prefill_chunk):
                break
            group.append(p)
        return group if len(group) > 1 else []

    def _read_together(self, group: list[_Prefill], sink: Sink) -> _Prefill | None:
        """Read `group`'s prompts in one pass over the weights, left-padded to the longest (an attention
        mask hides the padding; each prompt's positions count from its first token, as alone), where
        each prompt alone took its own pass: waiting prompts (a server's clients arriving together)
        cost one read of the weights, not one each. Returns one _Prefill holding every generating row
        of the group in order, its cache a row per row (a prompt's choices copy its row), right-aligned
        as the batch keeps rows; None when no row generates."""
        for p in group:
            p.rows = [(k, r) for k, r in p.rows if not sink.cancelled(k)]
        group = [p for p in group if p.rows]
        if not group:
            return None
        dev, T = self.eng.device, max(len(p.ids) for p in group)
        x = torch.zeros((len(group), T), dtype=torch.long, device=dev)
        mask = torch.zeros((len(group), T), dtype=torch.long, device=dev)
        for i, p in enumerate(group):
            x[i, T - len(p.ids):] = torch.tensor(p.ids, dtype=torch.long, device=dev)
            mask[i, T - len(p.ids):] = 1
        cache = self.eng.new_cache(len(group), T + max(max(r.max_tokens for p in group for _, r in p.rows), 1))
        hidden = self.eng.body(x, cache, mask)  # (P, T, D): every prompt's last position is column T - 1
        together, rows = _Prefill(self.eng, ()), []
        for i, p in enumerate(group):
            p.done = len(p.ids)
            self._ready(p, hidden[i, -1], sink)
            together.live += p.live
            rows += [i] * len(p.live)
            if p.live:
                together.logits = p.logits if together.logits is None else torch.cat([together.logits, p.logits])
        del hidden
        if not rows:
            return None
        together.cache = self.eng.reorder_cache(cache, torch.tensor(rows, dtype=torch.long, device=dev))
        return together

    def _join(self, ready: list[_Prefill]) -> None:
        """Prefilled rows join the running ones: one cache, right-aligned, with the padding mask."""
        old = self.live
        if not old and len(ready) == 1:
            cache = ready[0].cache
        else:
            parts = ([(self.cache, self._first_needed())] if old else []) + [(p.cache, 0) for p in ready]
            rows = old + [r for p in ready for r in p.live]
            S = max(r.length for r in rows)
            cache = self.eng.join_caches(parts, S + max(r.row.max_tokens - r.count for r in rows))
            if cache is None:  # this engine's cache cannot be joined: the first prompt now (if none runs), the rest later
                self._joins = False
                if old:
                    self.queued[:0] = ready
                    return
                cache, self.queued[:0], ready = ready[0].cache, ready[1:], ready[:1]
        self.cache = cache
        self.live = old + [r for p in ready for r in p.live]
        self.logits = torch.cat(([self.logits] if old else []) + [p.logits for p in ready])  # (R, V)
        for p in ready:
            p.cache, p.logits = None, None
        self._set_mask(max(r.length for r in self.live))

    def _first_needed(self) -> int:
        """The first cache column any live row reads (columns before it are padding for every row)."""
        return self.columns - max(r.length for r in self.live)

    def _set_mask(self, S: int) -> None:
        """The padding mask for the live rows, right-aligned in S columns; None when no row is padded."""
        if all(r.length == S for r in self.live):
            self.mask = None
            return
        cols = torch.arange(S, device=self.eng.device)
        lengths = torch.tensor([r.length for r in self.live], device=self.eng.device)
        self.mask = (cols[None, :] >= S - lengths[:, None]).long()  # (R, S)
