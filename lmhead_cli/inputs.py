"""Text that comes from outside (arguments, stdin, files), checked before anything uses it.

Everything here is bounded: stdin is read up to a limit, and bytes that are not UTF-8 are a
UsageError naming where the first bad byte is, never a TypeError deep in a tokenizer.
"""

from __future__ import annotations

import re
import sys

from lmhead_cli.errors import LmheadError, UsageError

MAX_STDIN_BYTES = 1 << 24  # a prompt piped to `generate -` (16 MiB); it is cut to the context anyway
MAX_LINE_BYTES = 1 << 20  # one prompt line of a file or of explore at most (1 MiB)


def check_working_directory() -> None:
    """LmheadError when this process's working directory has been deleted: relative paths mean nothing
    there, and torch's import dies in it ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so", with
    no word of why), so this runs before torch is imported (the CLI's start, load())."""
    import os

    try:
        os.getcwd()
    except FileNotFoundError:
        raise LmheadError("the working directory no longer exists (it was deleted); cd to a folder that exists "
                          "and run the command again") from None


def special_kind(mode: int) -> str | None:
    """What a stat() mode is when it is neither a regular file nor a folder ("a FIFO (named pipe)", "a
    device", "a socket"), or None: a FIFO, a device or a socket is never opened by lmhead, since opening a
    FIFO waits for the other end (for ever, when there is none)."""
    import stat

    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a special file")


def decode_utf8(data: bytes, what: str, line: int | None = None, offset: int = 0,
                advice: str = "save it as UTF-8") -> str:
    """`data` as UTF-8, or a UsageError naming `what`, the first bad byte and its position (from 0)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        on = f" on line {line:,}," if line is not None else ""
        raise UsageError(f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x}{on} at byte {offset + e.start:,}); "
                         f"{advice}") from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Where the first lone surrogate (U+D800-U+DFFF) in `text` is, or None: a str Python allows but that
    no UTF-8 text holds, so no tokenizer takes it. One pass, no copy (an ASCII text is not searched)."""
    found = None if text.isascii() else _SURROGATE.search(text)
    return None if found is None else found.start()


def surrogate_problem(text: str) -> str | None:
    """What is wrong with a text that holds a lone surrogate, in words ("must be valid Unicode text: ..."),
    or None when it holds none."""
    at = lone_surrogate(text)
    if at is None:
        return None
    return (f"must be valid Unicode text: character {at:,} is a lone surrogate (U+{ord(text[at]):04X}), which no "
            "UTF-8 text holds")


def check_text(value: str | None, what: str) -> str | None:
    """An argument as the shell gave it, as text. Python decodes argv with surrogateescape, so a byte
    it could not decode arrives as a lone surrogate (U+DC80-U+DCFF). Under a C or POSIX locale
    (LANG=C, no UTF-8 mode) that is every non-ASCII byte, even of valid UTF-8 text: those bytes are
    decoded here as UTF-8 ("café" is "café" again). Bytes that are not UTF-8 are a UsageError naming
    the byte and its position, instead of a TypeError in the tokenizer later."""
    if value is None:
        return None
    if lone_surrogate(value) is None:
        return value
    try:
        data = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that stands for no byte: not from argv, from a program
        raise UsageError(f"{what} {surrogate_problem(value)}") from None
    return decode_utf8(data, what, advice="pass text in UTF-8")


def check_args(values: dict, spelled=lambda name: f"--{name.replace('_', '-')}") -> None:
    """check_text on every string (or list of strings) among a command's parameters, each replaced
    in `values` by its text; `spelled(name)` says how the user typed the parameter (`--target`,
    `the prompt`)."""
    for name, value in values.items():
        if isinstance(value, str):
            values[name] = check_text(value, spelled(name))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value):
            values[name] = type(value)(check_text(v, spelled(name)) if isinstance(v, str) else v for v in value)


def read_stdin(what: str = "stdin", limit: int | None = None, stream=None) -> str:
    """All of stdin (or the binary `stream`) as text, at most `limit` bytes (MAX_STDIN_BYTES; a
    UsageError beyond, so /dev/zero ends at once); a byte-order mark is dropped."""
    limit = limit or MAX_STDIN_BYTES
    if stream is None:
        if sys.stdin is None or getattr(sys.stdin, "closed", False):
            raise UsageError(f"{what}: stdin is closed; pipe the text in, or pass it as an argument")
        stream = getattr(sys.stdin, "buffer", None)
    data = stream.read(limit + 1) if stream is not None else sys.stdin.read(limit + 1).encode("utf-8", "surrogateescape")
    if len(data) > limit:
        raise UsageError(f"{what} is longer than {limit:,} bytes, the limit for one text (the model reads only "
                         "its last tokens anyway)")
    return decode_utf8(data.removeprefix(b"\xef\xbb\xbf"), what)


def read_text(what: str, stream=None) -> str:
    """One text from stdin (or the binary `stream`), as read_stdin, less the one line break a shell or an
    editor puts at the end (`\n` or `\r\n`): `score -` and `generate -` read their text so."""
    return read_stdin(what, stream=stream).removesuffix("\n").removesuffix("\r")


def unreadable(e: OSError, name: str, what: str) -> UsageError:
    """The OSError met opening or reading the file `name` as the one UsageError that names it as `what`
    (read_small_file's, and readings.batch.open_input's for --file): missing, a folder, or the system's
    reason."""
    if isinstance(e, FileNotFoundError):
        return UsageError(f"no such {what}: {name}")
    if isinstance(e, IsADirectoryError):
        return UsageError(f"the {what} {name} is a folder, not a file")
    return UsageError(f"the {what} {name} cannot be read: {e.strerror or e}")


def read_small_file(name: str, what: str, limit: int = 1 << 20) -> str:
    """A small text file given by path (`-`: stdin), whole: at most `limit` bytes, UTF-8 (a byte-order mark
    dropped). A missing file, a folder, a FIFO or other special file (never opened: a FIFO with no writer
    waits for ever) or a longer file is a UsageError naming it as `what`."""
    import os

    if name == "-":
        return read_stdin(what, limit)
    try:
        kind = special_kind(os.stat(name).st_mode)
        if kind is not None:
            raise UsageError(f"the {what} {name} is {kind}, not a regular file")
        with open(name, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise unreadable(e, name, what) from None
    if len(data) > limit:
        raise UsageError(f"the {what} {name} is longer than {limit:,} bytes")
    return decode_utf8(data.removeprefix(b"\xef\xbb\xbf"), f"the {what} {name}")


def bounded_lines(stream, label: str, max_bytes: int | None = None):
    """(line number, bytes read so far, text without its line break) for every line of a binary
    stream, read one at a time with a limit (MAX_LINE_BYTES): a longer line, or one that is not
    UTF-8, is a UsageError naming `label`, the line and the byte. Memory: one line."""
    max_bytes = max_bytes or MAX_LINE_BYTES
    number = offset = 0
    while raw := _readline(stream, max_bytes + 1, label):  # +1: room for the line break of a full line
        number += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            raise UsageError(f"{label}: line {number:,} is longer than {max_bytes:,} bytes, the limit for one line "
                             "(the model reads only its last tokens anyway); shorten it")
        text = decode_utf8(raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw, label, number, offset)
        offset += len(raw)
        yield number, offset, text.removesuffix("\n").removesuffix("\r")


def _readline(stream, limit: int, label: str) -> bytes:
    """One line of `stream`; a read that fails (/proc/self/mem gives EIO, a disk error) is a UsageError
    naming `label`, not an OSError."""
    try:
        return stream.readline(limit)
    except OSError as e:
        raise UsageError(f"{label} cannot be read: {e.strerror or e}") from None
