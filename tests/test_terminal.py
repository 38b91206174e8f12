"""Terminal safety: no control byte or markup from a prompt, a file, a path, a token or generated text reaches
the terminal, tables stay readable at any width, and JSON stays exact."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers import control_byte_checkpoint, invoke

HOSTILE = "\x1b]0;HACKED\x07\x1b[2J[bold]hi[/] \x9b31m\x7f"  # title, clear screen, markup, C1 CSI, DEL


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """A GPT-2 checkpoint whose every prediction is a control byte (helpers.control_byte_checkpoint):
    the top tokens, the lens and every generated token are ESC or BEL."""
    return control_byte_checkpoint(tmp_path_factory.mktemp("hostile"))


def control_bytes(text: str) -> list[str]:
    """The bytes below 0x20 (but newline and tab), DEL and C1 controls in `text`."""
    return [repr(c) for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]


TERMINAL_CASES = {
    "inspect": ["inspect", HOSTILE, "-t", HOSTILE, "-t", "\x1b", "-k", "3"],
    "inspect --stages": ["inspect", HOSTILE, "--stages", "--temperature", "0.5", "-k", "3"],
    "inspect --explain": ["inspect", HOSTILE, "--explain", "\x1b", "-k", "3"],
    "lens": ["lens", HOSTILE, "-t", HOSTILE],
    "lens --heat": ["lens", HOSTILE, "--heat", "-k", "2", "-t", "[/]"],
    "greedy --show-steps": ["greedy", HOSTILE, "-n", "4", "--show-steps", "2"],
    "sample": ["sample", HOSTILE, "-n", "4", "--seed", "1"],
    "beams": ["generate", HOSTILE, "-n", "3", "--beams", "2"],
    "softcap": ["softcap", HOSTILE, "-n", "3", "--seed", "1"],
}


@pytest.mark.parametrize("case", list(TERMINAL_CASES))
def test_no_control_byte_from_data_reaches_stdout(hostile_model, case):
    got = invoke([*TERMINAL_CASES[case], "--model", hostile_model])
    assert got.exit_code == 0, got.output
    assert control_bytes(got.stdout) == [], got.stdout
    assert control_bytes(got.stderr) == [], got.stderr
    assert "\\x1b" in got.stdout  # shown, escaped


def test_no_control_byte_in_files_explore_and_paths(hostile_model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{HOSTILE}\n\x1b[2Jhi\n", encoding="utf-8")
    got = invoke(["inspect", "--file", str(prompts), "-t", HOSTILE, "--model", hostile_model])
    assert got.exit_code == 0 and control_bytes(got.stdout + got.stderr) == [], got.output
    got = invoke(["explore", "--model", hostile_model, "-t", "\x1b"],
                 input=f"{HOSTILE}\n:target {HOSTILE}\n:gen 3\n:lens\n:\x1b[2J\n")
    assert got.exit_code == 0 and control_bytes(got.stdout + got.stderr) == [], got.output
    odd = tmp_path / "br[" / "]k [bold]x \x1b[2J"  # a path with markup and ESC: shown as it is, escaped
    odd.parent.mkdir()
    os.symlink(hostile_model, odd)
    got = invoke(["tie", "--model", str(odd)], env={"COLUMNS": "200"})  # (the path's cell unwrapped)
    assert got.exit_code == 0 and "[bold]x \\x1b[2J" in got.stdout and control_bytes(got.stdout) == []
    got = invoke(["inspect", "x", "--model", str(tmp_path / "gone \x1b[2J")])
    assert got.exit_code == 2 and "gone \\x1b[2J" in got.stderr and control_bytes(got.stderr) == []


def test_json_stays_exact(hostile_model):
    got = invoke(["inspect", HOSTILE, "-t", HOSTILE, "--model", hostile_model, "--json"])
    doc = json.loads(got.stdout)
    assert doc["top"][0]["token"] == "\x1b" and doc["top"][1]["token"] == "\x07"
    assert doc["targets"][0]["token"] == HOSTILE
    got = invoke(["greedy", HOSTILE, "-n", "2", "--model", hostile_model, "--json"])
    assert json.loads(got.stdout)["text"] == "\x1b\x1b"


def test_markup_in_data_is_shown_as_it_is(tiny):
    for args in (["inspect", "[bold]x[/]", "-t", "[/]", "-t", "[", "-t", "b]"],
                 ["greedy", "[/]", "-n", "3", "--show-steps", "3"],
                 ["inspect", "--explain", "[/]", "[x]"]):
        got = invoke([*args, "--model", str(tiny[0])])
        assert got.exit_code == 0, got.output
    got = invoke(["inspect", "[bold]x[/]", "--explain", "[/]", "--model", str(tiny[0])])
    heading = " ".join(got.stdout.split("\n\n")[0].split())  # wrapped as the terminal's width says
    assert heading.startswith('one logit taken apart: [/ (id 13412) after "[bold]x[/]"')


def test_multi_token_target_notice_is_escaped_once(tiny):
    got = invoke(["inspect", "x", "-t", "日本", "--model", str(tiny[0])])
    assert "target '日本' is 4 tokens ('\\xe6\\x97', '\\xa5', " in got.stderr.replace("\n", " ")


def test_a_long_prompt_shows_a_bounded_number_of_rows(tiny):
    prompt = "The keys on the table " * 240  # 1,200 tokens, longer than... the tiny model's 1,024
    got = invoke(["inspect", prompt, "--model", str(tiny[0]), "-k", "1"])
    rows = [line for line in got.stdout.splitlines().__iter__() if "│" in line]
    assert got.exit_code == 0 and "1,000 more tokens (--json lists them all)" in got.stdout
    assert len(rows) < 40  # 24 prompt tokens, the top token, no 1,024 rows
    assert "keeping the last 1024" in got.stderr.replace("\n", " ") or "1024" in got.stderr


def test_a_narrow_terminal_never_cuts_figures(tiny, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    got = invoke(["params"])
    assert "38,597,376" in got.stdout and "124,439,808" in got.stdout and "7,087,872" in got.stdout
    doc = json.loads(invoke(["inspect", "The keys", "--model", str(tiny[0]), "-k", "3", "--json"]).stdout)
    table = invoke(["inspect", "The keys", "--model", str(tiny[0]), "-k", "3"]).stdout
    for t in doc["top"]:
        assert f"{t['logit']:.4f}" in table and f"{t['prob']:.4%}" in table and f"{t['logprob']:.4f}" in table
    steps = invoke(["greedy", "The keys", "-n", "2", "--show-steps", "3", "--model", str(tiny[0])]).stdout
    assert not any("…" in line for line in steps.splitlines() if "│" in line)


C1 = "a\x9b31m b\x85c\x7fd\x80"


def _no_raw_c1(text: str) -> None:
    assert not any("\x7f" <= c <= "\x9f" for c in text), [c for c in text if "\x7f" <= c <= "\x9f"]


@pytest.mark.parametrize("args, get", [
    (["score", C1, "--json"], lambda d: d["text"]),
    (["inspect", "x", "-t", C1, "--json", "-k", "1"], lambda d: d["targets"][0]["token"]),
    (["diff", C1, C1 + "x", "--json"], lambda d: d["a"]["prompt"] if "a" in d else d["prompts"][0]),
    (["greedy", C1, "-n", "1", "--json"], lambda d: d["prompt"]),
])
def test_json_escapes_c1_controls_and_del_and_stays_exact(args, get):
    got = invoke([*args, "--model", "random:distilgpt2"])
    assert got.exit_code == 0, got.output
    _no_raw_c1(got.stdout)
    assert "\\u009b" in got.stdout and "\\u007f" in got.stdout
    assert get(json.loads(got.stdout)) == C1


def test_openai_format_escapes_c1_controls():
    got = invoke(["score", C1, "--format", "openai", "--model", "random:distilgpt2"])
    assert got.exit_code == 0, got.output
    _no_raw_c1(got.stdout)
    json.loads(got.stdout)


def test_the_json_writer_escapes_every_c0_c1_and_del_and_round_trips():
    from lmhead_cli.render import json_text

    s = "".join(map(chr, range(0, 0xA0))) + "é☕"
    text = json_text({"s": s}, lines=True)
    assert all(c >= " " and not ("\x7f" <= c <= "\x9f") for c in text)
    assert json.loads(text)["s"] == s


# ---- tables of thousands of rows: render.big_table draws them line by line, as rich would --------------

# Token cells that are hard to lay out: double-width (one GPT-2 token, 15 cells), a leading space shown
# as ␣, an escaped ESC, markup-like text, combining accents and zero-width joiners (fewer cells than
# characters), a variation selector (more), trailing spaces, nothing; and a right-justified figure with
# trailing spaces.
ODD_TOKENS = [" サーティワン", "␣the", "\\x1b[2J", "[/", "[bold]x[/]", "e\u0301\u0301 ", "a\u200d ", "x  ", "",
              "☕:smile:", "❤\ufe0f", "👩\u200d💻"]


def _odd_rows(add_row, n: int = 40, style: str = "bold") -> None:
    """n rows of explore's shape (rank, id, token Text, figures, a markup bar) with ODD_TOKENS among them,
    the last three in `style` (explore's targets)."""
    from lmhead_cli.render import bar, token_cell

    for i in range(n):
        token = token_cell(ODD_TOKENS[i % len(ODD_TOKENS)] if i % 4 != 3 else f" tok{i}")
        figure = f"{-i / 7:.4f}" + ("  " if i == 5 else "")
        add_row(f"{i + 1:,}", str(i * 997), token, figure, f"{0.9 ** i:.4%}", f"[cyan]{bar(0.9 ** i)}[/]",
                style=style if i >= n - 3 else None)


def _big_tables():
    """The shapes lmhead prints (explore's reading, inspect's top and prompt tables, compact_table,
    lens's boxless tables, tie's headerless table) and a few it does not (edges, centred, a caption,
    row and border styles)."""
    from rich import box
    from rich.table import Table

    from lmhead_cli.render import compact_table, compose, token_cell

    def filled(table, justify=("right", "right", "left", "right", "right", "left"), style="bold", **column):
        for name, j in zip(("rank", "id", "token", "logit", "prob", ""), justify):
            table.add_column(name, justify=j, **column)
        _odd_rows(table.add_row, 30, style)
        table.add_section()
        _odd_rows(table.add_row, 8, style)
        return table

    yield "explore", filled(Table(show_edge=False, pad_edge=False), no_wrap=True)
    yield "inspect", filled(Table(title="next token: top 38 of 50,257", title_justify="left", show_edge=False))
    prompt = Table(title="prompt tokens", title_justify="left", show_edge=False)
    prompt.add_column("#", justify="right", style="dim")
    prompt.add_column(compose(token_cell("[/"), " rank"), justify="right")  # a header with markup-like data
    prompt.add_column("token")
    for i, t in enumerate(ODD_TOKENS * 3):
        prompt.add_row(str(i), str(i * 31), token_cell(t))
    prompt.add_row("…", "", "[dim]1,000 more tokens (--json lists them all)[/]")
    yield "prompt tokens", prompt
    compact = compact_table("each side's top 38", ("rank", "right"), ("A token", "left"), ("prob A", "right"),
                            ("│", "center"), ("B token", "left"), ("prob B", "right"))
    _odd_rows(lambda rank, i, tok, logit, prob, bar, style: compact.add_row(rank, tok, prob, "│", tok, logit), 38)
    yield "compact", compact
    yield "boxless", filled(Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1)), no_wrap=True)
    headless = Table(show_header=False, show_edge=False)
    headless.add_column(style="bold")
    headless.add_column(overflow="fold")
    for t in ODD_TOKENS * 2:
        headless.add_row(compose("stored ", token_cell(t), " equals"), "yes :thumbs_up: [bold]yes[/]")
    yield "headless", headless
    every_part = box.Box("╭─┬╮\n┃ ┆┃\n┡━╇┩\n│ ││\n├─┼┤\n╞═╪╡\n╏ ╎╏\n╰─┴╯\n")  # each row kind its own
    yield "edges", filled(Table(box=every_part, caption="a caption", title="centred [b]title[/]"),
                          justify=("center", "right", "center", "left", "center", "right"))
    styled = Table(style="italic", border_style="red", header_style="bold magenta", box=box.SIMPLE,
                   padding=(0, 2, 0, 1), collapse_padding=True)
    yield "styled", filled(styled, style="bold on dark_red", no_wrap=True)


