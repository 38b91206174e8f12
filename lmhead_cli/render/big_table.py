"""A table of thousands of rows (explore's `:top-k 100000`, `inspect -k 50257`), drawn line by line.

rich lays a Table out cell by cell, each cell measured, then wrapped, justified and padded through
several renderables: tens of seconds for GPT-2's whole vocabulary (50,257 rows). `BigTable` draws the
same table as Table._render does, segment for segment (widths, padding, box characters, justification,
header, sections, title, caption, and the styles, so the same escape codes), for what lmhead prints:
str and Text cells of one line each, in columns as wide as their widest cell (lmhead never cuts a cell:
`_Console.print` widens the console instead). A plain cell is justified here; a cell with markup or
styles of its own is wrapped and rendered by rich's Text (once for each distinct str cell, such as a
bar). Any other table, or a cell that is neither str nor Text or holds a line break, is left to rich.
"""

from __future__ import annotations

import re

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import DEFAULT_OVERFLOW, Text

ROWS = 2_000  # a table with more rows than this is drawn here

# What makes a cell more than one line to rich (Text splits on "\n", measures with str.splitlines,
# expands tabs).
_BREAKS = re.compile("[\n\r\t\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")
# Text with one of these is not as wide as its characters together (rich's cell_len joins them to a
# neighbour, a padding space included): rich pads it again after justifying it, so rich renders it.
_JOINERS = re.compile("[\u200d\ufe0f]")


def as_big_table(console, table: Table) -> BigTable | None:
    """`table` as a BigTable when it has more than ROWS rows and a shape drawn here; None otherwise."""
    if len(table.rows) <= ROWS or not _supported(table):
        return None
    big = BigTable(console, table)
    return big if big.widths else None


def _supported(t: Table) -> bool:
    """Tables sized to their content, one line a row, no footer: the ones lmhead prints."""
    top, _, bottom, _ = t.padding
    return bool(t.columns) and not (t.expand or t.width is not None or t.min_width is not None or t.show_footer
                                    or t.show_lines or t.leading or t.row_styles or top or bottom) and all(
        c.width is None and c.min_width is None and c.max_width is None and not c.highlight
        and c.justify in ("left", "center", "right") and c.overflow != "ignore" for c in t.columns)


