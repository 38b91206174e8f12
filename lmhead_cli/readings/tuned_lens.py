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
from dataclasses import dataclass
from pathlib import Path

import torch

from lmhead_cli.errors import BadPath, CorruptCheckpoint, UnsupportedModel, WrongLens
from lmhead_cli.loading.sources import Loaded

FORMAT = "lmhead-tuned-lens/1"
BUNDLED = "bundled"  # `--tuned bundled`: the lens that ships for bundled:tiny
BUNDLED_FOR = "bundled:tiny"
BUNDLED_FILE = "tuned-lens.safetensors"  # in lmhead_cli/data/bundled-tiny/
MAX_HEADER = 1 << 20  # bytes of JSON header a lens file may have: its metadata is a few hundred


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
    """Write `lens` as safetensors (weight, bias; the identity and training record as metadata),
    atomically: a file that is there is whole."""
    import os
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    meta = {"format": FORMAT, **{k: str(v) for k, v in vars(lens.identity).items() if v is not None}}
    if lens.trained:
        meta["trained"] = json.dumps(lens.trained)
    tensors = {"weight": lens.weight.detach().float().contiguous().cpu(),
               "bias": lens.bias.detach().float().contiguous().cpu()}
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tuned-lens-", dir=path.parent or ".")
        os.close(fd)
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        raise CorruptCheckpoint(f"cannot write the tuned lens to {path}: {e.strerror or e}") from None
    return path


def _corrupt(name: str, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"the tuned lens {name} cannot be read: {why}")


def read_lens(path: str | Path, name: str | None = None) -> TunedLens:
    """A lens file, checked for what it claims (format, identity, the tensors' shapes and values)
    before its tensors are read; one line naming the file otherwise."""
    from safetensors import safe_open

    path = Path(path)
    name = name or str(path)
    if path.is_dir():  # a path that cannot be read as a file is a usage error, as every bad path is
        raise BadPath(f"the tuned lens {name} cannot be read: it is a folder")
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
            if meta.get("format") != FORMAT:
                raise _corrupt(name, f"it is not a tuned lens (its metadata has no format {FORMAT!r})")
            try:
                ident = Identity(model=meta["model"], architecture=meta["architecture"], n_layer=int(meta["n_layer"]),
                                 d_model=int(meta["d_model"]), vocab=int(meta["vocab"]), embedding=meta["embedding"],
                                 embedding_int8=meta.get("embedding_int8"))
            except (KeyError, ValueError) as e:
                raise _corrupt(name, f"its metadata lacks the model's identity ({e})") from None
            L, D = ident.n_layer, ident.d_model
            want = {"weight": [L, D, D], "bias": [L, D]}
            if sorted(f.keys()) != sorted(want):
                raise _corrupt(name, f"it holds {sorted(f.keys())}, not weight and bias")
            for key, shape in want.items():
                got = list(f.get_slice(key).get_shape())
                if got != shape:
                    raise _corrupt(name, f"{key} has shape {got}, not {shape} for {L} layers of width {D}")
            weight, bias = f.get_tensor("weight").float(), f.get_tensor("bias").float()
    except CorruptCheckpoint:
        raise
    except Exception as e:  # safetensors' own error for a truncated or garbled file
        raise _corrupt(name, f"damaged ({type(e).__name__}: {str(e)[:120]})") from None
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise _corrupt(name, "it holds NaN or infinite values")
    trained = None
    if meta.get("trained"):
        try:
            trained = json.loads(meta["trained"])
        except ValueError:
            trained = None
    return TunedLens(ident, weight, bias, name=name, trained=trained)


def check_lens(loaded: Loaded, lens: TunedLens) -> TunedLens:
    """`lens`, if it was trained for the loaded model; WrongLens naming both otherwise."""
    check_readable(loaded)
    mine = identity_of(loaded, fingerprints=False)
    theirs = lens.identity
    same_shape = (theirs.architecture, theirs.n_layer, theirs.d_model, theirs.vocab) == \
        (mine.architecture, mine.n_layer, mine.d_model, mine.vocab)
    if not same_shape:
        raise WrongLens(f"the tuned lens {lens.name} is for {theirs.describe()}; this model is {mine.describe()}")
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
        lens = read_lens(where)
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
    neg_entropy = (p * final).sum(-1)  # (T,)
    out: dict[str, list[float]] = {"logit": []}
    if lens is not None:
        out["tuned"] = []
    for layer, h in enumerate(resid):
        out["logit"].append(float((neg_entropy - (p * logprobs(h)).sum(-1)).double().mean()))
        if lens is not None:
            out["tuned"].append(float((neg_entropy - (p * logprobs(lens.translate(layer, h))).sum(-1)).double().mean()))
    return out
