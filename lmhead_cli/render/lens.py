"""The logit lens as a table (one row per layer), as a heat map (layers × tokens, shades), or as the
position map (layers × prompt positions, each cell the layer's top token)."""

from __future__ import annotations

from dataclasses import asdict

from rich.table import Table

from lmhead_cli.render import compact_table, compose, elided, out, provenance_json, show_token, text_cell
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.fit import drop_order
from lmhead_cli.render.inspect import random_banner

SHADES = " ░▒▓█"
SHADE_WIDTH = 3


def layer_name(layer: int) -> str:
    return "embeddings" if layer == 0 else f"block {layer}"


def lens_json(lens) -> dict:
    """The documented `lens --json` document: `layers`, the embeddings first and the last block last."""
    return {
        **provenance_json(lens),
        "prompt_tokens": [asdict(t) for t in lens.prompt_tokens],
        "truncated": lens.truncated,
        "position": lens.position,
        "layers": [asdict(layer) for layer in lens.layers],
        "norm": lens.norm,
        "tied": lens.tied,
        "tuned_lens": lens.tuned_lens,
        "grid_start": lens.grid_start,
        "grid": None if lens.grid is None else [[asdict(cell) for cell in row] for row in lens.grid],
    }


def tuning_json(result) -> dict:
    """The documented `tune-lens --json` document: what was trained, how long it took, the KL per layer."""
    t = result.reading
    return {
        **provenance_json(result.source),
        "out": result.out,
        "layers": len(t.first_kl),
        "steps": t.steps, "batch": t.batch, "seq": t.seq, "tokens": t.tokens,
        "seconds": t.seconds, "cpu_seconds": t.cpu_seconds, "threads": t.threads,
        "load_average": list(t.load_average), "text_bytes": t.text_bytes,
        "kl_first_step": t.first_kl, "kl_last_steps": t.last_kl,
    }


def tuning_report(result) -> None:
    """tune-lens for people: the file, the time, and each translated layer's KL before and after."""
    t = result.reading
    con = out()
    random_banner(result.source.model, result.source.random_weights)
    con.print(f"trained {t.steps:,} steps of {t.batch} × {t.seq} tokens ({t.tokens:,} positions) in "
              f"{t.seconds:.1f} s ({t.cpu_seconds:.1f} s of CPU time, {t.threads} threads; load average "
              f"{t.load_average[0]:.1f} at the start, {t.load_average[1]:.1f} at the end)")
    table = compact_table("KL(final ‖ tuned reading), nats per position", ("layer", "left"),
                          ("first step", "right"), ("last 10% of steps", "right"))
    for layer, (a, b) in enumerate(zip(t.first_kl, t.last_kl)):
        table.add_row(layer_name(layer), f"{a:.4f}", f"{b:.4f}")
    con.print(table)
    if result.out is not None:
        con.print(compose("wrote ", text_cell(result.out), " (read it with lmhead lens PROMPT --tuned PATH)"))


def _header(lens) -> None:
    con = out()
    random_banner(lens.model, lens.random_weights)
    last = lens.position == len(lens.prompt_tokens) - 1
    where = (("the last position",) if last else
             (f"position {lens.position} (", tok(lens.prompt_tokens[lens.position].text), ": what would follow it)"))
    con.print(compose("logit lens: the residual stream at ", *where, " after each layer, through ", tok(lens.norm),
                      f" (recomputed for that vector) and the {'tied' if lens.tied else 'untied'} head"))
    first, left_out, last_tokens = elided(lens.prompt_tokens)
    shown = [f"[{show_token(t.text)}]" for t in first] + ([f"… {left_out:,} more …"] if left_out else []) \
        + [f"[{show_token(t.text)}]" for t in last_tokens]
    con.print("prompt: " + " ".join(shown), markup=False)


