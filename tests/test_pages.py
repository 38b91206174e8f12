"""Weights on 2 MiB pages (engine/pages.py): the same figures either way, the same tensors (the tie
kept), nothing copied that a file holds, and a kernel or platform that refuses changes nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lmhead_cli.engine import pages
from lmhead_cli.loading.sources import load_model

linux = pytest.mark.skipif(not pages.supported(), reason="huge pages are asked for on Linux with THP not `never` only")


def _thp_setting() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


def _anon_huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's first element (/proc/self/smaps)."""
    ptr, found = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
            start, end = (int(x, 16) for x in head[0].split("-"))
            found = start <= ptr < end
        elif found and line.startswith("AnonHugePages:"):
            return int(head[1])
    return 0


def _logits(loaded, ids=(464, 8251, 319, 262, 3084)) -> torch.Tensor:
    eng = loaded.engine
    cache = eng.new_cache(1, len(ids) + 2)
    first = eng.head(eng.body(torch.tensor([ids]), cache)[:, -1:])
    step = eng.head(eng.body(first[:, 0].argmax(-1)[:, None], cache))  # one compiled step, where it runs
    return torch.cat([first, step], dim=1)


@linux
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_converted_weights_are_packed_and_give_the_same_logits(tiny, dtype, monkeypatch):
    folder, _ = tiny
    monkeypatch.setenv(pages.ENV, "0")
    plain = load_model(str(folder), device="cpu", dtype=dtype, engine="lean")
    monkeypatch.delenv(pages.ENV)
    packed = load_model(str(folder), device="cpu", dtype=dtype, engine="lean")
    gpt = packed.engine.gpt
    table = gpt.wte.table.q if dtype == "int8" else gpt.wte.weight
    if dtype == "bfloat16":
        assert gpt.lm_head.weight is gpt.wte.weight  # the tie: the very same Parameter, rebound in place
    assert table.untyped_storage().data_ptr() != plain.engine.gpt.state_dict()[
        "wte.table.q" if dtype == "int8" else "wte.weight"].untyped_storage().data_ptr()
    starts, ends = pages._file_ranges()
    big = [p for p in gpt.parameters() if p.untyped_storage().nbytes() >= pages.SMALLEST]
    made = {p.untyped_storage().data_ptr() for p in big if not pages._in_file(p.data_ptr(), starts, ends)}
    assert len(made) == 1, "every large weight made at load in one mapping"
    if dtype == "int8":  # wpe stays float32: the file's own memory, not copied
        assert pages._in_file(gpt.wpe.weight.data_ptr(), starts, ends)
    if _thp_setting() in ("always", "madvise"):
        assert _anon_huge_kb(table) > 0
    assert torch.equal(_logits(plain), _logits(packed))


@linux
def test_float32_weights_stay_in_the_file_mapping(tiny):
    """float32 from safetensors is the file's memory: nothing to pack, nothing copied."""
    folder, _ = tiny
    loaded = load_model(str(folder), device="cpu", dtype="float32", engine="lean")
    assert pages.pack(loaded.engine.gpt) == 0


@linux
def test_pack_rebinds_in_place_and_keeps_views(monkeypatch):
    """Parameters are rebound, not replaced: a transposed view stays a view of the same values, the
    tie stays one object, small tensors stay where they are."""
    from torch import nn

    monkeypatch.setattr(pages, "_in_file", lambda *a: False)
    m = nn.Module()
    rows = torch.randn(300, 200)
    m.w = nn.Parameter(rows.t())  # (200, 300) view of (300, 200) rows, as bfloat16 Conv1Ds are kept
    m.tied = m.w
    m.small = nn.Parameter(torch.randn(10))
    small_ptr = m.small.data_ptr()
    n = pages.pack(m)
    assert n == 300 * 200 * 4
    assert m.tied is m.w and torch.equal(m.w, rows.t()) and m.w.stride() == (1, 200)
    assert m.w.data_ptr() % pages.HUGE == 0  # the mapping's first tensor on a 2 MiB boundary
    assert m.small.data_ptr() == small_ptr


def test_turned_off_or_elsewhere_nothing_happens(tiny, monkeypatch, tmp_path):
    from torch import nn

    m = nn.Module()
    m.w = nn.Parameter(torch.randn(512, 512))
    before = m.w.data_ptr()
    monkeypatch.setenv(pages.ENV, "0")
    assert pages.pack(m) == 0 and m.w.data_ptr() == before
    assert not pages.read_file_in_huge_pages(tiny[0] / "model.safetensors")
    monkeypatch.delenv(pages.ENV)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert pages.pack(m) == 0 and m.w.data_ptr() == before
    assert not pages.read_file_in_huge_pages(tiny[0] / "model.safetensors")


