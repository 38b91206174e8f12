"""Whether the output matrix W_out is the embedding table E: the engine's objects, the config and what
the checkpoint file stores, under the model's own parameter names."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmhead_cli.engine.base import Engine, TieNames


@dataclass(frozen=True)
class TieReport:
    """Whether the output matrix W_out is the embedding table E, and the evidence."""

    tied: bool  # the head's weight is the embedding's weight object
    same_object: bool  # the head's weight is the embedding's (e.g. lm_head.weight is wte.weight)
    same_data_ptr: bool
    config_tie_word_embeddings: bool
    file_has_lm_head: bool | None  # the file stores the head's own weight; None: no file (random weights)
    file_lm_head_equals_wte: bool | None  # that stored head equals the stored embedding
    head_name: str  # the model's own names, e.g. "lm_head.weight" and "model.embed_tokens.weight"
    embedding_name: str
    shape: tuple[int, int]  # (V, D)
    # c when the model soft-caps its own logits after the head (Gemma-2's final_logit_softcapping), else None
    own_softcap: float | None = None
    # how the shared (or head's) matrix is stored: "float32", ..., or "int8 table + float32 scale per row"
    storage: str = "float32"


def file_tie(state: dict[str, torch.Tensor], names: TieNames) -> tuple[bool, bool | None]:
    """What the checkpoint file stores: (its own head weight?, that head equal to the stored embedding?
    None when either is absent)."""
    head, embedding = _stored(state, names.head), _stored(state, names.embedding)
    if hasattr(head, "same_as"):  # a GGUF's quantised blocks (engine/quant.py): the same type and bytes
        return True, head.same_as(embedding) if hasattr(embedding, "same_as") else False
    return head is not None, (torch.equal(head, embedding) if head is not None and embedding is not None else None)


def tie_report(eng: Engine, stored: tuple[bool, bool | None] | None, config_tied: bool) -> TieReport:
    """Whether the engine's head weight is its embedding weight, under the model's own names, and what
    the checkpoint file stores (`file_tie`; None for random weights)."""
    names = eng.tie_names
    head_w, emb_w = eng.head_weight, eng.embedding_weight
    return TieReport(
        tied=head_w is emb_w,
        same_object=head_w is emb_w,
        same_data_ptr=head_w.data_ptr() == emb_w.data_ptr(),
        config_tie_word_embeddings=config_tied,
        file_has_lm_head=None if stored is None else stored[0],
        file_lm_head_equals_wte=None if stored is None else stored[1],
        head_name=names.head,
        embedding_name=names.embedding,
        shape=tuple(head_w.shape),
        own_softcap=eng.own_stages.get("softcap"),
        storage="int8 table + float32 scale per row" if eng.weight_format == "int8" else eng.weight_format,
    )


def _stored(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The file's tensor for the model's parameter `name` (file names are normalised: no `transformer.`)."""
    return state.get(name, state.get(name.removeprefix("transformer.")))
