"""`--model FILE.gguf`: a llama.cpp file (GGUF) -> the config, the float32 state dict and the tokenizer
that lmhead's loaders build from a checkpoint folder.

The header (metadata and tensor infos) is read and checked against the file's bytes by
loading/gguf_header.py (the gguf package's GGUFReader trusts it, and is slow on a vocabulary); the
tensors' data are views of the file mapped in memory. Then, before any tensor is dequantised:

* the architecture (general.architecture) must be one lmhead runs: gpt2 (lean GPT-2), llama or qwen2
  (lmhead's own Llama engine, engine/llama.py);
* the metadata lmhead reads must be whole numbers (or floats) in range, and every tensor's shape must
  be the one the metadata makes, with no tensor missing or left over;
* the tokenizer is built from tokenizer.ggml.* (loading/gguf_tokenizer.py) and checked on a probe.

Each tensor is then dequantised to float32 by gguf.quants.dequantize, the package's numpy port of
ggml's own dequantisation, and laid out under the names and layouts of the Hugging Face checkpoint
that llama.cpp's convert_hf_to_gguf.py made it from: GPT-2's Conv1D weights transposed back to
[in, out], Llama's q and k projections un-permuted (the converter interleaves each head's rotary
halves for ggml's rope). For lmhead's own Llama engine (`keep`) a quantised matrix is not dequantised:
it stays the file's blocks, read into memory as they are, and engine/quant.py multiplies them a chunk of
rows at a time. The tie: output.weight absent (llama.cpp then reads token_embd.weight as the
head), or present and equal to token_embd.weight after dequantisation, is a tied head.

Shapes: numpy's order, the reverse of GGUF's dims (token_embd.weight is (V, D)).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lmhead_cli.errors import CorruptCheckpoint, UnsupportedModel
from lmhead_cli.loading.checks import existing_file
from lmhead_cli.loading.gguf_header import Header, changed, check_header

ARCHITECTURES = ("gpt2", "llama", "qwen2")
# The metadata lmhead reads; the arrays of any other key are walked past unread (gguf_header.Skipped).
READ_KEYS = ("general.", "tokenizer.", *(f"{a}." for a in ARCHITECTURES))
# The most positions lmhead runs a file at: a Llama's context is a claim no tensor checks (RoPE has no
# table), and n_ctx bounds what a request without a token limit generates. Llama 3.1's 131,072; a file
# claiming more runs at this, announced.
MAX_CONTEXT = 1 << 17
_BLOCK = re.compile(r"^blk\.(\d+)\.")
PLAIN = {0: "<f4", 1: "<f2"}  # F32 and F16: stored as values, not blocks
SUFFIX = ".gguf"


def is_gguf(source: str) -> bool:
    """Whether `source` names a GGUF file: a path ending in .gguf (what llama.cpp's tools expect)."""
    return source.lower().endswith(SUFFIX)


@dataclass
class GGUFModel:
    """What a GGUF file holds, in the shapes lmhead's engines load."""

    config: dict  # a config.json dict: model_type gpt2 or llama
    state: dict  # name -> float32 torch tensor, Hugging Face names (GPT-2's without `transformer.`)
    tokenizer: object  # loading.tokenizer.GPT2Tokenizer
    file_type: str  # general.file_type's name, e.g. "MOSTLY_Q8_0", or "unset"
    types: dict  # tensor type name -> how many tensors of it ("Q8_0": 8, "F32": 17)
    notes: tuple[str, ...] = ()  # what the loader announces besides describe(): a context cut to MAX_CONTEXT
    kept: dict = field(default_factory=dict)  # type name -> how many matrices stay the file's blocks

    def describe(self, path, dtype: str) -> str:
        """The one line the loader announces: the file's own type and what was dequantised to what."""
        held = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items(), key=lambda kv: -kv[1]))
        then = ("" if dtype == "float32" else ", then quantised to lmhead's int8 (a scale per row)" if dtype == "int8"
                else f", then cast to {dtype}")
        if self.kept:
            kept = ", ".join(f"{n} {t}" for t, n in sorted(self.kept.items(), key=lambda kv: -kv[1]))
            return (f"{path}: a GGUF {self.config['model_type']} of file type {self.file_type} ({held} tensors): "
                    f"{kept} matrices kept as the file's blocks, the rest float32")
        return (f"{path}: a GGUF {self.config['model_type']} of file type {self.file_type} ({held} tensors), "
                f"dequantised to float32 by gguf.quants{then}")


