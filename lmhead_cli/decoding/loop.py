"""The one batched step loop: rows join and leave a running batch between two decoding steps.

Everything that continues a prompt runs here: `Model.generate` (one row, or n choices and many
prompts as one batch: decoding.generate.generate_many), explore's generation, the server's rows
(continuous batching, serve/worker.py) and beam search (a group of rows that `regroup` copies to the
surviving beams and `advance` steps: decoding/beams.py). A `Row` is one choice to compute; a
`Batch` holds the rows that are running, with one KV cache, and between two steps:

* **Rows join.** `add` queues a row; `prefill` runs the queued prompts through the body, each
  prompt alone (rows with the same prompt, a request's `n` choices, share one prefill and copy its
  cache), at most `budget` positions per call, in chunks, so a long prompt is read over several
  calls while the running rows go on stepping. A prefilled row scores its prompt (echo), draws its
  first token from the prompt's last position, and its cache joins the batch's
  (engine.join_caches): rows are right-aligned, left-padded, an attention mask hides the padding,
  and positions come from the mask, so each row reads exactly what it would alone, up to float
  rounding. Rows already running are never recomputed. A joined row's first token is chosen and
  handed to the sink at once, from its prompt's logits (as vLLM and llama.cpp's server do): its
  time to first token does not wait for the other prompts of the round or for the next step; the
  step runs that token through the body with everyone else's.
* **One step.** `step` chooses every row's next token from its logits (its own stages, its own
  greedy choice or seeded generator, so seed s gives the same tokens alone or beside other rows),
  records it, checks end-of-text and stop strings, and runs one new position for every row that
  goes on, all rows in one forward (a row that joined since the last step runs its first token).
* **Rows leave.** A row that finishes, or whose caller cancels it (`Sink.cancelled`), leaves at once
  (`reorder_cache`); padding columns no row needs any more are dropped when the cache is rebuilt.

Shapes: R rows, S cache columns, T prompt positions, D width, V vocabulary, K top tokens. Each
generated token's full record is a decoding.generate.Step (`_record`, one transfer per step for
all rows); its log-probability is under the `raw` distribution or the `processed` one (after the
row's stages: what it was drawn from), as the row asks (`mode`); echo uses the same choice.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lmhead_cli.decoding import stages
from lmhead_cli.decoding.generate import Step, Top, _greedy_record, _record, _step, _top
from lmhead_cli.decoding.stages import Knobs
from lmhead_cli.head import check_finite, entropy, log_softmax, margin, varentropy

MODES = ("raw", "processed")
# Prompt positions read per forward while prefilling: bounds attention's (T, T) scores and lets a long
# prompt be read over several rounds, between the running rows' steps.
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Row:
    """One choice to compute: a prompt, what to score and how to continue it."""

    ids: tuple[int, ...]  # the prompt, at least one token, all in the vocabulary
    echo: bool = False  # score the prompt's own tokens (the first has nothing before it)
    max_tokens: int = 0  # tokens to generate at most (the prompt plus max_tokens - 1 fit the context)
    top: int = 0  # the most probable tokens to report per position, 0..V
    mode: str = "raw"  # the distribution logprobs and `top` come from: raw or processed
    knobs: Knobs = field(default_factory=Knobs)  # the stages (soft-cap, temperature, top-k, top-p, min-p, ...)
    greedy: bool = True  # the most probable token each step; else drawn with `seed`
    seed: int = 0
    stop: tuple[str, ...] = ()  # text that ends the row (not included in its text)
    eos: int | None = None  # the token that ends the row (not text), None to run to max_tokens
    alternatives: int = 0  # the K most probable (processed) tokens kept in each Step (--show-steps)
    uncertainty: bool = False  # also each position's entropy, varentropy and margin (raw or processed, as `mode`)


@dataclass(frozen=True)
class Echo:
    """A prompt's scores: position i holds token i's log p given tokens < i; position 0 is unscored."""

    logprob: torch.Tensor  # (T,) float32, NaN at 0
    top_ids: torch.Tensor | None  # (T, K) int64 (row 0 unused), or None when K = 0
    top_logprobs: torch.Tensor | None  # (T, K) float32
    spread: torch.Tensor | None = None  # (T, 3) float32 entropy, varentropy, margin (NaN at 0), when asked


@dataclass(frozen=True)
class Token:
    """One generated token: its log p, the top K at its step, and the text that it made safe to show."""

    id: int
    logprob: float  # under the row's mode
    top_ids: list[int]
    top_logprobs: list[float]
    text: str  # new text shown with this token: held back while it may still start a stop string
    step: Step | None = None  # the whole record: raw and processed figures, rank, entropy, alternatives
    spread: tuple[float, float, float] | None = None  # entropy, varentropy, margin of its step, when asked


class Sink(Protocol):
    """Where a batch's results go, row by row (rows named by the caller's key), in order: echo, tokens, finish."""

    def echo(self, key, echo: Echo) -> None: ...

    def token(self, key, token: Token) -> None: ...

    def finish(self, key, reason: str, tail: str) -> None:
        """reason: "eos", "stop" (a stop string) or "length"; tail: the text still held back."""

    def cancelled(self, key) -> bool: ...


def check_mode(mode: str) -> str:
    from lmhead_cli.errors import BadValue

    if mode not in MODES:
        raise BadValue("logprobs_mode", f"must be raw or processed (got {mode!r})")
    return mode


def check_finite_rows(logits: torch.Tensor) -> None:
    """NonFiniteLogits for a NaN or infinite logit, checked through each row's max (O(N), not O(N·V))."""
    if not bool(torch.isfinite(logits.amax(-1)).all() & torch.isfinite(logits.amin(-1)).all()):
        check_finite(logits)


