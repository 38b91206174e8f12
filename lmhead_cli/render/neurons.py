"""`lmhead neurons`: a layer's neurons with the tokens each promotes and suppresses, the neurons that
write a token, or the neurons' shares of a target's logit with the check against attribute."""

from __future__ import annotations

from dataclasses import asdict

from rich.text import Text

from lmhead_cli.render import compact_table, compose, out, provenance_json, text_cell
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.attribute import diverging
from lmhead_cli.render.inspect import random_banner


def neurons_json(n) -> dict:
    """The documented `neurons --json` document: `neurons` (each mode's own objects) and what they read."""
    doc = {
        **provenance_json(n),
        "mode": n.mode, "n_layer": n.n_layer, "n_neurons": n.n_neurons, "norm": n.norm, "tied": n.tied,
        "layer": n.layer, "top": n.top,
        "token": None if n.token is None else asdict(n.token),
        "neurons": [asdict(x) for x in n.neurons],
    }
    if n.mode == "prompt":
        doc |= {"prompt_tokens": [asdict(t) for t in n.prompt_tokens], "truncated": n.truncated,
                "logit": n.logit, "sigma": n.sigma, "mlp_parts": n.mlp_parts, "neuron_sums": n.neuron_sums,
                "bias_parts": n.bias_parts, "sum": n.sum, "mlp_sum": n.mlp_sum, "error": n.error}
    return doc


def _tokens(values) -> Text:
    parts = []
    for i, t in enumerate(values):
        parts += ([" "] if i else []) + [tok(t.token), f" {t.value:+.2f}"]
    return compose(*parts)


def neurons_report(n) -> None:
    con = out()
    random_banner(n.model, n.random_weights)
    centre = "centre(v)" if n.norm == "LayerNorm" else "v"
    if n.mode == "layer":
        con.print(f"layer {n.layer}'s MLP neurons ({n.n_neurons:,} a layer, {n.n_layer} layers): each value vector v "
                  f"read as e_k · (γ ⊙ {centre}) through the final {n.norm} and the {'tied' if n.tied else 'untied'} head")
        table = compact_table(f"{len(n.neurons):,} neurons: the {n.top} tokens each promotes and suppresses most",
                              ("neuron", "right"), ("promotes", "left"), ("suppresses", "left"))
        for x in n.neurons:
            table.add_row(str(x.index), _tokens(x.promotes), _tokens(x.suppresses))
        con.print(table)
        return
    if n.mode == "token":
        where = "the model" if n.layer is None else f"layer {n.layer}"
        con.print(compose(f"the neurons of {where} that write ", tok(n.token.pieces[0]), " most: e · (γ ⊙ ", centre,
                          ") with e its row of the ", "tied" if n.tied else "untied", " head"))
        scale = max((abs(x.value) for x in n.neurons), default=0.0)
        table = compact_table(f"top {len(n.neurons)}, largest first", ("layer", "right"), ("neuron", "right"),
                              ("value", "right"), ("", "left"))
        for x in n.neurons:
            table.add_row(str(x.layer), str(x.index), f"{x.value:+.4f}", diverging(x.value, scale))
        con.print(table)
        return
    prompt = text_cell("".join(t.text for t in n.prompt_tokens))
    con.print(compose("neuron shares of z(", tok(n.token.pieces[0]), ') after "', prompt, '"'))
    con.print(f"each neuron's share = activation × e · (γ ⊙ {centre}) / σ,  σ = {n.sigma:.6f} (the final {n.norm}'s "
              "scale, from the actual final residual)")
    con.print(f"check: Σ neurons + Σ MLP biases = {n.sum:.6f}, attribute's MLP parts sum to {n.mlp_sum:.6f} "
              f"(error {n.error:+.1e})")
    scale = max((abs(x.value) for x in n.neurons), default=0.0)
    where = "all layers" if n.layer is None else f"layer {n.layer}"
    table = compact_table(f"top {len(n.neurons)} neurons of {where}, largest in size first", ("layer", "right"),
                          ("neuron", "right"), ("activation", "right"), ("readout", "right"), ("share", "right"),
                          ("", "left"))
    for x in n.neurons:
        table.add_row(str(x.layer), str(x.index), f"{x.activation:+.4f}", f"{x.readout:+.4f}", f"{x.value:+.4f}",
                      diverging(x.value, scale))
    con.print(table)
    per_layer = compact_table("per layer: Σ neurons + bias = attribute's MLP part", ("layer", "right"),
                              ("Σ neurons", "right"), ("bias", "right"), ("mlp part", "right"))
    for layer, (s, b, m) in enumerate(zip(n.neuron_sums, n.bias_parts, n.mlp_parts)):
        per_layer.add_row(str(layer), f"{s:+.6f}", f"{b:+.6f}", f"{m:+.6f}")
    con.print(per_layer)
