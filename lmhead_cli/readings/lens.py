"""`lmhead lens`: the logit lens. What would the model say if it stopped after the embeddings, or
after block i, and went straight to the head?

Each layer's residual vector at the last position goes through the model's own final norm
(GPT-2's LayerNorm ln_f, Llama's RMSNorm), recomputed for that vector (its own mean and variance, not the scale the last layer happened to have), and
the head. The last row is then `ln_f(x_L)` through the head: exactly `inspect`'s logits.

The same forward also gives the position map: every layer's top-1 token and its probability at each
of up to GRID_POSITIONS prompt positions ending at the one read (rows = layers, columns = positions).
The head runs on a chunk of positions at a time (lmhead_cli/chunks.py: GRID_BUFFERS float32 (chunk, V)
buffers within its budget), and what is kept is one id and one probability a cell, never a
(positions, V) table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmhead_cli.errors import BadValue
from lmhead_cli.engine.base import module_name
from lmhead_cli.head import (Distribution, TargetScore, check_finite, clamp_top_k, encode_targets, kl_divergence,
                             log_sum_exp)
from lmhead_cli.chunks import default_chunk
from lmhead_cli.readings.inspect import PromptToken, encode_prompt
from lmhead_cli.loading.sources import Loaded

GRID_POSITIONS = 32  # the position map's most columns: the positions up to the one read (and after it, to fill)
GRID_BUFFERS = 2  # a chunk's float32 logits and its log-sum-exp's temporary


@dataclass(frozen=True)
class TunedReading:
    """The same layer read through its tuned-lens translator (readings/tuned_lens.py)."""

    top_id: int
    top_token: str
    top_prob: float
    entropy: float  # nats
    targets: list[TargetScore]


@dataclass(frozen=True)
class LensLayer:
    """The head's verdict on one layer's residual vector."""

    layer: int  # 0 = after the embeddings, i = after block i
    top_id: int
    top_token: str
    top_prob: float
    entropy: float  # nats
    targets: list[TargetScore]
    # KL(final ‖ this layer's reading) in nats: {"logit": ...}, and "tuned" when a tuned lens is given
    kl_to_final: dict[str, float] = field(default_factory=dict)
    tuned: TunedReading | None = None  # the tuned lens's reading, when one is given


@dataclass(frozen=True)
class GridCell:
    """One cell of the position map: a layer's top-1 token at one prompt position."""

    id: int
    token: str
    prob: float


@dataclass
class Lens:
    model: str
    random_weights: bool
    prompt_tokens: list[PromptToken]
    truncated: int
    position: int  # the prompt position read (0-based, after any truncation): what comes after that token
    layers: list[LensLayer]  # embeddings first, the last block last
    # The heat map: the last layer's top tokens (then any targets not among them) as columns,
    # and every layer's probability for each, shape (layers, columns).
    columns: list[PromptToken]
    heat: list[list[float]]
    top_columns: int  # how many columns are top tokens; the rest are targets
    peak: float  # the largest probability in the heat map: the darkest shade
    norm: str  # the final norm every layer goes through, as the model names it ("ln_f", "model.norm")
    tied: bool  # the head is the embedding table
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # per layer, (V,) float32
    tuned_lens: str | None = None  # the tuned lens read beside the logit lens: its file, and whose it is
    tuned_logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # per layer, (V,) float32
    # The position map: grid[layer][j] is that layer's top-1 at prompt position grid_start + j (the
    # logit lens, through the same norm and head); rows = layers, embeddings first. None: not asked for.
    grid_start: int | None = None
    grid: list[list[GridCell]] | None = None


def check_position(position: int | None, T: int) -> int:
    """The prompt position to read, 0 ≤ i < T (None: the last; negative counts from the end)."""
    if position is None:
        return T - 1
    if not -T <= position < T:
        raise BadValue("position", f"{position} is outside the prompt's {T} tokens: give 0 to {T - 1}, "
                       "or -1 for the last")
    return position % T


@torch.inference_mode()
def layer_logits(loaded: Loaded, ids: list[int], position: int = -1, tuned=None) -> list[torch.Tensor]:
    """Logits (V,) float32 at `position` (default the last) for the residual stream after the embeddings
    and after each block, each through ln_f recomputed for that vector, then the head. With `tuned` (a
    readings.tuned_lens.TunedLens), each layer's vectors go through its translator first."""
    return layer_readings(loaded, ids, position, tuned)[1 if tuned is not None else 0]


def grid_span(position: int, T: int, width: int = GRID_POSITIONS) -> range:
    """The prompt positions the map shows: at most `width`, ending at `position` (the one read) unless
    the prompt's start leaves room for more after it."""
    n = min(T, width)
    start = min(max(0, position - n + 1), T - n)
    return range(start, start + n)