BIG_TABLES = dict(_big_tables())


def _printed(monkeypatch, table, *, colour: bool, fast: bool, width: int = 80) -> str:
    """What lmhead's console prints for `table`, colour on (a terminal) or off: drawn by render.big_table
    (`fast`, whatever its size) or by rich."""
    import io

    from lmhead_cli import render
    from lmhead_cli.render import big_table

    monkeypatch.setattr(big_table, "ROWS", 0 if fast else 1 << 30)
    file = io.StringIO()
    con = render._Console(file=file, width=width, force_terminal=colour, color_system="truecolor" if colour else None,
                          highlight=False, soft_wrap=False)
    con.print(table)
    return file.getvalue()


def _spy(monkeypatch) -> list:
    """The tables lmhead's console draws line by line from now on (a BigTable, or None for rich), in order."""
    from lmhead_cli import render
    from lmhead_cli.render.big_table import as_big_table

    drawn = []
    monkeypatch.setattr(render, "as_big_table", lambda con, t: drawn.append(as_big_table(con, t)) or drawn[-1])
    return drawn


@pytest.mark.parametrize("colour", [False, True], ids=["plain", "colour"])
@pytest.mark.parametrize("shape", list(BIG_TABLES))
def test_a_big_table_is_drawn_as_rich_draws_it(shape, colour, monkeypatch):
    table, drawn = BIG_TABLES[shape], _spy(monkeypatch)
    by_rich = _printed(monkeypatch, table, colour=colour, fast=False)
    assert _printed(monkeypatch, table, colour=colour, fast=True) == by_rich
    assert drawn[0] is None and drawn[1] is not None and ("\x1b[" in by_rich) == colour
    from rich.cells import cell_len
    from rich.text import Text

    narrow = _printed(monkeypatch, table, colour=colour, fast=True, width=30)  # fitted by rich, or whole
    assert narrow == by_rich or max(cell_len(Text.from_ansi(line).plain) for line in narrow.splitlines()) <= 30
    assert _printed(monkeypatch, table, colour=colour, fast=True) == by_rich  # fitting left the table as it was


