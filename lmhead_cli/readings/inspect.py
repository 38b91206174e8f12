"""`lmhead inspect`: prompt -> tokens -> hidden states -> the head on the last position -> distribution."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmhead_cli.errors import NoPrompt, NoTokens
from lmhead_cli.head import (Distribution, TargetScore, TokenScore, check_finite, check_top_k, clamp_top_k,
                             encode_target, encode_targets)
from lmhead_cli.loading.sources import Loaded

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class PromptToken:
    id: int
    text: str


@dataclass(frozen=True)
class ShapeWalk:
    """The shapes the head sees, read off the real tensors, and what the last-position head saves."""

    hidden: tuple[int, ...]  # (B, T, D)
    last: tuple[int, ...]  # (B, 1, D)
    logits: tuple[int, ...]  # (B, 1, V)
    head_macs_last: int  # D·V multiply-adds
    head_macs_full: int  # T·D·V for logits at every position
    logits_bytes_last: int  # V·4 bytes in float32
    logits_bytes_full: int  # T·V·4


@dataclass
class Inspection:
    model: str
    random_weights: bool
    tied: bool
    engine: str
    device: str
    dtype: str
    prompt_tokens: list[PromptToken]
    truncated: int  # tokens dropped from the front to fit the context
    shapes: ShapeWalk
    top: list[TokenScore]
    targets: list[TargetScore]
    entropy: float  # nats
    entropy_bits: float
    logits: torch.Tensor | None = field(default=None, repr=False)  # (V,) float32, for later stages


def check_prompt(prompt: str | None) -> str:
    """The prompt, or NoPrompt if it is missing, empty or only white space."""
    if not prompt or not prompt.strip():
        raise NoPrompt(given=prompt is not None)
    return prompt


def check_targets(targets: list[str] | None) -> list[str]:
    """The targets asked about; BadValue for an empty one (it can encode to no token)."""
    for t in targets or []:
        if not t:
            encode_target(None, t)  # raises BadValue: no tokenizer is needed to know "" has no token
    return list(targets or [])


def check_request(prompt: str | None, targets: list[str] | None, top_k: int) -> None:
    """Usage errors of a one-prompt reading, raised before any model is loaded."""
    check_prompt(prompt)
    check_targets(targets)
    check_top_k(top_k)


def encode_prompt(loaded: Loaded, prompt: str) -> tuple[list[int], int]:
    """Token ids of `prompt`, keeping the last n_ctx; returns (ids, number dropped from the front).
    Where the model's tokenizer puts a beginning-of-text token before every text (Llama's), the ids
    begin with it, as transformers and llama.cpp read a prompt, and the text keeps the last n_ctx - 1.
    NoTokens when there is nothing to run on (a tokenizer that keeps no character of the prompt).

    Memory is bounded by n_ctx, not by the prompt: the tokenizer cuts a long text at boundaries its
    BPE cannot cross and keeps only the last ids (GPT2Tokenizer.encode_tail has the proof)."""
    tok, text = loaded.tokenizer, check_prompt(prompt)
    ids, dropped = tok.encode_tail(text, loaded.engine.n_ctx - tok.add_bos)
    ids = [tok.bos_id, *ids] if tok.add_bos else ids
    if not ids:
        raise NoTokens(len(text))
    return ids, dropped


def shape_walk(T: int, D: int, V: int) -> ShapeWalk:
    """The shapes of one prompt of T tokens through a width-D body and a V-row head, batch 1."""
    return ShapeWalk(hidden=(1, T, D), last=(1, 1, D), logits=(1, 1, V),
                     head_macs_last=D * V, head_macs_full=T * D * V,
                     logits_bytes_last=V * FLOAT32_BYTES, logits_bytes_full=T * V * FLOAT32_BYTES)


def last_logits(loaded: Loaded, ids: list[int]) -> tuple[torch.Tensor, ShapeWalk]:
    """Run the body on all T positions and the head on the last one only: logits (V,) float32."""
    eng = loaded.engine
    x = torch.tensor([ids], device=eng.device)  # (1, T)
    logits = eng.last_logits(x)  # (1, V)
    check_finite(logits)
    walk = shape_walk(x.shape[1], eng.head_weight.shape[1], logits.shape[-1])  # T, the head's width D, V
    return logits[0], walk


def inspection_from_logits(loaded: Loaded, ids: list[int], dropped: int, logits: torch.Tensor,
                           walk: ShapeWalk, k: int, target_ids: list[tuple[str, list[int]]]) -> Inspection:
    """The `inspect` reading of one prompt from its last-position logits (V,) float32."""
    eng, text = loaded.engine, loaded.tokenizer.token_text
    dist = Distribution(logits)
    return Inspection(
        model=loaded.source, random_weights=loaded.random_weights, tied=loaded.tie.tied, engine=eng.name,
        device=str(eng.device), dtype=eng.weight_format,
        prompt_tokens=[PromptToken(i, text(i)) for i in ids], truncated=dropped, shapes=walk,
        top=dist.top(k, text), targets=[dist.target(t, tid, text) for t, tid in target_ids],
        entropy=dist.entropy, entropy_bits=dist.entropy_bits, logits=logits,
    )


def inspect_prompt(loaded: Loaded, prompt: str, top_k: int = 10, targets: list[str] | None = None) -> Inspection:
    ids, dropped = encode_prompt(loaded, prompt)
    k = clamp_top_k(top_k, loaded.engine.vocab_size)
    logits, walk = last_logits(loaded, ids)
    target_ids = encode_targets(loaded.tokenizer, targets)
    return inspection_from_logits(loaded, ids, dropped, logits, walk, k, target_ids)
