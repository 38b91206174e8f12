"""`lmhead score`: every token of a text (or of each line of a file) scored."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import (BosOpt, FormatOpt, JsonOpt, ModelChoice, NoBosOpt, StrideOpt, TopLogprobsOpt,
                                    bos_choice, chunk_option, command, output_kind)
from lmhead_cli.api.choices import FLOAT32_BYTES, logits_bytes_per_position
from lmhead_cli.errors import UsageError

ChunkOpt = chunk_option(f"the head: each pass holds N × V × {FLOAT32_BYTES} bytes of float32 logits (GPT-2: "
                        f"{logits_bytes_per_position() / 1000:.0f} kB a position) and one more buffer of that size",
                        "score")

@command("score")
def score_cmd(
    text: Annotated[
        Optional[str], typer.Argument(help="The text to score; - reads it from stdin.")
    ] = None,
    file: Annotated[
        Optional[str], typer.Option("--file", "-f", help="Score every line of this file (- for stdin) as its own "
                                    "text, streamed; a corpus summary at the end.")
    ] = None,
    bos: BosOpt = False,
    no_bos: NoBosOpt = False,
    stride: StrideOpt = None,
    chunk: ChunkOpt = None,
    show_table: Annotated[
        bool, typer.Option("--table", help="Also list every token's figures (a long text: the first and last rows).")
    ] = False,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
    output_format: FormatOpt = None,
    top_logprobs: TopLogprobsOpt = 0,
    html: Annotated[
        Optional[str], typer.Option("--html", metavar="FILE", help="Also write the coloured text as one "
                                    "self-contained HTML page (no network; hover a token for its figures).")
    ] = None,
) -> None:
    """Score every token of a text you already have: log-probability, rank, entropy, surprisal, perplexity.

    Each token is coloured by its rank (top-1, 10, 100, 1000, the rest); marked instead without colour.

    Example: lmhead score "The keys on the table are on the table." --table --model random:gpt2
    """
    from lmhead_cli.api import checks
    from lmhead_cli.inputs import read_text
    from lmhead_cli.render.html import ALTERNATIVES
    from lmhead_cli.render import score as show

    bos = bos_choice(bos, no_bos)
    kind = output_kind(json_out, output_format, top_logprobs, None)
    checks.settings({"top_logprobs": top_logprobs})
    if file is not None and kind == "openai":
        raise UsageError("--format openai scores one text; give it as an argument or on stdin, not with --file")
    if html is not None:
        html_target(html, file)
    if file is not None:
        checks.prompt_or_file(text, file, "a text")
        if show_table:
            raise UsageError("--table lists one text's tokens; it cannot be combined with --file")
        return score_file(file, bos, stride, chunk, source, kind == "json")
    if text is None:
        raise UsageError('give a text, e.g. lmhead score "The keys on the table are here." '
                         "(- reads stdin; --file PATH scores one text a line)")
    text = checks.text(read_text("the text on stdin") if text == "-" else text)
    model = source.load()
    model.check_score(stride=stride, chunk=chunk, top_logprobs=top_logprobs)
    bos = model.wants_bos(bos)  # --bos / --no-bos, else as the model's tokenizer
    doc = show.openai_document(model, text, bos, stride) if kind == "openai" else None
    with show.Progress("scoring") as progress:  # the OpenAI document is written as each chunk is scored
        result = model.score(text, bos=bos, stride=stride, chunk=chunk, progress=progress,
                             top_logprobs=top_logprobs, on_rows=doc.rows if doc else None,
                             alternatives=0 if html is None else ALTERNATIVES)
    if doc is not None:
        show.openai_end(doc, result.reading)
    elif kind == "json":
        show.write_json(result.reading)  # streamed, a token a line: the same document as result.to_dict()
    else:
        show.report(result.reading, show_table)
    if html is not None:
        write_html(result, html)


def html_target(path: str, file: str | None) -> None:
    """--html's file, checked before the model loads: one text; a new file, a regular file or a link
    (replaced, never written through) in a folder that exists; never a FIFO (outputs.check_target)."""
    from lmhead_cli.outputs import check_target

    if file is not None:
        raise UsageError("--html shows one text; it cannot be combined with --file")
    check_target(path, "--html")


def write_html(result, path: str, what: str | None = None) -> None:
    """result.to_html() into `path`, written whole or not at all (a file beside it renamed over it:
    outputs.py), and one line saying what it holds (`what`; score's: the coloured text)."""
    from lmhead_cli.outputs import write_atomically
    from lmhead_cli.render import notice

    write_atomically(path, result.to_html(), "--html")
    what = what or f"{len(result.ids):,} tokens, coloured by rank"
    notice(f"wrote {path}: {what}; open it in a browser")


def score_file(file: str, bos: bool | None, stride, chunk, source: ModelChoice, as_json: bool) -> None:
    """`score --file`: each line scored as its own text, streamed (api/files.py, torchrun included)."""
    from lmhead_cli.api.files import score_file as score_lines
    from lmhead_cli.render import score as show

    def write(model, items, corpus, size) -> None:
        show.file_report(items, corpus, model.source, model.random_weights, as_json, size)

    score_lines(file, source.load, write, bos=bos, stride=stride, chunk=chunk, device=source.device)
