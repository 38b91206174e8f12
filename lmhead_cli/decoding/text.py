"""A row's text and its stop strings: tokens' bytes decoded incrementally, cut at the first stop string,
held back while one may still be forming. Every door's stops are these (decoding/batch.py's rows)."""

from __future__ import annotations

import codecs


class Text:
    """A row's text: its tokens' bytes decoded incrementally (a character split across tokens comes
    once whole), cut at the first stop string, and held back while a stop string may still be forming."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.shown = "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> bool:
        """Add a token's bytes; True when a stop string is now in the text (the text is cut before it)."""
        before = len(self.text)
        self.text += self.decoder.decode(self.tokenizer.token_bytes(token_id))
        found = [i for s in self.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if found:
            self.text = self.text[:min(found)]
        return bool(found)

    def copy(self) -> Text:
        """This text so far, with its own decoder in the same state."""
        twin = Text(self.tokenizer, self.stop)
        twin.decoder.setstate(self.decoder.getstate())
        twin.text, twin.shown = self.text, self.shown
        return twin

    def piece(self, final: bool = False, flush: bool = False) -> str:
        """The text that became safe to show; `flush` ends the bytes (a final partial character)."""
        if flush:
            self.text += self.decoder.decode(b"", final=True)
        safe = len(self.text) if final or not self.stop else len(self.text) - self.hold
        out = self.text[self.shown:max(safe, self.shown)]
        self.shown += len(out)
        return out
