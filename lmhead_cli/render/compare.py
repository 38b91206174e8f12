"""`lmhead compare`: llama-perplexity's --kl-divergence tables, a sparkline of KL divergence along the
text, the positions that moved most, and the JSON document streamed token by token."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict

from lmhead_cli.render import _plain, dumps, compact_table, compose, data, out, provenance_json, sparkline
from lmhead_cli.render import token_cell as tok
from lmhead_cli.render.inspect import random_banner

FEW_POSITIONS = 100  # llama-perplexity prints no summary under this many; here a note says the figures are rough
WORST = 5


def num(v: float | None) -> str:
    """A figure as llama-perplexity prints it (6 decimals), or in scientific notation when that would
    show it as zeros; "n/a" where it has no value."""
    if v is None:
        return "n/a"
    return f"{v:,.6f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.3e}"


def pct(v: float | None) -> str:
    return "n/a" if v is None else (f"{100 * v:.3f}%" if v == 0 or abs(v) >= 1e-5 else f"{100 * v:.2e}%")


def column(values: list[float | None], decimals: int) -> list[str]:
    """One table column in one notation: llama-perplexity's fixed `decimals` when every non-zero value
    keeps at least 3 significant digits there, else scientific for every row (a KLD of 2e-7 is not 0)."""
    smallest = min((abs(v) for v in values if v), default=1.0)
    if smallest >= 10.0 ** (2 - decimals):
        return ["n/a" if v is None else f"{v:,.{decimals}f}" for v in values]
    return ["n/a" if v is None else f"{v:.3e}" for v in values]


def prob(p: float) -> str:
    return f"{p:.4%}" if p >= 1e-4 else f"{100 * p:.2e}%"


def _who(s) -> str:
    return f"{s.model} ({s.dtype})"


def _table(title: str, rows: list[tuple[str, str, str]]):
    t = compact_table(title, ("", "left"), ("value", "right"), ("±", "right"))
    for row in rows:
        t.add_row(*row)
    return t


def perplexity_rows(s) -> list[tuple[str, str, str]]:
    cor = "n/a" if s.cor_ln_ppl is None else f"{100 * s.cor_ln_ppl:.2f}%"
    return [("Mean PPL(Q)", num(s.ppl_q.value), num(s.ppl_q.uncertainty)),
            ("Mean PPL(base)", num(s.ppl_base.value), num(s.ppl_base.uncertainty)),
            ("Cor(ln(PPL(Q)), ln(PPL(base)))", cor, ""),
            ("Mean ln(PPL(Q)/PPL(base))", num(s.ln_ppl_ratio.value), num(s.ln_ppl_ratio.uncertainty)),
            ("Mean PPL(Q)/PPL(base)", num(s.ppl_ratio.value), num(s.ppl_ratio.uncertainty)),
            ("Mean PPL(Q)-PPL(base)", num(s.ppl_diff.value), num(s.ppl_diff.uncertainty))]


def _label(label: str, what: str) -> str:
    named = {"max": "Maximum", "min": "Minimum", "median": "Median"}
    return f"{named.get(label, label)} {what}"


def _rows(labels: list[str], values: list, uncertainties: list, decimals: int,
          unit: str = "") -> list[tuple[str, str, str]]:
    shown = column([*values, *(u for u in uncertainties if u is not None)], decimals)
    vals, uncs = shown[:len(values)], iter(shown[len(values):])
    return [(label, v + unit, "" if u is None else next(uncs) + unit)
            for label, v, u in zip(labels, vals, uncertainties)]


def kld_rows(s) -> list[tuple[str, str, str]]:
    labels = ["Mean KLD", *(_label(k, "KLD") for k in s.kld_percentiles)]
    return _rows(labels, [s.kld_mean.value, *s.kld_percentiles.values()],
                 [s.kld_mean.uncertainty, *[None] * len(s.kld_percentiles)], 6)


def dp_rows(s) -> list[tuple[str, str, str]]:
    """Δp's rows in percent (3 decimals, as llama-perplexity), then same top p."""
    labels = ["Mean Δp", *(_label(k, "Δp") for k in s.dp_percentiles), "RMS Δp"]
    values = [s.dp_mean.value, *s.dp_percentiles.values(), s.dp_rms.value]
    uncertainties = [s.dp_mean.uncertainty, *[None] * len(s.dp_percentiles), s.dp_rms.uncertainty]
    rows = _rows(labels, [100 * v for v in values], [None if u is None else 100 * u for u in uncertainties],
                 3, "%")
    return [*rows, ("Same top p", pct(s.same_top.value), pct(s.same_top.uncertainty))]


