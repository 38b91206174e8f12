"""`lmhead compare`: a model under test against a base over one text (llama-perplexity --kl-divergence)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import (BosOpt, JsonOpt, ModelChoice, NoBosOpt, StrideOpt, bos_choice, chunk_option,
                                    command, one_text)
from lmhead_cli.api.choices import COMPARE_BUFFERS, FLOAT32_BYTES
from lmhead_cli.errors import UsageError

ChunkOpt = chunk_option(f"both heads: each pass holds about {COMPARE_BUFFERS} × N × V × {FLOAT32_BYTES} bytes",
                        "compare")


@command("compare")
def compare_cmd(
    text: Annotated[Optional[str], typer.Argument(help="The text; - reads it from stdin.")] = None,
    file: Annotated[
        Optional[str], typer.Option("--file", "-f", help="Read the whole file as one text (- for stdin), as "
                                    "llama-perplexity -f does.")
    ] = None,
    base: Annotated[
        Optional[str], typer.Option("--base", help="The model to compare against: a hub id, a folder, random:NAME, "
                                    "or same (--model's own).", show_default="same")
    ] = None,
    base_dtype: Annotated[
        str, typer.Option("--base-dtype", help="The base's dtype: float32, bfloat16 or float16.")
    ] = "float32",
    bos: BosOpt = False,
    no_bos: NoBosOpt = False,
    stride: StrideOpt = None,
    llama_chunks: Annotated[
        Optional[int], typer.Option("--llama-chunks", metavar="N", help="Score exactly llama-perplexity's "
                                    "positions: chunks of N tokens (its -c), the second half of each; with --bos, "
                                    "BOS in place of each chunk's first token (a tokenizer that adds BOS).")
    ] = None,
    chunk: ChunkOpt = None,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """How far a cheaper model moves the next-token distribution from a base, over every token of a text:
    llama-perplexity --kl-divergence's statistics (PPL ratio, mean KLD and percentiles, Δp, same top p).

    --model and --dtype choose the model under test (Q); the base is the same source in float32 unless
    --base and --base-dtype say otherwise. Either may be a GGUF file (--model q8.gguf --base ./original):
    the two tokenizers are compared on the text first. See docs/compare.md for each statistic.

    Example: lmhead compare "The keys on the table are on the table." --model random:gpt2 --dtype bfloat16
    """
    from lmhead_cli.api import checks
    from lmhead_cli.api.compare import SAME, check_base
    from lmhead_cli.render import compare as show
    from lmhead_cli.render.score import Progress

    text = one_text(text, file, 'lmhead compare "The keys on the table are here." --dtype bfloat16')
    bos = bos_choice(bos, no_bos)
    checks.chunk(chunk)
    check_base(base, base_dtype)
    if llama_chunks is not None and stride is not None:
        raise UsageError("give --stride or --llama-chunks, not both")
    model = source.load()
    base_model = None
    if base not in (None, SAME) or base_dtype != source.dtype:  # else: the model against itself, loaded once
        base_model = dataclasses.replace(source, model=model.source if base in (None, SAME) else base,
                                         dtype=base_dtype).load()
    with Progress("comparing") as progress:
        result = model.compare(text, base=base_model or model, bos=bos, stride=stride, chunk=chunk,
                               llama_chunks=llama_chunks, progress=progress)
    if json_out:
        show.write_json(result.reading)  # streamed, a token a line: the same document as result.to_dict()
    else:
        show.report(result.reading)
