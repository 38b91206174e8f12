"""How many positions a pass of the head takes by default (score, compare, serve's echo): the most
whose float32 (chunk, V) buffers fit in CHUNK_BYTES. Arithmetic only, torch-free, so that the command
line's --chunk help can show the figure computed for GPT-2 without importing the readings."""

from __future__ import annotations

FLOAT32_BYTES = 4
# The default chunk's working memory stays within this: score's float32 logits and one more buffer of
# the same size (head.score_rows), so 32 MiB is 83 positions for GPT-2's 50,257 tokens.
CHUNK_BYTES = 32 * 2**20
SCORE_BUFFERS = 2
# compare: both models' (chunk, V) float32 log-probabilities, one temporary of that size (the softmax's
# sum, then the KL's product), and a bfloat16 head's own output before its float32 copy.
COMPARE_BUFFERS = 4


def default_chunk(vocab: int, buffers: int = SCORE_BUFFERS) -> int:
    """The most positions whose `buffers` (chunk, V) float32 buffers fit in CHUNK_BYTES (at least 1)."""
    return max(1, CHUNK_BYTES // (buffers * vocab * FLOAT32_BYTES))
