"""Tables for `lmhead inspect` and `lmhead tie`."""

from __future__ import annotations

from dataclasses import asdict

from rich.table import Table

from lmhead_cli.data import describe as bundled_about  # the catalogue, not the loader
from lmhead_cli.render import bar, compose, data, elided, out, provenance_json
from lmhead_cli.render import token_cell as _cell



def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def tie_json(tie) -> dict:
    """The tie report's fields (loading.sources.TieReport) as JSON."""
    return asdict(tie)


def tie_document(result) -> dict:
    """The documented `tie --json` document, from an api.results.TieResult."""
    src = result.source
    return {**provenance_json(src, "engine"), **tie_json(result.tie)}


def inspection_json(result, tie) -> dict:
    """The documented `inspect --json` document (also one line per prompt of `inspect --file --json`)."""
    return {
        **provenance_json(result),
        "tied": result.tied,
        "engine": result.engine,
        "device": result.device,
        "dtype": result.dtype,
        "prompt_tokens": [asdict(t) for t in result.prompt_tokens],
        "truncated": result.truncated,
        "shapes": asdict(result.shapes),
        "top": [t.to_dict() for t in result.top],
        "targets": [asdict(t) for t in result.targets],
        "entropy": result.entropy,
        "entropy_bits": result.entropy_bits,
        "tie": tie_json(tie),
    }


def random_banner(model: str, random_weights: bool) -> None:
    """The one line that says what the weights are: random ones, or a bundled model and what it learnt from."""
    if random_weights:
        out().print(compose("[bold yellow]random weights[/] (", data(model), ", seeded): the architecture and "
                            "the arithmetic are real, the predictions are not."))
    elif about := bundled_about(model):
        out().print(compose(data(model, "bold green"), ": ", data(about + ".")))


def tie_line(tie):
    """The tie in one or two lines (a Text: the model's parameter names are shown, never parsed)."""
    if tie.tied:
        line = compose("tie: ", data(tie.head_name), " [bold]is[/] ", data(tie.embedding_name),
                       " (same object, same data_ptr)\n     W_out = E, so each logit is z_k = e_k · h")
    else:
        line = compose("tie: [bold]untied[/]: ", data(tie.head_name), f" is its own {tie.shape[0]}×{tie.shape[1]} "
                       f"matrix (tie_word_embeddings: {str(tie.config_tie_word_embeddings).lower()})")
    return compose(line, f"\n{own_softcap_line(tie.own_softcap)}") if tie.own_softcap else line


def own_softcap_line(cap: float) -> str:
    """What a model that soft-caps its own logits (Gemma-2) does after the head."""
    return (f"the model soft-caps its own logits: z → c·tanh(z/c) with c = {cap:g} (final_logit_softcapping), "
            "so every logit shown is already capped")


def inspection(result, tie) -> None:
    con = out()
    random_banner(result.model, result.random_weights)
    con.print(tie_line(tie))
    if result.truncated:
        con.print(f"[yellow]prompt cut to its last {len(result.prompt_tokens)} tokens "
                  f"({result.truncated} dropped from the front)[/]")

    tokens = Table(title="prompt tokens", title_justify="left", show_edge=False)
    tokens.add_column("#", justify="right", style="dim")
    tokens.add_column("id", justify="right")
    tokens.add_column("token")
    first, left_out, last = elided(list(enumerate(result.prompt_tokens)))
    for i, t in first:
        tokens.add_row(str(i), str(t.id), _cell(t.text))
    if left_out:
        tokens.add_row("…", "", f"[dim]{left_out:,} more tokens (--json lists them all)[/]")
    for i, t in last:
        tokens.add_row(str(i), str(t.id), _cell(t.text))
    con.print(tokens)

    s = result.shapes
    con.print(
        f"shapes: hidden {_shape(s.hidden)} → last position {_shape(s.last)} → logits {_shape(s.logits)}\n"
        f"head on the last position only: {s.head_macs_last:,} multiply-adds and {s.logits_bytes_last:,} bytes "
        f"of float32 logits, instead of {s.head_macs_full:,} and {s.logits_bytes_full:,} for all "
        f"{s.hidden[1]} positions ({s.head_macs_full // s.head_macs_last}× less)"
    )

    top = Table(title=f"next token: top {len(result.top)} of {s.logits[-1]:,}", title_justify="left",
                show_edge=False)
    for name, justify in (("rank", "right"), ("id", "right"), ("token", "left"), ("logit", "right"),
                          ("prob", "right"), ("logprob", "right"), ("", "left")):
        top.add_column(name, justify=justify)
    best = result.top[0].prob if result.top else 1.0
    for t in result.top:
        top.add_row(str(t.rank), str(t.id), _cell(t.token), f"{t.logit:.4f}", f"{t.prob:.4%}",
                    f"{t.logprob:.4f}", f"[cyan]{bar(t.prob / best if best else 0)}[/]")
    con.print(top)
    con.print(f"entropy: {result.entropy:.4f} nats = {result.entropy_bits:.4f} bits "
              "(bars are relative to the top token)")

    if result.targets:
        tg = Table(title="targets", title_justify="left", show_edge=False)
        for name, justify in (("target", "left"), ("id", "right"), ("rank", "right"), ("logit", "right"),
                              ("prob", "right"), ("note", "left")):
            tg.add_column(name, justify=justify)
        for t in result.targets:
            note = "" if len(t.pieces) == 1 else f"{len(t.pieces)} tokens; scored by the first"
            tg.add_row(_cell(t.token), str(t.id), f"{t.rank:,}", f"{t.logit:.4f}", f"{t.prob:.4%}", note)
        con.print(tg)


def tie_report(result) -> None:
    """`lmhead tie`'s table, from an api.results.TieResult."""
    tie, src = result.tie, result.source
    con = out()
    random_banner(src.model, src.random_weights)
    con.print(tie_line(tie))
    table = Table(show_header=False, show_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # a long path wraps; it is never cut

    def yes(v) -> str:
        return "n/a (no file)" if v is None else ("yes" if v else "no")

    table.add_row(compose(data(tie.head_name), " is ", data(tie.embedding_name)), yes(tie.same_object))
    table.add_row("same data_ptr", yes(tie.same_data_ptr))
    table.add_row("config tie_word_embeddings", str(tie.config_tie_word_embeddings).lower())
    table.add_row(compose("weights file stores its own ", data(tie.head_name)), yes(tie.file_has_lm_head))
    if tie.file_has_lm_head:
        table.add_row(compose("  stored ", data(tie.head_name), " equals ", data(tie.embedding_name)),
                      yes(tie.file_lm_head_equals_wte))
    table.add_row("matrix shape (V × d)", f"{tie.shape[0]:,} × {tie.shape[1]:,}")
    table.add_row("stored as", tie.storage)
    if tie.own_softcap:
        table.add_row("the model's own soft-cap c", f"{tie.own_softcap:g}")
    table.add_row("engine", src.engine)
    table.add_row("source", f"random weights, seed {src.seed}" if src.random_weights
                  else data(f"{src.kind}: {src.path}"))
    con.print(table)
