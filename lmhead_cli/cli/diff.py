"""`lmhead diff` (two prompts' distributions side by side) and `lmhead attribute` (direct logit
attribution)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import JsonOpt, ModelChoice, TargetOpt, command
from lmhead_cli.errors import UsageError


@command("diff")
def diff_cmd(
    prompt_a: Annotated[Optional[str], typer.Argument(help="The first prompt (A).")] = None,
    prompt_b: Annotated[Optional[str], typer.Argument(help="The second prompt (B).")] = None,
    top_k: Annotated[
        int, typer.Option("--top-k", "-k", help="Rows per side, and N for the movers: the union of both top N.",
                          min=1)
    ] = 10,
    target: TargetOpt = None,
    movers: Annotated[int, typer.Option("--movers", min=0, help="How many risers and fallers to list.")] = 5,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """Two prompts' next-token distributions side by side: KL both ways, Jensen–Shannon, total variation,
    each side's top tokens with their rank on the other side, the biggest risers and fallers.

    Example: lmhead diff "The key on the table" "The keys on the table" --target " is" --target " are" --model random:gpt2
    """
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.render.diff import diff_report

    if prompt_a is None or prompt_b is None:
        raise UsageError('give two prompts, e.g. lmhead diff "The key on the table" "The keys on the table"')
    checks.one_prompt(prompt_a, target, top_k)
    checks.one_prompt(prompt_b, target, top_k)
    model = source.load()
    result = model.diff(prompt_a, prompt_b, top_k, target or (), movers)
    for side in (result.a, result.b):
        render.truncated(len(side.prompt_tokens), side.truncated, model.n_ctx)
    render.multi_piece_notices(result.targets)
    if json_out:
        render.print_json(result.to_dict())
    else:
        diff_report(result.reading)


@command("attribute")
def attribute_cmd(
    prompt: Annotated[Optional[str], typer.Argument(help="The text whose next-token logit to take apart.")] = None,
    target: Annotated[
        Optional[str],
        typer.Option("--target", "-t", help="The token whose logit to decompose (required), e.g. --target ' are'."),
    ] = None,
    vs: Annotated[
        Optional[str], typer.Option("--vs", help="Decompose the logit difference z(target) − z(vs) instead.")
    ] = None,
    heads: Annotated[bool, typer.Option("--heads", help="Also list every attention head's share.")] = False,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """Direct logit attribution: a token's logit (or a logit difference) split exactly into the embeddings,
    each layer's attention heads and MLP, and the final norm's bias, with the check that they add up.

    Example: lmhead attribute "The keys on the table" --target " are" --vs " is" --heads --model random:gpt2
    """
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.render.attribute import attribution

    if target is None and prompt is not None:
        raise UsageError("attribute needs --target: the token whose logit to take apart, e.g. --target ' are'")
    checks.attribution(prompt, target, vs)
    model = source.load()
    result = model.attribute(prompt, target, vs, heads)
    render.truncated(len(result.prompt_tokens), result.truncated, model.n_ctx)
    render.multi_piece_notices([t for t in (result.target, result.vs) if t is not None])
    if json_out:
        render.print_json(result.to_dict())
    else:
        attribution(result.reading, heads)