def top1_rows(eng, normed: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """normed (1, n, D), after the final norm -> the head's top-1 id (n,) int64 and its probability
    (n,) float32, `chunk` positions at a time: at most (chunk, V) logits exist at once."""
    ids, probs = [], []
    for rows in torch.split(normed, chunk, dim=1):  # (1, c, D)
        z = eng.head(rows)[0].float()  # (c, V)
        check_finite(z)
        best = z.max(-1)
        ids.append(best.indices)
        probs.append((best.values - log_sum_exp(z)).exp())
    return torch.cat(ids), torch.cat(probs)


@torch.inference_mode()
def layer_readings(loaded: Loaded, ids: list[int], position: int = -1, tuned=None,
                   span: range | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """The logit lens's logits per layer and, with `tuned`, the tuned lens's (else []), from one forward:
    each (V,) float32 at `position`; with `span` (prompt positions), each layer's top-1 ids and
    probabilities there, [(ids (n,) int64, probs (n,) float32)] per layer (else [])."""
    eng = loaded.engine
    x = torch.tensor([ids], device=eng.device)  # (1, T)
    logit, translated, grid = [], [], []
    chunk = default_chunk(eng.vocab_size, GRID_BUFFERS)

    def read(resid: torch.Tensor) -> torch.Tensor:
        # ln_f on all positions then slice, as `body` does, so the last row is bit-identical to inspect's.
        h = eng.final_norm(resid)[:, position, :][:, None]  # (1, 1, D)
        logits = eng.head(h)  # (1, 1, V)
        check_finite(logits)
        return logits[0, 0].float()

    for layer, resid in enumerate(eng.residuals(x)):  # (1, T, D), raw: before ln_f
        logit.append(read(resid))
        if tuned is not None:
            translated.append(read(tuned.translate(layer, resid)))
        if span is not None:
            grid.append(top1_rows(eng, eng.final_norm(resid[:, span.start:span.stop]), chunk))
    return logit, translated, grid


def lens_prompt(loaded: Loaded, prompt: str, targets: list[str] | None = None, columns: int = 8,
                position: int | None = None, tuned=None, grid: bool = True) -> Lens:
    """Run the logit lens on `prompt` at `position` (None: the last; what comes after that token);
    `columns` of the last layer's top tokens go into the heat map. With `tuned` (a TunedLens checked
    against this model), each layer is also read through its translator."""
    ids, dropped = encode_prompt(loaded, prompt)
    at = check_position(position, len(ids))
    k = clamp_top_k(columns, loaded.engine.vocab_size)
    text = loaded.tokenizer.token_text
    target_ids = encode_targets(loaded.tokenizer, targets)
    span = grid_span(at, len(ids)) if grid else None
    per_layer, per_layer_tuned, per_layer_grid = layer_readings(loaded, ids, at, tuned, span)

    layers = []
    dists = [Distribution(z) for z in per_layer]
    tuned_dists = [Distribution(z) for z in per_layer_tuned]
    final = dists[-1].logprobs
    for i, dist in enumerate(dists):
        top = dist.top(1, text)[0]
        kl = {"logit": kl_divergence(final, dist.logprobs)}
        reading = None
        if tuned_dists:
            t_dist = tuned_dists[i]
            t_top = t_dist.top(1, text)[0]
            kl["tuned"] = kl_divergence(final, t_dist.logprobs)
            reading = TunedReading(top_id=t_top.id, top_token=t_top.token, top_prob=t_top.prob,
                                   entropy=t_dist.entropy,
                                   targets=[t_dist.target(t, tid, text) for t, tid in target_ids])
        layers.append(LensLayer(layer=i, top_id=top.id, top_token=top.token, top_prob=top.prob,
                                entropy=dist.entropy, targets=[dist.target(t, tid, text) for t, tid in target_ids],
                                kl_to_final=kl, tuned=reading))

    col_ids = [t.id for t in dists[-1].top(k, text)]
    n_top = len(col_ids)
    for _, tid in target_ids:
        if tid[0] not in col_ids:
            col_ids.append(tid[0])
    probs = torch.stack([d.logprobs for d in dists]).exp()[:, col_ids]  # (layers, columns)
    cells = [[GridCell(i, text(i), p) for i, p in zip(top.tolist(), prob.tolist())] for top, prob in per_layer_grid]
    return Lens(model=loaded.source, random_weights=loaded.random_weights,
                prompt_tokens=[PromptToken(i, text(i)) for i in ids], truncated=dropped, position=at, layers=layers,
                columns=[PromptToken(i, text(i)) for i in col_ids], heat=probs.tolist(), top_columns=n_top,
                peak=float(probs.max()), norm=module_name(loaded.engine.module, loaded.engine.final_norm_module),
                tied=loaded.tie.tied,
                logits=per_layer, tuned_lens=None if tuned is None else f"{tuned.name} (for {tuned.identity.model})",
                tuned_logits=per_layer_tuned, grid_start=None if span is None else span.start,
                grid=None if span is None else cells)
