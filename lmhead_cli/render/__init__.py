"""Output: rich tables for people, JSON for programs. Nothing here computes a figure.

Consoles are made per call (not at import) so they write to whatever sys.stdout is
at that moment: a terminal, a pipe, or Typer's CliRunner in tests.

Data (prompts, tokens, targets, file lines, paths, generated text) is untrusted for the terminal.
It reaches human output only through `safe_text` (lmhead_cli/safe_text.py: control characters such
as ESC, BEL, CR, DEL and the C1 range made visible as \\x1b, ...) and, inside rich output, only as
`Text` objects (`data`, `token_cell`, `compose`), so markup in data is never parsed. JSON stays exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmhead_cli.render import fit
from lmhead_cli.render.big_table import BigTable, as_big_table
from lmhead_cli.safe_text import quoted, safe_text  # noqa: F401 - the renderers' names for them

BAR_WIDTH = 16
SPARK = "▁▂▃▄▅▆▇█"


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich would exit 1 here; the CLI's one boundary ends a closed pipe (`| head`) quietly with 0.
        self.quiet = True
        raise BrokenPipeError

    def print(self, *objects, **kwargs) -> None:
        """A table wider than the console is fitted to it (render.fit): its cells wrap at their spaces,
        then the columns its renderer named leave, in that order, and a line under it says which. rich
        would instead cut cells with "…", figures included (38,597… at COLUMNS=60): a table that cannot
        fit is printed at its own width, and the terminal wraps the lines. Nothing is ever cut. A table
        of thousands of rows is drawn line by line (render.big_table: the same lines, in seconds where
        rich took a minute)."""
        left_out: list[str] = []
        need = 0
        drawn = []
        for o in objects:
            if isinstance(o, Table):  # (print's own settings, markup=False or a style, change what rich draws)
                big = None if kwargs else as_big_table(self, o)
                if big is not None and big.width <= self.width:
                    o = big
                elif (big.width if big is not None else fit.needs(self, o)) > self.width:
                    fitted = fit.fit(self, o, self.width)  # rich lays it out, its cells wrapped
                    if fitted is None:  # it cannot fit: drawn whole at its own width
                        o = big or o
                        need = max(need, fit.needs(self, o) if isinstance(o, Table) else 0)
                    else:
                        o, dropped = fitted
                        left_out += dropped
                else:
                    o = big or o
            need = max(need, o.width) if isinstance(o, BigTable) else need
            drawn.append(o)
        objects = tuple(drawn)
        if objects and all(isinstance(o, BigTable) for o in objects):
            kwargs["crop"] = False  # its lines are as wide as it is: cropping measured each of them again
        if need <= self.width:
            super().print(*objects, **kwargs)
        else:
            width, self.width = self.width, need
            try:
                super().print(*objects, **kwargs)
            finally:
                self.width = width
        if left_out:
            super().print(Text(f"at {self.width} columns, left out: {', '.join(left_out)}", style="dim"))


def out() -> Console:
    """Console on stdout (tables, text)."""
    return _Console(file=sys.stdout, highlight=False, soft_wrap=False)


def err() -> Console:
    """Console on stderr (warnings, notices, progress)."""
    return _Console(file=sys.stderr, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """A warning on stderr; `message` is plain text (it may hold data), shown terminal-safe."""
    err().print(compose("[yellow]warning:[/] ", data(message)))


def notice(message: str) -> None:
    """A dim notice on stderr; `message` is plain text, shown terminal-safe."""
    err().print(data(message, "dim"))


# ---- terminal-safe text: lmhead_cli/safe_text.py (safe_text, quoted), shown here as rich objects ----


def data(text: str, style: str = "") -> Text:
    """Data for rich output: terminal-safe and never parsed as markup."""
    return Text(safe_text(text), style=style)


def compose(*parts: str | Text) -> Text:
    """One line from constant markup (str, parsed) and data (Text, as it is)."""
    return Text.assemble(*(p if isinstance(p, Text) else Text.from_markup(p) for p in parts))


PROMPT_ROWS = 24  # prompt tokens shown at most: the first and the last halves, and a count between


def elided(items: list, keep: int = PROMPT_ROWS) -> tuple[list, int, list]:
    """(first, how many are left out, last) of a long list, so a 1,024-token prompt shows 24 rows."""
    if len(items) <= keep:
        return list(items), 0, []
    half = keep // 2
    return list(items[:half]), len(items) - 2 * half, list(items[-half:])


def short_cell(text: str, width: int) -> str:
    """Terminal-safe `text` cut to `width` terminal cells, with … when cut."""
    shown = safe_text(text)
    if cell_len(shown) <= width:
        return shown
    from rich.cells import set_cell_size

    return set_cell_size(shown, width - 1) + "…"


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
            pieces = ", ".join(map(quoted, t.pieces))
            notice(f"target {quoted(t.token)} is {len(t.pieces)} tokens ({pieces}); using the first, "
                   f"{quoted(t.pieces[0])}")


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


def provenance_json(src, *more: str) -> dict:
    """The header of every --json document that says where its figures came from: `model` and
    `random_weights`, then the fields `more` names (engine, device, dtype), read off `src` (an
    api.results.Provenance, or a reading that carries the same fields)."""
    return {"model": src.model, "random_weights": src.random_weights, **{k: getattr(src, k) for k in more}}


# What json.dumps leaves raw that a terminal showing the JSON would obey or choke on: DEL and the C1
# controls (U+009B is CSI), lone surrogates (undecodable bytes), U+2028/U+2029 (line breaks to JavaScript).
_JSON_RAW = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def dumps(value: Any, **kwargs) -> str:
    """The one JSON writer: json.dumps (non-ASCII kept as UTF-8), with C0 controls escaped by json and
    DEL, C1 controls, lone surrogates and U+2028/9 escaped here as \\uXXXX. They can only occur inside
    strings, and json.loads gives back the exact string."""
    text = json.dumps(value, ensure_ascii=False, **kwargs)
    return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def json_text(doc: Any, *, lines: bool = False, ascii: bool = False) -> str:  # noqa: A002
    """A document as JSON text: indented, or on one compact line with ``lines``; infinities made finite;
    controls escaped (`dumps`); non-ASCII as \\u escapes with ``ascii``."""
    if ascii:
        return json.dumps(_plain(doc), ensure_ascii=True, separators=(",", ":") if lines else None,
                          indent=None if lines else 2)
    return dumps(_plain(doc), separators=(",", ":") if lines else None, indent=None if lines else 2)


def print_json(doc: Any, *, lines: bool = False) -> None:
    """One JSON document on stdout (or one line per document with ``lines``), no colour."""
    # Exact either way: a stdout that cannot encode UTF-8 gets JSON's own \\u escapes instead.
    utf8 = "utf" in (getattr(sys.stdout, "encoding", None) or "utf-8").lower()
    sys.stdout.write(json_text(doc, lines=lines, ascii=not utf8) + "\n")
    sys.stdout.flush()


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar for a fraction in [0, 1], in eighths of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    return "█" * full + ("▏▎▍▌▋▊▉"[rest - 1] if rest else "")


def sparkline(values: list[float], resolution: float = 0.0) -> str:
    """One character per value, scaled between the values' min and max over a span of at least
    `resolution` (the caption's last printed digit): a range the caption prints as one number (10.67–10.67)
    draws flat, not as full-height bars for differences in digits nobody sees."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = max(hi - lo, resolution)
    return "".join(SPARK[0 if span == 0 else min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def plural(n: int, word: str) -> str:
    """"1 token", "2 tokens", "1,024 tokens": a count and its noun, in agreement."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def knobs_text(knobs, sep: str = " → ") -> str:
    """The stages that are on, in order, for people: "softcap 30 → temperature 0.8" ("" if none)."""
    return sep.join(f"{key.replace('_', '-')} {value:g}" for key, value in knobs.active().items())


def token_cell(text: str, style: str = "") -> Text:
    """A token for rich output: visible spaces and controls, and markup-like text such as '[/' as it is."""
    return Text(show_token(text), style=style)


def show_token(text: str) -> str:
    """A token's text made visible: a leading space as '␣', control characters escaped."""
    shown = safe_text(text)
    if shown.startswith(" "):
        shown = "␣" + shown[1:]
    return shown


def text_cell(text: str) -> Text:
    """Untrusted text (a prompt, a line) for rich output: `data`, terminal-safe and never parsed."""
    return data(text)


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
