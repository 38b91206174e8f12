"""What `lmhead explore` prints: a compact top-k table per prompt, settings, help, one-line errors."""

from __future__ import annotations

import sys

from rich.markup import escape
from rich.table import Table

from lmhead_cli.data import describe as bundled_about  # the catalogue, not the loader
from lmhead_cli.render import bar, compose, data, err, knobs_text, out, own_softcap_notice, print_json
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.generate import stream
from lmhead_cli.render.lens import lens_json, lens_table


def describe(s) -> str:
    """One line of an explore session's settings."""
    temp = "off" if s.temperature is None else f"{s.temperature:g}"
    cap = "off" if s.softcap is None else f"{s.softcap:g}"
    targets = ", ".join(repr(t) for t in s.targets) or "none"
    grammar = "" if s.grammar is None else f", :gen follows the {s.grammar.describe()}"
    return f"top-k {s.top_k}, temperature {temp}, softcap {cap}, targets {targets}, seed {s.seed}{grammar}"


class Terminal:
    """`explore`'s tables and text (a readings.explore.View): answers on stdout, the rest on stderr."""

    own_softcap_notice = staticmethod(own_softcap_notice)
    generation_start = text = staticmethod(stream)  # the prompt, then each piece as it is made

    @staticmethod
    def intro(model: str, random_weights: bool, load_s: float, settings, interactive: bool,
              threads: int | None = None) -> None:
        """Where the session stands; on stderr so piped output holds only the answers."""
        con = err()
        weights = " [bold yellow](random weights: the predictions are not real)[/]" if random_weights else ""
        if about := bundled_about(model):
            weights = f" ({escape(about)})"
        on = f", {threads} CPU thread{'s' * (threads != 1)}" if threads else ""
        con.print(compose("lmhead explore: ", data(model), f" loaded in {load_s:.1f} s{on}{weights}"))
        con.print(compose("settings: ", data(describe(settings))))
        if interactive:
            con.print("type a prompt, or :help for the commands; Ctrl-C cancels a line, Ctrl-D or :quit leaves",
                      markup=False)

    @staticmethod
    def reading(r) -> None:
        con = out()
        stages = knobs_text(r.knobs)
        scaled = bool(stages)
        cut = f", first {r.truncated} dropped" if r.truncated else ""
        con.print(compose("» ", data(r.prompt), f"  [dim]({r.n_tokens} tokens{cut}; stages: ",
                          data(stages or "none", "dim"), f"[dim]; {r.elapsed_ms:.0f} ms)[/]"))
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

    @staticmethod
    def settings(s, con=None) -> None:
        (con or out()).print(compose("settings: ", data(describe(s))))

    @staticmethod
    def help(commands, con=None) -> None:  # noqa: A001 - the :help command
        con = con or out()
        table = Table(show_header=False, show_edge=False, box=None, pad_edge=False)
        table.add_column(no_wrap=True)
        table.add_column()
        for name, (aliases, args, what) in commands.items():
            also = f" [dim](or {', '.join(':' + a for a in aliases)})[/]" if aliases else ""
            table.add_row(escape(f":{name} {args}".rstrip()), escape(what) + also)
        con.print("a line without ':' is a prompt; its top tokens appear at once. Commands:")
        con.print(table)

    @staticmethod
    def unknown(name: str, commands, con=None) -> None:
        """One line: the unknown command and where the list is."""
        err().print(compose("unknown command :", data(name), "; :help lists the commands"))

    @staticmethod
    def error(message: str) -> None:
        err().print(compose("[red]error:[/] ", data(message)))

    @staticmethod
    def cancelled() -> None:
        err().print("[dim]cancelled[/]", markup=True)

    @staticmethod
    def lens(result) -> None:
        lens_table(result)

    @staticmethod
    def generation_end(gen) -> None:
        sys.stdout.write("\n")
        ruled = gen.settings.grammar
        follows = "" if ruled is None else (f", the {ruled.describe()} complete" if gen.stop == "eos" else
                                            f", cut short: it does not follow the {ruled.describe()}")
        out().print(f"[dim]{len(gen.generated_ids)} tokens sampled (seed {gen.seed}), stop: {gen.stop}{escape(follows)}, "
                    f"{gen.tokens_per_second:.1f} tokens/s[/]")


# ---- explore --json: answers as JSON lines ------------------------------------------------------

def _row(t) -> dict:
    return {"rank": t.rank, "id": t.id, "token": t.token, "logit": t.logit, "scaled": t.scaled, "prob": t.prob}


def reading_json(r) -> dict:
    """One prompt's answer in `explore --json`: the table's rows and targets, the stages that were on."""
    return {"prompt": r.prompt, "n_tokens": r.n_tokens, "truncated": r.truncated, "knobs": r.knobs.active(),
            "rows": [_row(t) for t in r.rows], "targets": [_row(t) for t in r.targets],
            "entropy": r.entropy, "elapsed_ms": r.elapsed_ms}


class AsJson(Terminal):
    """`explore --json`: each answer (a prompt, :lens, :gen) is one JSON line on stdout; settings,
    help and errors go to stderr, so stdout holds JSON lines only (intro, error, the soft-cap notice
    and `cancelled` are Terminal's: on stderr either way)."""

    @staticmethod
    def reading(r) -> None:
        print_json(reading_json(r), lines=True)

    @staticmethod
    def settings(s) -> None:
        Terminal.settings(s, err())

    @staticmethod
    def help(commands) -> None:  # noqa: A003
        Terminal.help(commands, err())

    @staticmethod
    def unknown(name: str, commands) -> None:
        Terminal.unknown(name, commands, err())

    @staticmethod
    def lens(result) -> None:
        print_json(lens_json(result), lines=True)

    @staticmethod
    def generation_start(prompt: str) -> None:
        pass

    @staticmethod
    def text(piece: str) -> None:
        pass

    @staticmethod
    def generation_end(gen) -> None:
        print_json({"seed": gen.seed, "prompt_ids": gen.prompt_ids, "generated_ids": gen.generated_ids,
                    "text": gen.text, "stop": gen.stop}, lines=True)
