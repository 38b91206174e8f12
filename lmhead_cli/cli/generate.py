"""`lmhead generate`, `greedy`, `sample` and `softcap`: one option list (generate's) and one body; the
named ones only fix what api.checks.MODES says. Their stage options come from the registry."""

from __future__ import annotations

import inspect as pyinspect
from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import (DEFAULT_PROMPT, FormatOpt, JsonOpt, LogprobsOpt, ModelChoice, PresetOpt,
                                    TopLogprobsOpt, command, output_kind, setting_option, stage_options)
from lmhead_cli.api.choices import SETTINGS, STAGES


def decoding_options(
    prompt: Annotated[
        Optional[str], typer.Argument(help="The text to continue; - reads stdin.", show_default=DEFAULT_PROMPT)
    ] = None,
    max_new_tokens: Annotated[
        Optional[int], setting_option("max_new_tokens", "--max-new-tokens", "-n",
                                      show_default=str(SETTINGS["max_new_tokens"].default))
    ] = None,
    knobs: dict = None,
    preset: PresetOpt = None,
    seed: Annotated[
        Optional[int], setting_option("seed", help="Seed for the draws; without it one is drawn and reported.")
    ] = None,
    greedy: Annotated[bool, typer.Option("--greedy", help="Take the most likely token every time.")] = False,
    beams: Annotated[
        int, setting_option("beams", help="Beam search over N beams, as transformers' num_beams (deterministic).")
    ] = 1,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Go on past <|endoftext|>.")] = False,
    stop: Annotated[
        Optional[list[str]], typer.Option("--stop", help="End the text before this string (repeatable, up to 16).")
    ] = None,
    show_steps: Annotated[
        int, setting_option("show_steps", help="After the text, a table per step with the K most probable tokens.")
    ] = 0,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
    output_format: FormatOpt = None,
    top_logprobs: TopLogprobsOpt = 0,
    logprobs: LogprobsOpt = None,
    json_schema: Annotated[
        Optional[str], typer.Option("--json-schema", help="The text must be JSON that this JSON Schema file "
                                    "validates (- reads stdin); compiled with llguidance (docs/grammar.md).")
    ] = None,
    regex: Annotated[
        Optional[str], typer.Option("--regex", help="The text must match this regular expression whole (Rust's "
                                    "syntax: no look-around, no back-references).")
    ] = None,
    stages: Annotated[
        bool, typer.Option("--stages", help="After the text, a table per step of what the stages took: what the "
                           "grammar removed (and the tokens it forced), what the filters removed, raw and processed p.")
    ] = False,
) -> None:
    """The options the four decoding commands share (`knobs`: one per stage of the registry)."""


def _decoding_command(name: str, doc: str) -> None:
    """Register `lmhead NAME` with generate's options and body, in mode NAME.

    The four commands share decoding_options' signature; Typer reads options from a signature only,
    so each command is a function given that signature (the one documented way to reuse it)."""

    def run(**options) -> None:
        decode(name, **options)

    run.__signature__ = pyinspect.signature(decoding_options, eval_str=True)
    run.__doc__ = doc
    command(name, knobs=stage_options())(run)


_decoding_command("generate", f"""Generate text token by token: {' -> '.join(s.name for s in STAGES)} -> softmax -> choose.

    Samples unless --greedy or --beams N; `greedy`, `sample` and `softcap` are the named forms.

    Example: lmhead generate "The keys on the table" --temperature 0.8 --seed 1 --show-steps 5 --model random:gpt2
    """)
_decoding_command("greedy", """Take the most likely token every step (the same tokens as transformers' do_sample=False).

    Example: lmhead greedy "The dog" --max-new-tokens 18 --show-steps 3 --model random:gpt2
    """)
_decoding_command("sample", """Draw each token from the probabilities (seeded, so a run can be replayed).

    Example: lmhead sample --temperature 0.8 --top-p 0.95 --seed 1 --model random:gpt2
    """)
_decoding_command("softcap", """Sample after Gemma-style soft-capping z -> c·tanh(z/c) (c = 30 unless --cap says otherwise).

    Example: lmhead softcap --cap 30 --seed 1 --model random:gpt2
    """)


def decode(command_name: str, prompt, preset, greedy, beams, ignore_eos, stop, seed, show_steps, max_new_tokens,
           knobs: dict, source: ModelChoice, json_out, output_format, top_logprobs, logprobs, json_schema, regex,
           stages) -> None:
    """parse -> load -> generate (streaming) -> summary, shared by the four decoding commands."""
    from lmhead_cli import render
    from lmhead_cli.api import checks
    from lmhead_cli.inputs import read_small_file, read_text
    from lmhead_cli.render import generate as show
    from lmhead_cli.render.inspect import random_banner

    kind = output_kind(json_out, output_format, top_logprobs, logprobs)
    json_out = kind != "text"
    asked = dict(mode=command_name, preset=preset, greedy=greedy, beams=beams, ignore_eos=ignore_eos, seed=seed,
                 stop=tuple(stop or ()), show_steps=show_steps, max_new_tokens=max_new_tokens, top_logprobs=top_logprobs,
                 logprobs=logprobs or "raw", regex=regex,
                 json_schema=None if json_schema is None else read_small_file(json_schema, "JSON schema file"), **knobs)
    settings = checks.generation(**asked)  # the one check, before the load: a bad value fails in an instant
    text = checks.prompt(read_text("the prompt on stdin") if prompt == "-"
                        else DEFAULT_PROMPT if prompt is None else prompt)
    if prompt is None:  # the first line says so: a run without a prompt is not silently about the keys
        render.notice(f'no prompt given: continuing "{DEFAULT_PROMPT}" (give one: lmhead {command_name} "TEXT")')
    model = source.load()

    def start(ids: list[int], dropped: int, settings) -> None:
        render.own_softcap_notice(model.own_softcap, settings.knobs.softcap)
        render.truncated(len(ids), dropped, model.n_ctx)
        if not json_out:
            random_banner(model.source, model.random_weights)  # every output made from random weights says so
            show.begin(model.tokenizer.decode(ids))

    result = model.generate(text, on_start=start, on_text=None if json_out else lambda piece: show.stream(piece),
                            settings=settings, preset=preset)
    g = result.reading
    if not json_out:
        show.end_text()
    show.stop_notice(g, model.n_ctx)
    if kind == "openai":
        show.openai_json(result)
        return
    if json_out:
        render.print_json(result.to_dict())
        return
    if g.settings.show_steps:
        show.steps_table(g)
    if stages:
        show.stages_per_step(g)
    if g.beams:
        show.beams_table(g)
    show.summary(g, result.source)
