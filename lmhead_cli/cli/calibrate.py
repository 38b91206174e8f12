"""`lmhead calibrate`: is the model's top-1 probability honest on a text? Reliability bins, ECE, Brier,
NLL, the fitted temperature, and with --generations the entropy rate of the model's own samples."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import (BosOpt, JsonOpt, ModelChoice, NoBosOpt, StrideOpt, bos_choice, command, one_text,
                                    setting_option, stage_options)
from lmhead_cli.cli.score import ChunkOpt
from lmhead_cli.errors import UsageError


@command("calibrate", knobs=stage_options())
def calibrate_cmd(
    text: Annotated[Optional[str], typer.Argument(help="The text; - reads it from stdin.")] = None,
    file: Annotated[
        Optional[str], typer.Option("--file", "-f", help="Read the whole file as one text (- for stdin).")
    ] = None,
    bos: BosOpt = False,
    no_bos: NoBosOpt = False,
    stride: StrideOpt = None,
    chunk: ChunkOpt = None,
    generations: Annotated[
        int, typer.Option("--generations", help="Also sample N continuations after <|endoftext|> with the decoding "
                          "options given (--temperature, --top-k, ...) and compare their entropy rate with the "
                          "model's cross-entropy on the text.")
    ] = 0,
    max_new_tokens: Annotated[
        int, setting_option("max_new_tokens", "--max-new-tokens", "-n", help="Tokens per generation (--generations).")
    ] = 64,
    seed: Annotated[
        Optional[int], setting_option("seed", help="Seed of the first generation (the next ones: seed + 1, ...); "
                                      "without it one is drawn and reported.")
    ] = None,
    knobs: dict = None,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
    html: Annotated[
        Optional[str], typer.Option("--html", metavar="FILE", help="Also write the reliability diagrams as one "
                                    "self-contained HTML page (SVG, no network).")
    ] = None,
) -> None:
    """Is the model's top-1 probability honest on this text? 15 bins of confidence with their accuracy,
    ECE, the Brier score of the top-1 event, NLL, and the temperature that minimises the NLL.

    The positions are score's: windows of n_ctx tokens every --stride tokens, --bos to score the first.

    Example: lmhead calibrate "In the beginning God created the heaven and the earth." --model bundled:tiny --generations 2 --top-k 40
    """
    from lmhead_cli.api import checks
    from lmhead_cli.cli.score import html_target, write_html
    from lmhead_cli.render import calibrate as show, print_json
    from lmhead_cli.render.score import Progress

    text = one_text(text, file, 'lmhead calibrate "The keys on the table are here."')
    bos = bos_choice(bos, no_bos)
    checks.chunk(chunk)
    if generations:
        checks.generation(ignore_eos=True, seed=seed, max_new_tokens=max_new_tokens, **knobs)
    elif seed is not None or any(v is not None for v in knobs.values()):
        raise UsageError("--seed and the decoding options choose how --generations samples; give --generations N")
    if html is not None:
        html_target(html, None)
    model = source.load()
    with Progress("calibrating") as progress:
        result = model.calibrate(text, bos=bos, stride=stride, chunk=chunk, progress=progress,
                                 generations=generations, max_new_tokens=max_new_tokens, seed=seed, **knobs)
    if json_out:
        print_json(result.to_dict())
    else:
        show.report(result.reading)
    if html is not None:
        write_html(result, html, f"the reliability diagrams of {result.positions:,} positions")
