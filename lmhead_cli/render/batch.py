"""`lmhead inspect --file`: one table row per prompt, and how often each target won."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from lmhead_cli.render import multi_piece_notices, notice, out, show_token, warn
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.inspect import random_banner

PROMPT_WIDTH = 40
TOKEN_WIDTH = 12


def _short(text: str, width: int = PROMPT_WIDTH) -> str:
    shown = text.replace("\n", "\\n").replace("\t", "\\t")
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def file_notices(prompts, run, n_ctx: int) -> None:
    """On stderr: empty lines skipped, prompts cut to the context, targets of several tokens."""
    if prompts.skipped_empty:
        notice(f"skipped {prompts.skipped_empty} empty line{'s' * (prompts.skipped_empty > 1)}")
    cut = [n for n, r in enumerate(run.results, 1) if r.truncated]
    if cut:
        warn(f"{len(cut)} prompts (lines {', '.join(map(str, cut[:5]))}{'…' * (len(cut) > 5)}) are "
             f"longer than the context of {n_ctx}; each keeps its last tokens")
    multi_piece_notices(run.results[0].targets)


def batch_table(run, model: str, random_weights: bool) -> None:
    con = out()
    random_banner(model, random_weights)
    rows = []
    for n, r in enumerate(run.results, 1):
        top = r.top[0]
        rows.append([str(n), "", tok(top.token), f"{top.prob:.4%}", f"{r.entropy:.3f}",
                     *(f"{t.prob:.4%}" for t in r.targets)])
    headers = ["#", "prompt", "top token", "prob", "entropy", *(f"p({tok(w.token)})" for w in run.wins)]
    widths = [min(TOKEN_WIDTH if i == 2 else 99, max(len(h), *(len(row[i]) for row in rows)))
              for i, h in enumerate(headers)]
    # The prompt column gives way to a narrow terminal: each column takes its width, 2 of padding, 1 rule.
    widths[1] = max(8, min(PROMPT_WIDTH, con.width - sum(widths) - 3 * len(headers) + 1))
    for row, prompt in zip(rows, run.prompts):
        row[1] = escape(_short(prompt, widths[1]))
    table = Table(show_edge=False)
    for i, name in enumerate(headers):
        table.add_column(name, justify="left" if i in (1, 2) else "right", no_wrap=True, overflow="ellipsis",
                         width=widths[i])
    for row in rows:
        table.add_row(*row)
    con.print(table)
    con.print(summary(run), markup=False)


def summary(run) -> str:
    n = len(run.results)
    passes = "forward pass" if run.batches == 1 else "forward passes"
    lines = [f"{n} prompts, {run.batches} {passes} of ≤ {run.max_rows} rows (--batch-size {run.batch_size}; "
             "right-padded, head at each row's last real token)"]
    if run.splits:
        lines.append(f"memory ran out: batches were halved {run.splits} times")
    if run.wins:
        lines.append("targets won (the most probable of the targets): "
                     + ", ".join(f"{show_token(w.token)} {w.best_of_targets}/{n}" for w in run.wins)
                     + "; top-1 outright: " + ", ".join(f"{show_token(w.token)} {w.top1}" for w in run.wins))
    return "\n".join(lines)
