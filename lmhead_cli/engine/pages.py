"""Weights on 2 MiB pages, where the decoding step streams them.

A decoding step reads every weight once (GPT-2 small: 495 MB in float32, 247 MB in bfloat16). On 4 KiB
pages its reads cross a page every 4 KiB, and the hardware prefetchers stop at each crossing: measured
on this project's 2-core Zen 4 machine, random:gpt2's bfloat16 step body took 7.4-7.6 ms with about
60% of its weights on 2 MiB pages against 8.8-9.4 ms on 4 KiB pages; float32's 16.5-16.8 ms from a page
cache of 2 MiB folios against 20.5-21.3 ms (docs/performance.md). llama.cpp's memory-mapped GGUF gets
them from the page cache; lmhead asks for them in two ways, both best effort (Linux, with transparent
huge pages not set to `never`; elsewhere, or where the kernel refuses, the weights stay where they
are, the same figures slower):

* `read_file_in_huge_pages(path)`, before a safetensors file is memory-mapped (loading/weights.py): the
  file is read once through a mapping advised MADV_HUGEPAGE, so that pages not yet cached enter the
  page cache as 2 MiB folios, which every later mapping of the file maps whole (float32's tensors stay
  in that mapping; a conversion reads it once). Pages already cached stay as they are (the kernel cannot merge a file's small
  folios here: no CONFIG_READ_ONLY_THP_FOR_FS); a file larger than half the available memory is left
  to be read as the model touches it.
* `pack(module)`, for weights the loader made from a file's (converted to bfloat16 or float16,
  quantised to int8; loading/sources.py build_lean decides, and leaves random:NAME's draws alone; a
  GGUF Llama's blocks, read from the file, and the projections its engine stacked: loading/llama.py):
  every such tensor is copied into one anonymous mapping advised MADV_HUGEPAGE, 2 MiB-aligned, and
  rebound in place (`Tensor.set_`: the same Parameter objects, so the tied head is still the
  embedding's very tensor; the same `Blocks.data` tensors). Each old buffer is freed as its copy
  lands, so the peak is one tensor more. Weights a file holds (memory-mapped) are not copied. Measured
  on this 2-core AVX-512 host (2026-12-05), one 560 MB buffer summed on two threads: 32.7-35.8 GB/s on
  2 MiB pages against 24.6-26.9 on 4 KiB anonymous pages and 26.9-29.3 through a GGUF file's mapping.

LMHEAD_HUGE_PAGES=0 turns both off (to compare).
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lmhead_cli.engine import kernels
from lmhead_cli.engine.heap import release_free_memory

if TYPE_CHECKING:
    from torch import nn

ENV = "LMHEAD_HUGE_PAGES"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE = 2 << 20  # bytes in one huge page (x86-64's and arm64's PMD with 4 KiB base pages)
MADV_HUGEPAGE, MADV_POPULATE_READ = 14, 22  # Linux's <asm-generic/mman-common.h>
ALIGN = 64  # each packed tensor starts on a cache line
SMALLEST = 64 * 1024  # smaller tensors (norms, biases) are not worth a page's room
TRIM = 32 << 20  # bytes freed between two trims of the C heap: the peak stays about one trim's worth above the copy


def turned_off() -> bool:
    return kernels.switched_off(ENV)


def supported() -> bool:
    """Linux with transparent huge pages not set to `never` (there the advice is taken and nothing comes of
    it: a packed copy would cost its time for nothing), and not turned off."""
    if not sys.platform.startswith("linux") or not hasattr(mmap.mmap, "madvise") or turned_off():
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:  # no THP in this kernel
        return False


def _available_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def read_file_in_huge_pages(path: Path) -> bool:
    """Read `path` through a mapping advised MADV_HUGEPAGE (pages not yet cached become 2 MiB folios of
    the page cache); True when it was read so, False where it was not tried or the kernel refused."""
    if not supported():
        return False
    try:
        size = path.stat().st_size
        if size < HUGE or size > _available_bytes() // 2:
            return False
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            m.madvise(MADV_HUGEPAGE)
            m.madvise(MADV_POPULATE_READ)  # Linux 5.14+: fault every page in, reading ahead in 2 MiB folios
        return True
    except (OSError, ValueError):
        return False


def _file_ranges() -> tuple[list[int], list[int]]:
    """The (starts, ends) of this process's file-backed mappings, sorted, from /proc/self/maps."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = fields[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    ranges.sort()
    return [s for s, _ in ranges], [e for _, e in ranges]


def _in_file(ptr: int, starts: list[int], ends: list[int]) -> bool:
    i = bisect.bisect_right(starts, ptr) - 1
    return i >= 0 and ptr < ends[i]


def _weights(module: nn.Module) -> list:
    """`module`'s parameters and the data of its GGUF blocks (engine/quant.py Blocks, a module's weight)."""
    from lmhead_cli.engine.quant import Blocks

    blocks = {id(m.weight.data): m.weight.data for m in module.modules() if isinstance(getattr(m, "weight", None), Blocks)}
    return [*module.parameters(), *blocks.values()]  # each once: a tied head's blocks are the embedding's


def pack(module: nn.Module) -> int:
    """Copy `module`'s CPU parameters and GGUF blocks that no file holds (at least SMALLEST bytes each)
    into one anonymous mapping advised MADV_HUGEPAGE, each rebound in place; the bytes packed (0:
    nothing done)."""
    import torch

    if not supported():
        return 0
    try:
        starts, ends = _file_ranges()
    except OSError:
        return 0
    storages: dict[int, list] = {}  # storage address -> the tensors viewing it
    for p in _weights(module):
        s = p.untyped_storage()
        if (p.is_cpu and not p.is_quantized and s.nbytes() >= SMALLEST and s.data_ptr()
                and not _in_file(s.data_ptr(), starts, ends)):
            storages.setdefault(s.data_ptr(), []).append(p)
    if not storages:
        return 0
    total = sum(-(-ps[0].untyped_storage().nbytes() // ALIGN) * ALIGN for ps in storages.values())
    try:
        # private: a shared anonymous mapping is shmem, whose huge pages are a separate setting (often never)
        buf = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room for a 2 MiB start
    except (OSError, ValueError):
        return 0
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE
    try:
        buf.madvise(MADV_HUGEPAGE, skip, total - total % mmap.PAGESIZE or mmap.PAGESIZE)
    except (OSError, ValueError):
        return 0
    storage, offset, freed = whole.untyped_storage(), skip, 0
    with torch.no_grad():
        for params in storages.values():
            n = params[0].untyped_storage().nbytes()
            old = torch.empty(0, dtype=torch.uint8).set_(params[0].untyped_storage())
            whole[offset:offset + n].copy_(old)
            del old
            for p in params:
                size = p.element_size()
                p.set_(storage, (offset + p.storage_offset() * size) // size, p.shape, p.stride())
            offset += -(-n // ALIGN) * ALIGN
            freed += n
            if freed >= TRIM:  # buffers from the C heap (a GGUF's tensors, read) stay resident until trimmed
                release_free_memory()
                freed = 0
    release_free_memory()
    return offset - skip
