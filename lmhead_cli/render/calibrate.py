"""`lmhead calibrate`: the reliability chart in the terminal, the JSON document, and the reliability
diagram as SVG (`--html`, a notebook cell, the page of `lmhead serve`). Every figure is the reading's
own; nothing is computed here but positions on a chart."""

from __future__ import annotations

import html

from rich import box
from rich.table import Table

from lmhead_cli.render import out, provenance_json, safe_text
from lmhead_cli.render.inspect import random_banner

CHART_WIDTH = 30
FULL, MARK = "█", "◆"


# ---- JSON ------------------------------------------------------------------------------------------

def bins_json(bins) -> list[dict]:
    return [{"lo": b.lo, "hi": b.hi, "count": b.count, "confidence": b.confidence, "accuracy": b.accuracy}
            for b in bins]


def calibration_json(cal) -> dict:
    """The `calibrate --json` document (= CalibrateResult.to_dict())."""
    doc = {**provenance_json(cal), "text": cal.text, "bos": cal.bos, "window": cal.window, "stride": cal.stride,
           "chunk": cal.chunk, "positions": cal.positions, "bins": bins_json(cal.bins), "ece": cal.ece,
           "brier": cal.brier, "nll": cal.nll, "temperature": cal.temperature,
           "ece_at_temperature": cal.ece_at_temperature, "nll_at_temperature": cal.nll_at_temperature}
    g = cal.generations
    if g is not None:
        doc["generations"] = {"count": g.count, "prompt": g.prompt, "max_new_tokens": g.max_new_tokens,
                              "seed": g.seed, "settings": g.settings, "tokens": g.tokens,
                              "entropy_rate": g.entropy_rate, "cross_entropy": g.cross_entropy, "gap": g.gap,
                              "texts": g.texts}
    return doc


# ---- the terminal ----------------------------------------------------------------------------------

def chart(accuracy: float | None, confidence: float | None, width: int = CHART_WIDTH) -> str:
    """A bin's row of the chart: accuracy as a bar of `width` cells, confidence as ◆ where it falls (a
    calibrated bin's bar ends at its ◆)."""
    if accuracy is None:
        return ""
    cells = [FULL if i < round(accuracy * width) else " " for i in range(width + 1)]
    cells[min(width, round(confidence * width))] = MARK
    return "".join(cells).rstrip()


def reliability_table(bins, title: str | None = None) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title=title, title_justify="left")
    for name, justify in (("top-1 prob", "left"), ("count", "right"), ("confidence", "right"),
                          ("accuracy", "right"), (f"{FULL} accuracy  {MARK} confidence", "left")):
        t.add_column(name, justify=justify, no_wrap=True)
    for b in bins:
        if b.count:
            t.add_row(f"({b.lo:.2f}, {b.hi:.2f}]", f"{b.count:,}", f"{b.confidence:.3f}", f"{b.accuracy:.3f}",
                      chart(b.accuracy, b.confidence))
        else:
            t.add_row(f"({b.lo:.2f}, {b.hi:.2f}]", "0", "", "", "")
    return t


def report(cal) -> None:
    con = out()
    random_banner(cal.model, cal.random_weights)
    windows = "1 window" if cal.windows == 1 else f"{cal.windows:,} windows"
    con.print(f"{cal.positions:,} positions scored ({windows} of ≤ {cal.window:,} tokens, stride {cal.stride:,}); "
              f"top-1 right at {cal.accuracy:.1%}, mean confidence {cal.confidence:.1%}", markup=False)
    con.print(reliability_table(cal.bins, "reliability: 15 bins of the top-1 probability"))
    con.print(f"ECE {cal.ece:.4f} · Brier {cal.brier:.4f} (the top-1 event) · NLL {cal.nll:.4f} nats a token",
              markup=False)
    con.print(f"temperature {cal.temperature:.4f} minimises the NLL (fitted in {cal.passes} passes of the head): "
              f"NLL {cal.nll_at_temperature:.4f} · ECE {cal.ece_at_temperature:.4f}", markup=False)
    g = cal.generations
    if g is not None:
        on = ", ".join(f"{k} {v}" for k, v in g.settings.items()) or "plain sampling (T = 1)"
        verdict = "less sure than the text" if g.gap > 0 else "surer than the text"
        each = g.tokens / g.count  # what each held: the context may have had room for fewer than asked
        length = f"{each:,.0f} tokens" if each == int(each) else f"{each:,.1f} tokens on average"
        if each < g.max_new_tokens:
            length += f" (all the context holds; {g.max_new_tokens:,} asked)"
        con.print(f"{g.count:,} generation{'s' if g.count != 1 else ''} of {length} after {safe_text(g.prompt)} ({on}, seed "
                  f"{g.seed}): entropy rate {g.entropy_rate:.4f} nats a token against the text's cross-entropy "
                  f"{g.cross_entropy:.4f}: gap {g.gap:+.4f} ({verdict})", markup=False)


# ---- SVG and HTML ----------------------------------------------------------------------------------

SIZE, PAD = 320, 40  # the plot's side and the margin for the axes' labels, in SVG units


