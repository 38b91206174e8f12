"""`lmhead inspect` (one prompt, --explain, --stages, --file) and `lmhead tie`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import JsonOpt, ModelChoice, PresetOpt, TargetOpt, command, stage_options
from lmhead_cli.errors import BadValue, UsageError

INSPECT_STAGES = stage_options(rename={"top_k": (("--filter-top-k",),
                                                 "With --stages: the top-k stage (--top-k counts rows).")})


@command("inspect", knobs=INSPECT_STAGES)
def inspect_cmd(
    prompt: Annotated[Optional[str], typer.Argument(help="The text whose next token to inspect.")] = None,
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="How many of the best tokens to list.", min=1)] = 10,
    target: TargetOpt = None,
    file: Annotated[
        Optional[str], typer.Option("--file", "-f", help="Inspect every line of this file (- for stdin), in batches.")
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Prompts per forward pass with --file.", min=1)
    ] = 32,
    explain: Annotated[
        Optional[str], typer.Option("--explain", help="Take one token's logit apart: z = e·h = |e|·|h|·cos θ.")
    ] = None,
    stages: Annotated[
        bool, typer.Option("--stages", help="Follow the top tokens through every decoding stage to the probability.")
    ] = False,
    knobs: dict = None,
    preset: PresetOpt = None,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """Show how the last hidden vector becomes logits and probabilities for the next token.

    Example: lmhead inspect "The keys on the table" --target " are" --target " is" --model random:gpt2
    """
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.render.generate import stage_report
    from lmhead_cli.render.inspect import inspection

    chosen = stage_knobs(stages, preset, knobs)
    if chosen is not None and (file is not None or explain is not None):
        raise UsageError("--stages and its knobs take one prompt; not with --file or --explain")
    if file is not None:
        return inspect_file(prompt, file, batch_size, explain, top_k, target, source, json_out)
    if explain is not None:
        return inspect_explain(prompt, explain, top_k, target, source, json_out)
    checks.one_prompt(prompt, target, top_k)
    model = source.load()
    result = model.inspect(prompt, top_k, target or (), stages=chosen)
    render.truncated(len(result.prompt_tokens), result.truncated, model.n_ctx)
    render.multi_piece_notices(result.targets)
    render.own_softcap_notice(result.own_softcap, chosen and chosen.softcap)
    if json_out:
        render.print_json(result.to_dict())
        return
    inspection(result.reading, result.tie)
    if result.stages is not None:
        stage_report(result.stages, result.own_softcap)


def stage_knobs(stages: bool, preset: str | None, given: dict):
    """The stage settings for `inspect --stages` (any knob turns the table on), or None."""
    if not stages and preset is None and all(v is None for v in given.values()):
        return None
    from lmhead_cli.api import checks

    try:
        return checks.stages(preset, **given)
    except BadValue as e:
        if e.key == "top_k":  # inspect's own --top-k counts rows; this is the stage's
            raise UsageError(e.spelled("--filter-top-k")) from None
        raise


def inspect_file(prompt, file, batch_size, explain, top_k, target, source: ModelChoice, json_out) -> None:
    """`inspect --file`: read a batch of lines, compute it, write it, forget it; counts at the end.

    Under torchrun each rank computes every N-th batch and rank 0 writes them all in order (api/files.py)."""
    from lmhead_cli.api import checks
    from lmhead_cli.api.files import inspect_file as inspect_lines
    from lmhead_cli.render.batch import JsonLinesWriter, TableWriter, file_notices

    if explain is not None:
        raise UsageError("--explain takes apart one prompt's logit; it cannot be combined with --file")
    checks.prompt_or_file(prompt, file)
    targets = checks.prompt_file(top_k, batch_size, target)

    def write(model, batches, stats, lines) -> None:
        writer = (JsonLinesWriter(lambda r: r.to_dict()) if json_out
                  else TableWriter(model.source, model.random_weights, targets))
        for batch in batches:
            writer.write(batch)
        writer.end(stats)
        file_notices(lines, stats, model.n_ctx)

    inspect_lines(file, source.load, write, top_k=top_k, targets=targets, batch_size=batch_size,
                  device=source.device)


def inspect_explain(prompt, explain, top_k, target, source: ModelChoice, json_out) -> None:
    """`inspect --explain TOKEN`: one logit taken apart."""
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.render.explain import explanation

    checks.one_prompt(prompt, target, top_k)
    model = source.load()
    result = model.explain(prompt, explain, top_k, target or ())
    render.truncated(len(result.prompt_tokens), result.truncated, model.n_ctx)
    if json_out:
        render.print_json(result.to_dict())
    else:
        explanation(result.reading)


@command("tie")
def tie_cmd(source: ModelChoice = None, json_out: JsonOpt = False) -> None:
    """Prove weight tying: is the output matrix the very same tensor as the embedding table?

    Example: lmhead tie --model random:gpt2 --engine transformers
    """
    from lmhead_cli import render
    from lmhead_cli.render.inspect import tie_report

    result = source.load().tie()
    if json_out:
        render.print_json(result.to_dict())
    else:
        tie_report(result)
