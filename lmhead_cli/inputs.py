"""Text that comes from outside (arguments, stdin, files), checked before anything uses it.

Everything here is bounded: stdin is read up to a limit, and bytes that are not UTF-8 are a
UsageError naming where the first bad byte is, never a TypeError deep in a tokenizer.
"""

from __future__ import annotations

import sys

from lmhead_cli.errors import UsageError

MAX_STDIN_BYTES = 1 << 24  # a prompt piped to `generate -` (16 MiB); it is cut to the context anyway
MAX_LINE_BYTES = 1 << 20  # one prompt line of a file or of explore at most (1 MiB)


def decode_utf8(data: bytes, what: str, line: int | None = None, offset: int = 0,
                advice: str = "save it as UTF-8") -> str:
    """`data` as UTF-8, or a UsageError naming `what`, the first bad byte and its position (from 0)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        on = f" on line {line:,}," if line is not None else ""
        raise UsageError(f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x}{on} at byte {offset + e.start:,}); "
                         f"{advice}") from None


def check_text(value: str | None, what: str) -> str | None:
    """An argument as the shell gave it. Python decodes argv with surrogateescape, so a byte that is
    not UTF-8 arrives as a lone surrogate (U+DC80-U+DCFF): found here, it is a UsageError naming
    the byte and its position, instead of a TypeError later."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        decode_utf8(value.encode("utf-8", "surrogateescape"), what, advice="pass text in UTF-8")
    return value


def check_args(values: dict) -> None:
    """check_text on every string (or list of strings) among a command's parameters."""
    for name, value in values.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, str):
                check_text(v, "the prompt" if name == "prompt" else f"--{name.replace('_', '-')}")


def read_stdin(what: str = "stdin", limit: int | None = None) -> str:
    """All of stdin as text, at most `limit` bytes (MAX_STDIN_BYTES; a UsageError beyond, so /dev/zero
    ends at once)."""
    limit = limit or MAX_STDIN_BYTES
    if sys.stdin is None or getattr(sys.stdin, "closed", False):
        raise UsageError(f"{what}: stdin is closed; pipe the text in, or pass it as an argument")
    stream = getattr(sys.stdin, "buffer", None)
    data = stream.read(limit + 1) if stream is not None else sys.stdin.read(limit + 1).encode("utf-8", "surrogateescape")
    if len(data) > limit:
        raise UsageError(f"{what} is longer than {limit:,} bytes, the limit for one prompt (the model reads only "
                         "its last tokens anyway)")
    return decode_utf8(data, what)
