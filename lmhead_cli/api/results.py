"""What the Model's methods return: a reading's result plus the provenance its document needs.

Each result's `to_dict()` is exactly the document `lmhead COMMAND --json` prints for the same call
(the CLI prints `to_dict()` itself, or streams the same fields for score); `_repr_html_` shows the
reading's own picture in a notebook where it has one (render/notebook.py: inspect's bars, generate's
text, diff's two sides, lens's layers × positions map; score's coloured text; calibrate's diagrams), else the
document as a table; `__rich__` shows it in a terminal. Any other attribute is the reading's own
(`result.top`, `result.entropy`...), so a result can be used as the reading it wraps.
Renderers (lmhead_cli.render) take these results, never the loaded model.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

HTML_ROWS = 20  # rows of a list shown in a notebook table; the rest are counted


class Result:
    """Base of every result: the document, and the two views of it. A subclass that wraps a reading
    keeps it in the field `reading`."""

    def __getattr__(self, name: str):  # only for names the result does not have itself
        reading = self.__dict__.get("reading")
        if reading is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(reading, name)

    # The renderer that builds the document, "module:function" in lmhead_cli.render, imported when asked
    # (so `import lmhead_cli` stays light): function(self), or function(self.reading) for a ReadingResult.
    DOCUMENT: ClassVar[str] = ""

    def document(self) -> dict:
        return _renderer(self.DOCUMENT)(self)

    def to_dict(self) -> dict:
        """The CLI's --json document for the same call, as plain Python values (infinities made finite
        and NaN None, as the JSON text has them)."""
        from lmhead_cli.render import _plain

        return _plain(self.document())

    def _repr_html_(self) -> str:
        return html_table(self.to_dict())

    def __rich__(self):
        from rich.table import Table

        from lmhead_cli.render import data

        table = Table(show_header=False, show_edge=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for key, value in self.to_dict().items():
            table.add_row(key, data(_short(value)))
        return table


def _renderer(name: str) -> Callable[[Any], dict]:
    """The function "module:function" of lmhead_cli.render."""
    import importlib

    module, function = name.split(":")
    return getattr(importlib.import_module(f"lmhead_cli.render.{module}"), function)


def _short(value: Any, limit: int = 200) -> str:
    """One cell's text: scalars as JSON, lists and objects as JSON cut to `limit` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def html_table(doc: dict) -> str:
    """A document as an HTML table, every value escaped; a list of objects as a nested table of its
    first HTML_ROWS rows."""
    rows = []
    for key, value in doc.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            cols = list(value[0])
            head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(_short(v.get(c), 60))}</td>" for c in cols) + "</tr>"
                           for v in value[:HTML_ROWS])
            more = f"<p>… {len(value) - HTML_ROWS:,} more</p>" if len(value) > HTML_ROWS else ""
            cell = f"<table><tr>{head}</tr>{body}</table>{more}"
        else:
            cell = html.escape(_short(value))
        rows.append(f"<tr><th style='text-align:left'>{html.escape(str(key))}</th><td>{cell}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


class LineResults:
    """What Model.inspect_lines and Model.score_lines return: their results, lazily, one at a time (a
    file's worth never held), and `totals`, the counts of what has been yielded so far (the reading's
    own: readings.batch.BatchStats, readings.score.Corpus)."""

    def __init__(self, items, totals):
        self._items = iter(items)
        self.totals = totals

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)


@dataclass(eq=False)
class Provenance:
    """Where a result came from: the model as the user named it, and how it ran."""

    model: str
    random_weights: bool
    engine: str
    device: str
    dtype: str
    kind: str = ""  # hub, local or random
    path: str | None = None
    seed: int | None = None  # the random weights' seed
    products: str = ""  # how the products ran: "compiled kernels (VARIANT)" or "torch's products" (engine/execution.py)


@dataclass(eq=False)
class ReadingResult(Result):
    """A result that wraps one reading: its document is the renderer DOCUMENT names, applied to the reading."""

    reading: Any

    def document(self) -> dict:
        return _renderer(self.DOCUMENT)(self.reading)


