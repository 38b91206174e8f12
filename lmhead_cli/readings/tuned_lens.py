"""The tuned lens (Belrose et al. 2023): each layer's residual vector read through a learned affine
translator before the model's own final norm and head, instead of as it is (the logit lens).

Layer i's translator (i = 0 the embeddings, ..., L − 1 the block before the last) maps

    h -> h + h · A_iᵀ + b_i          A_i (D, D), b_i (D,)

and is initialised at A = 0, b = 0: the identity, where the tuned lens is the logit lens. The last
layer (block L) is the model's own output and has no translator. Training (readings/tune_lens.py)
fits A and b to the model's final distribution (KL to it).

The file is safetensors: `weight` (L, D, D) and `bias` (L, D), float32, with the model's identity in
its metadata (architecture, layers, width, vocabulary, two fingerprints of the embedding table: as
numbers, and as lmhead's int8 codes), checked at load: a lens for another model is refused by name, a
damaged file or a wrong shape is one line. The translators are float and read the residual stream, which
is float in every dtype lmhead loads, int8 included: a lens trained on the float model reads the same
model loaded in int8 (its int8 codes are the float table's, quantised the same way at load).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lmhead_cli.errors import BadPath, CorruptCheckpoint, UnsupportedModel, WrongLens
from lmhead_cli.head import ordered_sum
from lmhead_cli.loading.sources import Loaded

FORMAT = "lmhead-tuned-lens/1"
BUNDLED = "bundled"  # `--tuned bundled`: the lens that ships for bundled:tiny
BUNDLED_FOR = "bundled:tiny"
BUNDLED_FILE = "tuned-lens.safetensors"  # in lmhead_cli/data/bundled-tiny/
MAX_HEADER = 1 << 20  # bytes of JSON header a lens file may have: its metadata is a few hundred
FLOATING = ("F16", "BF16", "F32", "F64")  # the dtypes a lens's tensors may be stored in
# A lens's values lie within ±MAX_VALUE: trained translators stay near 0 (the bundled lens's largest is
# 0.13); larger ones would carry a residual vector past float32's range in the final norm's squares.
MAX_VALUE = 1e6
MAX_TRAINED_DEPTH = 8  # the training record is a flat object of numbers and short lists


@dataclass(frozen=True)
class Identity:
    """What a lens belongs to: checked field by field against the loaded model."""

    model: str  # the source it was trained on, as the user named it ("bundled:tiny")
    architecture: str  # the config's model_type ("gpt2", "llama")
    n_layer: int
    d_model: int
    vocab: int
    embedding: str  # sha256 of the embedding table rounded to bfloat16 (the same for every float dtype)
    # sha256 of the embedding table's int8 codes (engine/int8.py's quantise: the codes an int8 load makes);
    # None in a file written before it was recorded
    embedding_int8: str | None = None

    def describe(self) -> str:
        return f"{self.model} ({self.architecture}, {self.n_layer} layers, width {self.d_model}, vocabulary {self.vocab:,})"


@dataclass
class TunedLens:
    """The translators of one model: weight (L, D, D), bias (L, D), float32."""

    identity: Identity
    weight: torch.Tensor
    bias: torch.Tensor
    name: str = ""  # where it came from: a path, or "bundled"
    trained: dict | None = None  # how it was trained (steps, tokens, seconds...), from the file's metadata

    def translate(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s residual vectors (..., D) -> translated (..., D), in h's dtype; the last
        layer (no translator) is returned as it is."""
        if layer >= self.weight.shape[0]:
            return h
        x = h.float()
        return (x + x @ self.weight[layer].T + self.bias[layer]).to(h.dtype)