class Text:
    """A row's text: its tokens' bytes decoded incrementally (a character split across tokens comes
    once whole), cut at the first stop string, and held back while a stop string may still be forming."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.shown = "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> bool:
        """Add a token's bytes; True when a stop string is now in the text (the text is cut before it)."""
        before = len(self.text)
        self.text += self.decoder.decode(self.tokenizer.token_bytes(token_id))
        found = [i for s in self.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if found:
            self.text = self.text[:min(found)]
        return bool(found)

    def copy(self) -> Text:
        """This text so far, with its own decoder in the same state."""
        twin = Text(self.tokenizer, self.stop)
        twin.decoder.setstate(self.decoder.getstate())
        twin.text, twin.shown = self.text, self.shown
        return twin

    def piece(self, final: bool = False, flush: bool = False) -> str:
        """The text that became safe to show; `flush` ends the bytes (a final partial character)."""
        if flush:
            self.text += self.decoder.decode(b"", final=True)
        safe = len(self.text) if final or not self.stop else len(self.text) - self.hold
        out = self.text[self.shown:max(safe, self.shown)]
        self.shown += len(out)
        return out


class _Live:
    """One row while it generates: its key, generator, text and count."""

    __slots__ = ("key", "row", "pipeline", "generator", "text", "count", "length", "pending")

    def __init__(self, key, row: Row, tokenizer, device):
        self.key, self.row = key, row
        self.pipeline = row.knobs.pipeline()
        self.generator = None if row.greedy else torch.Generator(device=device).manual_seed(row.seed)
        self.text = Text(tokenizer, row.stop)
        self.count = 0
        self.length = len(row.ids)  # positions in the cache (the prompt, then each token run)
        self.pending: int | None = None  # a token chosen (and handed to the sink) not yet run: its first

    def copy(self) -> _Live:
        """The same row, with a generator and text of its own in the same state (a beam kept twice)."""
        twin = object.__new__(_Live)
        for name in self.__slots__:
            setattr(twin, name, getattr(self, name))
        if self.generator is not None:
            twin.generator = torch.Generator(device=self.generator.device).set_state(self.generator.get_state())
        twin.text = self.text.copy()
        return twin


class _Prefill:
    """Rows with one prompt, while the prompt is read: its own cache, how far it has got, echo so far;
    once read, its rows (`live`) and their first logits (rows, V), ready to join."""

    def __init__(self, eng, ids: tuple[int, ...]):
        self.ids = ids
        self.rows: list[tuple[object, Row]] = []
        self.echo: dict = {}
        self.cache = None
        self.done = 0
        self.live: list[_Live] = []
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


def spread(logprobs: torch.Tensor) -> torch.Tensor:
    """(N, V) log-probabilities -> (N, 3) float32: entropy (nats), varentropy (nats²) and margin (nats,
    inf with one possible token) of each row: head.py's, once."""
    h = entropy(logprobs)
    return torch.stack([h, varentropy(logprobs, h), margin(logprobs)], dim=-1)


def _score_echo(eng, hidden: torch.Tensor, start: int, ids: tuple[int, ...], row: Row, echo: Echo, chunk: int) -> None:
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
            top_ids, top_lps = _top(raw, used, row.mode, K)
            echo.top_ids[at + 1:at + 1 + m], echo.top_logprobs[at + 1:at + 1 + m] = top_ids, top_lps
        if echo.spread is not None:
            echo.spread[at + 1:at + 1 + m] = spread(sel).cpu()
        del z, raw, used, sel


class Batch:
    """The running rows, their KV cache and their next logits; rows join (`add`, `prefill`) and leave
    (`step`) between steps. One model thread drives it; nothing here is thread-safe."""

    def __init__(self, loaded, chunk: int | None = None, prefill_chunk: int = PREFILL_CHUNK):
        from lmhead_cli.readings.score import default_chunk

        self.loaded, self.eng = loaded, loaded.engine
        self.chunk = chunk or default_chunk(self.eng.vocab_size)
        self.prefill_chunk = prefill_chunk
        self.live: list[_Live] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # (R, S) 1 = real; None while no row is padded
        self.logits: torch.Tensor | None = None  # (R, V) each live row's next-token logits
        self.record: tuple | None = None  # (those very logits, the engine's greedy record of them)
        self.queued: list[_Prefill] = []
        self.tokens = 0  # tokens generated, all rows together
        self._joins = True  # False once engine.join_caches has said it cannot join this engine's caches
        self.row_kernel = loaded.execution.row_kernel()  # plain greedy steps' figures (generate._greedy_record)

    def __len__(self) -> int:
        """Rows running or being prefilled."""
        return len(self.live) + sum(len(p.rows) for p in self.queued)

    @property
    def columns(self) -> int:
        return max((r.length for r in self.live), default=0) if self.mask is None else self.mask.shape[1]

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
                        _score_echo(self.eng, hidden, p.done, p.ids, r, p.echo[key], self.chunk)
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
                p.live.append(_Live(key, r, self.loaded.tokenizer, self.eng.device))
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

    @torch.inference_mode()
    def step(self, sink: Sink) -> int:
        """Choose each live row's next token, hand it to `sink`, let finished and cancelled rows leave, and
        run one position for the rest (a row whose first token was chosen when it joined runs that one).
        Returns the rows that stepped."""
        if not self.live:
            return 0
        keep_cancel = [i for i, r in enumerate(self.live) if not sink.cancelled(r.key)]
        if len(keep_cancel) < len(self.live):
            self.regroup(keep_cancel)
            if not self.live:
                return 0
        live = self.live
        choose = [i for i, r in enumerate(live) if r.pending is None]
        ended: set[int] = set()
        tokens = [r.pending for r in live]
        if choose:
            chosen, ended = self._choose(choose, sink)
            for i, token in zip(choose, chosen.tolist()):
                tokens[i] = token
        for r in live:
            r.pending = None
        stepped = len(live)
        keep = [i for i in range(len(live)) if i not in ended]
        if len(keep) < len(live):
            self.regroup(keep)
        if self.live:
            self._forward(torch.tensor([tokens[i] for i in keep], dtype=torch.long, device=self.eng.device))
        return stepped

    def _choose(self, idx: list[int], sink: Sink) -> tuple[torch.Tensor, set[int]]:
        """Live rows `idx` choose their next token from their logits (their own stages, greedy choice or
        generator), record it, hand it to `sink` and check end-of-text, stop strings and max_tokens.
        Returns the tokens (len(idx),) and the rows (indices into live) that ended with theirs."""
        live = [self.live[i] for i in idx]
        logits = self.logits if len(idx) == len(self.live) else self.logits[torch.tensor(idx, device=self.eng.device)]
        k = max(r.row.alternatives for r in live)
        # plain greedy rows (no stage, nothing more asked of each step): the compiled kernel's two passes,
        # or the record the engine made with these very logits (`_forward`)
        made = self.record[1] if self.record is not None and self.record[0] is logits else None
        fast = _greedy_record(logits, self.row_kernel, made) if _plain(live) else None
        if fast is not None:
            chosen, table = fast
        else:
            if not all(r.row.greedy for r in live):  # a draw from NaN fails obscurely; greedy rows: the record's check
                check_finite_rows(logits)
            raw, used, piped = self.distributions(logits, live)
            if len(live) == 1:
                chosen = stages.choose(used, live[0].row.greedy, live[0].generator)  # (1,)
            else:
                chosen = used.argmax(-1)  # (R,) greedy rows; drawn rows replaced below, each with its generator
                for i, r in enumerate(live):
                    if not r.row.greedy:
                        chosen[i] = stages.choose(used[i:i + 1], False, r.generator)[0]
            table = _record(logits, raw, used, chosen, k, bool(piped)).tolist()  # one transfer for every row
        ended = set()
        for i, r in enumerate(live):
            top = None
            if r.row.top:
                ids, lps = _top(raw[i:i + 1], used[i:i + 1], r.row.mode, min(r.row.top, raw.shape[-1]))
                top = Top(ids[0], lps[0])
            rec = table[i] if r.row.alternatives == k else _trim(table[i], k, r.row.alternatives)
            st = _step(rec, self.loaded.tokenizer.token_text, logits[i:i + 1], top)
            r.count += 1
            self.tokens += 1
            reason = None
            if st.id == r.row.eos:
                reason = "eos"
            elif r.text.add(st.id):
                reason = "stop"
            if reason is None and r.count >= r.row.max_tokens:
                reason = "length"
            piece = r.text.piece(final=reason is not None, flush=reason in ("eos", "length"))
            lp = st.logprob if r.row.mode == "processed" else st.raw_logprob
            sp = (tuple(spread((used if r.row.mode == "processed" else raw)[i:i + 1])[0].tolist())
                  if r.row.uncertainty else None)
            sink.token(r.key, Token(st.id, lp, top.ids.tolist() if top else [], top.logprobs.tolist() if top else [],
                                    piece, st, sp))
            if reason is not None:
                ended.add(idx[i])
                sink.finish(r.key, reason, r.text.piece(final=True))
        return chosen, ended

    def distributions(self, logits: torch.Tensor | None = None, live: list[_Live] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The head half of a step for the live rows (or rows `live` with their `logits`), from their
        logits (R, V): raw (R, V), the model's own log-softmax, and processed (R, V), the log-softmax
        after each row's stages (rows with the same stages processed together; raw itself where no row
        has a stage), and whether any stage ran. `step` chooses from them; beam search
        (decoding.beams) ranks its candidates by them."""
        if live is None:
            live, logits = self.live, self.logits
        raw = log_softmax(logits)  # (R, V) the model's own distribution
        piped = [i for i, r in enumerate(live) if r.pipeline]
        if not piped:
            return raw, raw, False
        used = raw.clone()
        groups: dict[Knobs, list[int]] = {}
        for i in piped:
            groups.setdefault(live[i].row.knobs, []).append(i)
        for idx in groups.values():
            at = torch.tensor(idx, device=logits.device)
            used[at] = log_softmax(stages.process(logits[at], live[idx[0]].pipeline))
        return raw, used, True

    def regroup(self, rows: list[int]) -> None:
        """The live rows become rows `rows` of the current ones, in that order: a row left out leaves the
        batch and the cache (`step`'s finished rows), a row named twice is copied with its cache (beam
        search's survivors: decoding.beams)."""
        live, seen = [], set()
        for i in rows:
            live.append(self.live[i].copy() if i in seen else self.live[i])
            seen.add(i)
        self.live = live
        if not live:
            self.cache, self.mask, self.logits = None, None, None
            return
        at = torch.tensor(rows, device=self.eng.device)
        self.cache = self.eng.reorder_cache(self.cache, at)
        self.logits = self.logits[at]
        if self.mask is not None:
            self.mask = self.mask[at]
            if bool(self.mask.all()):
                self.mask = None

    def advance(self, chosen: torch.Tensor) -> None:
        """Run each live row's token `chosen` (R,), picked by the caller from `distributions` (beam
        search), through the body: the rows' logits (R, V) for the next step."""
        for r in self.live:
            r.count += 1
        self._forward(chosen, record=False)  # beams rank `distributions`: no greedy record

    def _forward(self, chosen: torch.Tensor, record: bool = True) -> None:
        """Run each live row's chosen token (R,) through the body: logits (R, V) for the next step (and,
        with `record`, where every row is plain greedy, the engine's record of them)."""
        S = self.columns
        if S + 1 > _capacity(self.cache, self.eng):  # full: drop the padding every row has, with room to go on
            first = self._first_needed()
            rest = max(r.row.max_tokens - r.count for r in self.live)
            self.cache = self.eng.join_caches([(self.cache, first)], S - first + rest)
            if self.mask is not None:
                self.mask = self.mask[:, first:]
                S -= first
        for r in self.live:
            r.length += 1
        mask = ()  # none while no row is padded: the engine's plain one-position step
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.live), 1))], dim=1)  # (R, S + 1)
            mask = (self.mask,)
        # (R, V); where every row is plain greedy, the engine may make each row's record with them
        self.logits, made = self.eng.step_logits(chosen[:, None], self.cache, *mask,
                                                 record=record and _plain(self.live))
        self.record = (self.logits, made) if made is not None else None

    def keys(self) -> list:
        """The keys of every row running or being prefilled."""
        return [r.key for r in self.live] + [k for p in self.queued for k in [r.key for r in p.live] + [k for k, _ in p.rows]]

    @torch.inference_mode()
    def round(self, sink: Sink, budget: int | None = None) -> int:
        """Queued prompts prefilled (up to `budget` positions) and joined, then one step; the rows that stepped."""
        if self.queued:
            self.prefill(sink, budget)
        return self.step(sink)

    def run(self, sink: Sink, budget: int | None = None) -> None:
        """Every row added, to its end."""
        while self.queued or self.live:
            self.round(sink, budget)


def _plain(live: list[_Live]) -> bool:
    """Whether every row is plain greedy: no stage, no alternatives, nothing more asked of each step
    (decoding/generate.py `_greedy_record` records them)."""
    return all(r.row.greedy and not r.row.alternatives and not r.pipeline and not r.row.top and not r.row.uncertainty
               for r in live)


def _trim(rec: list[float], k: int, want: int) -> list[float]:
    """A record with k alternatives cut to `want` (the batch records the most any row asked for)."""
    fixed = len(rec) - 2 * k
    return rec[:fixed] + rec[fixed:fixed + want] + rec[fixed + k:fixed + k + want]


def _capacity(cache, eng) -> int:
    """How many columns `cache` holds: the lean engine's preallocated length; others grow (the context)."""
    k = getattr(cache, "k", None)
    return k.shape[3] if k is not None else eng.n_ctx


def run(loaded, rows: list[Row], sink: Sink, chunk: int | None = None) -> None:
    """Compute `rows` (keys 0 … len - 1) together, results to `sink` as they are made."""
    batch = Batch(loaded, chunk)
    for b, row in enumerate(rows):
        if not sink.cancelled(b):
            batch.add(b, row)
    batch.run(sink)
