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

Layout (little-endian, GGUF versions 2 and 3): magic "GGUF", version u32, tensor_count u64, kv_count
u64; kv_count entries (key: u64 length + UTF-8, type u32, value); tensor_count tensor infos (name,
n_dims u32, n_dims × u64 dims, type u32, offset u64); padding to the alignment; the tensors' data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
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
    meta: dict  # key -> int, float, bool, str or list, as the file stores them
    tensors: tuple[TensorSpan, ...]
    size: int  # the file's size in bytes


class _Walk:
    """A cursor over the mapped file that refuses to read past its end, naming what it was reading."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.at, self.size = buf, path, 0, len(buf)

    def lie(self, what: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.path}: not a GGUF file lmhead can read: {what}")

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.at:
            raise self.lie(f"{what} needs {n:,} bytes at byte {self.at:,}, but the file ends at byte "
                           f"{self.size:,} (truncated?)")
        start, self.at = self.at, self.at + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > self.size - self.at:
            raise self.lie(f"{what} is {n:,} bytes long by its header, but only {self.size - self.at:,} bytes "
                           "are left in the file")
        raw = bytes(self.buf[self.take(n, what):self.at])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.lie(f"{what} is not UTF-8 ({raw[:40]!r})") from None

    def value(self, vtype: int, key: str, depth: int = 0):
        """One value of type `vtype` (GGUFValueType) as Python's int, float, bool, str or list, every
        length checked against the bytes left before it is read."""
        if vtype in SCALAR:
            v = struct.unpack_from(FORMAT[vtype], self.buf, self.take(SCALAR[vtype], f"the value of {key}"))[0]
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
        if item in SCALAR:
            import numpy as np

            start = self.take(count * SCALAR[item], f"the items of {key}")
            values = np.frombuffer(self.buf, dtype=NUMPY[item], count=count, offset=start).tolist()
            return [bool(v) for v in values] if item == 7 else values
        if item == STRING:  # a vocabulary: 50,257 to 256,000 strings, read in one tight loop
            return self._strings(count, key)
        return [self.value(item, key, depth + 1) for _ in range(count)]

    def _strings(self, count: int, key: str) -> list[str]:
        buf, at, size, out = self.buf, self.at, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if at + 8 > size:
                self.at = at
                raise self.lie(f"{key}[{i}]'s length needs 8 bytes at byte {at:,}, past the end of the file at byte "
                               f"{size:,} (truncated?)")
            n = unpack(buf, at)[0]
            if n > size - at - 8:
                raise self.lie(f"{key}[{i}] is {n:,} bytes long by its header, but only {size - at - 8:,} bytes are "
                               "left in the file")
            try:
                out.append(buf[at + 8:at + 8 + n].decode("utf-8"))
            except UnicodeDecodeError:
                raise self.lie(f"{key}[{i}] is not UTF-8 ({buf[at + 8:at + 8 + min(n, 40)]!r})") from None
            at += 8 + n
        self.at = at
        return out


def check_header(path: Path) -> Header:
    """The header of the GGUF file at `path`, walked and checked (see the module's docstring); no tensor
    is read. Raises CorruptCheckpoint naming the field that lies, or UnsupportedModel for a tensor type
    the gguf reader cannot dequantise."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import _type_traits

    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 4 + 4 + 8 + 8:
                raise CorruptCheckpoint(f"{path}: not a GGUF file lmhead can read: it is {size} bytes, shorter "
                                        "than a GGUF header (24 bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Walk(buf, path), GGML_QUANT_SIZES, GGMLQuantizationType, _type_traits)
    except OSError as e:
        raise CorruptCheckpoint(f"{path} cannot be read: {e.strerror or e}") from None


def _walk(w: _Walk, sizes, types, traits) -> Header:
    if bytes(w.buf[w.take(4, "the magic"):w.at]) != MAGIC:
        raise w.lie(f"it does not begin with the magic {MAGIC!r} but {bytes(w.buf[:4])!r}")
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
    meta: dict = {}
    for i in range(kv_count):
        key = w.string(f"the key of metadata entry {i}")
        if key in meta:
            raise w.lie(f"metadata key {key} appears twice")
        vtype = w.u32(f"the value type of {key}")
        if key == "general.alignment" and vtype != 4:
            raise w.lie(f"general.alignment has value type {vtype}, not uint32 (4)")
        meta[key] = w.value(vtype, key)
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
