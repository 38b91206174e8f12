"""`lmhead inspect --file`: one row (or one JSON line) per prompt, written a batch at a time, then how
often each target won.

The writers keep nothing per prompt: rows are printed as each batch finishes, with column widths
set by the first batch (a later, longer figure takes the room it needs and is never cut; the
prompt column gives way to a narrow terminal)."""

from __future__ import annotations

from rich.cells import cell_len

from lmhead_cli.render import multi_piece_notices, notice, out, print_json, short_cell, show_token, warn
from lmhead_cli.render.inspect import random_banner

PROMPT_WIDTH = 40
TOKEN_WIDTH = 12


def file_notices(lines, stats, n_ctx: int) -> None:
    """On stderr, after the run: empty lines skipped, prompts cut to the context."""
    if lines.skipped_empty:
        notice(f"skipped {lines.skipped_empty} empty line{'s' * (lines.skipped_empty > 1)}")
    if stats.truncated:
        shown = ", ".join(f"{n:,}" for n in stats.truncated_lines)
        more = "…" * (stats.truncated > len(stats.truncated_lines))
        warn(f"{stats.truncated} prompts (lines {shown}{more}) are longer than the context of {n_ctx}; "
             "each keeps its last tokens")


class TableWriter:
    """The human table, printed batch by batch under one header."""

    def __init__(self, model: str, random_weights: bool, targets: list[str]):
        self.con = out()
        random_banner(model, random_weights)
        self.headers = ["#", "prompt", "top token", "prob", "entropy", *(f"p({show_token(t)})" for t in targets)]
        self.widths: list[int] = []

    def _line(self, cells: list[str], sep: str) -> str:
        padded = []
        for i, (cell, width) in enumerate(zip(cells, self.widths)):
            gap = " " * max(0, width - cell_len(cell))
            padded.append(cell + gap if i in (1, 2) else gap + cell)
        return " " + f" {sep} ".join(padded)

    def write(self, batch) -> None:
        if not self.widths:
            multi_piece_notices(batch[0][1].targets)
        rows = [[str(line.number), line.text, show_token(r.top[0].token), f"{r.top[0].prob:.4%}", f"{r.entropy:.3f}",
                 *(f"{t.prob:.4%}" for t in r.targets)] for line, r in batch]
        lines = []
        if not self.widths:
            self.widths = [max(cell_len(h), *(cell_len(row[i]) for row in rows)) for i, h in enumerate(self.headers)]
            self.widths[2] = min(TOKEN_WIDTH, self.widths[2])
            # The prompt column takes what the terminal has left: each column its width plus 3 of rule.
            self.widths[1] = 0
            self.widths[1] = max(8, min(PROMPT_WIDTH, self.con.width - sum(self.widths) - 3 * len(self.headers) + 1))
            lines.append(self._line(self.headers, "┃"))
            lines.append("━" + "━╇━".join("━" * w for w in self.widths) + "━")
        for row in rows:
            row[1], row[2] = short_cell(row[1], self.widths[1]), short_cell(row[2], TOKEN_WIDTH)
            lines.append(self._line(row, "│"))
        self.con.print("\n".join(lines), markup=False, highlight=False, crop=False, soft_wrap=True)

    def end(self, stats) -> None:
        self.con.print(summary(stats), markup=False, crop=False, soft_wrap=True)


class JsonLinesWriter:
    """One compact JSON document per line (`doc(reading)` builds it), the summary on stderr."""

    def __init__(self, doc):
        self.doc = doc
        self.started = False

    def write(self, batch) -> None:
        if not self.started:
            multi_piece_notices(batch[0][1].targets)
            self.started = True
        for _, r in batch:
            print_json(self.doc(r), lines=True)

    def end(self, stats) -> None:
        from lmhead_cli.render import err

        err().print(summary(stats), markup=False, style="dim")


def summary(stats) -> str:
    n = stats.prompts
    passes = "forward pass" if stats.batches == 1 else "forward passes"
    lines = [f"{n} prompts, {stats.batches} {passes} of ≤ {stats.max_rows} rows (--batch-size {stats.batch_size}; "
             "right-padded, head at each row's last real token)"]
    if stats.splits:
        lines.append(f"memory ran out: batches were halved {stats.splits} times")
    wins = stats.wins
    if wins:
        lines.append("targets won (the most probable of the targets): "
                     + ", ".join(f"{show_token(w.token)} {w.best_of_targets}/{n}" for w in wins)
                     + "; top-1 outright: " + ", ".join(f"{show_token(w.token)} {w.top1}" for w in wins))
    return "\n".join(lines)
