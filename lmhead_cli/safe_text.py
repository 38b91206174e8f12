"""Terminal-safe text: the one helper through which data (prompts, tokens, targets, file lines, paths,
generated text) reaches a person, in a table (render/) or in a message that quotes it (outputs.py,
the CLI's error line, the server's log). Plain Python: every layer may import it.

Control characters (C0 and C1, DEL), lone surrogates (undecodable bytes) and the characters that
reorder or break lines (bidi overrides and isolates, line and paragraph separators) are made visible
as escapes; nothing else changes. JSON never goes through it: JSON stays exact.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def safe_text(text: str, keep: str = "") -> str:
    """`text` with every control character made visible (ESC as \\x1b, BEL as \\x07, newline as \\n),
    except those in `keep` (streamed text keeps "\\n\\t"). Nothing else changes."""

    def visible(m: re.Match) -> str:
        ch = m.group()
        if ch in keep:
            return ch
        return _NAMED.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")

    return _UNSAFE.sub(visible, text)


def quoted(text: str) -> str:
    """A token, target or path in quotes for a message: 'are', safe, without repr's doubled backslashes."""
    return "'" + safe_text(text) + "'"
