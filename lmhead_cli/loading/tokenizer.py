"""GPT-2's byte-level BPE through the `tokenizers` library (fast, and no transformers import), and
any tokenizer.json a checkpoint ships (SentencePiece-style pieces such as Llama's map back to text too).

The bundled vocab.json / merges.txt (lmhead_cli/data/gpt2-tokenizer, MIT, OpenAI 2019) serve
`random:` models and checkpoints that ship no tokenizer files of their own.
"""

from __future__ import annotations

import hashlib
import re
import threading
from array import array
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lmhead_cli.errors import CorruptCheckpoint, UsageError, is_library_panic
from lmhead_cli.loading.checks import read_json, regular_file

EOT = "<|endoftext|>"
PIECE_CHARS = 1 << 16  # characters per piece when a long text is encoded
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one raw byte
# Prompt text lmhead tokenizes in one piece at most. A longer prompt is cut at a boundary that
# BPE cannot cross (see `encode_tail`); a tokenizer without that guarantee refuses it instead.
CHUNK_CHARS = 1 << 16
MAX_UNSPLIT_CHARS = 1 << 20
# Unicode White_Space (what \s means in the tokenizers' regex) and Python's str.isspace, together.
_SPACE = frozenset("\t\n\v\f\r \x1c\x1d\x1e\x1f\x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                   + "".join(map(chr, range(0x2000, 0x200B))))


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

    def __init__(self, tok: Tokenizer, origin: str, *, bos_id: int | None = None, add_bos: bool = False):
        self.tok = tok
        self.origin = origin  # where the files came from, for reports
        # The beginning-of-text token, and whether this tokenizer puts it before every text (Llama's
        # do: tokenizer_config.json's add_bos_token, a GGUF's tokenizer.ggml.add_bos_token; GPT-2's not).
        self.bos_id, self.add_bos = bos_id, add_bos and bos_id is not None
        # GPT-2's byte-level pieces map back to bytes through its table; SentencePiece-style ones
        # (Llama, Gemma: "▁the", byte fallback "<0x0A>") through their own rules.
        self.byte_level = tok.decoder is None or isinstance(tok.decoder, decoders.ByteLevel)

    @classmethod
    def from_folder(cls, folder: Path) -> GPT2Tokenizer | None:
        """The tokenizer a checkpoint folder ships (tokenizer.json, else vocab.json + merges.txt), or None.

        Checked before use: regular files only (a FIFO would block), and a file the library cannot
        read, or a tokenizer that fails (or panics, in Rust) on a probe text, is one CorruptCheckpoint
        naming the file and the library's reason."""
        if (folder / "tokenizer.json").exists():
            path = regular_file(folder / "tokenizer.json")
            tok = checked(path, lambda: _parsed((path,), lambda: Tokenizer.from_file(str(path))))
            bos_id, add_bos = _folder_bos(folder, tok)
            return cls(tok, str(path), bos_id=bos_id, add_bos=add_bos)
        vocab, merges = folder / "vocab.json", folder / "merges.txt"
        if vocab.exists() and merges.exists():
            regular_file(vocab), regular_file(merges)

            def blame(reason: str) -> Path:  # the library names no file: its reason tells which
                return merges if "out of vocabulary" in reason or "merges" in reason.lower() else vocab

            return cls(checked(blame, lambda: _parsed((vocab, merges), lambda: _bpe(vocab, merges))), str(folder))
        return None

    @classmethod
    def bundled(cls) -> GPT2Tokenizer:
        folder = resources.files("lmhead_cli.data") / "gpt2-tokenizer"
        with resources.as_file(folder) as path:
            vocab, merges = path / "vocab.json", path / "merges.txt"
            return cls(_parsed((vocab, merges), lambda: _bpe(vocab, merges)), "bundled GPT-2 BPE")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_long(self, text: str, piece_chars: int = PIECE_CHARS) -> array:
        """The ids of a text of any length, as a compact int32 array (4 bytes a token).

        `tokenizers` holds ~150 bytes per token while it encodes (1.4 GB for a 10 MB text), so a long
        text is encoded in pieces of about `piece_chars` characters, cut only at forced boundaries
        (`_forced`, the proof is in `encode_tail`), so the ids are those of encoding the whole text
        at once. Other tokenizers encode it whole."""
        ids = array("i")
        if len(text) <= piece_chars or not self._cuttable:
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

    def encode_tail(self, text: str, keep: int) -> tuple[list[int], int]:
        """The last `keep` token ids of `text` and how many came before them, with memory bounded by
        `keep` and CHUNK_CHARS whatever the length of `text`: (ids, dropped).

        Why cutting is exact. GPT-2's tokenizer first splits out the added tokens (<|endoftext|>),
        then splits the rest with its pre-tokenizer regex ('s|'t|... | ?\\p{L}+| ?\\p{N}+|
        ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+), and BPE merges only inside one regex piece. The regex
        looks ahead but never behind, so where a piece starts depends only on the text from there on.
        A position j is a *forced* boundary when no alternative can match across it, whatever came
        before: an ASCII letter, digit or punctuation mark (not the apostrophe, which starts 's and
        't) followed by an ASCII character of another class, or a white-space character other than
        the space (which ` ?` glues to the next word) followed by a non-space. Every split of the
        whole text therefore has a piece starting at j, and tokenizing text[j:] on its own gives
        exactly the whole text's tokens after j (`_cut` also keeps j outside every added token).
        So the text is tokenized in chunks cut at forced boundaries: the ids of the tail, and only
        the count of the rest. A token is at most `max_token_bytes` bytes (128 for GPT-2), hence at
        most that many characters, so a tail of keep x max_token_bytes characters holds at least
        `keep` tokens: the kept ids all come from the last chunk.
        """
        if len(text) <= CHUNK_CHARS or not self._cuttable:
            if len(text) > MAX_UNSPLIT_CHARS:
                raise UsageError(f"the prompt is {len(text):,} characters; this tokenizer is tokenized in one "
                                 f"piece, up to {MAX_UNSPLIT_CHARS:,} characters")
            ids = self.encode(text)
            return ids[max(0, len(ids) - keep):], max(0, len(ids) - keep)
        # Only backwards: the tail must keep at least keep x max_token_bytes characters.
        tail_start = self._cut(text, max(0, len(text) - keep * self.max_token_bytes - 1))
        tail = self.encode(text[tail_start:])
        dropped, pos = 0, 0
        while pos < tail_start:  # the head, counted a chunk at a time and not kept
            end = tail_start if tail_start - pos <= CHUNK_CHARS else \
                self._cut(text, pos + CHUNK_CHARS, floor=pos + 1, ceiling=tail_start)
            dropped += len(self.encode(text[pos:end]))
            pos = end
        cut = max(0, len(tail) - keep)
        return tail[cut:], dropped + cut

    @cached_property
    def max_token_bytes(self) -> int:
        """The longest token's length in bytes (128 for GPT-2's vocabulary)."""
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size))

    @cached_property
    def _cuttable(self) -> bool:
        """True for GPT-2's own set-up, the one `encode_tail`'s proof is about: no normalizer, the
        byte-level regex, BPE, and <|endoftext|> as the only added token."""
        pre = self.tok.pre_tokenizer
        added = [t.content for t in self.tok.get_added_tokens_decoder().values()]
        return (self.tok.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel)
                and pre.use_regex and not pre.add_prefix_space and isinstance(self.tok.model, models.BPE)
                and added in ([], [EOT]))

    @staticmethod
    def _cut(text: str, at: int, floor: int = 0, ceiling: int | None = None) -> int:
        """The last forced boundary in [floor, at], else (with `ceiling`) the first in (at, ceiling];
        position 0 counts as one. A UsageError when MAX_UNSPLIT_CHARS of text hold none."""
        for j in range(at, max(floor, at - MAX_UNSPLIT_CHARS) - 1, -1):
            if j == 0 or _forced(text, j):
                return j
        for j in range(at + 1, min(ceiling or 0, at + MAX_UNSPLIT_CHARS) + 1):
            if _forced(text, j):
                return j
        raise UsageError(f"the prompt holds {MAX_UNSPLIT_CHARS:,} characters with no break the tokenizer can be "
                         "cut at (a line break, punctuation, a digit after a letter); lmhead tokenizes at most "
                         "that much in one piece")

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


