"""The parameter account of a GPT-2: where the parameters live, what tying saves, what the head costs.

Two ways to the same account, and a test holds them equal:
- `account_from_config`: arithmetic on a config dict (Hugging Face config.json keys). Instant, no weights.
- `account_from_tensors`: the real tensors of a loaded model, shared storage counted once.

No torch import anywhere in this module: tensors are duck-typed (.numel(), .data_ptr(), .shape, .is_meta).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lmhead_cli.errors import LmheadError

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class BlockParams:
    """One transformer block, each part counted as weights + biases."""

    ln_1: int  # 2d
    attn_qkv: int  # c_attn: d x 3d + 3d
    attn_proj: int  # c_proj: d x d + d
    ln_2: int  # 2d
    mlp_up: int  # c_fc: d x inner + inner
    mlp_down: int  # c_proj: inner x d + d

    @property
    def total(self) -> int:
        return self.ln_1 + self.attn_qkv + self.attn_proj + self.ln_2 + self.mlp_up + self.mlp_down


@dataclass(frozen=True)
class ParamAccount:
    """Where a GPT-2's parameters live. ``total`` counts every distinct tensor once."""

    vocab_size: int  # V
    n_positions: int
    n_embd: int  # d
    n_inner: int  # MLP width, 4d for GPT-2
    n_layer: int
    embedding: int  # wte: V x d
    position: int  # wpe: n_positions x d
    block: BlockParams  # one block, by part
    per_block: int
    blocks: int  # all n_layer blocks
    final_norm: int  # ln_f: 2d
    head_extra: int  # lm_head beyond wte: 0 when tied, V x d when untied
    other: int  # tensors under names GPT-2 does not have (0 for a GPT-2)
    total: int
    tied: bool
    untied_total: int  # what the model would have with its own head
    tied_total: int  # what it would have with the head tied to wte
    embedding_share: float  # embedding / total


@dataclass(frozen=True)
class HeadCost:
    """The head's work for one position: a (d,) vector times a (d, V) matrix."""

    n_embd: int
    vocab_size: int
    multiply_adds_per_position: int  # d x V


@dataclass(frozen=True)
class LogitsMemory:
    """Bytes of float32 logits: every position (B, T, V) against the last position only (B, V)."""

    batch: int
    seq: int
    vocab: int
    bytes_per_logit: int
    all_positions_bytes: int  # B x T x V x 4
    last_position_bytes: int  # B x V x 4


def _account(*, vocab_size: int, n_positions: int, n_embd: int, n_inner: int, n_layer: int, embedding: int,
             position: int, block: BlockParams, blocks: int, final_norm: int, head_extra: int, other: int,
             tied: bool) -> ParamAccount:
    total = embedding + position + blocks + final_norm + head_extra + other
    return ParamAccount(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_inner=n_inner, n_layer=n_layer,
        embedding=embedding, position=position, block=block, per_block=block.total, blocks=blocks,
        final_norm=final_norm, head_extra=head_extra, other=other, total=total, tied=tied,
        # Untying gives the head its own V x d matrix; an untied model already has it.
        untied_total=total + (embedding if tied else 0),
        tied_total=total - head_extra,
        embedding_share=embedding / total if total else 0.0,
    )


def account_from_config(config: Mapping[str, Any]) -> ParamAccount:
    """The parameter account from a GPT-2 config dict (vocab_size, n_positions, n_embd, n_layer, n_inner,
    tie_word_embeddings), by arithmetic alone."""
    V, P, d, L = (int(config[k]) for k in ("vocab_size", "n_positions", "n_embd", "n_layer"))
    inner = int(config.get("n_inner") or 4 * d)  # n_inner null means 4d
    tied = bool(config.get("tie_word_embeddings", True))
    norm = d + d  # layer norm: a scale and a shift per dimension
    block = BlockParams(
        ln_1=norm,
        attn_qkv=d * 3 * d + 3 * d,
        attn_proj=d * d + d,
        ln_2=norm,
        mlp_up=d * inner + inner,
        mlp_down=inner * d + d,
    )
    return _account(
        vocab_size=V, n_positions=P, n_embd=d, n_inner=inner, n_layer=L, embedding=V * d, position=P * d,
        block=block, blocks=L * block.total, final_norm=norm, head_extra=0 if tied else V * d, other=0, tied=tied,
    )