class _Meta:
    """The file's metadata values, checked for the types lmhead reads them as, each one named on error."""

    def __init__(self, values: dict, path: Path):
        self.values, self.path = values, path

    def get(self, key: str):
        return self.values.get(key)

    def int(self, key: str, default: int | None = None, low: int = 1) -> int:
        value = self.get(key)
        if value is None:
            if default is None:
                raise CorruptCheckpoint(f"{self.path}: the GGUF metadata lacks {key}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CorruptCheckpoint(f"{self.path}: {key} must be a whole number of at least {low}, not {value!r}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key)
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            what = "missing" if value is None else f"{value!r}"
            raise CorruptCheckpoint(f"{self.path}: {key} must be a finite number above 0, not {what}")
        return float(value)

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.get(key)
        if value is not None and not isinstance(value, str):
            raise CorruptCheckpoint(f"{self.path}: {key} must be a string, not {str(value)[:40]}")
        return default if value is None else value


def read_header(path: Path) -> Header:
    """The checked header of the GGUF file at `path` (a regular file: not a folder, a FIFO nor a link
    loop), the arrays of keys lmhead does not read walked past unread."""
    existing_file(path)
    return check_header(path, keep=READ_KEYS)


def architecture(path: Path) -> str:
    """general.architecture of a GGUF file, read from its checked header without any tensor."""
    return _arch(_Meta(read_header(path).meta, path))


def _arch(meta: _Meta) -> str:
    arch = meta.string("general.architecture")
    if arch is None:
        raise CorruptCheckpoint(f"{meta.path}: the GGUF metadata lacks general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"{meta.path}: general.architecture is {arch!r}; lmhead runs GGUF files of "
                               f"{', '.join(ARCHITECTURES[:-1])} and {ARCHITECTURES[-1]}")
    return arch