BIG_TABLE_RUNS = {  # lmhead's own tables through the CLI; explore with targets (a bold section) and a stage
    "explore": (["explore", "-t", "\x1b", "-t", " サーティワン", "-t", "[/", "--temperature", "0.8", "-k", "40"],
                "The keys\n"),
    "inspect": (["inspect", "ドラゴン [b]The\x1b keys", "-k", "40", "-t", " サーティワン", "-t", "\x1b"], None),
    "inspect --stages": (["inspect", "The keys", "--stages", "--temperature", "0.5", "-k", "30"], None),
    "diff": (["diff", "The keys", "The \x1b サーティワン", "-k", "30"], None),
}


@pytest.mark.parametrize("colour", [False, True], ids=["plain", "colour"])
@pytest.mark.parametrize("case", list(BIG_TABLE_RUNS))
def test_commands_print_the_same_whoever_draws_their_tables(tiny, monkeypatch, case, colour):
    from lmhead_cli.render import big_table

    if colour:
        monkeypatch.setenv("FORCE_COLOR", "1")
    args, script = BIG_TABLE_RUNS[case]
    monkeypatch.setattr(big_table, "ROWS", 1 << 30)
    by_rich = invoke([*args, "--model", str(tiny[0])], input=script)
    monkeypatch.setattr(big_table, "ROWS", 0)
    drawn = _spy(monkeypatch)
    by_lines = invoke([*args, "--model", str(tiny[0])], input=script)
    assert by_rich.exit_code == by_lines.exit_code == 0, by_rich.output
    assert drawn and all(drawn)  # every table of these commands has a shape drawn line by line
    timing = re.compile(r"; \d+ ms\)")  # explore's one figure that changes from run to run
    assert timing.sub("", by_lines.stdout) == timing.sub("", by_rich.stdout)
    assert ("\x1b[" in by_lines.stdout) == colour


