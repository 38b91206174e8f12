"""The one batched step loop: rows join and leave a running batch between two decoding steps.

A `Row` (decoding/rows.py) is one choice to compute; a `Batch` holds the rows that are running, with
one KV cache, and between two steps:

* **Rows join** (decoding/prefill.py, `Joining`): prompts read in chunks, echo scored, caches joined,
  each joined row's first token chosen at once from its prompt's logits.
* **One step** (`step`): every row chooses its next token from its logits (its own stages, its own
  greedy choice or seeded generator, so seed s gives the same tokens alone or beside other rows:
  `_choose`, the one sampling), records it (decoding/record.py, one transfer per step for all rows),
  checks end-of-text, stop strings (decoding/text.py) and max_tokens, and runs one new position for
  every row that goes on, all rows in one forward (`_forward`; a row that joined since the last step
  runs its first token). The decoder may name the rows whose turn it is (`turn`): only they step
  (engine.step_rows), the others wait with their cache and next logits as they are, an empty cache
  column each (`holes`, hidden by the mask, dropped when the cache is rebuilt: `_compact`).
* **Rows leave.** A row that finishes, or whose caller cancels it (`Sink.cancelled`), leaves at once
  (`regroup`, engine.reorder_cache); padding columns no row needs any more are dropped when the
  cache is rebuilt.

Beam search (decoding/beams.py) uses the same step's halves: `distributions` (the head half: raw and
processed log p), `regroup` (survivors copied with their cache) and `advance` (one position per row).
The Batch is decoding's own: callers reach it through decoding/decoder.py.

Shapes: R rows, S cache columns, D width, V vocabulary, K top tokens. A token's log-probability is
under the `raw` distribution or the `processed` one (after the row's stages: what it was drawn from),
as the row asks (`mode`); echo uses the same choice.
"""

from __future__ import annotations

from functools import cached_property

import torch

from lmhead_cli.chunks import default_chunk
from lmhead_cli.decoding import grammar, stages
from lmhead_cli.decoding.prefill import PREFILL_CHUNK, Joining, _Prefill
from lmhead_cli.decoding.record import (FINITE, ID, Step, Top, greedy_record, greedy_rows, record, spread, step_of,
                                        top_tokens)
from lmhead_cli.decoding.rows import Live, Row, Sink, Token, check_finite_rows
from lmhead_cli.decoding.stages import Knobs
from lmhead_cli.head import log_softmax


