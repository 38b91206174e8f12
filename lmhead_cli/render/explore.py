"""What `lmhead explore` prints: a compact top-k table per prompt, settings, help, one-line errors."""

from __future__ import annotations

import sys

from rich.markup import escape
from rich.table import Table

from lmhead_cli.render import bar, err, knobs_text, out
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.lens import lens_table


def describe(s) -> str:
    """One line of an explore session's settings."""
    temp = "off" if s.temperature is None else f"{s.temperature:g}"
    cap = "off" if s.softcap is None else f"{s.softcap:g}"
    targets = ", ".join(repr(t) for t in s.targets) or "none"
    return f"top-k {s.top_k}, temperature {temp}, softcap {cap}, targets {targets}, seed {s.seed}"


def intro(model: str, random_weights: bool, load_s: float, settings, interactive: bool,
          threads: int | None = None) -> None:
    """Where the session stands; on stderr so piped output holds only the answers."""
    con = err()
    weights = " [bold yellow](random weights: the predictions are not real)[/]" if random_weights else ""
    on = f", {threads} CPU thread{'s' * (threads != 1)}" if threads else ""
    con.print(f"lmhead explore: {escape(model)} loaded in {load_s:.1f} s{on}{weights}", markup=True)
    con.print(f"settings: {escape(describe(settings))}", markup=True)
    if interactive:
        con.print("type a prompt, or :help for the commands; Ctrl-C cancels a line, Ctrl-D or :quit leaves",
                  markup=False)


def reading(r) -> None:
    con = out()
    stages = knobs_text(r.knobs)
    scaled = bool(stages)
    cut = f", first {r.truncated} dropped" if r.truncated else ""
    con.print(f"» {escape(r.prompt)}  [dim]({r.n_tokens} tokens{cut}; stages: {escape(stages or 'none')}; "
              f"{r.elapsed_ms:.0f} ms)[/]")
    table = Table(show_edge=False, pad_edge=False)
    columns = [("rank", "right"), ("id", "right"), ("token", "left"), ("logit", "right")]
    columns += [("scaled", "right")] if scaled else []
    columns += [("prob", "right"), ("", "left")]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    best = r.rows[0].prob if r.rows else 1.0

    def add(row, style=None):
        cells = [f"{row.rank:,}", str(row.id), tok(row.token), f"{row.logit:.4f}"]
        cells += [f"{row.scaled:.4f}"] if scaled else []
        cells += [f"{row.prob:.4%}", f"[cyan]{bar(row.prob / best if best else 0)}[/]"]
        table.add_row(*cells, style=style)

    for row in r.rows:
        add(row)
    if r.targets:
        table.add_section()
        for row in r.targets:
            add(row, style="bold")
    con.print(table)
    con.print(f"[dim]entropy {r.entropy:.4f} nats[/]")


def settings(s) -> None:
    out().print(f"settings: {escape(describe(s))}")


def help(commands) -> None:  # noqa: A001 - the :help command
    table = Table(show_header=False, show_edge=False, box=None, pad_edge=False)
    table.add_column(no_wrap=True)
    table.add_column()
    for name, (aliases, args, what) in commands.items():
        also = f" [dim](or {', '.join(':' + a for a in aliases)})[/]" if aliases else ""
        table.add_row(escape(f":{name} {args}".rstrip()), escape(what) + also)
    out().print("a line without ':' is a prompt; its top tokens appear at once. Commands:")
    out().print(table)


def unknown(name: str, commands) -> None:
    err().print(f"unknown command :{escape(name)}", markup=True)
    help(commands)


def error(message: str) -> None:
    err().print(f"[red]error:[/] {escape(message)}", markup=True)


def cancelled() -> None:
    err().print("[dim]cancelled[/]", markup=True)


def lens(result) -> None:
    lens_table(result)


def generation_start(prompt: str) -> None:
    sys.stdout.write(prompt)
    sys.stdout.flush()


def text(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def generation_end(gen) -> None:
    sys.stdout.write("\n")
    out().print(f"[dim]{len(gen.generated_ids)} tokens sampled (seed {gen.seed}), stop: {gen.stop}, "
                f"{gen.tokens_per_second:.1f} tokens/s[/]")