WIDE_OUTPUTS = [  # the commands whose tables and captions overflowed 80 columns (issue 51), and their kin
    ["score", "The keys on the table are here.", "--table", "--model", "{tiny}"],
    ["lens", "The keys on the table", "--tuned", "bundled", "--model", "bundled:tiny"],
    ["lens", "The keys on the table", "--target", " are", "--model", "{tiny}"],
    ["neurons", "--layer", "1", "--model", "bundled:tiny"],
    ["neurons", "The keys on the table", "--layer", "1", "--target", " are", "--model", "{tiny}"],
    ["generate", "The keys on the table", "--beams", "4", "-n", "5", "--model", "{tiny}"],
    ["generate", "The keys on the table", "-n", "3", "--seed", "1", "--show-steps", "3", "--model", "{tiny}"],
    ["inspect", "The keys on the table", "--explain", "1", "--model", "{tiny}"],
    ["inspect", "The keys on the table", "--stages", "--top-p", "0.9", "--model", "{tiny}"],
    ["calibrate", "The keys on the table are on the table.", "--model", "{tiny}"],
]


@pytest.mark.parametrize("args", WIDE_OUTPUTS, ids=lambda a: " ".join(w for w in a[:4] if w.startswith("-") or
                                                                        w == a[0]))
@pytest.mark.slow
def test_at_80_columns_every_line_fits(tiny, monkeypatch, args):
    """At COLUMNS=80 no line of stdout is wider than 80 cells: tables wrap their text cells and leave
    columns out in their stated order (saying which), captions wrap at words, and no figure is cut."""
    from rich.cells import cell_len

    monkeypatch.setenv("COLUMNS", "80")
    got = invoke([a.format(tiny=tiny[0]) for a in args])
    assert got.exit_code == 0, got.output
    wide = [line for line in got.stdout.splitlines() if cell_len(line) > 80]
    assert not wide, wide
    assert not any("…" in line for line in got.stdout.splitlines() if "│" in line)


def test_a_table_leaves_columns_out_in_its_stated_order_and_says_so(tiny, monkeypatch):
    """score's token table at 80 columns: bits, varentropy and margin leave (in that order) and a line
    says so; at 200 columns every column is there and no such line."""
    from lmhead_cli.render.score import DROP_ORDER

    args = ["score", "The keys on the table are here.", "--table", "--model", str(tiny[0])]
    monkeypatch.setenv("COLUMNS", "200")
    wide = invoke(args).stdout
    assert "varentropy" in wide and "left out" not in wide
    monkeypatch.setenv("COLUMNS", "80")
    narrow = invoke(args).stdout
    said = [line for line in narrow.splitlines() if line.startswith("at 80 columns, left out: ")]
    assert said, narrow
    gone = said[0].removeprefix("at 80 columns, left out: ").split(", ")
    assert gone == list(DROP_ORDER[:len(gone)]) and "varentropy" not in narrow.split("left out")[0]