def _class(c: str) -> str:
    """ASCII character classes of the GPT-2 regex: letter, digit, space, other; "" if not ASCII."""
    if not c.isascii() or "\x1c" <= c <= "\x1f":  # not ASCII, or white space to Python only
        return ""
    return "L" if c.isalpha() else "N" if c.isdigit() else "S" if c in _SPACE else "P"


def _forced(text: str, j: int) -> bool:
    """Whether no piece of GPT-2's pre-tokenizer can span text[j-1:j+1], nor <|endoftext|> (see encode_tail)."""
    a, b = text[j - 1], text[j]
    kind_a = _class(a)
    if a in (" ", "'") or not kind_a:
        return False
    ok = b not in _SPACE if kind_a == "S" else _class(b) not in ("", kind_a)
    return ok and EOT not in text[max(0, j - len(EOT) + 1): j + len(EOT) - 1]


def _cut(text: str, at: int) -> int:
    """The first forced boundary (`_forced`) at or after `at`, len(text) if none: where a long text
    can be cut for `encode_long` and each piece encoded on its own."""
    for i in range(max(at, 1), len(text)):
        if _forced(text, i):
            return i
    return len(text)


PROBE = "The keys on the table, don't they? 2024 — café ☕\n\t<|endoftext|>"


def checked(path, load) -> Tokenizer:
    """`load()`'s tokenizer, tried on PROBE; its failure (an exception, or a Rust panic, which is a
    BaseException) is a CorruptCheckpoint naming `path` (or `path(reason)`, the file it blames)."""
    try:
        tok = load()
        tok.encode(PROBE, add_special_tokens=False)
    except BaseException as e:  # noqa: BLE001 - pyo3's PanicException is a BaseException
        if not (isinstance(e, Exception) or is_library_panic(e)):
            raise
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = (lines[0] if lines else type(e).__name__)[:200]
        raise CorruptCheckpoint(f"{path(reason) if callable(path) else path} is not a tokenizer lmhead can read: "
                                f"{reason}") from None
    if tok.get_vocab_size(with_added_tokens=True) == 0:
        raise CorruptCheckpoint(f"{path if not callable(path) else path('')} holds no tokens")
    return tok


