"""Output: rich tables for people, JSON for programs. Nothing here computes a figure.

Consoles are made per call (not at import) so they write to whatever sys.stdout is
at that moment: a terminal, a pipe, or Typer's CliRunner in tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import unicodedata
from typing import Any

from rich.console import Console

BAR_WIDTH = 16
SPARK = "▁▂▃▄▅▆▇█"


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich would exit 1 here; the CLI's one boundary ends a closed pipe (`| head`) quietly with 0.
        self.quiet = True
        raise BrokenPipeError


def out() -> Console:
    """Console on stdout (tables, text)."""
    return _Console(file=sys.stdout, highlight=False, soft_wrap=False)


def err() -> Console:
    """Console on stderr (warnings, notices, progress)."""
    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    err().print(f"[yellow]warning:[/] {message}", markup=True)


def notice(message: str) -> None:
    err().print(f"[dim]{message}[/]", markup=True)


def truncated(kept: int, dropped: int, n_ctx: int) -> None:
    """One warning on stderr when a prompt lost its first `dropped` tokens to the context limit."""
    if dropped:
        warn(f"the prompt is {kept + dropped} tokens, longer than the context of {n_ctx}; keeping the last {kept}")


def own_softcap_notice(own: float | None, softcap: float | None) -> None:
    """One notice when a soft-cap stage (c = `softcap`) is asked of a model that soft-caps its own
    logits at c = `own` (Gemma-2)."""
    if own and softcap is not None:
        notice(f"the model already soft-caps its own logits at c = {own:g}; the softcap stage "
               f"(c = {softcap:g}) caps them a second time")


def multi_piece_notices(targets) -> None:
    """A notice for each target that is several tokens: it is scored by its first."""
    for t in targets:
        if len(t.pieces) > 1:
            notice(f"target {t.token!r} is {len(t.pieces)} tokens {t.pieces}; using the first, {t.pieces[0]!r}")


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else (1e308 if obj > 0 else -1e308)
    return obj


def json_text(doc: Any, *, lines: bool = False) -> str:
    """A document as JSON text: indented, or on one compact line with ``lines``; infinities made finite."""
    return json.dumps(_plain(doc), ensure_ascii=False, separators=(",", ":") if lines else None,
                      indent=None if lines else 2)


def print_json(doc: Any, *, lines: bool = False) -> None:
    """One JSON document on stdout (or one line per document with ``lines``), no colour."""
    sys.stdout.write(json_text(doc, lines=lines) + "\n")
    sys.stdout.flush()


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar for a fraction in [0, 1], in eighths of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    return "█" * full + ("▏▎▍▌▋▊▉"[rest - 1] if rest else "")


def sparkline(values: list[float]) -> str:
    """One character per value, scaled between the values' min and max."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(SPARK[0 if span == 0 else min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def knobs_text(knobs, sep: str = " → ") -> str:
    """The stages that are on, in order, for people: "softcap 30 → temperature 0.8" ("" if none)."""
    return sep.join(f"{key.replace('_', '-')} {value:g}" for key, value in knobs.active().items())


def token_cell(text: str) -> str:
    """A token for rich output: visible spaces, and markup-like text such as '[/' shown as it is."""
    from rich.markup import escape

    return escape(show_token(text))


def show_token(text: str) -> str:
    """A token's text made visible: a leading space as '␣', control characters escaped."""
    shown = visible(text)
    if shown.startswith(" "):
        shown = "␣" + shown[1:]
    return shown


def visible(text: str) -> str:
    """Text with newlines, tabs and every other control character (ESC, BEL, DEL, C1) shown as escapes,
    so data cannot drive the terminal."""
    return _controls_escaped(text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r"))


def safe_text(text: str) -> str:
    """Running text (a scored text, a file line) for rich Text: line breaks and tabs kept, every other
    control character shown as an escape (ESC as \\x1b), so data cannot drive the terminal."""
    return _controls_escaped(text, keep="\n\t")


def _controls_escaped(text: str, keep: str = "") -> str:
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in keep else c for c in text)


def text_cell(text: str) -> str:
    """Untrusted text (a prompt, a line) for rich output: control characters escaped, markup shown as it is."""
    from rich.markup import escape

    return escape(visible(text))


def compact_table(title: str, *columns: tuple[str, str]):
    """A rich table with no outer edge and collapsed padding, titled on the left, with these
    (name, justify) columns that never wrap: the narrow form `diff` and `attribute` print."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
              collapse_padding=True)
    for name, justify in columns:
        t.add_column(name, justify=justify, no_wrap=True)
    return t