@linux
def test_reading_a_file_ahead(tiny, tmp_path):
    big = tiny[0] / "model.safetensors"
    assert big.stat().st_size >= pages.HUGE
    assert pages.read_file_in_huge_pages(big)
    small = tmp_path / "small.bin"
    small.write_bytes(b"\0" * 4096)
    assert not pages.read_file_in_huge_pages(small)  # under one huge page: not worth a read
    assert not pages.read_file_in_huge_pages(tmp_path / "missing.bin")  # an error is no read, never a raise
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    assert not pages.read_file_in_huge_pages(empty)


@linux
def test_a_refusing_kernel_changes_nothing(monkeypatch):
    """madvise refused (an old kernel, a seccomp filter): the weights stay where they were."""
    from torch import nn

    monkeypatch.setattr(pages, "_in_file", lambda *a: False)
    monkeypatch.setattr(pages, "MADV_HUGEPAGE", 12345)  # advice no kernel knows: EINVAL, for real
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(512, 512))
    before = m.w.data_ptr()
    assert pages.pack(m) == 0 and m.w.data_ptr() == before


def test_a_kernel_with_huge_pages_set_to_never_gets_no_copy(tmp_path, monkeypatch):
    """THP `never`: the advice would be taken and nothing would come of it, so nothing is copied; a kernel
    without THP (no sysfs file) likewise."""
    from torch import nn

    m = nn.Module()
    m.w = nn.Parameter(torch.randn(512, 512))
    before = m.w.data_ptr()
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(pages, "THP_SETTING", setting)
    monkeypatch.setattr(sys, "platform", "linux")
    assert not pages.supported() and pages.pack(m) == 0 and m.w.data_ptr() == before
    monkeypatch.setattr(pages, "THP_SETTING", tmp_path / "missing")
    assert not pages.supported()
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(pages, "THP_SETTING", setting)
    assert pages.supported() == hasattr(__import__("mmap").mmap, "madvise")


@linux
@pytest.mark.parametrize("qtype,tied", [("Q8_0", False), ("Q4_K", True)])
def test_a_gguf_llama_s_blocks_and_stacks_are_packed_and_give_the_same_steps(tmp_path, qtype, tied, monkeypatch):
    """A GGUF Llama's matrices, read from the file into the C heap, and the projections its engine
    stacks (q/k/v, gate/up) are copied onto one mapping of 2 MiB pages (loading/llama.py): each stack's
    parts still views of it, a tied head still the embedding's blocks, every block in the one mapping,
    on huge pages where the kernel gives them; the steps and a greedy run give the same logits and
    tokens, bit for bit. Mutants: blocks left out of the pack (engine/pages.py `_weights`); a tied
    table rebound twice."""
    import lmhead_cli
    from helpers import write_gguf
    from test_llama_engine import build

    from lmhead_cli.engine.quant import Blocks

    _, model = build(tmp_path / "llama", "llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                     num_key_value_heads=2, tie_word_embeddings=tied)
    path = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(model, path, qtype)
    monkeypatch.setenv(pages.ENV, "0")
    plain = lmhead_cli.load(str(path), device="cpu").loaded
    monkeypatch.delenv(pages.ENV)
    packed = lmhead_cli.load(str(path), device="cpu").loaded
    llama = packed.engine.llama
    blocks = [m.weight for m in llama.modules() if isinstance(getattr(m, "weight", None), Blocks)]
    assert len({b.data.untyped_storage().data_ptr() for b in blocks}) == 1  # one mapping: every block in it
    assert (llama.lm_head.weight is llama.model.embed_tokens.weight) == tied
    attn = llama.model.layers[0].self_attn
    q, stack = attn.q_proj.weight.data, attn.qkv.weight.data
    assert q.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr() and q.data_ptr() == stack.data_ptr()
    if _thp_setting() in ("always", "madvise"):
        assert _anon_huge_kb(stack) > 0
    ids = (1, 464, 8251, 319, 262, 3084)
    assert torch.equal(_logits(plain, ids), _logits(packed, ids))
    runs = []
    for loaded in (plain, packed):
        cache = loaded.engine.new_cache(1, 16)
        with torch.inference_mode():
            loaded.engine.body(torch.tensor([ids]), cache)
            run = loaded.engine.greedy_run(ids[-1], cache, 8, None)
        runs.append((run.top_ids, run.figures, run.logits))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
