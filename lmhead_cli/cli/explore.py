"""`lmhead lens` (the logit lens, and a tuned lens beside it), `lmhead tune-lens` (train a tuned lens)
and `lmhead explore` (an interactive session)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import JsonOpt, ModelChoice, command, stage_options
from lmhead_cli.errors import UsageError


@command("lens")
def lens_cmd(
    prompt: Annotated[Optional[str], typer.Argument(help="The text whose next token to follow through the layers.")] = None,
    target: Annotated[
        Optional[list[str]],
        typer.Option("--target", "-t", help="A token to follow (repeatable): its rank and probability per layer."),
    ] = None,
    heat: Annotated[
        bool, typer.Option("--heat", help="Show a heat map (layers × top tokens, probabilities as shades) instead.")
    ] = False,
    grid: Annotated[
        bool, typer.Option("--grid", help="Show the position map instead: layers × prompt positions, each cell "
                           "the layer's top token there.")
    ] = False,
    top_k: Annotated[
        int, typer.Option("--top-k", "-k", help="How many of the last layer's top tokens the heat map shows.",
                          min=1)
    ] = 8,
    position: Annotated[
        Optional[int], typer.Option("--position", help="Read the prompt at token I (0-based; -1 the last): "
                                    "what each layer predicts after it.", show_default="the last")
    ] = None,
    tuned: Annotated[
        Optional[str], typer.Option("--tuned", help="Also read each layer through a tuned lens: a file from "
                                    "lmhead tune-lens, or 'bundled' (bundled:tiny's, shipped with lmhead).")
    ] = None,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """Logit lens: what the head would predict from the residual stream after the embeddings and each block.
    Each row's KL is KL(final ‖ that layer's reading) in nats; --tuned adds the tuned lens's reading.

    Example: lmhead lens "In the beginning God created the heaven" --grid --model bundled:tiny
    """
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.render.lens import lens_grid, lens_heat, lens_table

    checks.one_prompt(prompt, target, top_k)
    if heat and grid:
        raise UsageError("give --heat or --grid, not both")
    model = source.load()
    # the position map costs the head at up to 32 positions: made only where it is shown
    result = model.lens(prompt, position, target or (), top_k, tuned=tuned, grid=json_out or grid)
    render.truncated(len(result.prompt_tokens), result.truncated, model.n_ctx)
    if json_out:
        render.print_json(result.to_dict())
    elif heat:
        lens_heat(result.reading)
    elif grid:
        lens_grid(result.reading)
    else:
        lens_table(result.reading)


@command("tune-lens")
def tune_lens_cmd(
    text: Annotated[Optional[str], typer.Argument(help="The text to train on (or --file).")] = None,
    file: Annotated[Optional[str], typer.Option("--file", "-f", help="A text file to train on, read a window "
                                                "at a time.")] = None,
    out_path: Annotated[Optional[str], typer.Option("--out", "-o", help="Where to write the lens "
                                                    "(safetensors).")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 300,
    batch: Annotated[int, typer.Option("--batch", help="Windows per step.")] = 4,
    seq: Annotated[Optional[int], typer.Option("--seq", help="Tokens per window.",
                                               show_default="min(n_ctx, 128)")] = None,
    lr: Annotated[float, typer.Option("--lr", help="Adam's learning rate (after the warm-up, decayed "
                                      "linearly to 0).")] = 1e-3,
    warmup: Annotated[int, typer.Option("--warmup", help="Steps of linear warm-up.")] = 20,
    seed: Annotated[int, typer.Option("--seed", help="Where the windows are drawn.")] = 0,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """Train a tuned lens: one affine translator per layer (identity at the start), fitted to the model's
    final distribution (KL) on windows of the text, and write it for lens --tuned.

    Example: lmhead tune-lens "In the beginning God created the heaven and the earth." --out /tmp/lens.safetensors --steps 2 --model bundled:tiny
    """
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.render.lens import tuning_report

    checks.prompt_or_file(text, file, "a text")
    if text is None and file is None:
        raise UsageError("give a text or --file to train the lens on, e.g. lmhead tune-lens --file book.txt "
                         "--out lens.safetensors")
    if out_path is None:
        raise UsageError("give --out PATH: where to write the lens")
    from lmhead_cli.outputs import check_target

    check_target(out_path, "--out")  # before the model loads; the API checks it again before training
    from lmhead_cli.render.score import Progress

    model = source.load()
    with Progress("training the lens", unit="steps", verb="trained") as progress:
        result = model.tune_lens(text, file=file, out=out_path, steps=steps, batch=batch, seq=seq, lr=lr,
                                 warmup=warmup, seed=seed, progress=lambda done, total, _kl: progress(done, total))
    if json_out:
        render.print_json(result.to_dict())
    else:
        tuning_report(result)


@command("explore", knobs=stage_options(only=("softcap", "temperature")))  # the start values of :softcap, :temp
def explore_cmd(
    top_k: Annotated[
        int, typer.Option("--top-k", "-k", help="How many tokens each table lists (:top-k).", min=1)
    ] = 10,
    knobs: dict = None,
    target: Annotated[
        Optional[list[str]], typer.Option("--target", "-t", help="Follow a token in every table (:target).")
    ] = None,
    source: ModelChoice = None,
    json_out: Annotated[bool, typer.Option("--json", help="Each answer (a prompt, :lens, :gen) as one JSON line "
                                           "on stdout; settings, help and errors on stderr.")] = False,
) -> None:
    """An interactive session: the model loads once, each line you type is a prompt answered at once.

    Commands: :temp 0.8, :softcap 30, :top-k 20, :target " are", :gen 20, :lens, :help, :quit.
    Input can be piped, one prompt a line; --json answers in JSON lines.

    Example: printf 'The keys on the table\\n:temp 0.5\\nThe key on the table\\n' | lmhead explore --model random:gpt2
    """
    import time

    from lmhead_cli.api import explore
    from lmhead_cli.render import explore as show

    settings = explore.settings(top_k, **knobs, targets=target or (), threads=source.threads)  # before the load
    if sys.stdin is None or sys.stdin.closed:
        raise UsageError("stdin is closed; explore reads its prompts from the terminal or a pipe")
    interactive = sys.stdin.isatty()
    start = time.perf_counter()
    model = source.load()
    view = show.AsJson if json_out else show.Terminal
    view.own_softcap_notice(model.own_softcap, knobs.get("softcap"))
    n_threads = model.warm_up()
    view.intro(model.source, model.random_weights, time.perf_counter() - start, settings, interactive,
               n_threads if model.provenance.device == "cpu" else None)
    session = explore.session(model, settings, view)
    if not interactive:
        session.run(explore.piped_lines())
        return
    history = explore.History(explore.history_file())
    try:
        session.run(explore.terminal_lines(on_cancel=lambda: sys.stderr.write("\n")))
    finally:
        history.save()
        sys.stderr.write("\n")
