"""Tables that fit the terminal: wrap cells at their spaces, then leave columns out in a stated order.

A table wider than the console is laid out here before rich draws it:
1. a column of figures (right-justified) keeps its width, header included; a text column narrows,
   the widest first: its text wraps at its spaces, and (left-justified) a word wider than FOLD folds
   onto the next line, every character kept;
2. while even that is too wide, the columns the renderer named with `drop_order(table, ...)` are left
   out, in that order, and `fit` returns their headers so the caller can say so under the table;
3. a table that still cannot fit (no order given, or every named column gone) is drawn at its own
   width, as before: the terminal wraps its lines, and nothing is cut.
"""

from __future__ import annotations

import copy
import dataclasses

from rich.measure import Measurement
from rich.table import Table

FOLD = 16  # a text column narrows to this even when a word (a long token) is wider: the word folds onto
# the next line, every character kept


def drop_order(table: Table, *headers: str) -> Table:
    """Name the columns (by header) that may be left out when the table cannot fit, first to go first."""
    table.lmhead_drop_order = headers
    return table


def _floor_and_widths(console, table: Table) -> tuple[int, list[int], list[int]]:
    """The narrowest the table can be without cutting a word, and each column's (min, max) widths,
    padding included."""
    options = console.options.update_width(1 << 16)
    ranges = [table._measure_column(console, options, c) for c in table.columns]
    maxs = [max(r.maximum, r.minimum) for r in ranges]
    mins = [most if c.justify == "right" else min(r.minimum, FOLD + table._get_padding_width(c._index))
            if c.justify == "left" else r.minimum for r, c, most in zip(ranges, table.columns, maxs)]
    return sum(mins) + table._extra_width, mins, maxs


def _leave_out(table: Table, header: str) -> bool:
    for i, column in enumerate(table.columns):
        if str(column.header) == header:
            del table.columns[i]
            _reindex(table)
            return True
    return False


def _reindex(table: Table) -> None:
    for n, c in enumerate(table.columns):  # rich pads the first and last column by their index
        c._index = n


def fit(console, table: Table, width: int) -> tuple[Table, list[str]] | None:
    """`table` laid out within `width` columns (see the module's docstring), as a copy (the caller's
    table is left as it is), with the headers of the columns left out ([] when none); None when it
    cannot fit and is to be drawn whole at its own width."""
    table = copy.copy(table)
    table.columns = [dataclasses.replace(c) for c in table.columns]  # the cells are shared, never changed
    dropped: list[str] = []
    order = list(getattr(table, "lmhead_drop_order", ()))
    floor, mins, maxs = _floor_and_widths(console, table)
    while floor > width and order:
        header = order.pop(0)
        if _leave_out(table, header):
            dropped.append(header)
            floor, mins, maxs = _floor_and_widths(console, table)
    if floor > width:
        return None
    widths = list(maxs)
    excess = sum(widths) + table._extra_width - width
    while excess > 0:  # narrow the widest column that can still narrow, one cell at a time
        i = max((i for i in range(len(widths)) if widths[i] > mins[i]), key=lambda i: widths[i])
        widths[i] -= 1
        excess -= 1
    for column, w, most in zip(table.columns, widths, maxs):
        column.max_width = w - table._get_padding_width(column._index)
        if w < most:  # it narrows: its text wraps at its spaces, a word wider than w folds (nothing is cut)
            column.no_wrap, column.overflow = False, "fold"
    return table, dropped


def needs(console, renderable) -> int:
    """How wide `renderable` is when nothing limits it."""
    return Measurement.get(console, console.options.update_width(1 << 16), renderable).maximum