def reliability_svg(bins, title: str) -> str:
    """The reliability diagram: each non-empty bin's accuracy as a bar over (lo, hi], its mean confidence as
    a tick, the diagonal a calibrated model would follow. Text in it is escaped."""
    side = SIZE - 2 * PAD

    def x(v: float) -> float:
        return PAD + v * side

    def y(v: float) -> float:
        return SIZE - PAD - v * side

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {SIZE} {SIZE}" width="{SIZE}" height="{SIZE}" '
             f'role="img" class="lmhead-reliability"><title>{html.escape(title)}</title>',
             f'<rect x="{PAD}" y="{PAD}" width="{side}" height="{side}" fill="none" stroke="#999"/>']
    for b in bins:
        if not b.count:
            continue
        top = y(b.accuracy)
        parts.append(f'<rect class="bar" x="{x(b.lo):.2f}" y="{top:.2f}" width="{x(b.hi) - x(b.lo):.2f}" '
                     f'height="{SIZE - PAD - top:.2f}" fill="#4878d0" stroke="#fff" stroke-width="0.5">'
                     f'<title>({b.lo:.3f}, {b.hi:.3f}]: {b.count:,} positions, confidence {b.confidence:.4f}, '
                     f'accuracy {b.accuracy:.4f}</title></rect>')
        parts.append(f'<line class="confidence" x1="{x(b.lo):.2f}" x2="{x(b.hi):.2f}" y1="{y(b.confidence):.2f}" '
                     f'y2="{y(b.confidence):.2f}" stroke="#d65f5f" stroke-width="2"/>')
    parts.append(f'<line x1="{x(0)}" y1="{y(0)}" x2="{x(1)}" y2="{y(1)}" stroke="#555" stroke-dasharray="4 3"/>')
    for v in (0, 0.5, 1):
        parts.append(f'<text x="{x(v):.1f}" y="{SIZE - PAD + 14}" font-size="10" text-anchor="middle">{v:g}</text>')
        parts.append(f'<text x="{PAD - 6}" y="{y(v) + 3:.1f}" font-size="10" text-anchor="end">{v:g}</text>')
    parts.append(f'<text x="{SIZE / 2}" y="{SIZE - 8}" font-size="11" text-anchor="middle">confidence (top-1 '
                 'probability)</text>')
    parts.append(f'<text x="12" y="{SIZE / 2}" font-size="11" text-anchor="middle" '
                 f'transform="rotate(-90 12 {SIZE / 2})">accuracy</text>')
    parts.append(f'<text x="{SIZE / 2}" y="{PAD - 14}" font-size="12" text-anchor="middle">{html.escape(title)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def figures_table(cal) -> str:
    rows = [("positions", f"{cal.positions:,}"), ("ECE", f"{cal.ece:.4f}"), ("Brier", f"{cal.brier:.4f}"),
            ("NLL", f"{cal.nll:.4f}"), ("temperature", f"{cal.temperature:.4f}"),
            ("ECE at temperature", f"{cal.ece_at_temperature:.4f}"),
            ("NLL at temperature", f"{cal.nll_at_temperature:.4f}")]
    g = cal.generations
    if g is not None:
        rows += [("entropy rate of generations", f"{g.entropy_rate:.4f}"), ("cross-entropy on the text",
                                                                           f"{g.cross_entropy:.4f}")]
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in rows)
    return f"<table class='lmhead-figures'>{body}</table>"


def diagrams(cal) -> list[str]:
    """The two reliability diagrams, as the model gives them and at the fitted temperature (SVG text)."""
    return [reliability_svg(cal.bins, f"as given: ECE {cal.ece:.4f}"),
            reliability_svg(cal.bins_at_temperature, f"at T = {cal.temperature:.3f}: ECE {cal.ece_at_temperature:.4f}")]


def calibration_view(cal) -> dict:
    """What the page of `lmhead serve` draws for a Calibration: `calibrate --json`'s figures and bins
    (exact), and `svg`, the two diagrams that `--html` shows, as SVG text. The page parses each as an
    SVG document (XML: nothing in it runs) and sets every other text with textContent."""
    doc = calibration_json(cal)
    return {"kind": "calibrate", "model": safe_text(cal.model), "random_weights": cal.random_weights,
            **{k: doc[k] for k in ("positions", "bins", "ece", "brier", "nll", "temperature", "ece_at_temperature",
                                   "nll_at_temperature")},
            "accuracy": cal.accuracy, "confidence": cal.confidence, "svg": diagrams(cal)}


def calibration_html(cal, *, fragment: bool = False) -> str:
    """The two reliability diagrams (as the model gives them, and at the fitted temperature) and the
    figures: a <div> for a notebook cell, or a whole page (`calibrate --html`) under a CSP that allows
    no request."""
    from lmhead_cli.render.html import EXPORT_CSP

    model = html.escape(safe_text(cal.model))
    body = (f"<div class='lmhead-calibration'><p><b>lmhead calibrate</b> · {model}"
            + (" · random weights" if cal.random_weights else "") + "</p>"
            + "<div style='display:flex;flex-wrap:wrap;gap:1em'>"
            + "".join(diagrams(cal)) + "</div>" + figures_table(cal) + "</div>")
    if fragment:
        return body
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{EXPORT_CSP}\">\n"
            f"<title>lmhead calibrate: {model}</title>\n</head>\n<body>\n{body}\n</body>\n</html>\n")