@dataclass(eq=False)
class InspectResult(ReadingResult):
    """inspect: readings.inspect.Inspection, the tie report, and with stages= the stage table."""

    tie: Any
    stages: Any = None  # decoding.stages.StageTable
    own_softcap: float | None = None  # the c a model soft-caps its own logits at (Gemma-2)

    def document(self) -> dict:
        from lmhead_cli.render.generate import stages_json
        from lmhead_cli.render.inspect import inspection_json

        doc = inspection_json(self.reading, self.tie)
        return doc | ({"stages": stages_json(self.stages, self.own_softcap)} if self.stages is not None else {})

    def _repr_html_(self) -> str:
        """The top-k table with its bars, and the targets."""
        from lmhead_cli.render.notebook import inspect_html

        return inspect_html(self.to_dict())


class ExplainResult(ReadingResult):
    """inspect --explain: readings.explain.Explanation."""

    DOCUMENT = "explain:explanation_json"


class DiffResult(ReadingResult):
    """diff: readings.diff.Diff."""

    DOCUMENT = "diff:diff_json"

    def _repr_html_(self) -> str:
        """The two distributions side by side."""
        from lmhead_cli.render.notebook import diff_html

        return diff_html(self.to_dict())


class AttributeResult(ReadingResult):
    """attribute: readings.attribute.Attribution."""

    DOCUMENT = "attribute:attribution_json"


class LensResult(ReadingResult):
    """lens: readings.lens.Lens."""

    DOCUMENT = "lens:lens_json"

    def _repr_html_(self) -> str:
        """The layers × positions map of each layer's top token."""
        from lmhead_cli.render.notebook import lens_html

        return lens_html(self.to_dict())


class NeuronsResult(ReadingResult):
    """neurons: readings.neurons.Neurons."""

    DOCUMENT = "neurons:neurons_json"


@dataclass(eq=False)
class TuneResult(Result):
    """tune-lens: readings.tune_lens.Tuning (`lens` the trained TunedLens), where the model came from,
    and the file written (None when not saved)."""

    DOCUMENT = "lens:tuning_json"

    reading: Any
    source: Provenance
    out: str | None


@dataclass(eq=False)
class TieResult(Result):
    """tie: loading.sources.TieReport and where the model came from."""

    DOCUMENT = "inspect:tie_document"

    tie: Any
    source: Provenance


@dataclass(eq=False)
class ParamsResult(Result):
    """params: the parameter account, the head's cost and the logits' memory (readings.params)."""

    DOCUMENT = "params:params_document"

    model: str
    counted_from: str  # "config" or "tensors"
    account: Any
    head_cost: Any
    logits_memory: Any


@dataclass(eq=False)
class GenerateResult(Result):
    """generate: decoding.generate.Generation, the prompt as given, the preset, and the model's
    provenance; `token_text`/`token_bytes` spell ids for the OpenAI document."""

    DOCUMENT = "generate:generation_json"

    reading: Any
    source: Provenance
    prompt: str
    preset: str | None
    token_text: Callable[[int], str] = field(repr=False)
    token_bytes: Callable[[int], bytes] = field(repr=False)

    def _repr_html_(self) -> str:
        """The text, each step's figures and alternatives on hover."""
        from lmhead_cli.render.notebook import generate_html

        return generate_html(self.to_dict())


class ScoreResult(ReadingResult):
    """score: readings.score.Score (T values a column; `tokens()` yields one row at a time)."""

    def document(self) -> dict:
        from dataclasses import asdict

        from lmhead_cli.render.score import json_ends

        head, tail = json_ends(self.reading)
        return {**head, "tokens": [asdict(t) for t in self.reading.tokens()], **tail}

    def to_html(self) -> str:
        """The text coloured by each token's rank as one self-contained HTML page (what `score --html`
        writes): hover or focus a token for its figures (and the model's top-k there, when scored with
        `alternatives`)."""
        from lmhead_cli.render.html import score_html

        return score_html(self.reading)

    def _repr_html_(self) -> str:
        """The same view for a notebook cell."""
        from lmhead_cli.render.html import score_html

        return score_html(self.reading, fragment=True)


class CalibrateResult(ReadingResult):
    """calibrate: readings.calibrate.Calibration; its pictures are the reliability diagram."""

    DOCUMENT = "calibrate:calibration_json"

    def to_html(self) -> str:
        """The reliability diagram and the figures as one self-contained HTML page (`calibrate --html`)."""
        from lmhead_cli.render.calibrate import calibration_html

        return calibration_html(self.reading)

    def _repr_html_(self) -> str:
        from lmhead_cli.render.calibrate import calibration_html

        return calibration_html(self.reading, fragment=True)
