"""`lmhead neurons`: what MLP neurons write into the vocabulary (a layer's, a token's writers, or their
shares of a target's logit after a prompt)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import JsonOpt, ModelChoice, command


@command("neurons")
def neurons_cmd(
    prompt: Annotated[Optional[str], typer.Argument(help="With --target: the text whose next-token logit the "
                                                    "neurons' shares take apart.")] = None,
    layer: Annotated[Optional[int], typer.Option("--layer", "-l", help="A layer (0-based, as attribute's mlp.L): "
                                                 "its neurons, or only its neurons with --token or a prompt.")] = None,
    token: Annotated[Optional[str], typer.Option("--token", help="List the neurons that write this token "
                                                 "most.")] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="With a prompt: the token whose logit "
                                                  "to split into neurons.")] = None,
    top: Annotated[Optional[int], typer.Option("--top", "-k", help="Tokens per side with --layer; neurons with "
                                               "--token or a prompt.", show_default="5 with --layer, else 10")] = None,
    neuron: Annotated[Optional[list[int]], typer.Option("--neuron", "-n", help="With --layer: only this neuron "
                                                        "(repeatable).")] = None,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """What MLP neurons write: each value vector v read as attribute reads a part, e_k · (γ ⊙ centre(v)).

    --layer L: each neuron's most promoted and suppressed tokens. --token T: the neurons that write T most.
    PROMPT --target T: each neuron's share (activation × readout) of T's logit, checked against attribute.

    Example: lmhead neurons "The keys on the table" --target " are" --model random:gpt2
    """
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.render.neurons import neurons_report

    checks.neurons(prompt, layer, token, target, top)
    model = source.load()
    result = model.neurons(prompt, layer=layer, token=token, target=target, top=top, neurons=neuron or ())
    if result.prompt_tokens:
        render.truncated(len(result.prompt_tokens), result.truncated, model.n_ctx)
    if result.token is not None:
        render.multi_piece_notices([result.token])
    if json_out:
        render.print_json(result.to_dict())
    else:
        neurons_report(result.reading)
