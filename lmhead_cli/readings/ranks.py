"""Rank buckets, as GLTR colours a text, and entropy buckets, the page's other colouring. Torch-free, so that the renderers (render/score.py,
render/html.py) read them without importing the score reading, and with it torch and the loader."""

from __future__ import annotations

import math

# (the largest rank in the bucket, its name); the last is open.
BUCKETS = ((1, "top-1"), (10, "top-10"), (100, "top-100"), (1000, "top-1000"), (math.inf, "rest"))


def bucket(rank: int) -> int:
    """The index in BUCKETS of a rank (1 = the model's own top-1)."""
    return next(i for i, (top, _) in enumerate(BUCKETS) if rank <= top)


# (the largest entropy in the bucket, nats, its name); the last is open. The page can colour a text by
# how unsure the model was at each token instead of by the rank of the token that came.
ENTROPY_BUCKETS = ((1.0, "entropy < 1 nat"), (2.0, "1-2 nats"), (4.0, "2-4 nats"), (6.0, "4-6 nats"),
                   (math.inf, "> 6 nats"))