def _folder_bos(folder: Path, tok: Tokenizer) -> tuple[int | None, bool]:
    """(BOS id, whether to put it before every text) for a folder's tokenizer.json, as transformers
    reads them: tokenizer_config.json's add_bos_token and bos_token where it says; else whatever
    tokenizer.json's own post-processor puts first (Llama's TemplateProcessing puts <s>; GPT-2's none)."""
    config = folder / "tokenizer_config.json"
    doc = read_json(config) if config.exists() else {}
    doc = doc if isinstance(doc, dict) else {}
    bos = doc.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    bos_id = tok.token_to_id(bos) if isinstance(bos, str) else None
    add = doc.get("add_bos_token")
    if add is not None and not isinstance(add, bool):
        raise CorruptCheckpoint(f"{config}: add_bos_token must be true or false, not {str(add)[:20]}")
    if add is None:  # the tokenizer's post-processor decides: a special token it puts before the text
        plain, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
        first = full[0] if len(full) > len(plain) and full[1:len(plain) + 1] == plain else None
        add, bos_id = first is not None, first if first is not None else bos_id
    return bos_id, add


# Parsed tokenizers by their files' content: parsing GPT-2's 50,257 tokens and 50,000 merges takes ~0.1 s,
# hashing the files ~3 ms, so a process that loads models again (the API in a notebook, a server, a test
# suite) parses each tokenizer once. lmhead never changes a Tokenizer after building it (encode and decode
# only), so models share one. A few entries at most: memory stays bounded.
_PARSED: dict[bytes, Tokenizer] = {}
_PARSED_MAX = 4
_PARSED_LOCK = threading.Lock()


def _parsed(paths: tuple[Path, ...], build) -> Tokenizer:
    """`build()`'s tokenizer, or the one built before from files with the same bytes as `paths`."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    key = digest.digest()
    with _PARSED_LOCK:
        tok = _PARSED.get(key)
    if tok is None:
        tok = build()
        with _PARSED_LOCK:
            while len(_PARSED) >= _PARSED_MAX:
                del _PARSED[next(iter(_PARSED))]
            _PARSED[key] = tok
    return tok


def _bpe(vocab: Path, merges: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok
