"""`lmhead score`: the text coloured by rank bucket (or marked, without colour), a surprisal
sparkline, the summary, `--table` rows, the JSON document streamed token by token, `--file` lines."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

from rich import box
from rich.table import Table
from rich.text import Text

from lmhead_cli.readings.ranks import BUCKETS, bucket
from lmhead_cli.render import _plain, dumps, err, out, provenance_json, safe_text, sparkline
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.fit import drop_order
from lmhead_cli.render.inspect import random_banner

# GLTR's colours (top-10 green, top-100 yellow, top-1000 red, the rest purple), with top-1 set apart.
STYLES = ("bold green", "green", "yellow", "red", "magenta")
# Without colour: a mark after each token; mark n means rank ≤ 10ⁿ.
MARKS = ("⁰", "¹", "²", "³", "⁺")
UNSCORED_STYLE, UNSCORED_MARK = "dim", "⁻"
TOKEN_WIDTH = 14
TABLE_EDGE = 10  # a long --table shows this many first and last rows
SURPRISING = 5
PARAGRAPH_TOKENS = 4096  # the coloured text is printed a paragraph (or this many pieces) at a time
PROGRESS_DELAY_S = 1.0
LINES_EVERY = 10  # off a terminal, a progress line every 10 × PROGRESS_DELAY_S seconds


def coloured(con) -> bool:
    """Colour only on a terminal that has not asked for none (NO_COLOR); marks otherwise."""
    return con.is_terminal and con.color_system is not None and not con.no_color


# ---- the text view ----------------------------------------------------------------------------

def _piece(text: Text, piece: str, rank: int | None, colour: bool) -> None:
    shown = safe_text(piece, keep="\n\t")
    if colour:
        text.append(shown, style=UNSCORED_STYLE if rank is None else STYLES[bucket(rank)])
        return
    body = shown.rstrip("\n")  # the mark goes before a token's line break, next to the token
    text.append(body + (UNSCORED_MARK if rank is None else MARKS[bucket(rank)]) + shown[len(body):])


def legend(score, colour: bool) -> Text:
    counts, n = score.bucket_counts(), max(score.scored_tokens, 1)
    line = Text("rank buckets: ")
    for i, ((_, name), count) in enumerate(zip(BUCKETS, counts)):
        label = f"{name} {count}" + (f" ({count / n:.0%})" if count else "")
        if colour:
            line.append(label, style=STYLES[i])
        else:
            line.append(f"{MARKS[i]} {label}")
        line.append("  ")
    if colour:
        line.append("unscored", style=UNSCORED_STYLE)
    else:
        line.append(f"{UNSCORED_MARK} unscored  (mark n: rank ≤ 10ⁿ)")
    return line


def text_view(score) -> None:
    """The text itself, each token coloured (or marked) by its rank bucket, then the legend."""
    con = out()
    colour = coloured(con)
    para, pieces = Text(), 0
    for piece, rank in score.spans():
        _piece(para, piece, rank, colour)
        pieces += 1
        if "\n" in piece or pieces >= PARAGRAPH_TOKENS:
            con.print(para, end="")
            para, pieces = Text(), 0
    con.print(para)
    con.print(legend(score, colour))


def summary_lines(score) -> list[str]:
    n, T = score.scored_tokens, len(score.ids)
    first = ("the first follows --bos" if score.bos else "the first has nothing before it; --bos scores it")
    unscored = T - n - (0 if score.bos else 1)
    gaps = (f"; {unscored} more open a window with no token before them (--stride {score.stride} = the "
            "context: no overlap)") if unscored else ""
    windows = "1 window" if score.windows == 1 else f"{score.windows:,} windows"
    bpb = "n/a" if score.bits_per_byte is None else f"{score.bits_per_byte:.4f}"
    return [
        f"scored {n:,} of {T:,} tokens ({first}{gaps})",
        f"{windows} of ≤ {score.window:,} tokens (stride {score.stride:,}); the head {score.chunk:,} positions at a time",
        f"NLL {score.nll:,.4f} nats (mean {score.mean_nll:.4f}) · perplexity {score.perplexity:,.4f} · "
        f"{bpb} bits per byte ({score.bytes:,} bytes)",
    ]


def summary(score) -> None:
    con = out()
    values, per = score.profile(max(16, min(con.width, 120) - 12))
    scale = "one mark per token" if per == 1 else f"one mark = the mean of {per:,} tokens"
    con.print(f"surprisal  {sparkline(values)}", markup=False)
    con.print(f"           bits per token, ▁ {min(values):.2f} … █ {max(values):.2f}; {scale}", markup=False)
    for line in summary_lines(score):
        con.print(line, markup=False)
    con.print(_token_table([_cells(r) for r in score.most_surprising(SURPRISING)], "most surprising"))


COLUMNS = (("#", "right"), ("id", "right"), ("token", "left"), ("logprob", "right"), ("prob", "right"),
           ("rank", "right"), ("entropy", "right"), ("varentropy", "right"), ("margin", "right"), ("bits", "right"),
           ("top-1", "left"), ("p(top-1)", "right"))
LEGEND = ("logprob, entropy and margin (log p of the top-1 minus the second's) in nats, varentropy (the variance "
          "of -log p) in nats²; bits: surprisal, -log2 prob; top-1: the model's own choice there")
SHRINKS = ("token", "top-1")  # on a narrow terminal these give way; figures are never cut
# then these columns leave, in this order (render.fit): the ones another column already implies first
# (bits = -logprob / ln 2), --json keeps every one
DROP_ORDER = ("bits", "varentropy", "margin", "prob", "p(top-1)", "id")


def _cells(r) -> list[str]:
    if r is None:
        return ["…", *[""] * (len(COLUMNS) - 1)]
    if not r.scored:
        return [str(r.index), str(r.id), tok(r.token), "[dim]unscored[/]", *[""] * (len(COLUMNS) - 4)]
    gap = "n/a" if r.margin is None else f"{r.margin:.3f}"  # n/a: no second token was possible
    return [str(r.index), str(r.id), tok(r.token), f"{r.logprob:.3f}", f"{r.prob:.2e}", f"{r.rank:,}",
            f"{r.entropy:.3f}", f"{r.varentropy:.3f}", gap, f"{r.surprisal_bits:.2f}", tok(r.top_token),
            f"{r.top_prob:.2%}"]


def _token_table(rows: list[list[str]], title: str | None = None) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), title=title,
              title_justify="left", collapse_padding=True)
    for name, justify in COLUMNS:
        # rich narrows only columns that may wrap: the token columns (a token is one word: cut with …).
        shrinks = name in SHRINKS
        t.add_column(name, justify=justify, no_wrap=not shrinks, overflow="ellipsis",
                     max_width=TOKEN_WIDTH if shrinks else None)
    for r in rows:
        t.add_row(*r)
    return drop_order(t, *DROP_ORDER)


def table(score) -> None:
    """One row per token; a long text shows its first and last TABLE_EDGE rows and a count between."""
    T = len(score.ids)
    shown = range(T) if T <= 2 * TABLE_EDGE + 1 else [*range(TABLE_EDGE), None, *range(T - TABLE_EDGE, T)]
    rows = [_cells(None if i is None else score.token(i)) for i in shown]
    con = out()
    con.print(_token_table(rows))
    if T > 2 * TABLE_EDGE + 1:
        con.print(f"… {T - 2 * TABLE_EDGE:,} rows not shown between #{TABLE_EDGE - 1} and #{T - TABLE_EDGE} "
                  "(--json lists every token)")
    con.print(LEGEND)


def report(score, show_table: bool) -> None:
    random_banner(score.model, score.random_weights)
    text_view(score)
    if show_table:
        table(score)
    summary(score)


# ---- JSON ----------------------------------------------------------------------------------------

def json_ends(score) -> tuple[dict, dict]:
    """The `score --json` document's fields before its "tokens" and after them."""
    head = {**provenance_json(score), "text": score.text, "bos": score.bos,
            "window": score.window, "stride": score.stride, "chunk": score.chunk}
    tail = {"scored_tokens": score.scored_tokens, "nll": score.nll, "mean_nll": score.mean_nll,
            "perplexity": score.perplexity, "bytes": score.bytes, "bits_per_byte": score.bits_per_byte}
    return head, tail


def write_json(score, lines: bool = False) -> None:
    """The documented `score --json` document, written token by token (no list of T dicts is built):
    indented with one token a line, or on one line for JSON Lines."""
    dump = (lambda v: dumps(_plain(v), separators=(",", ":"))) if lines else (lambda v: dumps(_plain(v)))
    head, tail = json_ends(score)
    sep, indent, nl = ("", "", "") if lines else (" ", "  ", "\n")
    write = sys.stdout.write
    write("{" + nl)
    for k, v in head.items():
        write(f"{indent}{dump(k)}:{sep}{dump(v)},{nl}")
    write(f"{indent}{dump('tokens')}:{sep}[{nl}")
    for i, t in enumerate(score.tokens()):
        write(("," + nl if i else "") + indent * 2 + dump(asdict(t)))
    write(f"{nl}{indent}],{nl}")
    write(("," + nl).join(f"{indent}{dump(k)}:{sep}{dump(v)}" for k, v in tail.items()))
    write(nl + "}\n")
    sys.stdout.flush()


# ---- --file ------------------------------------------------------------------------------------

FILE_HEADER = f"{'line':>6}  {'tokens':>7}  {'NLL':>11}  {'perplexity':>12}  {'bits/byte':>9}  text"


def openai_document(model, text: str, bos: bool, stride: int | None):
    """`score --format openai`: a `text_completion` that echoes the text with each token's logprob in the
    legacy shape, as `lmhead serve` answers echo with max_tokens 0 (render.openai.EchoCompletion; its
    `rows` is score_text's `on_rows`). Scoring has no stages, so the logprobs are raw."""
    from lmhead_cli.render.openai import EchoCompletion

    ids = model.encode(text)
    return EchoCompletion(model.tokenizer, model.source, text, ids,
                          model.scored_positions(len(ids), bos=bos, stride=stride), bos)


