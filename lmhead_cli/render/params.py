"""`lmhead params`: the parameter account as a table. Shows what lmhead_cli.readings.params computed, nothing more."""

from __future__ import annotations

import dataclasses

from rich import box
from rich.table import Table

from lmhead_cli.render import out, print_json

COUNTED_FROM = {
    "config": "counted from the bundled config by arithmetic; no weights loaded",
    "tensors": "counted from the loaded model's tensors, shared storage once",
}


def _si(n: float, unit: str = "") -> str:
    """38597376 -> '38.6 M', 2097152000 bytes -> '2.10 GB' (powers of 1000)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:g} {unit}".rstrip()


def _share(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else ""


def params_document(result) -> dict:
    """The documented `params --json` document, from an api.results.ParamsResult."""
    return {"model": result.model, "counted_from": result.counted_from, **dataclasses.asdict(result.account),
            "head_cost": result.head_cost, "logits_memory": result.logits_memory}


def render_params(result, *, as_json: bool = False) -> None:
    if as_json:
        print_json(params_document(result))
        return
    model, counted_from = result.model, result.counted_from
    acc, cost, memory = result.account, result.head_cost, result.logits_memory
    V, P, d, inner, L, b = acc.vocab_size, acc.n_positions, acc.n_embd, acc.n_inner, acc.n_layer, acc.block
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for name, justify in (("key", "left"), ("what", "left"), ("shape", "left"), ("parameters", "right"),
                          ("share", "right")):
        table.add_column(name, justify=justify, no_wrap=True)

    def row(key: str, what: str, shape: str, n: int, share: bool = True) -> None:
        table.add_row(key, what, shape, f"{n:,}", _share(n, acc.total) if share else "")

    row("wte", "token embedding", f"{V:,} × {d:,}", acc.embedding)
    row("wpe", "position embedding", f"{P:,} × {d:,}", acc.position)
    table.add_row("h.N", "one block:", "", "", "")
    row("  ln_1", "layer norm", f"{d:,} + {d:,}", b.ln_1, share=False)
    row("  attn.c_attn", "attention q,k,v", f"{d:,} × {3 * d:,} + {3 * d:,}", b.attn_qkv, share=False)
    row("  attn.c_proj", "attention out", f"{d:,} × {d:,} + {d:,}", b.attn_proj, share=False)
    row("  ln_2", "layer norm", f"{d:,} + {d:,}", b.ln_2, share=False)
    row("  mlp.c_fc", "MLP up", f"{d:,} × {inner:,} + {inner:,}", b.mlp_up, share=False)
    row("  mlp.c_proj", "MLP down", f"{inner:,} × {d:,} + {d:,}", b.mlp_down, share=False)
    row("", "one block", "", acc.per_block, share=False)
    row(f"h.0 … h.{L - 1}" if L else "h", f"{L} blocks", f"× {L}", acc.blocks)
    row("ln_f", "final layer norm", f"{d:,} + {d:,}", acc.final_norm)
    row("lm_head", "head", "tied: it is wte" if acc.tied else f"{V:,} × {d:,}", acc.head_extra)
    if acc.other:
        row("?", "not GPT-2 names", "", acc.other)
    table.add_section()
    table.add_row("[bold]total[/]", "", "", f"[bold]{acc.total:,}[/]", _share(acc.total, acc.total))

    console = out()
    console.print(f"{model}: {COUNTED_FROM[counted_from]}", soft_wrap=True)
    console.print(table)
    console.print()
    console.print(f"embedding  {acc.embedding:,} = {_share(acc.embedding, acc.total)} of the total")
    if acc.tied:
        console.print(f"untied     {acc.untied_total:,}: a head of its own would add {acc.embedding:,}")
    else:
        console.print(f"tied       {acc.tied_total:,}: this head is its own matrix; tying would save "
                      f"{acc.head_extra:,}")
    console.print(f"head cost  {cost.n_embd:,} × {cost.vocab_size:,} = {cost.multiply_adds_per_position:,} "
                  f"multiply-adds per position ({_si(cost.multiply_adds_per_position)})")
    console.print(f"logits     float32, batch {memory.batch:,} × seq {memory.seq:,} × vocab {memory.vocab:,}:")
    console.print(f"  every position (B, T, V)  {memory.all_positions_bytes:>16,} bytes  "
                  f"{_si(memory.all_positions_bytes, 'B'):>8}")
    console.print(f"  last position  (B, V)     {memory.last_position_bytes:>16,} bytes  "
                  f"{_si(memory.last_position_bytes, 'B'):>8}")