class BigTable:
    """A rich Table drawn line by line, as rich draws it when the console is at least `width` wide."""

    def __init__(self, console, table: Table):
        self.table = table
        self.widths: list[int] = []  # each column's width, padding included; [] when rich must draw it
        self.cells: list[list[tuple]] = []  # per column, header first: (plain text or None, cell, cells wide)
        self.pads = [self._pads(i) for i in range(len(table.columns))]  # (left, right) padding of each column
        self.markup: dict[str, Text] = {}  # str cell with markup -> the Text rich makes of it
        markup = self.markup
        columns, widths = [], []
        for column, (left, right) in zip(table.columns, self.pads):
            cells, plains = [], []
            for cell in ([column.header] if table.show_header else []) + list(column.cells):
                if isinstance(cell, str):
                    simple = "[" not in cell and ":" not in cell  # no markup, no :emoji:: rich makes Text(cell)
                    if not simple and cell not in markup:
                        markup[cell] = console.render_str(cell, highlight=False)
                    plain = cell if simple else markup[cell].plain
                elif isinstance(cell, Text) and cell.justify in (None, "left", "center", "right"):
                    simple = not (cell.spans or cell.style or cell.justify)
                    plain = cell.plain
                else:
                    return
                simple = simple and not _JOINERS.search(plain)
                plains.append(plain)
                cells.append((plain if simple else None, cell, _cell_len(plain)))
            if len(cells) != len(table.rows) + table.show_header or _BREAKS.search("".join(plains)):
                return  # (a column added after some rows is short, and rich drops rows: rich draws it)
            columns.append(cells)
            widths.append(max(n for _, _, n in cells) + left + right)
        if all(widths):  # (a column of nothing: rich's measure and its layout disagree, so rich decides)
            self.cells, self.widths = columns, widths

    def _pads(self, i: int) -> tuple[int, int]:
        """(left, right) padding of column i, as Table._get_cells works it out."""
        t = self.table
        _, right, _, left = t.padding
        if t.collapse_padding and i:
            left = max(0, left - right)
        if not t.pad_edge:
            left = 0 if i == 0 else left
            right = 0 if i == len(t.columns) - 1 else right
        return left, right

    @property
    def width(self) -> int:
        """The table's width, edges and dividers included (Table.__rich_measure__'s maximum)."""
        t = self.table
        return sum(self.widths) + (len(t.columns) - 1 + 2 * t.show_edge if t.box else 0)

    def __rich_console__(self, console, options):
        t = self.table
        around = options.update(width=self.width, highlight=t.highlight, height=None)

        def annotation(text, style, default, justify):  # as Table.__rich_console__ renders title and caption
            shown = console.render_str(text, style=Style.pick_first(style, default), highlight=False) \
                if isinstance(text, str) else text
            return console.render(shown, around.update(justify=justify))

        if t.title:
            yield from annotation(t.title, t.title_style, "table.title", t.title_justify)
        yield from self._body(console, options)
        if t.caption:
            yield from annotation(t.caption, t.caption_style, "table.caption", t.caption_justify)

    def _body(self, console, options):
        t, get = self.table, console.get_style
        box = t.box.substitute(options, safe=console.safe_box if t.safe_box is None else t.safe_box) if t.box else None
        box = box.get_plain_headed_box() if box and not t.show_header else box
        border = get(t.style or "") + get(t.border_style or "")
        # each line's style: the header's is null, a row's its own (Table.get_row_style)
        row_styles = [Style.null()] * t.show_header + [get(t.get_row_style(console, r)) for r in range(len(t.rows))]
        header_styles = [get(t.header_style or "") + get(c.header_style) for c in t.columns]
        column_styles = [get(c.style or "") for c in t.columns]
        body_styles = {}  # a row's style -> its cells' styles

        def cell_styles(line: int) -> list[Style]:
            """The style of each cell of a line: the header's, or the column's and the row's."""
            if t.show_header and line == 0:
                return header_styles
            row_style = row_styles[line]
            if row_style not in body_styles:
                body_styles[row_style] = [style + row_style for style in column_styles]
            return body_styles[row_style]

        columns = [self._lines(console, i, cell_styles) for i in range(len(t.columns))]
        n = len(row_styles)
        if box and t.show_edge:
            yield Segment(box.get_top(self.widths), border)
            yield Segment.line()
        for line, row_style in enumerate(row_styles):
            if box:
                left, right, divider = ((box.head_left, box.head_right, box.head_vertical) if line == 0 else
                                        (box.foot_left, box.foot_right, box.foot_vertical) if line == n - 1 else
                                        (box.mid_left, box.mid_right, box.mid_vertical))
                # a divider that is a space takes the row's background, as in rich
                divider_style = border if divider.strip() else row_style.background_style + border
            pieces = [(left, border)] if box and t.show_edge else []
            for i, (cells, (pad_left, pad_right), style) in enumerate(zip(columns, self.pads, cell_styles(line))):
                if i and box:
                    pieces.append((divider, divider_style))
                cell = cells[line]
                if not isinstance(cell, str):
                    pieces += cell
                elif style:  # padding and text, each its own segment as in rich
                    pieces += [(" " * pad_left, style), (cell, style), (" " * pad_right, style)]
                else:
                    pieces.append((" " * pad_left + cell + " " * pad_right, None))
            if box and t.show_edge:
                pieces.append((right, border))
            yield from _segments(pieces)
            if box and t.show_header and line == 0:
                yield Segment(box.get_row(self.widths, "head", edge=t.show_edge), border)
                yield Segment.line()
            row = line - t.show_header
            if box and row >= 0 and t.rows[row].end_section and line < n - 1:
                yield Segment(box.get_row(self.widths, "row", edge=t.show_edge), border)
                yield Segment.line()
        if box and t.show_edge:
            yield Segment(box.get_bottom(self.widths), border)
            yield Segment.line()

    def _lines(self, console, i: int, cell_styles) -> list:
        """Column i's cells, header first, each as its line: a justified str without the padding, or
        the (text, style) pieces rich renders for it, padding included."""
        column, (left, right), width = self.table.columns[i], self.pads[i], self.widths[i]
        inner = width - left - right
        rendered = {}  # (str cell, style) -> its pieces: a bar repeats on thousands of rows
        lines = []
        for line, (plain, cell, n) in enumerate(self.cells[i]):
            if plain is not None and len(plain) <= inner:  # (a longer one has its end trimmed by rich's wrap)
                if column.justify == "left":
                    lines.append(plain + " " * (inner - n))
                    continue
                stripped = plain.rstrip()  # rich strips right-justified and centred lines
                space = inner - (n if len(stripped) == len(plain) else _cell_len(stripped))
                before = space if column.justify == "right" else space // 2
                lines.append(" " * before + stripped + " " * (space - before))
                continue
            style = cell_styles(line)[i]
            if isinstance(cell, Text):
                lines.append(self._render(console, i, inner, cell, style))
                continue
            if (cell, style) not in rendered:
                rendered[cell, style] = self._render(console, i, inner, cell, style)
            lines.append(rendered[cell, style])
        return lines

    def _render(self, console, i: int, inner: int, cell: str | Text, style: Style) -> list:
        """A cell of column i that is not one plain run (markup, a Text with spans or a style, a joiner, or
        text that rich's wrap trims): its (text, style) pieces, padding included, as Text.__rich_console__
        renders it and render_lines pads it in Table._render's Padding."""
        column, (left, right) = self.table.columns[i], self.pads[i]
        text = cell if isinstance(cell, Text) else self.markup[cell] if cell in self.markup else Text(cell)
        [line] = text.wrap(console, inner, justify=text.justify or column.justify,
                           overflow=text.overflow or column.overflow or DEFAULT_OVERFLOW,
                           no_wrap=column.no_wrap if text.no_wrap is None else text.no_wrap)
        segments = Segment.adjust_line_length(list(Text("\n").join([line]).render(console)), inner)
        return [(" " * left, style), *((s.text, style + s.style) for s in segments), (" " * right, style)]


def _cell_len(text: str) -> int:
    """rich's cell_len, without its cache for the common case: printable ASCII is one cell a character."""
    return len(text) if text.isascii() and text.isprintable() else cell_len(text)


def _segments(pieces):
    """One line's segments from its (text, style) pieces: unstyled pieces side by side joined into one
    segment (they print the same), each styled piece on its own as rich has it (it carries its codes)."""
    run = []
    for text, style in pieces:
        if not style:
            run.append(text)
        elif text:
            if run:
                yield Segment("".join(run))
                run = []
            yield Segment(text, style)
    run.append("\n")
    yield Segment("".join(run))
