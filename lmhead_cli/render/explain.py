"""`lmhead inspect --explain TOKEN`: the dot product behind one logit, beside the top tokens."""

from __future__ import annotations

from dataclasses import asdict

from rich import box
from rich.table import Table

from lmhead_cli.render import compose, data, elided, out, provenance_json, quoted
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.inspect import random_banner

TOKEN_WIDTH = 12


def explanation_json(ex) -> dict:
    """The `inspect --explain --json` document: the provenance header, then every field of the reading."""
    doc = {**provenance_json(ex), **asdict(ex)}
    doc["prompt_tokens"] = [asdict(t) for t in ex.prompt_tokens]
    return doc


def explanation(ex) -> None:
    con = out()
    random_banner(ex.model, ex.random_weights)
    e = ex.explained
    row = "embedding row" if ex.tied else "row of the (untied) output matrix"
    first, left_out, last = elided(ex.prompt_tokens)
    prompt = "".join(t.text for t in first) + (f" … {left_out:,} tokens … " if left_out else "") \
        + "".join(t.text for t in last)
    con.print(compose("one logit taken apart: ", tok(e.token, "bold"), f" (id {e.id}) after \"", data(prompt),
                      f"\": rank {e.rank:,} of {ex.vocab:,}"))
    if len(ex.pieces) > 1:
        con.print(compose(data(quoted(ex.token)), f" is {len(ex.pieces)} tokens; explaining the first, ",
                          tok(ex.pieces[0])))

    if ex.norm == "RMSNorm":
        con.print(f"\n[bold]h[/]: the last position's residual vector x through the final RMSNorm (D = {ex.width})")
        con.print(f"  x, the last block's output   |x| = {ex.norm_before:.4f}  (root mean square {ex.rms_before:.4f}, "
                  f"mean {ex.mean_before:.4f}, kept)")
        con.print(f"  x̂ = x / rms                  |x̂| = {ex.norm_standardised:.4f}  (≈ √D, whatever |x| was)")
        con.print(f"  h = γ ⊙ x̂                    |h| = {ex.norm_after:.4f}")
    else:
        con.print(f"\n[bold]h[/]: the last position's residual vector x through the final layer norm (D = {ex.width})")
        con.print(f"  x, the last block's output   |x| = {ex.norm_before:.4f}  (mean {ex.mean_before:.4f}, "
                  f"std {ex.std_before:.4f})")
        con.print(f"  x̂ = (x − mean) / std         |x̂| = {ex.norm_standardised:.4f}  (≈ √D, whatever |x| was)")
        con.print(f"  h = γ ⊙ x̂ + β                |h| = {ex.norm_after:.4f}")

    b = f" + {e.bias:.4f}" if ex.head_has_bias else ""
    plus_b = " + b" if ex.head_has_bias else ""
    con.print(f"\n[bold]z[/]: the dot product of h and the token's own {row} e"
              + ("" if ex.head_has_bias else " (no bias)"))
    if ex.own_softcap:
        c = ex.own_softcap
        con.print(f"  z = e · h{plus_b}               = {e.dot:.4f}{b}")
        con.print(f"    = |e| · |h| · cos θ{plus_b}   = {e.row_norm:.4f} × {ex.norm_after:.4f} × {e.cos:.4f}{b}"
                  f" = {e.product:.4f}")
        con.print(f"  then the model's own soft-cap: {c:g}·tanh(z/{c:g}) = {e.logit:.4f}   (the logit it outputs)")
    else:
        con.print(f"  z = e · h{plus_b}               = {e.dot:.4f}{b}   (the head's logit: {e.logit:.4f})")
        con.print(f"    = |e| · |h| · cos θ{plus_b}   = {e.row_norm:.4f} × {ex.norm_after:.4f} × {e.cos:.4f}{b}"
                  f" = {e.product:.4f}")
    con.print(compose("  margin to the top token ", tok(ex.top_token), f": {e.margin_to_top:+.4f}; to the runner-up ",
                      tok(ex.runner_up_token), f": {e.margin_to_runner_up:+.4f}"))
    con.print()

    table = Table(title="side by side: one h for every token, so only |e| and cos θ differ", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    columns = [("rank", "right"), ("token", "left"), ("|e|", "right"), ("cos θ", "right"), ("e · h", "right")]
    columns += [("b", "right")] if ex.head_has_bias else []
    columns += [("logit", "right"), ("prob", "right"), ("vs top", "right"), ("vs #2", "right")]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True, max_width=TOKEN_WIDTH if name == "token" else None)
    for p in ex.top:
        cells = [f"{p.rank:,}", tok(p.token), f"{p.row_norm:.4f}", f"{p.cos:+.4f}", f"{p.dot:.4f}"]
        cells += [f"{p.bias:.4f}"] if ex.head_has_bias else []
        cells += [f"{p.logit:.4f}", f"{p.prob:.4%}", f"{p.margin_to_top:+.4f}", f"{p.margin_to_runner_up:+.4f}"]
        style = "bold" if p.id == e.id else None
        table.add_row(*cells, style=style)
    con.print(table)