# GPT-2 checkpoint names, with or without the "transformer." prefix of GPT2LMHeadModel.
_TOP = re.compile(r"^(?:transformer\.)?(wte|wpe|ln_f)\.(?:weight|bias)$")
_BLOCK = re.compile(
    r"^(?:transformer\.)?h\.(\d+)\.(ln_1|attn\.c_attn|attn\.c_proj|ln_2|mlp\.c_fc|mlp\.c_proj)\.(?:weight|bias)$"
)
_HEAD = re.compile(r"^lm_head\.(?:weight|bias)$")
# Buffers that old GPT-2 state dicts carry (the causal mask), not parameters.
_BUFFER = re.compile(r"^(?:transformer\.)?h\.\d+\.attn\.(?:bias|masked_bias)$")
_PART = {"ln_1": "ln_1", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_proj", "ln_2": "ln_2",
         "mlp.c_fc": "mlp_up", "mlp.c_proj": "mlp_down"}


def _storage(tensor: Any) -> tuple:
    """What makes two tensors the same parameter: the same memory and shape, or for meta tensors
    (no memory, data_ptr() is 0) the same object."""
    if getattr(tensor, "is_meta", False):
        return ("object", id(tensor))
    return ("memory", tensor.data_ptr(), tuple(tensor.shape))


def account_from_tensors(named: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> ParamAccount:
    """The parameter account of real tensors: ``module.named_parameters(remove_duplicate=False)`` or a
    state dict, under GPT-2 key names. Shared storage is counted once; ``tied`` means the head shares
    wte's storage, or has no tensor of its own (GPT-2 checkpoints store the tied head only as wte).
    """
    items = list(named.items() if isinstance(named, Mapping) else named)
    # The head goes last, so a tied head finds its storage already claimed by wte.
    items.sort(key=lambda item: bool(_HEAD.match(item[0])))
    seen: set[tuple] = set()
    top = {"wte": 0, "wpe": 0, "ln_f": 0}
    parts: dict[int, dict[str, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    head_extra = other = 0
    wte_storage = head_storage = None
    for name, tensor in items:
        if _BUFFER.match(name):
            continue
        key = _storage(tensor)
        if name.endswith("wte.weight"):
            wte_storage = key
        if _HEAD.match(name) and name.endswith("weight"):
            head_storage = key
        if key in seen:
            continue
        seen.add(key)
        n = int(tensor.numel())
        if m := _TOP.match(name):
            top[m.group(1)] += n
            shapes.setdefault(f"{m.group(1)}.{name.rsplit('.', 1)[1]}", tuple(tensor.shape))
        elif m := _BLOCK.match(name):
            block = parts.setdefault(int(m.group(1)), dict.fromkeys(_PART.values(), 0))
            block[_PART[m.group(2)]] += n
            if m.group(2) == "mlp.c_fc" and name.endswith("bias"):
                shapes["c_fc.bias"] = tuple(tensor.shape)
        elif _HEAD.match(name):
            head_extra += n
        else:
            other += n

    if "wte.weight" not in shapes or "wpe.weight" not in shapes:
        raise LmheadError("not a GPT-2: no wte.weight or wpe.weight among the tensors")
    V, d = shapes["wte.weight"]
    distinct = {tuple(sorted(p.items())) for p in parts.values()}
    if len(distinct) > 1:
        raise LmheadError("not a GPT-2: its blocks differ in size")
    block = BlockParams(**parts[min(parts)]) if parts else BlockParams(0, 0, 0, 0, 0, 0)
    return _account(
        vocab_size=V, n_positions=shapes["wpe.weight"][0], n_embd=d,
        n_inner=shapes.get("c_fc.bias", (4 * d,))[0], n_layer=len(parts),
        embedding=top["wte"], position=top["wpe"], block=block,
        blocks=sum(sum(p.values()) for p in parts.values()), final_norm=top["ln_f"],
        head_extra=head_extra, other=other, tied=head_storage is None or head_storage == wte_storage,
    )


def head_cost(n_embd: int, vocab_size: int) -> HeadCost:
    """Multiply-adds for one position's logits: (d,) @ (d, V) -> (V,) is d x V of them."""
    return HeadCost(n_embd=n_embd, vocab_size=vocab_size, multiply_adds_per_position=n_embd * vocab_size)


def logits_memory(batch: int, seq: int, vocab: int) -> LogitsMemory:
    """Bytes for float32 logits at every position, (B, T, V), and at the last position alone, (B, V)."""
    return LogitsMemory(
        batch=batch, seq=seq, vocab=vocab, bytes_per_logit=FLOAT32_BYTES,
        all_positions_bytes=batch * seq * vocab * FLOAT32_BYTES,
        last_position_bytes=batch * vocab * FLOAT32_BYTES,
    )
