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
  runs its first token).
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

import torch

from lmhead_cli.chunks import default_chunk
from lmhead_cli.decoding import grammar, stages
from lmhead_cli.decoding.prefill import PREFILL_CHUNK, Joining, _Prefill
from lmhead_cli.decoding.record import Top, greedy_record, record, spread, step_of, top_tokens
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
        self.row_kernel = loaded.execution.row_kernel()  # plain greedy steps' figures (record.greedy_record)

    def __len__(self) -> int:
        """Rows running or being prefilled."""
        return len(self.live) + sum(len(p.rows) for p in self.queued)

    @property
    def columns(self) -> int:
        return max((r.length for r in self.live), default=0) if self.mask is None else self.mask.shape[1]

    @torch.inference_mode()
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
            st = step_of(rec, self.loaded.tokenizer.token_text, logits[i:i + 1], top)
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