def lens_table(lens) -> None:
    _header(lens)
    table = Table(show_edge=False)
    for name, justify in (("layer", "left"), ("top token", "left"), ("id", "right"), ("prob", "right"),
                          ("entropy", "right")):
        table.add_column(name, justify=justify)
    targets = lens.layers[0].targets if lens.layers else []
    for t in targets:
        table.add_column(compose(tok(t.token), " rank"), justify="right")
        table.add_column(compose(tok(t.token), " prob"), justify="right")
    tuned = lens.tuned_lens is not None  # the KL columns come with it (--json always has kl_to_final)
    if tuned:
        table.add_column("KL logit", justify="right")
        for name in ("tuned top", "prob", "KL tuned"):
            table.add_column(name, justify="left" if name == "tuned top" else "right")
        for t in targets:
            table.add_column(compose(tok(t.token), " tuned"), justify="right")
    for row in lens.layers:
        cells = [layer_name(row.layer), tok(row.top_token), str(row.top_id), f"{row.top_prob:.4%}",
                 f"{row.entropy:.4f}"]
        for t in row.targets:
            cells += [f"{t.rank:,}", f"{t.prob:.4%}"]
        if tuned:
            cells += [f"{row.kl_to_final['logit']:.4f}", tok(row.tuned.top_token), f"{row.tuned.top_prob:.4%}", f"{row.kl_to_final['tuned']:.4f}"]
            cells += [f"{t.prob:.4%}" for t in row.tuned.targets]
        table.add_row(*cells)
    # on a narrow terminal these leave first (render.fit): the id, the entropy, the targets' ranks, the
    # probabilities; the layer, the top tokens and the KL divergences stay
    drop_order(table, "id", "entropy", *(f"{show_token(t.token)} rank" for t in targets), "prob", "prob",
               *(f"{show_token(t.token)} prob" for t in targets))
    out().print(table)
    if tuned:
        out().print(compose("tuned lens: ", text_cell(lens.tuned_lens), "; each layer read through its "
                            "translator h + A·h + b before the norm and the head"))
        out().print("KL: KL(final ‖ the layer's reading) in nats")
    if lens.position == len(lens.prompt_tokens) - 1:
        out().print("entropy in nats; the last row is what `lmhead inspect` shows")
    else:
        out().print(f"entropy in nats; the last row is the model's own prediction after token {lens.position}: "
                    f"what `lmhead score` reports for token {lens.position + 1}")


def lens_heat(lens) -> None:
    """Layers down, tokens across; each cell shaded by its probability relative to the largest in the map."""
    _header(lens)
    peak = lens.peak
    table = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1))
    table.add_column("layer", no_wrap=True)
    for col in lens.columns:
        table.add_column(tok(col.text), justify="center", no_wrap=True)
    for row, probs in zip(lens.layers, lens.heat):
        cells = []
        for p in probs:
            level = 0 if peak == 0 else min(len(SHADES) - 1, int(p / peak * len(SHADES)))
            cells.append(f"[cyan]{SHADES[level] * SHADE_WIDTH}[/]")
        table.add_row(layer_name(row.layer), *cells)
    out().print(table)
    out().print(f"shades: {SHADES[1]} ≥ 20%, {SHADES[2]} ≥ 40%, {SHADES[3]} ≥ 60%, {SHADES[4]} ≥ 80% of the largest "
                f"probability in the map ({peak:.4%})")
    out().print(f"columns: the last layer's top {lens.top_columns} tokens"
                + (", then the targets" if len(lens.columns) > lens.top_columns else ""))


GRID_CELL = 9  # a position map cell's width: a shade and the token, cut to fit


def lens_grid(lens) -> None:
    """Layers down, prompt positions across (the ones that fit the terminal, ending at the position read);
    each cell that layer's top token there after a shade of its probability (of 1, not of the map's peak)."""
    _header(lens)
    con = out()
    width = len(lens.grid[0]) if lens.grid else 0
    fit = max(1, min(width, (con.width - 12) // (GRID_CELL + 1)))
    end = min(width, max(fit, lens.position - lens.grid_start + 1))
    first = end - fit  # offset in the grid
    cols = range(lens.grid_start + first, lens.grid_start + end)
    table = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1))
    table.add_column("after", no_wrap=True)
    for p in cols:
        table.add_column(tok(lens.prompt_tokens[p].text, "bold underline" if p == lens.position else ""),
                         no_wrap=True, max_width=GRID_CELL, overflow="ellipsis")
    for row, cells in zip(lens.layers, lens.grid):
        shown = []
        for cell in cells[first:end]:
            level = min(len(SHADES) - 1, int(cell.prob * len(SHADES)))
            shown.append(compose(f"[cyan]{SHADES[level] if level else '·'}[/]", tok(cell.token)))
        table.add_row(layer_name(row.layer), *shown)
    con.print(table)
    con.print(f"each cell: the layer's top token after that prompt token; its shade: · < 20%, {SHADES[1]} ≥ 20%, "
              f"{SHADES[2]} ≥ 40%, {SHADES[3]} ≥ 60%, {SHADES[4]} ≥ 80% probability")
    if fit < len(lens.prompt_tokens):
        con.print(f"positions {cols.start} to {cols.stop - 1} of the prompt's {len(lens.prompt_tokens)} (a wider "
                  f"terminal shows more; --json has {lens.grid_start} to {lens.grid_start + width - 1})")