def openai_end(doc, score) -> None:
    """usage: the text's tokens (and --bos's) are the prompt; nothing is generated."""
    doc.end(len(score.ids) + score.bos)


def file_row(item, width: int) -> str:
    if item.score is None:
        return f"{item.line:>6}  skipped: {item.skipped}"
    s = item.score
    bpb = "n/a" if s.bits_per_byte is None else f"{s.bits_per_byte:.4f}"
    text = safe_text(s.text)
    room = max(8, width - len(FILE_HEADER) + 4)
    text = text if len(text) <= room else text[: room - 1] + "…"
    return f"{item.line:>6}  {s.scored_tokens:>7,}  {s.nll:>11,.3f}  {s.perplexity:>12,.3f}  {bpb:>9}  {text}"


def _lines(n: int, phrase: str, one: str = "line", many: str = "lines") -> str:
    return f"{n:,} " + phrase.format(one if n == 1 else many)


def corpus_summary(corpus) -> str:
    skipped = []
    if corpus.skipped_empty:
        skipped.append(_lines(corpus.skipped_empty, "empty {}"))
    if corpus.skipped_short:
        skipped.append(_lines(corpus.skipped_short, "{} of one token (--bos scores them)"))
    head = f"{_lines(corpus.texts, '{}', 'text', 'texts')} scored" + (f"; skipped {', '.join(skipped)}" if skipped else "")
    if not corpus.tokens:
        return head + "; no tokens scored"
    bpb = "n/a" if corpus.bits_per_byte is None else f"{corpus.bits_per_byte:.4f}"
    return (f"{head}; {corpus.tokens:,} tokens, NLL {corpus.nll:,.4f} nats, mean {corpus.mean_nll:.4f}; "
            f"corpus perplexity {corpus.perplexity:,.4f} (exp of total NLL / total tokens); {bpb} bits per byte")


def file_report(items, corpus, model: str, random_weights: bool, as_json: bool, size: int | None = None) -> None:
    """Stream one line (or JSON document) per text as it is scored, then the corpus summary
    (on stderr under --json, so stdout stays JSON Lines). `size`: the file's bytes, for a progress bar."""
    con = out()
    if not as_json:
        random_banner(model, random_weights)
        con.print(FILE_HEADER, markup=False)
    # Off a terminal the rows (or JSON lines) are the progress: one per text, as each is scored.
    with Progress("scoring lines", unit="bytes", verb="read", lines=False) as progress:
        for item in items:
            if as_json:
                if item.score is not None:
                    write_json(item.score, lines=True)
            else:
                con.print(file_row(item, con.width), markup=False)
            if size and (as_json or not con.is_terminal):  # on a terminal the rows themselves show progress
                progress(item.end, size)
    if as_json:
        err().print(corpus_summary(corpus), markup=False, style="dim")
    else:
        con.print(corpus_summary(corpus), markup=False)


# ---- progress --------------------------------------------------------------------------------------

class Progress:
    """Progress on stderr for work that lasts, called with (done, total) tokens; close() at the end.

    On a terminal: a bar, once the work has taken `delay` seconds. Off a terminal (a log, a pipe),
    with `lines`: once the work has taken `delay` seconds, one line saying its size and the time it
    will take at the pace so far (work expected to last LINES_EVERY × delay seconds or more), then a
    line every LINES_EVERY × delay seconds. Short runs see nothing."""

    def __init__(self, label: str, delay: float | None = None, clock=time.monotonic, console=None,
                 unit: str = "tokens", verb: str = "scored", lines: bool = True):
        self.label, self.clock, self.unit, self.verb, self.lines = label, clock, unit, verb, lines
        self.delay = PROGRESS_DELAY_S if delay is None else delay
        self.console = console or err()
        self.start = clock()
        self.bar = self.task = None
        self.last_line: float | None = None  # when the last plain line was written

    def __call__(self, done: int, total: int) -> None:
        if not self.console.is_terminal:
            return self._line(done, total) if self.lines else None
        if self.bar is None:
            if self.clock() - self.start < self.delay:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TimeRemainingColumn

            self.bar = Bar("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                           TimeRemainingColumn(), console=self.console, transient=True,
                           redirect_stdout=False, redirect_stderr=False)  # stdout may be JSON: never into the bar
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done, total=total)

    def _line(self, done: int, total: int) -> None:
        now = self.clock()
        elapsed = now - self.start
        if done <= 0 or elapsed < self.delay or done >= total and self.last_line is None:
            return
        left = elapsed / done * (total - done)
        if self.last_line is None:
            if elapsed + left < LINES_EVERY * self.delay:
                return  # work of a few seconds says nothing
            line = (f"{self.label}: {total:,} {self.unit}, about {_duration(elapsed + left)} at the pace of the "
                    f"first {done:,}")
        elif now - self.last_line >= LINES_EVERY * self.delay:
            line = f"{self.label}: {done:,} of {total:,} {self.unit} {self.verb}, about {_duration(left)} left"
        else:
            return
        self.last_line = now
        self.console.print(Text(line, style="dim"))

    @property
    def shown(self) -> bool:
        return self.bar is not None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(seconds: float) -> str:
    """12 s, 3 min 5 s, 2 h 4 min."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
