"""A GGUF file's header read and checked before any tensor is touched: every count, length, type,
shape and offset against the bytes the file really holds.

The gguf package's reader (llama.cpp's own, gguf.GGUFReader) trusts its header: a tensor count or an
array length that lies sends it past the end of its memory map into an IndexError, a loop over 2^60
entries or a reshape that fails; and it builds a numpy array per string, so GPT-2's 100,000
vocabulary strings take it 13 s to open. So the header is read here: each count is checked against
the bytes left (an entry takes at least a fixed number of bytes) before the loop over it, each
string's length against the end of the file, each tensor's type against the types the gguf package
knows and can dequantise, its shape against its type's block, and its data against the file's size
and the other tensors' data. A lie is one CorruptCheckpoint naming the field, the value and the bytes
there are; a type that cannot be dequantised is UnsupportedModel naming the tensor and the type. The
values are decoded as gguf's ReaderField.contents() gives them (tests/test_gguf.py compares the two).

What the header may make lmhead hold is bounded whatever the file claims: at most MAX_KV entries and
MAX_TENSORS tensors, an array lmhead reads at most MAX_ITEMS long, the inner arrays of an array of
arrays at most MAX_NESTED items in all; the arrays of keys the caller does not keep are walked past
unread (Skipped). The file is read a window at a time, never mapped (a mapped file cut short kills the
process with SIGBUS); a file that shrinks while it is read is one line saying so.

Layout (little-endian, GGUF versions 2 and 3): magic "GGUF", version u32, tensor_count u64, kv_count
u64; kv_count entries (key: u64 length + UTF-8, type u32, value); tensor_count tensor infos (name,
n_dims u32, n_dims × u64 dims, type u32, offset u64); padding to the alignment; the tensors' data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from lmhead_cli.errors import CorruptCheckpoint, UnsupportedModel

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# Bytes of each scalar value type (GGUFValueType), and the fewest bytes any value of a type takes.
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
         12: "<f8"}
STRING, ARRAY = 8, 9
MIN_KV = 8 + 4 + 1  # an empty key, a type, a one-byte value
MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # an empty name, n_dims 0, a type, an offset
MAX_ARRAY_DEPTH = 2  # arrays of arrays (none in llama.cpp's files); deeper is refused, not recursed into
# Bounds on what the metadata may ask lmhead to hold, whatever the file's size (llama.cpp's files hold a
# few dozen keys, a few hundred tensors, and arrays no longer than a vocabulary or a merge list:
# 128,256 tokens and 280,147 merges for Llama 3, 262,144 tokens for Gemma 3).
MAX_KV = 1 << 16  # metadata entries
MAX_TENSORS = 1 << 16  # tensor infos
MAX_ITEMS = 1 << 21  # items of one array lmhead reads (2,097,152); a longer one is refused
MAX_NESTED = 1 << 16  # items in all the inner arrays of one array of arrays, counted as they are walked
CHUNK = 1 << 20  # bytes read from the file at a time while the header is walked


@dataclass(frozen=True)
class Skipped:
    """A metadata array lmhead does not read (its key is outside the prefixes the caller keeps): walked
    past without being read, so that an unused 40,000,000-item array costs no memory."""

    item_type: int  # GGUFValueType of its items
    count: int

    def __repr__(self) -> str:
        return f"<{self.count:,} items of value type {self.item_type}, not read>"


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's data lies in the file, in bytes from the file's start."""

    name: str
    type: int  # GGMLQuantizationType's value
    dims: tuple[int, ...]  # GGUF's order: dims[0] is the row (the fastest-varying axis)
    start: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    version: int
    tensor_count: int
    kv_count: int
    alignment: int
    data_offset: int
    meta: dict  # key -> int, float, bool, str or list, as the file stores them (Skipped: not read)
    tensors: tuple[TensorSpan, ...]
    size: int  # the file's size in bytes
    mtime_ns: int = 0  # the file's modification time when the header was read


