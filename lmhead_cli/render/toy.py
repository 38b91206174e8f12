"""`lmhead toy`: the four-word head as tables. Shows what lmhead_cli.readings.toy computed, nothing more."""

from __future__ import annotations

from dataclasses import asdict

from rich import box
from rich.table import Table

from lmhead_cli.render import bar, out, print_json
from lmhead_cli.readings.toy import Sample, ToyExample, Variant


def short_number(x: float) -> str:
    """2.0 -> '2', 0.5 -> '0.5', 0.9640 -> '0.964': at most three decimals, no trailing zeros."""
    if 0 < abs(x) < 0.0005:  # a temperature of 1e-06 keeps three significant digits, not "0"
        return f"{x:.3g}"
    text = f"{x:.3f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def label(v: Variant) -> str:
    """What a variant did to the logits, for people: "logits + 10", "h × 2 (= temperature 0.5)"."""
    if v.name == "shift":
        return f"logits + {short_number(v.amount)}"
    if v.name == "scale":
        return f"h × {short_number(v.amount)} (= temperature {short_number(v.equivalent_temperature)})"
    return f"softcap c = {short_number(v.amount)}"


def toy_json(ex: ToyExample) -> dict:
    """The `toy --json` document: the example's fields, each variant with its label."""
    doc = asdict(ex)
    doc["variants"] = [{"name": v.name, "label": label(v), **asdict(v)} for v in ex.variants]
    return doc


def _vector(values) -> str:
    return "[" + ", ".join(short_number(v) for v in values) + "]"


def _table(**kwargs) -> Table:
    return Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0), title_justify="left", **kwargs)


def _effect(v: Variant) -> str:
    if v.effect == "unchanged":
        return "unchanged"
    return f"{v.effect}, {'same order' if v.order_kept else 'order changed'}"


def _choices(ex: ToyExample) -> Table:
    table = _table(title=f"Choosing a word, {len(ex.sample.draws)} times")
    table.add_column("rule")
    for word in ex.words:
        table.add_column(word, justify="right")
    table.add_column("the words chosen", no_wrap=True, overflow="ellipsis", max_width=32)

    def add(rule: str, s: Sample) -> None:
        table.add_row(rule, *(str(s.counts[w]) for w in ex.words), " ".join(s.draws))

    add("argmax", ex.argmax)
    add(f"sample, seed {ex.sample.seed}", ex.sample)
    return table


def _changes(ex: ToyExample) -> Table:
    table = _table(title="What moves the probabilities")
    table.add_column("change", no_wrap=True)
    table.add_column("")
    for word in ex.words:
        table.add_column(word, justify="right")
    table.add_column("entropy", justify="right")

    def add(label: str, effect: str, z, p, bits: float) -> None:
        table.add_row(label, "z", *(short_number(v) for v in z), "")
        table.add_row(f"  [dim]{effect}[/]", "p", *(f"{v:.3f}" for v in p), f"{bits:.2f} bits", end_section=True)

    add("none", "", ex.logits, ex.probs, ex.entropy_bits)
    for v in ex.variants:
        add(label(v), _effect(v), v.logits, v.probs, v.entropy_bits)
    return table


def render_toy(ex: ToyExample, *, as_json: bool = False) -> None:
    if as_json:
        print_json(toy_json(ex))
        return
    console = out()
    t = short_number(ex.temperature)
    console.print(f"h = {_vector(ex.hidden)}, temperature {t}: logit z = row · h, p = softmax(z / {t})")

    table = _table()
    table.add_column("word")
    table.add_column("row of W_e")
    table.add_column("logit z", justify="right")
    table.add_column("p", justify="right")
    table.add_column("")
    for word, row, z, p in zip(ex.words, ex.rows, ex.logits, ex.probs):
        table.add_row(word, _vector(row), short_number(z), f"{p:.3f}", bar(p))
    table.add_section()
    table.add_row("sum", "", "", f"{ex.prob_sum:.3f}", "")
    console.print(table)
    console.print()
    console.print(_choices(ex))
    console.print()
    console.print(_changes(ex))
    console.print()
    for v in ex.variants:
        if v.scale is not None:
            console.print(f"h × {short_number(v.scale)} against temperature "
                          f"{short_number(v.equivalent_temperature)}: p differs by at most {v.equivalence_gap:.1e}")
