"""`lmhead params` and `lmhead toy`: arithmetic only unless --model is given, so no torch import on
this path (tests/test_startup.py)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import DEFAULT_MODEL, AllowPickleOpt, JsonOpt, command
from lmhead_cli.api.choices import MAX_TOY_DRAWS
from lmhead_cli.errors import UsageError


@command()
def params(
    config: Annotated[
        Optional[str],
        typer.Option("--config", "-c", help="A bundled config, counted by arithmetic (default gpt2): "
                     "distilgpt2, gpt2, gpt2-medium, gpt2-large, gpt2-xl."),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", "-m", help="Count a loaded model's real tensors instead: a hub id, a local "
                     "folder, random:NAME or bundled:tiny."),
    ] = None,
    batch: Annotated[
        int, typer.Option("--batch", help="Batch size B for the logits memory.", min=1)
    ] = 1,
    seq: Annotated[
        Optional[int], typer.Option("--seq", help="Sequence length T for the logits memory (default: n_positions).",
                                    min=1)
    ] = None,
    vocab: Annotated[
        Optional[int],
        typer.Option("--vocab", help="Vocabulary size V for the logits memory, e.g. 32000 (default: the model's).",
                     min=1),
    ] = None,
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Where GPT-2's parameters live, what weight tying saves, and what the head's logits cost.

    Example: lmhead params --config gpt2-xl --batch 8 --seq 2048 --vocab 32000
    """
    from lmhead_cli import api
    from lmhead_cli.render.params import render_params

    if config is not None and model is not None:
        raise UsageError("--config and --model are mutually exclusive: --config counts a bundled config by "
                         "arithmetic, --model counts a loaded model's tensors")
    if model is None:
        result = api.params(config or DEFAULT_MODEL, batch, seq, vocab)
    else:  # imports torch only here
        result = api.model_params(model, batch, seq, vocab, allow_pickle=allow_pickle)
    render_params(result, as_json=json_out)


@command()
def toy(
    hidden: Annotated[
        Optional[str],
        typer.Option("--hidden", help="Your own hidden vector h: 3 numbers, e.g. 0.5,1,2 (default 1,0,1)."),
    ] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", help="Divide the logits by T before softmax.")
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed for the sampled draws.")] = 0,
    draws: Annotated[
        int, typer.Option("--draws", help="How many times to choose a word.",
                          min=1, max=MAX_TOY_DRAWS)
    ] = 20,
    json_out: JsonOpt = False,
) -> None:
    """The whole last step on four words you can check by hand: h -> logits -> softmax -> a word.

    Example: lmhead toy --hidden 0.5,1,2 --temperature 0.7
    """
    from lmhead_cli import api
    from lmhead_cli.render.toy import render_toy

    render_toy(api.toy(hidden, temperature, seed, draws), as_json=json_out)
