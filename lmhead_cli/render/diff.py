"""`lmhead diff`: the two distributions side by side, their divergences, the movers and the targets."""

from __future__ import annotations

from dataclasses import asdict

from lmhead_cli.render import compact_table, compose, out, provenance_json, text_cell
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.inspect import random_banner


def diff_json(d) -> dict:
    """The documented `diff --json` document."""

    def side(s) -> dict:
        return {"prompt": s.prompt, "prompt_tokens": [asdict(t) for t in s.prompt_tokens],
                "top": [t.to_dict() for t in s.top], "entropy": s.entropy}

    def mover(m) -> dict:
        return {"id": m.id, "token": m.token, "logprob_a": m.logprob_a, "logprob_b": m.logprob_b, "delta": m.delta}

    return {
        **provenance_json(d),
        "a": side(d.a), "b": side(d.b),
        "kl_ab": d.kl_ab, "kl_ba": d.kl_ba, "js": d.js, "tv": d.tv,
        "risers": [mover(m) for m in d.risers], "fallers": [mover(m) for m in d.fallers],
        "targets": [{"token": t.token, "id": t.id, "logprob_a": t.logprob_a, "logprob_b": t.logprob_b,
                     "rank_a": t.rank_a, "rank_b": t.rank_b, "delta": t.delta} for t in d.targets],
    }


def _prompt(side):
    return text_cell("".join(t.text for t in side.prompt_tokens))


def diff_report(d) -> None:
    con = out()
    random_banner(d.model, d.random_weights)
    con.print(compose('A: "', _prompt(d.a), f'" ({len(d.a.prompt_tokens)} tokens)\nB: "', _prompt(d.b),
                      f'" ({len(d.b.prompt_tokens)} tokens)'))

    div = compact_table("how far apart: p after A, q after B", ("", "left"), ("nats", "right"),
                        ("bits", "right"), ("", "left"))
    div.add_row("KL(A‖B)", f"{d.kl_ab:.6f}", f"{d.kl_ab_bits:.6f}", "Σ p·(log p − log q)")
    div.add_row("KL(B‖A)", f"{d.kl_ba:.6f}", f"{d.kl_ba_bits:.6f}", "Σ q·(log q − log p)")
    div.add_row("Jensen–Shannon", f"{d.js:.6f}", f"{d.js_bits:.6f}", "½KL(p‖m) + ½KL(q‖m), m = (p+q)/2")
    div.add_row("total variation", f"{d.tv:.6f}", "", "½ Σ |p − q|, a probability")
    div.add_row("entropy A", f"{d.a.entropy:.6f}", f"{d.a.entropy_bits:.6f}", "")
    div.add_row("entropy B", f"{d.b.entropy:.6f}", f"{d.b.entropy_bits:.6f}", "")
    con.print(div)

    top = compact_table(f"each side's top {len(d.a.top)}, and its rank on the other side",
                        ("rank", "right"), ("A token", "left"), ("prob A", "right"), ("B rank", "right"),
                        ("│", "center"), ("B token", "left"), ("prob B", "right"), ("A rank", "right"))
    for x, y in zip(d.a.top, d.b.top):
        top.add_row(str(x.rank), tok(x.token), f"{x.prob:.4%}", f"{x.other_rank:,}", "│",
                    tok(y.token), f"{y.prob:.4%}", f"{y.other_rank:,}")
    con.print(top)

    con.print(f"movers among the {d.pool} tokens in either top {len(d.a.top)}, Δ = logprob B − logprob A:")
    for title, movers in (("risers", d.risers), ("fallers", d.fallers)):
        if not movers:
            con.print(f"{title}: none")
            continue
        t = compact_table(title, ("id", "right"), ("token", "left"), ("logprob A", "right"),
                          ("logprob B", "right"), ("Δ", "right"))
        for m in movers:
            t.add_row(str(m.id), tok(m.token), f"{m.logprob_a:.4f}", f"{m.logprob_b:.4f}", f"{m.delta:+.4f}")
        con.print(t)

    if d.targets:
        t = compact_table("targets", ("target", "left"), ("logp A", "right"), ("logp B", "right"), ("Δ", "right"),
                          ("prob A", "right"), ("prob B", "right"), ("rank A", "right"), ("rank B", "right"))
        for x in d.targets:
            t.add_row(tok(x.pieces[0]), f"{x.logprob_a:.4f}", f"{x.logprob_b:.4f}", f"{x.delta:+.4f}",
                      f"{x.prob_a:.4%}", f"{x.prob_b:.4%}", f"{x.rank_a:,}", f"{x.rank_b:,}")
        con.print(t)
