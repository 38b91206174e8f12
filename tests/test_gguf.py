"""`--model FILE.gguf`: llama.cpp's files, written here with the gguf package's writer and quantisers
from random transformers checkpoints (a GPT-2 and a Llama, the GPT-2 tokenizer), no llama.cpp binary.

The oracle is transformers' forward with the weights the file holds, dequantised by gguf.quants from
the very bytes the writer stored and put back into transformers' layout by the test's own inverse of
convert_hf_to_gguf.py's layout (tests/helpers.py); the header is compared with gguf.GGUFReader's.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from helpers import (PROMPT, PROMPT_IDS, _tokenizer_files, build_checkpoint, cli, gguf_oracle, refused_gguf,
                     gpt2_tokens, web, write_gguf)

import lmhead_cli
from lmhead_cli.errors import LmheadError
from lmhead_cli.errors import CorruptCheckpoint, UnsupportedModel
from lmhead_cli.loading.gguf import read_gguf
from lmhead_cli.loading.gguf_header import check_header

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")
IDS = PROMPT_IDS + [11, 290, 262, 3290, 318]  # "The keys on the table, and the dog is"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tied GPT-2 whose MLP is 256 wide, so that its c_proj rows fit a K-quant block of 256."""
    folder = tmp_path_factory.mktemp("gguf-gpt2")
    return folder, build_checkpoint(folder, n_inner=256, n_positions=128, seed=4).requires_grad_(False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """An untied Llama with grouped-query attention (4 heads, 2 for k and v) and a 256-wide MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50257, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         bos_token_id=50256, eos_token_id=50256, initializer_range=0.15)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    model.model.norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    folder = tmp_path_factory.mktemp("gguf-llama")
    model.save_pretrained(folder)
    _tokenizer_files(folder)
    return folder, model


def lmhead_logits(m, ids=IDS) -> torch.Tensor:
    eng = m.loaded.engine
    with torch.no_grad():
        return eng.head(eng.body(torch.tensor([ids])))[0]  # (T, V)


# ---- the figures ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.slow
def test_logits_equal_transformers_on_the_dequantised_weights(arch, qtype, request, tmp_path, monkeypatch):
    # x unrounded for every type: the file's weights, read right (tests/test_quant.py measures the 4-bit
    # types' own arithmetic, llama.cpp's rounding of x)
    monkeypatch.setenv("LMHEAD_GGUF_ARITHMETIC", "exact")
    folder, model = request.getfixturevalue(arch)
    path = tmp_path / f"tiny-{qtype}.gguf"
    written = write_gguf(model, path, qtype)
    assert qtype == "F32" or qtype in {kind for kind, _ in written.values()}  # the type is really in the file
    twin, state = gguf_oracle(model, written)
    # The weights: each tensor exactly its type's dequantisation, in transformers' layout.
    loaded = read_gguf(path).state
    for name, t in state.items():
        mine = loaded[name.removeprefix("transformer.")]
        assert mine.dtype == torch.float32 and torch.equal(mine, t), name
    # The logits at every position: transformers' on those weights.
    m = lmhead_cli.load(str(path), device="cpu")
    with torch.no_grad():
        ref = twin(torch.tensor([IDS])).logits[0]
    assert torch.allclose(lmhead_logits(m), ref, atol=1e-5, rtol=1e-5)
    assert m.loaded.engine.__class__.__name__ == ("LeanGPT2" if arch == "gpt2" else "LeanLlama")
    if arch == "llama" and qtype.startswith("Q"):  # held as the file's blocks, not dequantised
        assert qtype in m.loaded.engine.weight_format.split("+")
    if qtype == "F32":  # nothing was rounded: the file is the checkpoint
        with torch.no_grad():
            assert torch.allclose(lmhead_logits(m), model(torch.tensor([IDS])).logits[0], atol=1e-5, rtol=1e-5)


def test_k_quant_dequantisation_is_ggufs_on_whole_blocks(gpt2, tmp_path):
    """A Q6_K ffn_down: lmhead's weight is gguf.quants.dequantize of the raw blocks, transposed to
    GPT-2's [in, out], every value; and the blocks' scales really vary (not a constant tensor)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    _, model = gpt2
    written = write_gguf(model, tmp_path / "q6k.gguf", "Q6_K")
    kind, raw = written["blk.0.ffn_down.weight"]
    assert kind == "Q6_K" and raw.dtype == np.uint8 and raw.shape == (64, 256 // 256 * 210)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K))  # (64, 256)
    got = read_gguf(tmp_path / "q6k.gguf").state["h.0.mlp.c_proj.weight"]  # (256, 64)
    assert torch.equal(got, ref.t()) and ref.std() > 0


@pytest.mark.slow
def test_the_header_lmhead_reads_is_the_one_ggufs_reader_reads(gpt2, tmp_path):
    from gguf import GGUFReader

    _, model = gpt2
    write_gguf(model, tmp_path / "q8.gguf", "Q8_0")
    header = check_header(tmp_path / "q8.gguf")
    reader = GGUFReader(str(tmp_path / "q8.gguf"))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.meta.keys() == fields.keys()
    for key, value in fields.items():
        assert header.meta[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert [(t.name, t.type, t.dims, t.start, t.nbytes) for t in header.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes) for t in reader.tensors]
    assert header.data_offset == reader.data_offset


# ---- the tie ----------------------------------------------------------------------------------------

def test_tie_on_a_gguf_output_absent_equal_or_its_own(gpt2, tmp_path):
    _, model = gpt2
    emb = model.transformer.wte.weight.detach().clone()
    absent = tmp_path / "absent.gguf"
    write_gguf(model, absent, "Q8_0")
    tie = lmhead_cli.load(str(absent), device="cpu").loaded.tie
    assert tie.tied and tie.file_has_lm_head is False and tie.file_lm_head_equals_wte is None

    same = tmp_path / "same.gguf"
    write_gguf(model, same, "F32", tensors={"output.weight": emb})
    tie = lmhead_cli.load(str(same), device="cpu").loaded.tie
    assert tie.tied and tie.file_has_lm_head is True and tie.file_lm_head_equals_wte is True

    own = tmp_path / "own.gguf"
    head = emb.flip(0).contiguous()
    written = write_gguf(model, own, "F32", tensors={"output.weight": head})
    m = lmhead_cli.load(str(own), device="cpu")
    tie = m.loaded.tie
    assert not tie.tied and tie.file_has_lm_head is True and tie.file_lm_head_equals_wte is False
    with torch.no_grad():  # the file's own head is the one used
        h = model.transformer(torch.tensor([IDS])).last_hidden_state[0]
    assert torch.allclose(lmhead_logits(m), h @ head.t(), atol=1e-5, rtol=1e-5)
    assert "output.weight" in written
    out = cli("tie", "--model", str(own))
    assert out.exit_code == 0 and "untied" in out.stdout.lower()


# ---- the tokenizer -----------------------------------------------------------------------------------

HOSTILE = ["The keys on the table", "", " ", "   leading and trailing   ", "\x1b[31mred\x1b[0m\x07 bell",
           "<|endoftext|>", "a<|endoftext|>b <|endoftext|><|endoftext|>", "<|endoftext", "café naïve ☕ 🤖🏳️‍🌈",
           "日本語のテキスト、中文，한국어", "e\u0301 combining \u200b zero width \ufeff bom", "tab\tnew\nline\r\n",
           "don't 'tis it's we'll 'S", "1234567890 3.14159 -0.0e10", "\\n literal [bold]markup[/bold] %s {x}",
           "a" * 300, " " * 50 + "x", "\u0000 nul \u007f del", "ÿþ\x80\x81 latin-1 bytes", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀"]


def test_tokenizer_from_gguf_equals_the_hf_tokenizer_on_hostile_text(gpt2, tmp_path):
    from transformers import GPT2Tokenizer as ReferenceTokenizer

    folder, model = gpt2
    write_gguf(model, tmp_path / "t.gguf", "F32")
    tok = read_gguf(tmp_path / "t.gguf").tokenizer
    hf = ReferenceTokenizer.from_pretrained(str(folder))  # transformers' own, from the checkpoint's files
    assert tok.vocab_size == len(hf) == 50257
    for text in HOSTILE:
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == hf.decode(ids), text
    assert tok.encode("<|endoftext|>") == [50256]  # the control token is special, one id


# ---- refusals: the header --------------------------------------------------------------------------

def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _info(name: str, dims, ttype: int, offset: int) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<II", ttype, 0)[:4] + struct.pack("<Q", offset)


ARCH = _kv("general.architecture", 8, _s("gpt2"))
ONE = _info("t", [32], 0, 0)


def raw_gguf(path, *, magic=b"GGUF", version=3, kv=(ARCH,), infos=(ONE,), kv_count=None, tensor_count=None,
             data=bytes(128), cut=0):
    """A GGUF file put together byte by byte, so that any field can lie."""
    head = magic + struct.pack("<IQQ", version, len(infos) if tensor_count is None else tensor_count,
                               len(kv) if kv_count is None else kv_count)
    body = head + b"".join(kv) + b"".join(infos)
    body += bytes(-len(body) % 32) + data
    path.write_bytes(body[:len(body) - cut])
    return path


def _array_of_strings(n: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", 8, n) + b"".join(_s(i) for i in items)


MALFORMED = {
    "short": (dict(data=b"", kv=(), infos=(), cut=12), "shorter than a GGUF header"),
    "magic": (dict(magic=b"GGML"), "does not begin with the magic"),
    "version": (dict(version=1), "GGUF.version is 1"),
    "tensor count": (dict(tensor_count=2**40), "GGUF.tensor_count is 1,099,511,627,776"),
    "kv count": (dict(kv_count=2**40), "GGUF.kv_count is 1,099,511,627,776"),
    "key length": (dict(kv=(struct.pack("<Q", 2**40) + b"general.architecture",)),
                   "the key of metadata entry 0 is 1,099,511,627,776 bytes long"),
    "string length": (dict(kv=(_kv("general.architecture", 8, struct.pack("<Q", 10**9) + b"gpt2"),)),
                      "general.architecture's string is 1,000,000,000 bytes long"),
    "array length": (dict(kv=(ARCH, _kv("tokenizer.ggml.tokens", 9, _array_of_strings(10**12, [b"a"]))),),
                     "tokenizer.ggml.tokens holds 1,000,000,000,000 items"),
    "array item length": (dict(kv=(ARCH, _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + _s("a")
                                                + struct.pack("<Q", 10**9))),),
                          "tokenizer.ggml.tokens[1] is 1,000,000,000 bytes long"),
    "value type": (dict(kv=(_kv("general.architecture", 13, b"\0" * 8),)), "general.architecture has value type 13"),
    "duplicate key": (dict(kv=(ARCH, ARCH)), "metadata key general.architecture appears twice"),
    "alignment": (dict(kv=(ARCH, _kv("general.alignment", 4, struct.pack("<I", 3)))),
                  "general.alignment is 3, not a power of two"),
    "n_dims 0": (dict(infos=(_info("t", [], 0, 0),)), "t has n_dims 0"),
    "n_dims 5": (dict(infos=(_info("t", [1, 1, 1, 1, 32], 0, 0),)), "t has n_dims 5"),
    "a dim of 0": (dict(infos=(_info("t", [32, 0], 0, 0),)), "t has dims [32, 0]"),
    "row and block": (dict(infos=(_info("t", [33], 8, 0),)), "the first a multiple of Q8_0's block of 32"),
    "offset alignment": (dict(infos=(_info("t", [8], 0, 4),)), "t's offset 4 is not a multiple of general.alignment 32"),
    "data past the end": (dict(infos=(_info("t", [32], 0, 4096),)), "past the end of the file"),
    "truncated data": (dict(cut=64), "t's data ends at byte"),
    "truncated infos": (dict(data=b"", cut=40), "the file ends at byte"),
    "overlap": (dict(infos=(_info("a", [32], 0, 0), _info("b", [32], 0, 64)), data=bytes(256)),
                "the data of a and b overlap"),
    "duplicate tensor": (dict(infos=(ONE, _info("t", [32], 0, 128)), data=bytes(256)), "tensor t appears twice"),
    "huge dims": (dict(infos=(_info("t", [2**32, 2**32], 0, 0),)), "past the end of the file"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_a_header_that_lies_is_one_line_naming_the_field(case, tmp_path):
    kwargs, says = MALFORMED[case]
    path = raw_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(CorruptCheckpoint) as e:
        check_header(path)
    assert says in str(e.value) and str(path) in str(e.value)
    out = cli("inspect", PROMPT, "--model", str(path))
    assert out.exit_code == 1 and says in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.output


@pytest.mark.parametrize("ttype, says", [(99, "t has tensor type 99, which the gguf reader does not know"),
                                         (26, "t is I32, which the gguf package cannot dequantise")])
def test_a_tensor_type_the_reader_cannot_dequantise_is_refused(ttype, says, tmp_path):
    path = raw_gguf(tmp_path / "bad.gguf", infos=(_info("t", [32], ttype, 0),))
    with pytest.raises(UnsupportedModel, match=says):
        check_header(path)
    out = cli("inspect", PROMPT, "--model", str(path))
    assert out.exit_code == 1 and says in out.stderr and out.stderr.count("\n") == 1


# ---- refusals: the metadata against the tensors -------------------------------------------------------

def _refusal(model, tmp_path, says, error=CorruptCheckpoint, **kwargs):
    refused_gguf(model, tmp_path, says, error, **kwargs)


def test_an_architecture_lmhead_does_not_run(gpt2, tmp_path):
    _refusal(gpt2[1], tmp_path, "general.architecture is 'falcon'; lmhead runs GGUF files of gpt2, llama and qwen2",
             UnsupportedModel, arch="falcon")


def test_metadata_that_is_missing_or_disagrees_with_the_tensors(gpt2, llama, tmp_path):
    model = gpt2[1]
    _refusal(model, tmp_path, "the GGUF metadata lacks gpt2.block_count", drop=("gpt2.block_count",))
    _refusal(model, tmp_path, "gpt2.block_count is 3, but the file holds 2 blocks (blk.0 … blk.1)",
             meta={"gpt2.block_count": 3})
    _refusal(model, tmp_path, "token_embd.weight is 50,257 × 64, but the metadata makes it 50,257 × 128",
             meta={"gpt2.embedding_length": 128})
    _refusal(model, tmp_path, "gpt2.attention.head_count must be a whole number of at least 1, not 0",
             meta={"gpt2.attention.head_count": 0})
    _refusal(model, tmp_path, "holds blk.0.extra.weight, which a gpt2 of its metadata has no place for",
             tensors={"blk.0.extra.weight": torch.zeros(64)})
    _refusal(llama[1], tmp_path, "blk.0.attn_k.weight is 32 × 64, but the metadata makes it 64 × 64",
             meta={"llama.attention.head_count_kv": 4})
    _refusal(llama[1], tmp_path, "llama.rope.scaling.type is 'yarn'", UnsupportedModel,
             meta={"llama.rope.scaling.type": "yarn"})


def test_a_tokenizer_that_does_not_fit_is_refused(gpt2, tmp_path):
    model = gpt2[1]
    tokens, merges, types = gpt2_tokens()
    _refusal(model, tmp_path, "tokenizer.ggml.tokens holds 50,256 tokens but token_embd.weight has 50,257 rows",
             meta={"tokenizer.ggml.tokens": tokens[:-1]})
    _refusal(model, tmp_path, "tokenizer.ggml.tokens holds 'the' twice",
             meta={"tokenizer.ggml.tokens": tokens[:-1] + ["the"]})
    _refusal(model, tmp_path, "tokenizer.ggml.merges[3] 'nonsense' is not two tokens",
             meta={"tokenizer.ggml.merges": merges[:3] + ["nonsense"] + merges[4:]})
    # an unknown tokenizer.ggml.model or .pre: tests/test_gguf_tokenizer.py


def test_claims_the_metadata_makes_are_bounded_before_anything_is_built(gpt2, llama, tmp_path):
    """A block count, a head count or an embedding's rank that lies is one line, before a layout of
    that many blocks (2^40 of them grew memory without bound) or an IndexError."""
    from gguf.constants import GGUFValueType

    _refusal(gpt2[1], tmp_path, "gpt2.block_count is 1,099,511,627,776, but the file holds 2 blocks (blk.0 … blk.1)",
             meta={"gpt2.block_count": (2**40, GGUFValueType.UINT64)})
    _refusal(llama[1], tmp_path, "llama.block_count is 100,000,000, but the file holds 2 blocks (blk.0 … blk.1)",
             meta={"llama.block_count": 10**8})
    _refusal(llama[1], tmp_path, "llama.attention.head_count 5 does not divide llama.embedding_length 64, and the "
             "file gives no llama.attention.key_length", meta={"llama.attention.head_count": 5})
    table = gpt2[1].transformer.wte.weight.detach()
    _refusal(gpt2[1], tmp_path, "token_embd.weight is 3,216,448 (1-D); the embedding table is 2-D",
             tensors={"token_embd.weight": table.flatten(), "output.weight": table})


@pytest.mark.slow
def test_a_llama_context_beyond_the_bound_runs_at_the_bound(llama, tmp_path):
    """A Llama's context_length is a claim no tensor checks: 2^40 with no end token made n_ctx (and a
    request without a token limit) unbounded. It runs at MAX_CONTEXT, announced."""
    from gguf.constants import GGUFValueType

    from lmhead_cli.loading.gguf import MAX_CONTEXT

    path = tmp_path / "long.gguf"
    write_gguf(llama[1], path, "F32", meta={"llama.context_length": (2**40, GGUFValueType.UINT64)},
               drop=("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"))
    notes = []
    m = lmhead_cli.load(str(path), device="cpu", announce=notes.append)
    assert m.n_ctx == MAX_CONTEXT == 131_072
    assert any("llama.context_length is 1,099,511,627,776, more than lmhead runs; its context is taken as "
               "131,072 positions" in str(n) for n in notes), notes
    out = cli("inspect", PROMPT, "--model", str(path))
    assert out.exit_code == 0 and "taken as 131,072 positions" in out.stderr
    from helpers import serving

    with serving(path) as s:  # a real server process: its page's /api/info said n_ctx 1,099,511,627,776
        assert web.get(s.url + "/api/info", timeout=60).json()["n_ctx"] == MAX_CONTEXT
        # with no end token, a chat answer without max_tokens would run to the context's end: refused
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        r = web.post(s.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "no end-of-text token" in r.json()["error"]["message"]
        r = web.post(s.url + "/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def _array(key: str, item: int, count: int, items: bytes) -> bytes:
    return _kv(key, 9, struct.pack("<IQ", item, count) + items)


def test_metadata_lmhead_does_not_read_costs_no_memory(tmp_path):
    """An unused key holding 4,000,000 bools is walked past (Skipped), not made into a list: the header
    costs what it costs without it (a list of 4,000,000 bools took 64 MB; 40,000,000, 620 MB)."""
    import tracemalloc

    from lmhead_cli.loading.gguf import read_header
    from lmhead_cli.loading.gguf_header import Skipped

    n = 4_000_000
    plain = raw_gguf(tmp_path / "plain.gguf")
    big = raw_gguf(tmp_path / "big.gguf", kv=(ARCH, _array("x.unused", 7, n, bytes(n))))
    peaks = []
    for path in (plain, big):
        tracemalloc.start()
        header = read_header(path)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert header.meta["x.unused"] == Skipped(7, n)
    assert peaks[1] - peaks[0] < 2 * 1024**2, peaks  # the window it is read through, not the array


def test_metadata_arrays_are_bounded_as_they_are_walked(tmp_path, monkeypatch):
    """3,000,000 empty nested arrays took 10 s to read; an array lmhead reads is at most MAX_ITEMS long."""
    from lmhead_cli.loading import gguf_header
    from lmhead_cli.loading.gguf import read_header

    n = 3_000_000
    nested = raw_gguf(tmp_path / "nested.gguf", kv=(ARCH, _array("x.nested", 9, n, struct.pack("<IQ", 0, 0) * n)))
    with pytest.raises(CorruptCheckpoint, match="x.nested is an array of 3,000,000 arrays; lmhead reads no array of "
                       "arrays larger than 65,536 items"):
        read_header(nested)
    inner = struct.pack("<IQ", 7, 40_000) + bytes(40_000)
    wide = raw_gguf(tmp_path / "wide.gguf", kv=(ARCH, _array("x.wide", 9, 2, inner * 2)))
    with pytest.raises(CorruptCheckpoint, match="x.wide is an array of arrays holding more than 65,536 items"):
        read_header(wide)
    monkeypatch.setattr(gguf_header, "MAX_ITEMS", 1000)
    kept = raw_gguf(tmp_path / "kept.gguf", kv=(ARCH, _array("tokenizer.ggml.token_type", 5, 1001, bytes(4004))))
    with pytest.raises(CorruptCheckpoint, match="tokenizer.ggml.token_type holds 1,001 items; lmhead reads arrays "
                       "of at most 1,000 items"):
        read_header(kept)
    out = cli("inspect", PROMPT, "--model", str(nested))
    assert out.exit_code == 1 and "x.nested is an array of 3,000,000 arrays" in out.stderr
    assert out.stderr.count("\n") == 1


@pytest.mark.parametrize("name", ["loop.gguf", "loop"])
def test_a_model_path_that_is_a_symlink_loop_is_named(tmp_path, name):
    """A GGUF (or a folder) path that is a symlink loop was reported as "no such file" ("no such folder")."""
    loop = tmp_path / name
    loop.symlink_to(loop)
    out = cli("inspect", PROMPT, "--model", str(loop))
    assert out.exit_code == 2 and out.stderr == (f"lmhead: error: {loop} cannot be read: it is a symbolic link loop "
                                                 "(its links lead back to themselves)\n"), out.output


TRUNCATE = """
import sys, gguf.quants
from pathlib import Path
import lmhead_cli
from lmhead_cli.errors import LmheadError
path = Path(sys.argv[1])
real = gguf.quants.dequantize
def cut(*args):  # the file is cut short while lmhead reads it
    if path.stat().st_size > 4096:
        with open(path, "r+b") as f:
            f.truncate(4096)
    return real(*args)
gguf.quants.dequantize = cut
try:
    lmhead_cli.load(str(path), device="cpu")
except LmheadError as e:
    print(e)
"""


def test_a_gguf_cut_short_while_it_is_read_is_one_line(gpt2, tmp_path):
    """A mapped file cut short killed the process with SIGBUS and no message; it is read, not mapped."""
    import subprocess
    import sys

    path = tmp_path / "cut.gguf"
    write_gguf(gpt2[1], path, "F32")
    size = path.stat().st_size
    run = subprocess.run([sys.executable, "-c", TRUNCATE, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert f"{path} changed while lmhead read it: it was {size:,} bytes, it is now 4,096 bytes" in run.stdout


def test_a_gguf_that_is_a_folder_or_missing(tmp_path):
    (tmp_path / "dir.gguf").mkdir()
    assert cli("inspect", PROMPT, "--model", str(tmp_path / "dir.gguf")).exit_code == 2  # a bad path: usage
    out = cli("inspect", PROMPT, "--model", str(tmp_path / "none.gguf"))
    assert out.exit_code == 2 and "no such file" in out.stderr and out.stderr.count("\n") == 1


# ---- every front end -------------------------------------------------------------------------------

def test_the_cli_says_what_was_dequantised_and_inspect_is_the_forward(gpt2, tmp_path):
    _, model = gpt2
    path = tmp_path / "m.gguf"
    written = write_gguf(model, path, "Q8_0")
    out = cli("inspect", PROMPT, "-k", "3", "--model", str(path), "--json")
    assert out.exit_code == 0, out.output
    assert (f"{path}: a GGUF gpt2 of file type MOSTLY_Q8_0 (18 F32, 10 Q8_0 tensors), dequantised to float32 by "
            "gguf.quants") in out.stderr
    twin, _ = gguf_oracle(model, written)
    with torch.no_grad():
        ref = twin(torch.tensor([PROMPT_IDS])).logits[0, -1]
    top = json.loads(out.stdout)["top"]
    assert [t["id"] for t in top] == torch.topk(ref, 3).indices.tolist()
    assert top[0]["logit"] == pytest.approx(float(ref.max()), abs=1e-4)
    params = cli("params", "--model", str(path))
    assert params.exit_code == 0, params.output
    bf = cli("inspect", PROMPT, "--model", str(path), "--dtype", "bfloat16")
    assert bf.exit_code == 0 and "dequantised to float32 by gguf.quants, then cast to bfloat16" in bf.stderr


def test_the_server_serves_a_gguf(gpt2, tmp_path):
    """`lmhead serve --model FILE.gguf`: echo's logprobs are transformers' log_softmax on the file's
    dequantised weights, at every position of the prompt."""
    from helpers import serving

    _, model = gpt2
    path = tmp_path / "served.gguf"
    twin, _ = gguf_oracle(model, write_gguf(model, path, "Q4_0"))
    with serving(path) as s:
        doc = web.post(s.url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    assert "dequantised to float32 by gguf.quants" in s.output
    lp = doc["choices"][0]["logprobs"]["token_logprobs"]
    with torch.no_grad():
        ref = torch.log_softmax(twin(torch.tensor([PROMPT_IDS])).logits[0].double(), -1)
    assert lp[0] is None
    for i, got in enumerate(lp[1:], start=1):
        assert got == pytest.approx(float(ref[i - 1, PROMPT_IDS[i]]), abs=1e-4)


def test_a_gpt2_gguf_on_transformers_engine_is_the_same_model(gpt2, tmp_path):
    """--engine transformers builds transformers' own GPT2LMHeadModel from the same dequantised state:
    the same logits as the oracle, and the same tie."""
    _, model = gpt2
    path = tmp_path / "q4.gguf"
    twin, _ = gguf_oracle(model, write_gguf(model, path, "Q4_0"))
    m = lmhead_cli.load(str(path), device="cpu", engine="transformers")
    assert m.loaded.engine.__class__.__name__ == "TransformersEngine" and m.loaded.tie.tied
    with torch.no_grad():
        ref = twin(torch.tensor([IDS])).logits[0]
    assert torch.allclose(lmhead_logits(m), ref, atol=1e-5, rtol=1e-5)
