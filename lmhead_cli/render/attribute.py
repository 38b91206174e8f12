"""`lmhead attribute`: the logit's parts sorted by size, the check that they add up, a per-layer chart
of attention and MLP, and (with --heads) every head."""

from __future__ import annotations

from dataclasses import asdict

from rich.text import Text

from lmhead_cli.render import bar, compact_table, compose, out, provenance_json, text_cell
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.inspect import random_banner

HALF = 12  # cells on each side of a diverging bar


def attribution_json(a) -> dict:
    """The documented `attribute --json` document."""
    return {
        **provenance_json(a),
        "target": a.target.token, "vs": a.vs.token if a.vs is not None else None, "logit": a.logit,
        "parts": [asdict(p) for p in a.parts],
        "heads": [asdict(h) for h in a.heads],
        "attn_bias": [asdict(b) for b in a.attn_bias],
        "sum": a.sum, "error": a.error,
    }


def diverging(value: float, scale: float) -> str:
    """A bar for a signed value: red to the left of the axis when negative, green to the right when positive."""
    cells = bar(abs(value) / scale if scale else 0.0, HALF)
    if value < 0:
        return f"[red]{cells:>{HALF}}[/]│{'':<{HALF}}"
    return f"{'':>{HALF}}│[green]{cells:<{HALF}}[/]"


def attribution(a, show_heads: bool = False) -> None:
    con = out()
    random_banner(a.model, a.random_weights)
    def named(kind: str) -> Text:  # z(␣are) − z(␣is): tokens as data, never parsed
        return compose(f"{kind}(", tok(a.target.pieces[0]), ")",
                       *((f" − {kind}(", tok(a.vs.pieces[0]), ")") if a.vs is not None else ()))

    prompt = text_cell("".join(t.text for t in a.prompt_tokens))
    con.print(compose("direct logit attribution: ", named("z"), ' after "', prompt, '"'))
    centre = "centre(part)" if a.norm == "LayerNorm" else "part"
    con.print(compose(f"each part's share = e · (γ ⊙ {centre}) / σ\n  e = ", named("row"),
                      f" of the {'tied' if a.tied else 'untied'} head\n"
                      f"  σ = {a.sigma:.6f}: the final {a.norm}'s scale, from the actual final residual"))
    con.print(f"check: Σ parts = {a.sum:.6f}, the head's own {'difference' if a.vs is not None else 'logit'} "
              f"= {a.logit:.6f} (error {a.error:+.1e})")

    scale = max((abs(p.value) for p in a.parts), default=0.0)
    parts = compact_table(f"{len(a.parts)} parts, largest first", ("part", "left"), ("value", "right"),
                          ("", "left"))
    for p in sorted(a.parts, key=lambda p: -abs(p.value)):
        parts.add_row(p.name, f"{p.value:+.6f}", diverging(p.value, scale))
    con.print(parts)

    by_layer = {(p.layer, p.kind): p.value for p in a.parts if p.layer is not None}
    layer_scale = max((abs(v) for v in by_layer.values()), default=0.0)
    chart = compact_table("per layer: attention (heads + bias) and MLP", ("layer", "right"), ("attn", "right"),
                          ("", "left"), ("mlp", "right"), ("", "left"))
    for layer in range(a.n_layer):
        attn, mlp = by_layer[(layer, "attn")], by_layer[(layer, "mlp")]
        chart.add_row(str(layer), f"{attn:+.4f}", diverging(attn, layer_scale), f"{mlp:+.4f}",
                      diverging(mlp, layer_scale))
    con.print(chart)

    if show_heads:
        head_scale = max((abs(h.value) for h in a.heads), default=0.0)
        heads = compact_table(f"{len(a.heads)} heads ({a.n_layer} layers × {a.n_head}), largest first",
                              ("layer", "right"), ("head", "right"), ("value", "right"), ("", "left"))
        for h in sorted(a.heads, key=lambda h: -abs(h.value)):
            heads.add_row(str(h.layer), str(h.head), f"{h.value:+.6f}", diverging(h.value, head_scale))
        con.print(heads)
        split = compact_table("attention = Σ heads + output bias", ("layer", "right"), ("Σ heads", "right"),
                              ("bias", "right"), ("attn", "right"))
        for b, heads_sum in zip(a.attn_bias, a.heads_sum):
            split.add_row(str(b.layer), f"{heads_sum:+.6f}", f"{b.value:+.6f}", f"{by_layer[(b.layer, 'attn')]:+.6f}")
        con.print(split)