def read_gguf(path: Path, header: Header | None = None, keep: bool = False) -> GGUFModel:
    """The GGUF file at `path` checked, its tokenizer built, its tensors dequantised to float32
    (`header`: read_header(path), when the caller has it already). `keep`: a Llama's or Qwen2's
    quantised matrices stay the file's blocks (engine/quant.py Blocks), for lmhead's own engine;
    `materialise` dequantises them for another."""
    import numpy as np
    import torch
    from gguf.constants import GGMLQuantizationType, LlamaFileType
    from gguf.quants import dequantize

    from lmhead_cli.loading.gguf_tokenizer import tokenizer_from_gguf

    header = header or read_header(path)
    meta = _Meta(header.meta, path)
    arch = _arch(meta)
    tensors = {t.name: t for t in header.tensors}
    if "token_embd.weight" not in tensors:
        raise CorruptCheckpoint(f"{path} holds no token_embd.weight (the embedding table)")
    embedding_shape = _shape(tensors["token_embd.weight"])
    if len(embedding_shape) != 2:
        raise CorruptCheckpoint(f"{path}: token_embd.weight is {_dims(embedding_shape)} ({len(embedding_shape)}-D); "
                                "the embedding table is 2-D, vocabulary × width")
    V = embedding_shape[0]
    _block_count(meta, f"{arch}.block_count", tensors)  # before a layout of that many blocks is built
    config, layout = (_gpt2 if arch == "gpt2" else _llama)(meta, V, arch)
    config["tie_word_embeddings"] = True  # until output.weight says otherwise (below)
    if arch != "gpt2" and "rope_freqs.weight" in tensors:  # Llama 3.1's rope scaling, as llama.cpp stores it
        layout["rope_freqs.weight"] = ("rope_freqs", (config["head_dim"] // 2,), None)
    notes = _bound_context(meta, arch, config)
    expected = {g: shape for g, (_, shape, _) in layout.items()}
    if "output.weight" in tensors:
        expected["output.weight"] = embedding_shape
    _check_shapes(path, arch, tensors, expected)
    tokenizer = tokenizer_from_gguf(meta, V, path, arch)
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key.removesuffix('_token_id')}_token_id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < V:
            config[key] = value

    state = {}
    keep = keep and arch != "gpt2"  # GPT-2's matrices are transposed for its Conv1D: dequantised
    # Read, not mapped: a file cut short under a mapping kills the process with SIGBUS; a short read is
    # one line. One tensor's bytes are held at a time, beside what it dequantises to.
    with open(path, "rb", buffering=0) as f:
        _unchanged(f, header, path)
        for gname, t in tensors.items():
            qtype = GGMLQuantizationType(t.type)
            raw = _read(f, t, header, path)
            if qtype in PLAIN:  # gguf.quants.dequantize takes these as values, the rest as (rows, bytes)
                raw = raw.view(PLAIN[qtype])
            else:
                raw = raw.reshape(-1, t.nbytes // (math.prod(t.dims) // t.dims[0]))
            if keep and qtype not in PLAIN and qtype != GGMLQuantizationType.BF16 and len(t.dims) == 2:
                from lmhead_cli.engine.quant import Blocks

                w = Blocks(torch.from_numpy(raw), qtype, t.dims[0])  # the file's bytes, as they are
            else:
                values = dequantize(raw, qtype).reshape(_shape(t))  # float32, numpy's order
                w = torch.from_numpy(values if values.flags.writeable else values.copy())
            if gname == "output.weight":
                state["head"] = w
                continue
            name, _, transform = layout[gname]
            state[name] = transform(w) if transform else w
        _unchanged(f, header, path)
    embedding = "wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    head = state.pop("head", None)
    if head is not None:
        state["lm_head.weight"] = head
        same = getattr(head, "same_as", None)  # quantised blocks: the same type and bytes
        config["tie_word_embeddings"] = bool(same(state[embedding]) if same else torch.equal(head, state[embedding]))
    if "rope_freqs" in state:  # a divisor per rotary frequency (llama.cpp's form of Llama 3.1's scaling)
        config["rope_freqs"] = state.pop("rope_freqs").tolist()
    file_type = meta.get("general.file_type")
    known = isinstance(file_type, int) and file_type in LlamaFileType._value2member_map_
    ftype = "unset" if file_type is None else LlamaFileType(file_type).name if known else f"{file_type!r:.20} (unknown)"
    types = Counter(GGMLQuantizationType(t.type).name for t in tensors.values())
    kept = Counter(t.kind for t in state.values() if hasattr(t, "kind"))
    return GGUFModel(config, state, tokenizer, ftype, dict(types), notes, dict(kept))


def materialise(state: dict, config: dict, path: Path) -> dict:
    """`state` with every quantised matrix (Blocks) dequantised to float32, for an engine other than
    lmhead's own Llama; UnsupportedModel for rope_freqs, which only that engine applies."""
    if config.get("rope_freqs"):
        raise UnsupportedModel(f"{path} holds rope_freqs.weight (llama.cpp's form of Llama 3.1's rope scaling), "
                               "which transformers' Llama does not read; run it on the lean engine")
    return {k: t.dequantise() if hasattr(t, "dequantise") else t for k, t in state.items()}


def _unchanged(f, header: Header, path: Path) -> None:
    """CorruptCheckpoint unless the open file still has the size and time its header was read at."""
    info = os.fstat(f.fileno())
    if info.st_size != header.size or (header.mtime_ns and info.st_mtime_ns != header.mtime_ns):
        raise changed(path, header.size)


def _read(f, t, header: Header, path: Path):
    """The bytes of tensor `t` as a writable numpy uint8 array, read whole, or CorruptCheckpoint when the
    file ends before them (it shrank since its header was read)."""
    import numpy as np

    raw = np.empty(t.nbytes, dtype=np.uint8)
    view, got = memoryview(raw), 0
    f.seek(t.start)
    while got < t.nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise changed(path, header.size)
        got += n
    return raw


def _block_count(meta: _Meta, key: str, tensors: dict) -> int:
    """`key` (the block count), checked against the blocks the tensors' names hold (blk.0 … blk.N-1)
    before anything of that size is built: a count of 2^40 over a 17 kB file is one line."""
    L = meta.int(key)
    held = sorted({int(m.group(1)) for n in tensors if (m := _BLOCK.match(n))})
    if len(held) != L or held[-1] != L - 1:
        what = f"{len(held):,} blocks (blk.{held[0]} … blk.{held[-1]})" if held else "no blocks"
        raise CorruptCheckpoint(f"{meta.path}: {key} is {L:,}, but the file holds {what}")
    return L


def _bound_context(meta: _Meta, arch: str, config: dict) -> tuple[str, ...]:
    """A Llama's context cut to MAX_CONTEXT, with the line that says so (GPT-2's is its position table's
    rows, checked against the tensor)."""
    P = config.get("max_position_embeddings")
    if arch == "gpt2" or P <= MAX_CONTEXT:
        return ()
    config["max_position_embeddings"] = MAX_CONTEXT
    return (f"{meta.path}: {arch}.context_length is {P:,}, more than lmhead runs; its context is taken as "
            f"{MAX_CONTEXT:,} positions (Llama 3.1's), which bounds what a request without a token limit "
            "generates",)


def _shape(t) -> tuple[int, ...]:
    """A tensor's shape in numpy's order (GGUF lists the row length first)."""
    return tuple(reversed(t.dims))


def _check_shapes(path: Path, arch: str, tensors: dict, expected: dict) -> None:
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CorruptCheckpoint(f"{path} lacks {', '.join(missing[:3])}{more}, which its {arch} metadata asks for")
    extra = [n for n in tensors if n not in expected]
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise CorruptCheckpoint(f"{path} holds {', '.join(extra[:3])}{more}, which a {arch} of its metadata has "
                                "no place for")
    for name, shape in expected.items():
        held = _shape(tensors[name])
        if held != tuple(shape):
            raise CorruptCheckpoint(f"{path}: {name} is {_dims(held)}, but the metadata makes it {_dims(shape)}")


def _dims(shape) -> str:
    return " × ".join(f"{n:,}" for n in shape)


def _transpose(w):
    return w.t().contiguous()


# ---- the architectures: metadata -> a config.json dict, and GGUF name -> (HF name, shape, transform) ----

def _gpt2(meta: _Meta, V: int, arch: str = "gpt2") -> tuple[dict, dict]:
    """GPT-2 as convert_hf_to_gguf.py writes it: c_attn, c_proj, c_fc stored as [out, in]."""
    P = meta.int("gpt2.context_length")
    d = meta.int("gpt2.embedding_length")
    L = meta.int("gpt2.block_count")
    H = meta.int("gpt2.attention.head_count")
    ff = meta.int("gpt2.feed_forward_length", default=4 * d)
    eps = meta.float("gpt2.attention.layer_norm_epsilon")
    if d % H:
        raise CorruptCheckpoint(f"{meta.path}: gpt2.embedding_length {d} is not divisible by "
                                f"gpt2.attention.head_count {H}")
    config = {"model_type": "gpt2", "vocab_size": V, "n_positions": P, "n_ctx": P, "n_embd": d, "n_layer": L,
              "n_head": H, "n_inner": ff, "layer_norm_epsilon": eps, "activation_function": "gelu_new"}
    layout = {"token_embd.weight": ("wte.weight", (V, d), None), "position_embd.weight": ("wpe.weight", (P, d), None),
              "output_norm.weight": ("ln_f.weight", (d,), None), "output_norm.bias": ("ln_f.bias", (d,), None)}
    for i in range(L):
        for g, hf, shape, t in (("attn_norm", "ln_1", (d,), None), ("attn_qkv", "attn.c_attn", (3 * d, d), _transpose),
                                ("attn_output", "attn.c_proj", (d, d), _transpose), ("ffn_norm", "ln_2", (d,), None),
                                ("ffn_up", "mlp.c_fc", (ff, d), _transpose),
                                ("ffn_down", "mlp.c_proj", (d, ff), _transpose)):
            layout[f"blk.{i}.{g}.weight"] = (f"h.{i}.{hf}.weight", shape, t)
            layout[f"blk.{i}.{g}.bias"] = (f"h.{i}.{hf}.bias", (shape[0],), None)
    return config, layout


def _unpermute(heads: int):
    """The inverse of convert_hf_to_gguf.py's LlamaModel.permute for `heads` heads: (n, D) -> (n, D)."""
    def undo(w):
        n = w.shape[0]
        if hasattr(w, "qtype"):  # quantised blocks: whole rows move (a copy of q's and k's blocks)
            import torch

            return w.take(torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n))
        return w.reshape(heads, n // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).contiguous()
    return undo


def _llama(meta: _Meta, V: int, arch: str = "llama") -> tuple[dict, dict]:
    """Llama as convert_hf_to_gguf.py writes it: q and k permuted for ggml's rope, no biases; Qwen2 the
    same keys under qwen2.*, q and k as transformers has them, with biases on q, k and v."""
    P = meta.int(f"{arch}.context_length")
    d = meta.int(f"{arch}.embedding_length")
    L = meta.int(f"{arch}.block_count")
    H = meta.int(f"{arch}.attention.head_count")
    KV = meta.int(f"{arch}.attention.head_count_kv", default=H)
    ff = meta.int(f"{arch}.feed_forward_length")
    eps = meta.float(f"{arch}.attention.layer_norm_rms_epsilon")
    theta = meta.float(f"{arch}.rope.freq_base", default=10000.0)
    if d % H and meta.get(f"{arch}.attention.key_length") is None:
        raise CorruptCheckpoint(f"{meta.path}: {arch}.attention.head_count {H:,} does not divide "
                                f"{arch}.embedding_length {d:,}, and the file gives no {arch}.attention.key_length "
                                "(the head width)")
    hd = meta.int(f"{arch}.attention.key_length", default=d // H)
    if meta.int(f"{arch}.attention.value_length", default=hd) != hd:
        raise UnsupportedModel(f"{meta.path}: {arch}.attention.value_length differs from key_length; lmhead runs "
                               f"{arch} files whose heads have one width")
    rot = meta.int(f"{arch}.rope.dimension_count", default=hd)
    if rot != hd:
        raise UnsupportedModel(f"{meta.path}: {arch}.rope.dimension_count is {rot}, not the head width {hd}; partial "
                               "rotary embeddings are not a Llama transformers builds")
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.string(f"{arch}.rope.scaling.type", default="none")
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": meta.float(f"{arch}.rope.scaling.factor")}
    elif scaling != "none":
        raise UnsupportedModel(f"{meta.path}: {arch}.rope.scaling.type is {scaling!r}; lmhead runs {arch} GGUF files "
                               "without rope scaling, with linear scaling, or with llama.cpp's rope_freqs (Llama 3.1)")
    if H % KV or hd % 2:
        raise CorruptCheckpoint(f"{meta.path}: {arch}.attention.head_count {H} is not a multiple of head_count_kv "
                                f"{KV}, or the head width {hd} is odd")
    config = {"model_type": arch, "vocab_size": V, "hidden_size": d, "intermediate_size": ff,
              "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": hd,
              "max_position_embeddings": P, "rms_norm_eps": eps, "hidden_act": "silu",
              "rope_parameters": rope, "bos_token_id": None, "eos_token_id": None}
    qwen = arch == "qwen2"
    layout = {"token_embd.weight": ("model.embed_tokens.weight", (V, d), None),
              "output_norm.weight": ("model.norm.weight", (d,), None)}
    for i in range(L):
        p = f"model.layers.{i}."
        for g, hf, shape, t in (("attn_norm", "input_layernorm", (d,), None),
                                ("attn_q", "self_attn.q_proj", (H * hd, d), None if qwen else _unpermute(H)),
                                ("attn_k", "self_attn.k_proj", (KV * hd, d), None if qwen else _unpermute(KV)),
                                ("attn_v", "self_attn.v_proj", (KV * hd, d), None),
                                ("attn_output", "self_attn.o_proj", (d, H * hd), None),
                                ("ffn_norm", "post_attention_layernorm", (d,), None),
                                ("ffn_gate", "mlp.gate_proj", (ff, d), None), ("ffn_up", "mlp.up_proj", (ff, d), None),
                                ("ffn_down", "mlp.down_proj", (d, ff), None)):
            layout[f"blk.{i}.{g}.weight"] = (p + hf + ".weight", shape, t)
        if qwen:
            for g, hf, n in (("attn_q", "q_proj", H * hd), ("attn_k", "k_proj", KV * hd), ("attn_v", "v_proj", KV * hd)):
                layout[f"blk.{i}.{g}.bias"] = (f"{p}self_attn.{hf}.bias", (n,), None)
    return config, layout