class Batch(Joining):
    """The running rows, their KV cache and their next logits; rows join (`add`, `prefill`) and leave
    (`step`) between steps. One model thread drives it; nothing here is thread-safe."""

    def __init__(self, loaded, chunk: int | None = None, prefill_chunk: int = PREFILL_CHUNK):
        self.loaded, self.eng = loaded, loaded.engine
        self.chunk = chunk or default_chunk(self.eng.vocab_size)
        self.prefill_chunk = prefill_chunk
        self.live: list[Live] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # (R, S) 1 = real; None while no row is padded
        self.logits: torch.Tensor | None = None  # (R, V) each live row's next-token logits
        self.record: tuple | None = None  # (those very logits, the engine's greedy record of them)
        self.queued: list[_Prefill] = []
        self.tokens = 0  # tokens generated, all rows together
        self._joins = True  # False once engine.join_caches has said it cannot join this engine's caches
        self.holes = False  # whether a row waited a step (its empty column in the cache: `_forward`)
        self.row_kernel = loaded.execution.row_kernel()  # plain greedy steps' figures (record.greedy_record)

    @cached_property
    def device(self):
        """The engine's device, asked once: a property through three modules, each step."""
        return self.eng.device

    def __len__(self) -> int:
        """Rows running or being prefilled."""
        return len(self.live) + sum(len(p.rows) for p in self.queued)

    @property
    def columns(self) -> int:
        return max((r.length for r in self.live), default=0) if self.mask is None else self.mask.shape[1]

    @torch.inference_mode()
    def step(self, sink: Sink, turn: set | None = None, ahead: int = 1) -> int:
        """Choose each live row's next token, hand it to `sink`, let finished and cancelled rows leave, and
        run one position for the rest (a row whose first token was chosen when it joined runs that one).
        `turn`: the keys of the rows that step (the decoder's turns across requests); the others wait,
        their cache and next logits kept (None: every row; an engine without Engine.step_rows steps
        every row). `ahead`: where one plain greedy row runs alone, up to this many positions in one
        engine call (`_run_ahead`). Returns the positions run, all rows together (the rows that stepped,
        one each, but for a run ahead)."""
        if not self.live:
            return 0
        keep_cancel = [i for i, r in enumerate(self.live) if not sink.cancelled(r.key)]
        if len(keep_cancel) < len(self.live):
            self.regroup(keep_cancel)
            if not self.live:
                return 0
        live = self.live
        run = [i for i, r in enumerate(live) if turn is None or r.key in turn]
        if len(run) < len(live) and not self.eng.steps_rows:
            run = list(range(len(live)))
        choose = [i for i in run if live[i].pending is None]
        ended: set[int] = set()
        tokens = {i: live[i].pending for i in run}
        if choose:
            chosen, ended = self._choose(choose, sink)
            for i, token in zip(choose, chosen.tolist()):
                tokens[i] = token
        for i in run:
            live[i].pending = None
        going = [live[i] for i in run if i not in ended]
        ids = [tokens[i] for i in run if i not in ended]
        if ended:
            self.regroup([i for i in range(len(live)) if i not in ended])
        if going:
            if ahead > 1 and len(self.live) == 1 and not self.queued and self.mask is None and _plain(going):
                ran = self._run_ahead(going[0], ids[0], ahead, sink)
                if ran:
                    return ran
            at = {id(r): i for i, r in enumerate(self.live)}
            rows = [at[id(r)] for r in going]  # in order: `run` was, and regroup keeps the order
            self._forward(torch.tensor(ids, dtype=torch.long, device=self.device),
                          rows=None if len(rows) == len(self.live) else rows)
        return len(run)

    def _choose(self, idx: list[int], sink: Sink) -> tuple[torch.Tensor, set[int]]:
        """Live rows `idx` choose their next token from their logits (their own stages, greedy choice or
        generator), record it, hand it to `sink` and check end-of-text, stop strings and max_tokens.
        Returns the tokens (len(idx),) and the rows (indices into live) that ended with theirs."""
        live = [self.live[i] for i in idx]
        logits = self.logits if len(idx) == len(self.live) else self.logits[torch.tensor(idx, device=self.device)]
        k = max(r.row.alternatives for r in live)
        # plain greedy rows (no stage, nothing more asked of each step): the compiled kernel's two passes,
        # or the record the engine made with these very logits (`_forward`: these rows, in this order)
        made = self.record[1] if self.record is not None and _same(self.record[0], live) else None
        fast = greedy_record(logits, self.row_kernel, made) if _plain(live) else None
        if fast is not None:
            chosen, table = fast
        else:
            if not all(r.row.greedy for r in live):  # a draw from NaN fails obscurely; greedy rows: the record's check
                check_finite_rows(logits)
            allowed = _allowed(live, logits)  # (R, V) bool, None where no row has a grammar
            forced = [False] * len(live) if allowed is None else grammar.forced(allowed).tolist()
            raw, used, piped = self.distributions(logits, live, allowed)
            if len(live) == 1:  # a forced token is the one finite logprob: no draw
                chosen = stages.choose(used, live[0].row.greedy or forced[0], live[0].generator)  # (1,)
            else:
                chosen = used.argmax(-1)  # (R,) greedy and forced rows; drawn rows replaced below, each with its generator
                for i, r in enumerate(live):
                    if not (r.row.greedy or forced[i]):
                        chosen[i] = stages.choose(used[i:i + 1], False, r.generator)[0]
            table = record(logits, raw, used, chosen, k, bool(piped), allowed).tolist()  # one transfer for every row
            for i, r in enumerate(live):
                if r.matcher is not None:
                    r.matcher.advance(int(table[i][0]))
        ended = set()
        for i, r in enumerate(live):
            top = None
            if r.row.top:
                ids, lps = top_tokens(raw[i:i + 1], used[i:i + 1], r.row.mode, min(r.row.top, raw.shape[-1]))
                top = Top(ids[0], lps[0])
            rec = table[i] if r.row.alternatives == k else _trim(table[i], k, r.row.alternatives)
            # the row's logits only to say what is not finite: a slice a step is a dispatched op, ~30 us
            # once a step's weights have evicted torch's code from the caches
            st = step_of(rec, self.loaded.tokenizer.token_text, None if rec[FINITE] else logits[i:i + 1], top)
            sp = (tuple(spread((used if r.row.mode == "processed" else raw)[i:i + 1])[0].tolist())
                  if r.row.uncertainty else None)
            if self._hand_out(r, st, top, sp, sink):
                ended.add(idx[i])
        return chosen, ended

    def _hand_out(self, r: Live, st: Step, top: Top | None, sp: tuple | None, sink: Sink) -> str | None:
        """Row r's chosen token `st` counted and handed to `sink` with the text it made safe to show (its
        top tokens `top`, its spread `sp` where asked): "eos", "stop" or "length" where it ends the row (its
        finish handed out too), else None."""
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
        sink.token(r.key, Token(st.id, lp, top.ids.tolist() if top else [], top.logprobs.tolist() if top else [],
                                piece, st, sp))
        if reason is not None:
            sink.finish(r.key, reason, r.text.piece(final=True))
        return reason

    def _run_ahead(self, r: Live, token: int, ahead: int, sink: Sink) -> int:
        """Row r, the batch's one row, plain greedy, with nothing padded or queued: up to `ahead` positions
        in one engine call (Engine.greedy_run), the first on `token` (chosen), each next on the top-1 of
        the one before, as `step` would choose it. The tokens of all but the last are handed out here, in
        order, as `step` hands one out (a stop string may end the row: the rest are dropped with it); the
        last's logits and record are the next step's. Between two steps the decoding loop's own Python
        took ~0.5 ms once a step's weights had evicted it from the caches (a 20 ms Q4_K_M step, a 5 ms
        int8 one); run ahead, it is paid once a call. Returns the positions run; 0 where none was (the
        caller steps)."""
        n = min(ahead, r.row.max_tokens - r.count, _capacity(self.cache, self.eng) - self.columns)
        if n < 2:
            return 0
        run = self.eng.greedy_run(token, self.cache, n, r.row.eos)
        if run is None:
            return 0
        m = run.top_ids.shape[0]
        r.length += m
        rows = greedy_rows(run.top_ids.tolist(), *run.figures.tolist())
        for rec in rows[:-1]:
            if self._hand_out(r, step_of(rec, self.loaded.tokenizer.token_text, None), None, None, sink):
                self.regroup([])
                return m
        self.logits = run.logits
        self.record = ([r], (run.top_ids[m - 1:], run.figures[:, m - 1:])) if rows[-1][ID] >= 0 else None
        return m

    def distributions(self, logits: torch.Tensor | None = None, live: list[Live] | None = None,
                      allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The head half of a step for the live rows (or rows `live` with their `logits`), from their
        logits (R, V): raw (R, V), the model's own log-softmax, and processed (R, V), the log-softmax
        after each row's stages (rows with the same stages processed together; raw itself where no row
        has a stage), and whether any stage ran. `allowed` (R, V) bool: each row's grammar mask for this
        step (`_allowed`). `step` chooses from them; beam search (decoding.beams) ranks its candidates by them."""
        if live is None:
            live, logits = self.live, self.logits
        raw = log_softmax(logits)  # (R, V) the model's own distribution
        piped = [i for i, r in enumerate(live) if r.pipeline]
        if not piped:
            return raw, raw, False
        used = raw.clone()
        groups: dict[tuple[Knobs, bool], list[int]] = {}
        for i in piped:
            groups.setdefault((live[i].row.knobs, live[i].matcher is not None), []).append(i)
        for (_, masked), idx in groups.items():
            at = torch.tensor(idx, device=logits.device)
            used[at] = log_softmax(stages.process(logits[at], live[idx[0]].pipeline,
                                                  allowed[at] if masked else None))
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
        at = torch.tensor(rows, device=self.device)
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

    def _forward(self, chosen: torch.Tensor, record: bool = True, rows: list[int] | None = None) -> None:
        """Run each live row's chosen token (R,) through the body: logits (R, V) for the next step (and,
        with `record`, where every row is plain greedy, the engine's record of them). `rows`: the live
        rows that run `chosen` (n,), in order (None: every row); the others wait, and their new column
        stays empty, hidden by the mask (`holes`, dropped when the cache is rebuilt)."""
        S = self.columns
        if S + 1 > _capacity(self.cache, self.eng):  # full: drop the padding every row has, with room to go on
            rest = max(r.row.max_tokens - r.count for r in self.live)
            if self.holes:
                self._compact(rest)
            else:
                first = self._first_needed()
                self.cache = self.eng.join_caches([(self.cache, first)], S - first + rest)
                if self.mask is not None:
                    self.mask = self.mask[:, first:]
            S = self.columns
        running = self.live if rows is None else [self.live[i] for i in rows]
        for r in running:
            r.length += 1
        if rows is not None and self.mask is None:
            self.mask = torch.ones((len(self.live), S), dtype=torch.long, device=self.device)
        mask = ()  # none while no row is padded: the engine's plain one-position step
        if self.mask is not None:
            new = self.mask.new_ones((len(self.live), 1)) if rows is None else self.mask.new_zeros((len(self.live), 1))
            if rows is not None:
                new[rows] = 1
            self.mask = torch.cat([self.mask, new], dim=1)  # (R, S + 1)
            mask = (self.mask,)
        record = record and _plain(running)
        if rows is None:
            # (R, V); where every row is plain greedy, the engine may make each row's record with them
            self.logits, made = self.eng.step_logits(chosen[:, None], self.cache, *mask, record=record)
        else:
            self.holes = True
            logits, made = self.eng.step_rows(chosen[:, None], self.cache, self.mask, _runs(rows), record=record)
            self.logits[torch.tensor(rows, device=self.logits.device)] = logits  # (n, V) into (R, V)
        self.record = (running, made) if made is not None else None

    def _compact(self, rest: int) -> None:
        """The cache rebuilt without the columns that rows which waited left empty (Engine.compact_cache),
        with room for `rest` more positions."""
        if self.mask is not None:
            longest = max(r.length for r in self.live)
            self.cache = self.eng.compact_cache(self.cache, self.mask.bool(), longest + rest)
            self._set_mask(longest)
        self.holes = False

    def _join(self, ready: list) -> None:
        """prefill's Joining._join; the running rows' empty columns dropped first (the join keeps each part's
        columns as they are, and the mask is made again from the rows' lengths)."""
        if self.holes and self.live:
            self._compact(0)
        super()._join(ready)

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


def _allowed(live: list[Live], logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's grammar mask for this step, (R, V) bool on the logits' device (every token for a row
    without a grammar); None when no row has one, so those rows pay nothing."""
    if all(r.matcher is None for r in live):
        return None
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    for i, r in enumerate(live):
        if r.matcher is not None:
            allowed[i] = r.matcher.allowed()
    return allowed.to(logits.device)


def _plain(live: list[Live]) -> bool:
    """Whether every row is plain greedy: no stage, no alternatives, nothing more asked of each step
    (decoding/record.py `greedy_record` records them)."""
    return all(r.row.greedy and not r.row.alternatives and not r.pipeline and not r.row.top and not r.row.uncertainty
               for r in live)


def _same(a: list[Live], b: list[Live]) -> bool:
    """Whether two lists hold the same rows (objects), in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices as runs of consecutive ones, (start, stop) each: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    runs: list[tuple[int, int]] = []
    for i in rows:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


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
