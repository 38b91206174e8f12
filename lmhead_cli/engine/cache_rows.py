"""Some rows of a KV cache stepped, the others waiting (decoding/batch.py steps rows in turns across
requests): each run of rows steps on a view of its rows, the rows that wait keep an empty (zero)
column that their attention mask hides, and `compact_kv_cache` drops those columns when the cache is
rebuilt. `RowSteps` gives them to the engines whose cache is engine/lean.py's KVCache ([L, B, H, T_max,
hd]): LeanGPT2 and LeanLlama.
"""

from __future__ import annotations

import torch


def step_kv_rows(engine, ids: torch.Tensor, cache, mask: torch.Tensor, runs: list[tuple[int, int]],
                 record: bool) -> tuple[torch.Tensor, tuple | None]:
    """Engine.step_rows for a KVCache: each run a step_logits of its own on a view of its rows (their
    keys and values in place), the other rows' new column zeroed; then the cache one column on."""
    zs, made, at, past = [], [], 0, cache.length
    for a, b in runs:
        part = cache.rows(a, b)
        z, rec = engine.step_logits(ids[at:at + b - a], part, mask[a:b], record)
        zs.append(z)
        made.append(rec)
        at += b - a
    ran = torch.zeros(cache.k.shape[1], dtype=torch.bool)
    for a, b in runs:
        ran[a:b] = True
    idle = (~ran).nonzero()[:, 0].to(cache.k.device)
    if past < cache.k.shape[3] and idle.numel():  # a cache made with torch.empty: the column must be finite
        cache.k[:, idle, :, past] = 0
        cache.v[:, idle, :, past] = 0
    cache.length = past + 1
    both = None
    if record and all(r is not None for r in made):
        both = (torch.cat([r[0] for r in made]), torch.cat([r[1] for r in made], dim=1))
    return torch.cat(zs), both


def compact_kv_cache(cache, keep: torch.Tensor, max_len: int, new_cache):
    """Engine.compact_cache for a KVCache: `new_cache(rows, max_len)` makes the compact one."""
    counts = keep.sum(1).tolist()
    length = max(counts)
    out = new_cache(cache.k.shape[1], max(length, max_len))
    out.k.zero_()
    out.v.zero_()
    for b, n in enumerate(counts):
        cols = keep[b].nonzero()[:, 0].to(cache.k.device)
        out.k[:, b, :, length - n:length] = cache.k[:, b].index_select(2, cols)
        out.v[:, b, :, length - n:length] = cache.v[:, b].index_select(2, cols)
    out.length = length
    return out


class RowSteps:
    """Engine.step_rows and Engine.compact_cache for an engine whose cache is a KVCache (a mixin before Engine)."""

    steps_rows = True

    def step_rows(self, ids: torch.Tensor, cache, attention_mask: torch.Tensor, runs: list[tuple[int, int]],
                  record: bool = False) -> tuple[torch.Tensor, tuple | None]:
        return step_kv_rows(self, ids, cache, attention_mask, runs, record)

    def compact_cache(self, cache, keep: torch.Tensor, max_len: int):
        return compact_kv_cache(cache, keep, max_len, self.new_cache)