def summary_lines(c) -> list[str]:
    T = len(c.ids)
    windows = "1 window" if c.windows == 1 else f"{c.windows:,} windows"
    plan = (f"{'1 chunk' if c.windows == 1 else f'{c.windows:,} chunks'} of {c.window:,} tokens, the second half of "
            "each scored (llama-perplexity's positions)" if c.llama_chunks
            else f"{windows} of ≤ {c.window:,} tokens (stride {c.stride:,})")
    lines = [f"Q:    {_who(c.q)}", f"base: {_who(c.base)}",
             f"{c.positions:,} positions scored of {T:,} tokens; {plan}; both heads {c.chunk:,} positions at a time"]
    if c.positions < FEW_POSITIONS:
        lines.append(f"few positions ({c.positions:,}): the ± figures are rough (llama-perplexity prints no "
                     f"summary under {FEW_POSITIONS})")
    return lines


def profile(c) -> None:
    con = out()
    values, per = c.profile(max(16, min(con.width, 120) - 12))
    scale = "one mark per token" if per == 1 else f"one mark = the mean of {per:,} tokens"
    con.print(f"KLD        {sparkline(values)}", markup=False)
    con.print(f"           nats along the text, ▁ {num(min(values))} … █ {num(max(values))}; {scale}",
              markup=False)


def worst_table(c):
    t = compact_table("where the distributions moved most", ("#", "right"), ("token", "left"), ("KLD", "right"),
                      ("p(Q)", "right"), ("p(base)", "right"), ("top Q", "left"), ("top base", "left"))
    for r in c.worst(WORST):
        t.add_row(str(r.index), tok(r.token), num(r.kld), prob(math.exp(r.logprob_q)),
                  prob(math.exp(r.logprob_base)), tok(r.top_q_token), tok(r.top_base_token))
    return t


def report(c) -> None:
    """The human report: who is compared, the three tables, the KLD sparkline, the worst positions."""
    con = out()
    random_banner(c.q.model, c.q.random_weights)
    if c.base.model != c.q.model:
        random_banner(c.base.model, c.base.random_weights)
    for line in summary_lines(c):
        con.print(data(line))
    s = c.stats
    con.print(_table("perplexity", perplexity_rows(s)))
    con.print(_table("KL divergence KL(base ‖ Q), nats", kld_rows(s)))
    con.print(_table("token probability, Δp = p(Q) − p(base) of the actual token", dp_rows(s)))
    profile(c)
    con.print(worst_table(c))
    con.print(compose("[dim]statistics as llama-perplexity --kl-divergence defines them; docs/compare.md[/]"))


def json_header(c) -> dict:
    """The `compare --json` document's fields before its statistics: each side's provenance (model,
    random_weights, dtype), the text and the plan."""
    return {"q": provenance_json(c.q, "dtype"), "base": provenance_json(c.base, "dtype"), "text": c.text,
            "bos": c.bos, "window": c.window, "stride": c.stride, "chunk": c.chunk, "windows": c.windows,
            "llama_chunks": c.window if c.llama_chunks else None, "positions": c.positions}


def comparison_json(c) -> dict:
    """The `compare --json` document of a readings.compare.Comparison: the header, the statistics, one
    row per token."""
    return {**json_header(c), "statistics": asdict(c.stats), "tokens": [asdict(t) for t in c.tokens()]}


def write_json(c) -> None:
    """The `compare --json` document (comparison_json), written token by token: no list of T rows is
    built."""
    dump = lambda v: dumps(_plain(v))  # noqa: E731
    write = sys.stdout.write
    write("{\n")
    for k, v in json_header(c).items():
        write(f"  {dump(k)}: {dump(v)},\n")
    write(f'  "statistics": {dump(asdict(c.stats))},\n  "tokens": [\n')
    for i, t in enumerate(c.tokens()):
        write((",\n" if i else "") + "    " + dump(asdict(t)))
    write("\n  ]\n}\n")
    sys.stdout.flush()