def embedding_fingerprint(engine) -> str:
    """sha256 of the embedding table (V, D) rounded to bfloat16: one value for a model loaded in float32,
    float16 or bfloat16 alike (int8 tables are dequantised first, so they fingerprint differently)."""
    table = engine.embedding_weight
    if not table.is_floating_point():
        table = engine.head_rows(torch.arange(table.shape[0], device=table.device)) if engine.tied else None
        if table is None:
            raise UnsupportedModel("the tuned lens needs the embedding table as numbers; int8 weights with an "
                                   "untied head have none: load the model in float32")
    digest = hashlib.sha256()
    for rows in torch.split(table.detach(), 4096):  # bounded: 4,096 rows at a time
        digest.update(rows.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def int8_fingerprint(engine) -> str:
    """sha256 of the embedding table's int8 codes (V, D): an int8 model's own codes, or a float model's
    table quantised as an int8 load quantises it (per row, engine/int8.py), 4,096 rows at a time."""
    from lmhead_cli.engine.int8 import quantise

    table = engine.embedding_weight
    digest = hashlib.sha256()
    for rows in torch.split(table.detach(), 4096):
        codes = rows if rows.dtype == torch.int8 else quantise(rows)[0]
        digest.update(codes.cpu().numpy().tobytes())
    return digest.hexdigest()


def is_int8(engine) -> bool:
    return not engine.embedding_weight.is_floating_point()


def identity_of(loaded: Loaded, fingerprints: bool = True) -> Identity:
    """The identity of the loaded model, as a lens file records it (without `fingerprints`: its shape
    only, the two fingerprints empty)."""
    eng = loaded.engine
    return Identity(model=loaded.source, architecture=str(loaded.config.get("model_type") or eng.name),
                    n_layer=eng.n_layer, d_model=int(eng.head_weight.shape[1]), vocab=eng.vocab_size,
                    embedding=embedding_fingerprint(eng) if fingerprints else "",
                    embedding_int8=int8_fingerprint(eng) if fingerprints else None)


def check_readable(loaded: Loaded) -> None:
    """UnsupportedModel unless the model has the parts a lens reads through: a final norm that is a
    LayerNorm or an RMSNorm (the translator sits before it)."""
    from lmhead_cli.engine.base import linearise_norm

    norm = loaded.engine.final_norm_module
    if norm is None or linearise_norm(norm) is None:
        kind = "none" if norm is None else type(norm).__name__
        raise UnsupportedModel(f"the tuned lens reads through the final norm, which must be a LayerNorm or an "
                               f"RMSNorm; {loaded.source}'s is {kind}")


def identity_lens(loaded: Loaded) -> TunedLens:
    """Translators at A = 0, b = 0: the tuned lens that reads exactly as the logit lens."""
    check_readable(loaded)
    eng = loaded.engine
    L, D = eng.n_layer, int(eng.head_weight.shape[1])
    return TunedLens(identity_of(loaded), torch.zeros(L, D, D), torch.zeros(L, D), name="identity")


def bundled_path() -> Path:
    from lmhead_cli.loading.bundled import data_root

    return data_root() / "bundled-tiny" / BUNDLED_FILE


def save_lens(lens: TunedLens, path: str | Path) -> Path:
    """Write `lens` as safetensors (weight, bias; the identity and training record as metadata), whole or
    not at all (outputs.replace_with: a temporary file beside it, renamed over it, removed on failure)."""
    from safetensors.torch import save_file

    from lmhead_cli.outputs import replace_with

    meta = {"format": FORMAT, **{k: str(v) for k, v in vars(lens.identity).items() if v is not None}}
    if lens.trained:
        meta["trained"] = json.dumps(lens.trained)
    tensors = {"weight": lens.weight.detach().float().contiguous().cpu(),
               "bias": lens.bias.detach().float().contiguous().cpu()}
    try:
        replace_with(path, lambda tmp: save_file(tensors, tmp, metadata=meta), 0o644)
    except OSError as e:
        raise CorruptCheckpoint(f"cannot write the tuned lens to {path}: {e.strerror or e}") from None
    return Path(path)


def _corrupt(name: str, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"the tuned lens {name} cannot be read: {why}")


def read_lens(path: str | Path, name: str | None = None, model: Identity | None = None) -> TunedLens:
    """A lens file, checked for what it claims before its tensors are read (a regular file, the format,
    the identity, the tensors' names, dtypes and shapes), then for its values (finite, within
    ±MAX_VALUE); one line naming the file as it was given otherwise: BadPath for a path that is not a
    file (missing, empty, a folder, a FIFO: never opened), CorruptCheckpoint for a damaged file.
    `model` (identity_of without fingerprints): a lens of another shape is WrongLens before its
    tensors, however large, are read."""
    from safetensors import safe_open

    from lmhead_cli.loading.checks import not_a_file

    name = name or os.fspath(path)
    if not name:
        raise BadPath("the tuned lens path is empty; give a file from lmhead tune-lens, or 'bundled'")
    why = not_a_file(path)  # stat() only: a FIFO is refused, never opened (it would wait for a writer)
    if why is not None:
        raise BadPath(f"the tuned lens {name} cannot be read: {why}")
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise BadPath(f"the tuned lens {name} cannot be read: {e.strerror or type(e).__name__}") from None
    if len(head) < 8 or int.from_bytes(head, "little") > MAX_HEADER:
        raise _corrupt(name, "it is not a safetensors file (damaged or another format)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            ident = _identity(meta, name)
            if model is not None:
                _same_shape(ident, model, name)
            L, D = ident.n_layer, ident.d_model
            want = {"weight": [L, D, D], "bias": [L, D]}
            if sorted(f.keys()) != sorted(want):
                raise _corrupt(name, f"it holds {sorted(f.keys())}, not weight and bias")
            for key, shape in want.items():
                part = f.get_slice(key)
                if part.get_dtype() not in FLOATING:
                    raise _corrupt(name, f"{key} holds {part.get_dtype()} values; a lens holds floating-point "
                                         f"numbers ({', '.join(FLOATING)}; tune-lens writes F32)")
                got = list(part.get_shape())
                if got != shape:
                    raise _corrupt(name, f"{key} has shape {got}, not {shape} for {L} layers of width {D}")
            weight, bias = f.get_tensor("weight"), f.get_tensor("bias")
    except (CorruptCheckpoint, BadPath, WrongLens):
        raise
    except Exception as e:  # safetensors' own error for a truncated or garbled file
        raise _corrupt(name, f"damaged ({type(e).__name__}: {str(e)[:120]})") from None
    for key, t in (("weight", weight), ("bias", bias)):  # in the stored dtype: an F64 1e300 is not "infinite"
        if not torch.isfinite(t).all():
            raise _corrupt(name, f"{key} holds NaN or infinite values")
        largest = float(t.abs().max()) if t.numel() else 0.0
        if largest > MAX_VALUE:
            raise _corrupt(name, f"{key} holds a value of size {largest:.3g}; a lens's values lie within "
                                 f"±{MAX_VALUE:g} (trained ones stay near 0), or the translated vectors leave "
                                 "float32's range in the final norm")
    return TunedLens(ident, weight.float(), bias.float(), name=name, trained=_trained(meta, name))


def _identity(meta: dict, name: str) -> Identity:
    """The model's identity from a lens file's metadata (safetensors' metadata: strings only)."""
    if meta.get("format") != FORMAT:
        raise _corrupt(name, f"it is not a tuned lens (its metadata has no format {FORMAT!r})")
    try:
        ident = Identity(model=meta["model"], architecture=meta["architecture"], n_layer=int(meta["n_layer"]),
                         d_model=int(meta["d_model"]), vocab=int(meta["vocab"]), embedding=meta["embedding"],
                         embedding_int8=meta.get("embedding_int8"))
    except (KeyError, ValueError) as e:
        raise _corrupt(name, f"its metadata lacks the model's identity ({e})") from None
    if min(ident.n_layer, ident.d_model, ident.vocab) < 1:
        raise _corrupt(name, "its metadata gives a layer count, width or vocabulary below 1")
    return ident


def _trained(meta: dict, name: str) -> dict | None:
    """How the lens was trained (metadata "trained": a JSON object), None when the file does not say.
    Nesting is bounded before json.loads (a deeply nested record made it raise RecursionError)."""
    text = meta.get("trained")
    if not text:
        return None
    depth = most = 0
    for ch in text:  # brackets inside strings count too: a bound, not a parse
        if ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth -= 1
    if most > MAX_TRAINED_DEPTH:
        raise _corrupt(name, f"its training record (metadata 'trained') nests {most:,} deep; lmhead reads one "
                             f"nested at most {MAX_TRAINED_DEPTH} deep")
    try:
        trained = json.loads(text)
    except ValueError:
        trained = None
    if not isinstance(trained, dict):
        raise _corrupt(name, "its training record (metadata 'trained') is not a JSON object")
    return trained


def check_lens(loaded: Loaded, lens: TunedLens) -> TunedLens:
    """`lens`, if it was trained for the loaded model; WrongLens naming both otherwise."""
    check_readable(loaded)
    mine = identity_of(loaded, fingerprints=False)
    theirs = lens.identity
    _same_shape(theirs, mine, lens.name)
    eng = loaded.engine
    if is_int8(eng):  # its table is codes: compared code for code with the lens's model quantised alike
        if theirs.embedding_int8 is None:
            raise WrongLens(f"the tuned lens {lens.name} records no fingerprint of its model's int8 codes (it "
                            f"was written by an older lmhead), so it cannot be checked against {mine.model} in "
                            "int8: load the model in float32, or write the lens again with lmhead tune-lens")
        if theirs.embedding_int8 == int8_fingerprint(eng):
            return lens
    elif theirs.embedding == embedding_fingerprint(eng) or (
            theirs.embedding_int8 is not None and theirs.embedding_int8 == int8_fingerprint(eng)):
        return lens  # the same table, or (a lens trained on the int8 load) the same codes
    raise WrongLens(f"the tuned lens {lens.name} is for {theirs.model}, whose embedding table is not "
                    f"{mine.model}'s (same shape, other weights)")


def _same_shape(theirs: Identity, mine: Identity, name: str) -> None:
    if (theirs.architecture, theirs.n_layer, theirs.d_model, theirs.vocab) != \
            (mine.architecture, mine.n_layer, mine.d_model, mine.vocab):
        raise WrongLens(f"the tuned lens {name} is for {theirs.describe()}; this model is {mine.describe()}")


def load_lens(loaded: Loaded, where: str | Path) -> TunedLens:
    """The lens at `where` (a path, or "bundled": the one that ships for bundled:tiny), checked against
    the loaded model: WrongLens, naming both, if it was trained for another one."""
    check_readable(loaded)
    if str(where) == BUNDLED:
        if loaded.source != BUNDLED_FOR:
            raise WrongLens(f"the bundled tuned lens is {BUNDLED_FOR}'s; {loaded.source} has none: "
                            f"train one with lmhead tune-lens --model {loaded.source}")
        lens = read_lens(bundled_path(), name=BUNDLED)
    else:
        lens = read_lens(where, model=identity_of(loaded, fingerprints=False))
    return check_lens(loaded, lens)


@torch.inference_mode()
def mean_kl_to_final(loaded: Loaded, ids: list[int], lens: TunedLens | None = None) -> dict[str, list[float]]:
    """KL(final ‖ each layer's reading), in nats, averaged over every position of `ids` (at most n_ctx
    tokens, one forward): {"logit": [L + 1 values]} and, with `lens`, "tuned" too. Readings go through
    the model's own final norm and head, as `lens` reads them. Memory: one layer's (T, V) at a time."""
    eng = loaded.engine
    if len(ids) > eng.n_ctx:
        raise ValueError(f"{len(ids)} tokens exceed the context of {eng.n_ctx}")
    x = torch.tensor([ids], device=eng.device)  # (1, T)
    resid = list(eng.residuals(x))  # L + 1 × (1, T, D)

    def logprobs(h: torch.Tensor) -> torch.Tensor:  # (1, T, D) -> (T, V) float32
        return torch.log_softmax(eng.head(eng.final_norm(h))[0].float(), -1)

    final = logprobs(resid[-1])
    p = final.exp()
    neg_entropy = ordered_sum(p * final)  # (T,)
    out: dict[str, list[float]] = {"logit": []}
    if lens is not None:
        out["tuned"] = []
    for layer, h in enumerate(resid):
        out["logit"].append(float((neg_entropy - ordered_sum(p * logprobs(h))).double().mean()))
        if lens is not None:
            out["tuned"].append(float((neg_entropy - ordered_sum(p * logprobs(lens.translate(layer, h)))).double().mean()))
    return out