class _Walk:
    """A cursor over the file that refuses to read past its end, naming what it was reading. The file is
    read a window at a time (never mapped: a file cut short under a mapping kills the process with
    SIGBUS), and what is skipped is never read; a read that comes back short means the file shrank
    while it was read, and says so."""

    def __init__(self, f, size: int, path: Path):
        self.fd, self.path, self.at, self.size = f.fileno(), path, 0, size
        self.win, self.base = b"", 0  # the bytes of the file from offset `base` on
        self.nested = 0  # items walked in the inner arrays of the current array of arrays

    def lie(self, what: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.path}: not a GGUF file lmhead can read: {what}")

    def _window(self, n: int) -> None:
        """Make sure `win` holds the n bytes from `at` on (the caller checked that the file has them)."""
        if self.base <= self.at and self.at + n <= self.base + len(self.win):
            return
        self.win, self.base = os.pread(self.fd, max(n, CHUNK), self.at), self.at
        if len(self.win) < n:
            raise changed(self.path, self.size)

    def take(self, n: int, what: str) -> int:
        """Step over the next n bytes, read: their offset in `win`."""
        self._left(n, what)
        self._window(n)
        start, self.at = self.at - self.base, self.at + n
        return start

    def skip(self, n: int, what: str) -> None:
        """Step over the next n bytes without reading them."""
        self._left(n, what)
        self.at += n

    def _left(self, n: int, what: str) -> None:
        if n > self.size - self.at:
            raise self.lie(f"{what} needs {n:,} bytes at byte {self.at:,}, but the file ends at byte "
                           f"{self.size:,} (truncated?)")

    def u32(self, what: str) -> int:
        start = self.take(4, what)  # first: it may move the window
        return struct.unpack_from("<I", self.win, start)[0]

    def u64(self, what: str) -> int:
        start = self.take(8, what)
        return struct.unpack_from("<Q", self.win, start)[0]

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > self.size - self.at:
            raise self.lie(f"{what} is {n:,} bytes long by its header, but only {self.size - self.at:,} bytes "
                           "are left in the file")
        start = self.take(n, what)
        raw = self.win[start:start + n]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.lie(f"{what} is not UTF-8 ({raw[:40]!r})") from None

    def value(self, vtype: int, key: str, keep: bool = True, depth: int = 0):
        """One value of type `vtype` (GGUFValueType) as Python's int, float, bool, str or list, every
        length checked against the bytes left before it is read. An array under a key not kept is
        walked past, not read (Skipped); an array lmhead reads holds at most MAX_ITEMS items, and the
        inner arrays of an array of arrays MAX_NESTED items in all."""
        if vtype in SCALAR:
            start = self.take(SCALAR[vtype], f"the value of {key}")
            v = struct.unpack_from(FORMAT[vtype], self.win, start)[0]
            return bool(v) if vtype == 7 else v
        if vtype == STRING:
            return self.string(f"{key}'s string")
        if vtype != ARRAY:
            raise self.lie(f"{key} has value type {vtype}, which GGUF does not define")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.lie(f"{key} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        item = self.u32(f"the item type of {key}")
        count = self.u64(f"the length of {key}")
        least = SCALAR.get(item, 8 if item == STRING else 12 if item == ARRAY else None)
        if least is None:
            raise self.lie(f"{key} is an array of value type {item}, which GGUF does not define")
        if count * least > self.size - self.at:
            raise self.lie(f"{key} holds {count:,} items by its header, at least {count * least:,} bytes, but "
                           f"only {self.size - self.at:,} bytes are left in the file")
        if depth:
            self.nested += count
            if self.nested > MAX_NESTED:
                raise self.lie(f"{key} is an array of arrays holding more than {MAX_NESTED:,} items in all; "
                               "lmhead reads no array of arrays larger than that (llama.cpp writes none)")
        if item in SCALAR and not keep:
            self.skip(count * SCALAR[item], f"the items of {key}")
            return Skipped(item, count)
        if item != ARRAY and count > MAX_ITEMS:
            raise self.lie(f"{key} holds {count:,} items; lmhead reads arrays of at most {MAX_ITEMS:,} items "
                           "(no vocabulary or merge list is that long)")
        if item in SCALAR:
            import numpy as np

            start = self.take(count * SCALAR[item], f"the items of {key}")
            values = np.frombuffer(self.win, dtype=NUMPY[item], count=count, offset=start)
            return (values.astype(bool) if item == 7 else values).tolist()
        if item == STRING:  # a vocabulary: 50,257 to 256,000 strings, read in one tight loop
            strings = self._strings(count, key, keep)
            return strings if keep else Skipped(item, count)
        if count > MAX_NESTED:
            raise self.lie(f"{key} is an array of {count:,} arrays; lmhead reads no array of arrays larger than "
                           f"{MAX_NESTED:,} items (llama.cpp writes none)")
        self.nested = count
        values = [self.value(item, key, keep, depth + 1) for _ in range(count)]
        return values if keep else Skipped(item, count)

    def _strings(self, count: int, key: str, keep: bool) -> list[str] | None:
        """`count` strings from `at` on, decoded (`keep`) or only walked; the window is refilled as the
        loop reaches its end."""
        win, base, at, size = self.win, self.base, self.at, self.size
        out: list[str] | None = [] if keep else None
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if at + 8 - base > len(win) or at < base:
                if at + 8 > size:
                    self.at = at
                    raise self.lie(f"{key}[{i}]'s length needs 8 bytes at byte {at:,}, past the end of the file "
                                   f"at byte {size:,} (truncated?)")
                self.at = at
                self._window(8)
                win, base = self.win, self.base
            n = unpack(win, at - base)[0]
            if n > size - at - 8:
                raise self.lie(f"{key}[{i}] is {n:,} bytes long by its header, but only {size - at - 8:,} bytes are "
                               "left in the file")
            end = at + 8 + n
            if keep:
                if end - base > len(win):
                    self.at = at
                    self._window(8 + n)
                    win, base = self.win, self.base
                raw = win[at + 8 - base:end - base]
                try:
                    out.append(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise self.lie(f"{key}[{i}] is not UTF-8 ({raw[:40]!r})") from None
            at = end
        self.at = at
        return out


def changed(path: Path, size: int) -> CorruptCheckpoint:
    """The file shrank (or was replaced) while lmhead read it."""
    try:
        now = f"it is now {os.stat(path).st_size:,} bytes"
    except OSError as e:
        now = f"it can no longer be read ({e.strerror or e})"
    return CorruptCheckpoint(f"{path} changed while lmhead read it: it was {size:,} bytes, {now}; read it again "
                             "once nothing is writing it")


def check_header(path: Path, keep: tuple[str, ...] | None = None) -> Header:
    """The header of the GGUF file at `path`, walked and checked (see the module's docstring); no tensor
    is read. `keep`: the key prefixes whose arrays are read (None: every key's); the arrays of other
    keys are walked past and stand as Skipped. Raises CorruptCheckpoint naming the field that lies, or
    UnsupportedModel for a tensor type the gguf reader cannot dequantise."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import _type_traits

    try:
        with open(path, "rb", buffering=0) as f:
            info = os.fstat(f.fileno())
            size = info.st_size
            if size < 4 + 4 + 8 + 8:
                raise CorruptCheckpoint(f"{path}: not a GGUF file lmhead can read: it is {size} bytes, shorter "
                                        "than a GGUF header (24 bytes)")
            header = _walk(_Walk(f, size, path), keep, GGML_QUANT_SIZES, GGMLQuantizationType, _type_traits)
            return replace(header, mtime_ns=info.st_mtime_ns)
    except OSError as e:
        raise CorruptCheckpoint(f"{path} cannot be read: {e.strerror or e}") from None


def _walk(w: _Walk, keep: tuple[str, ...] | None, sizes, types, traits) -> Header:
    start = w.take(4, "the magic")
    if w.win[start:start + 4] != MAGIC:
        raise w.lie(f"it does not begin with the magic {MAGIC!r} but {w.win[start:start + 4]!r}")
    version = w.u32("GGUF.version")
    if version not in VERSIONS:
        raise w.lie(f"GGUF.version is {version}; the reader reads versions {' and '.join(map(str, VERSIONS))}")
    tensor_count, kv_count = w.u64("GGUF.tensor_count"), w.u64("GGUF.kv_count")
    left = w.size - w.at
    if kv_count * MIN_KV > left:
        raise w.lie(f"GGUF.kv_count is {kv_count:,}: at least {kv_count * MIN_KV:,} bytes of metadata, but "
                    f"the file holds {left:,} bytes after its header")
    if tensor_count * MIN_TENSOR_INFO > left:
        raise w.lie(f"GGUF.tensor_count is {tensor_count:,}: at least {tensor_count * MIN_TENSOR_INFO:,} bytes "
                    f"of tensor infos, but the file holds {left:,} bytes after its header")
    for count, field, most, what in ((kv_count, "GGUF.kv_count", MAX_KV, "metadata entries"),
                                     (tensor_count, "GGUF.tensor_count", MAX_TENSORS, "tensors")):
        if count > most:
            raise w.lie(f"{field} is {count:,}; lmhead reads files of at most {most:,} {what} (llama.cpp's "
                        "hold a few dozen keys and a few hundred tensors)")
    meta: dict = {}
    for i in range(kv_count):
        key = w.string(f"the key of metadata entry {i}")
        if key in meta:
            raise w.lie(f"metadata key {key} appears twice")
        vtype = w.u32(f"the value type of {key}")
        if key == "general.alignment" and vtype != 4:
            raise w.lie(f"general.alignment has value type {vtype}, not uint32 (4)")
        meta[key] = w.value(vtype, key, keep is None or key.startswith(keep))
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise w.lie(f"general.alignment is {alignment}, not a power of two")
    infos, names = [], set()
    for i in range(tensor_count):
        name = w.string(f"the name of tensor {i}")
        if name in names:
            raise w.lie(f"tensor {name} appears twice")
        names.add(name)
        n_dims = w.u32(f"{name}'s n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.lie(f"{name} has n_dims {n_dims}; a tensor has 1 to {MAX_DIMS} dimensions")
        dims = tuple(w.u64(f"{name}'s dims") for _ in range(n_dims))
        ttype = w.u32(f"{name}'s type")
        offset = w.u64(f"{name}'s offset")
        if ttype not in types._value2member_map_:
            raise UnsupportedModel(f"{w.path}: {name} has tensor type {ttype}, which the gguf reader does not know")
        qtype = types(ttype)
        if qtype not in sizes or (qtype not in traits and qtype not in (types.F32, types.F16)):
            raise UnsupportedModel(f"{w.path}: {name} is {qtype.name}, which the gguf package cannot dequantise")
        block, type_size = sizes[qtype]
        if 0 in dims or dims[0] % block:
            raise w.lie(f"{name} has dims {list(dims)}: each must be at least 1 and the first a multiple of "
                        f"{qtype.name}'s block of {block}")
        n = 1
        for d in dims:
            n *= d
        infos.append((name, int(qtype), dims, offset, n // block * type_size))
    data_offset = -(-w.at // alignment) * alignment
    spans = []
    for name, qtype, dims, offset, nbytes in infos:
        if offset % alignment:
            raise w.lie(f"{name}'s offset {offset:,} is not a multiple of general.alignment {alignment}")
        start = data_offset + offset
        if start + nbytes > w.size:
            raise w.lie(f"{name}'s data ends at byte {start + nbytes:,} (offset {offset:,} + {nbytes:,} bytes), "
                        f"past the end of the file at byte {w.size:,} (truncated?)")
        spans.append(TensorSpan(name, qtype, dims, start, nbytes))
    ordered = sorted(spans, key=lambda s: s.start)
    for a, b in zip(ordered, ordered[1:]):
        if a.start + a.nbytes > b.start:
            raise w.lie(f"the data of {a.name} and {b.name} overlap (offsets {a.start - data_offset:,} and "
                        f"{b.start - data_offset:,})")
    return Header(version, tensor_count, kv_count, alignment, data_offset, meta, tuple(spans), w.size)
