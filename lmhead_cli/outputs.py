"""Files lmhead writes (score --html, tune-lens --out): written whole or not at all, and only where a file may be.

A file is written to a temporary file in the same folder and renamed over the path, so that a reader
never sees half a file, a failed write leaves the old one, and a symbolic link at the path is replaced by
the new file, never written through (its target is left as it was). An existing path that is not a
regular file or a link (a FIFO, a device, a socket, a folder) is refused before any work: opening a FIFO
for writing waits for a reader, for ever when there is none.
"""

from __future__ import annotations

import os

from lmhead_cli.errors import LmheadError, UsageError
from lmhead_cli.safe_text import quoted


def check_target(path: str, what: str) -> None:
    """UsageError unless `path` can become the file `what` names (`--html`, or a Param): not empty, in a
    folder that exists, and either new, a regular file or a link (which the file will replace). Checked
    before any work."""
    import stat

    from lmhead_cli.inputs import special_kind

    if not path:
        raise UsageError(what, " is empty; give the name of the file to write")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise UsageError(what, f" cannot be written to {quoted(path)}: {e.strerror or e}") from None
    if mode is not None and not stat.S_ISLNK(mode) and (kind := special_kind(mode)) is not None:
        raise UsageError(what, f" {quoted(path)} is {kind}, not a regular file; give a new file's name (lmhead "
                         "replaces only a regular file or a link)")
    if os.path.isdir(path):
        raise UsageError(what, f" {quoted(path)} is a folder; give the name of a file to write")
    if not os.path.isdir(os.path.dirname(path) or "."):
        raise UsageError(what, f" needs a file in a folder that exists (got {quoted(path)})")


def write_atomically(path: str, text: str, what: str) -> None:
    """Write `text` (UTF-8) to `path` (see above), or LmheadError naming the path; nothing is left behind.
    The new file gets the permissions open() would give it (0666 less the umask)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    check_target(path, what)
    try:
        replace_with(path, write, 0o666 & ~_umask())
    except OSError as e:
        raise LmheadError(f"cannot write {quoted(path)}: {e.strerror or e}") from None


def replace_with(path, write, mode: int = 0o600) -> None:
    """A new file beside `path`, filled by `write(temporary path)`, given `mode` and renamed over `path`:
    a link there is replaced, never written through. An OSError goes to the caller, the temporary file
    removed (explore's history writes itself this way too)."""
    import tempfile

    folder, name = os.path.split(os.fspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        os.close(fd)
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0o22)  # read by setting it: there is no other way; set back at once
    os.umask(mask)
    return mask
