"""GPT-2's byte-level BPE through the `tokenizers` library (fast, and no transformers import), and
any tokenizer.json a checkpoint ships (SentencePiece-style pieces such as Llama's map back to text too).

The bundled vocab.json / merges.txt (lmhead_cli/data/gpt2-tokenizer, MIT, OpenAI 2019) serve
`random:` models and checkpoints that ship no tokenizer files of their own.
"""

from __future__ import annotations

import re
from array import array
from functools import lru_cache
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOT = "<|endoftext|>"
PIECE_CHARS = 1 << 16  # characters per piece when a long text is encoded
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one raw byte


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters in its vocabulary back to raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class GPT2Tokenizer:
    """encode / decode, and each token's raw bytes and readable text."""

    def __init__(self, tok: Tokenizer, origin: str):
        self.tok = tok
        self.origin = origin  # where the files came from, for reports
        # GPT-2's byte-level pieces map back to bytes through its table; SentencePiece-style ones
        # (Llama, Gemma: "▁the", byte fallback "<0x0A>") through their own rules.
        self.byte_level = tok.decoder is None or isinstance(tok.decoder, decoders.ByteLevel)

    @classmethod
    def from_folder(cls, folder: Path) -> GPT2Tokenizer | None:
        """The tokenizer a checkpoint folder ships (tokenizer.json, else vocab.json + merges.txt), or None."""
        if (folder / "tokenizer.json").is_file():
            return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), str(folder / "tokenizer.json"))
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            return cls(_bpe(folder / "vocab.json", folder / "merges.txt"), str(folder))
        return None

    @classmethod
    def bundled(cls) -> GPT2Tokenizer:
        folder = resources.files("lmhead_cli.data") / "gpt2-tokenizer"
        with resources.as_file(folder) as path:
            return cls(_bpe(path / "vocab.json", path / "merges.txt"), "bundled GPT-2 BPE")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_long(self, text: str, piece_chars: int = PIECE_CHARS) -> array:
        """The ids of a text of any length, as a compact int32 array (4 bytes a token).

        `tokenizers` holds ~150 bytes per token while it encodes (1.4 GB for a 10 MB text), so a long
        text is encoded in pieces of about `piece_chars` characters, cut only where a byte-level
        pre-tokenizer always starts a new word: at a white-space character between two others
        that are not (GPT-2's pattern never joins across it, and no special token holds one). The
        ids are those of encoding the whole text at once. Other tokenizers encode it whole."""
        ids = array("i")
        if len(text) <= piece_chars or not isinstance(self.tok.pre_tokenizer, pre_tokenizers.ByteLevel):
            ids.extend(self.encode(text))
            return ids
        start = 0
        while start < len(text):
            end = _cut(text, start + piece_chars)
            ids.extend(self.encode(text[start:end]))
            start = end
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if not self.byte_level:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte[1], 16)]) if byte else piece.replace("▁", " ").encode("utf-8")
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")  # a special token such as <|endoftext|>

    def token_text(self, token_id: int) -> str:
        """The token as text; a piece of a multi-byte character shows as its bytes (e.g. '\\xe4\\xbd')."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


def _cut(text: str, at: int) -> int:
    """The first safe place to cut `text` at or after `at` (len(text) if none): a white-space
    character with a non-white-space character on each side."""
    for i in range(max(at, 1), len(text) - 1):
        if text[i].isspace() and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
    return len(text)


def _bpe(vocab: Path, merges: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok
