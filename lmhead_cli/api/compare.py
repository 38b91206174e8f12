"""`Model.compare`: Q (this model) against a base over one text, llama-perplexity's --kl-divergence
statistics (readings/compare.py). Its own module, so that the Model's file stays about the one model."""

from __future__ import annotations

from typing import Callable

from lmhead_cli.api.results import ReadingResult, html_table
from lmhead_cli.errors import Param, UsageError

SAME = "same"  # --base same: the model's own source


class CompareResult(ReadingResult):
    """compare: readings.compare.Comparison (T values a column, `stats`, `tokens()` one row at a time)."""

    DOCUMENT = "compare:comparison_json"

    def _repr_html_(self) -> str:
        doc = self.to_dict()
        return html_table({**{k: v for k, v in doc.items() if k != "statistics"}, **doc["statistics"]})


def check_base(base, base_dtype: str) -> None:
    """The base asked for: not an empty source, a dtype a model loads in."""
    from lmhead_cli.loading.sources import DTYPES

    if isinstance(base, str) and not base.strip():
        raise UsageError(Param("base"), f" is empty; give a model (a hub id, a folder, random:NAME) or {SAME}")
    if base_dtype not in DTYPES:
        raise UsageError("unknown ", Param("base_dtype"), f" {base_dtype!r}; choose one of: {', '.join(DTYPES)}")


def compare(model, other, text: str, *, bos: bool = False, stride: int | None = None, chunk: int | None = None,
            llama_chunks: int | None = None, progress: Callable[[int, int], None] | None = None) -> CompareResult:
    """How far `model` (Q) moves the next-token distribution from `other` (the base, a loaded Model: see
    Model.compare) over every token of `text`: PPL of both, ln(PPL(Q)/PPL(base)), mean KLD with its
    percentiles, Δp, same top p. Both must share the vocabulary and the tokenizer. Texts longer than the
    context go in windows of n_ctx tokens that begin every `stride` tokens; both heads run `chunk`
    positions at a time. `llama_chunks` = n scores llama-perplexity's positions instead: chunks of n
    tokens, the second half of each (with `bos`, BOS in place of each chunk's first token). `text` and
    `chunk` are checked by the caller, before the base is loaded."""
    from lmhead_cli.api import checks
    from lmhead_cli.readings.compare import check_llama_chunks, compare_text

    n_ctx = min(model.n_ctx, other.n_ctx)
    checks.stride(stride, n_ctx)
    check_llama_chunks(llama_chunks, n_ctx)
    return CompareResult(compare_text(model.loaded, other.loaded, text, bos=bos, stride=stride, chunk=chunk,
                                      progress=progress, llama=llama_chunks))
