"""The command line. One Typer app, one function per command: parse -> load -> compute -> render.

No math and no torch at module top: `lmhead --help`, `params` and `toy` must start instantly.
Domain errors (lmhead_cli.errors) become one line and an exit code in `_boundary`, and only there.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Annotated, Optional

import typer

from lmhead_cli import __version__
from lmhead_cli.errors import LmheadError, UsageError

app = typer.Typer(
    name="lmhead",
    help="Make the last step of GPT-2 visible: hidden vector -> logits -> probabilities -> next token.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# ---- shared options: declared once, used by every command that loads a model --------------------
DEFAULT_MODEL = "gpt2"
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", "-m", envvar="LMHEAD_MODEL",
        help="Hub id (gpt2, distilgpt2, ...), a local folder, or random:NAME (seeded random weights, offline).",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16 (softmax is always float32).")]
EngineOpt = Annotated[
    str, typer.Option("--engine", help="auto (lean for GPT-2 checkpoints, transformers otherwise), lean or transformers.")
]
AllowPickleOpt = Annotated[
    bool, typer.Option("--allow-pickle", help="Allow pytorch_model.bin checkpoints (loaded with weights_only=True).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"lmhead: error: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def _boundary(fn):
    """Turn domain errors into one line on stderr and an exit code (1 runtime, 2 usage).

    Ctrl-C exits 130 and keeps what was printed; a closed pipe (`| head`) ends quietly.
    Any other exception is a bug: one line too, with LMHEAD_DEBUG=1 for the traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except LmheadError as e:
            _fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            sys.stdout.flush()
            sys.stderr.write("\ninterrupted\n")
            raise typer.Exit(130)
        except BrokenPipeError:
            # The reader went away (`lmhead ... | head`): stop quietly, and keep Python from
            # complaining when it flushes stdout at exit.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # stdout is not a real file (tests)
                pass
            raise typer.Exit(0)
        except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
            if os.environ.get("LMHEAD_DEBUG"):
                raise
            _fail(f"unexpected {type(e).__name__}: {e} (set LMHEAD_DEBUG=1 for the traceback)", 1)

    return wrapper


def command(*args, **kwargs):
    """`app.command` with the error boundary around it."""

    def register(fn):
        return app.command(*args, **kwargs)(_boundary(fn))

    return register


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmhead {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """lmhead: how GPT-2's final hidden vector becomes logits, probabilities and the next word."""


# ==== inspect / tie (issue 2) ===================================================================

def load(model: str, device: str = "auto", dtype: str = "float32", engine: str = "auto",
         allow_pickle: bool = False):
    """Load a model source (lazily importing torch); every model command goes through here."""
    from lmhead_cli.loading.sources import load_model

    return load_model(model, device=device, dtype=dtype, engine=engine, allow_pickle=allow_pickle)


def tie_json(tie) -> dict:
    import dataclasses

    return dataclasses.asdict(tie)


@command("inspect")
def inspect_cmd(
    prompt: Annotated[Optional[str], typer.Argument(help="The text whose next token to inspect.")] = None,
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="How many of the best tokens to list.")] = 10,
    target: Annotated[
        Optional[list[str]],
        typer.Option("--target", "-t", help="A token to follow (repeatable), e.g. --target ' are'."),
    ] = None,
    file: Annotated[
        Optional[str], typer.Option("--file", "-f", help="Inspect every line of this file (- for stdin), in batches.")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per forward pass with --file.")] = 32,
    explain: Annotated[
        Optional[str], typer.Option("--explain", help="Take one token's logit apart: z = e·h = |e|·|h|·cos θ.")
    ] = None,
    stages: Annotated[
        bool, typer.Option("--stages", help="Follow the top tokens through every decoding stage to the probability.")
    ] = False,
    temperature: TemperatureOpt = None,  # the knob options of issue 3, defined with generate below
    filter_top_k: Annotated[
        Optional[int], typer.Option("--filter-top-k", help="With --stages: the top-k stage (--top-k counts rows).")
    ] = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    softcap: SoftcapOpt = None,
    preset: PresetOpt = None,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    engine: EngineOpt = "auto",
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Show how the last hidden vector becomes logits and probabilities for the next token.

    Example: lmhead inspect "The keys on the table" --target " are" --target " is"
    """
    from lmhead_cli import render
    from lmhead_cli.readings.inspect import check_request, inspect_prompt
    from lmhead_cli.render.inspect import inspection

    knobs = stage_knobs(stages, preset, temperature, filter_top_k, top_p, min_p, softcap)  # issue 3
    if knobs is not None and (file is not None or explain is not None):
        raise UsageError("--stages and its knobs take one prompt; not with --file or --explain")
    if file is not None or explain is not None:  # issue 6: batches, and one logit taken apart
        return inspect_more(prompt, file, batch_size, explain, top_k, target, model, device, dtype, engine,
                            allow_pickle, json_out)
    check_request(prompt, target, top_k)
    loaded = load(model, device, dtype, engine, allow_pickle)
    result = inspect_prompt(loaded, prompt, top_k, target)
    warn_truncated(len(result.prompt_tokens), result.truncated, loaded.engine.n_ctx)
    multi_piece_notices(result.targets)
    if json_out:
        render.print_json(inspection_json(result, loaded) | show_stages(knobs, result, top_k, loaded, as_json=True))
    else:
        inspection(result, loaded.tie)
        show_stages(knobs, result, top_k, loaded)


def warn_truncated(kept: int, dropped: int, n_ctx: int) -> None:
    """One warning on stderr when a prompt lost its first `dropped` tokens to the context limit."""
    if dropped:
        from lmhead_cli import render

        render.warn(f"the prompt is {kept + dropped} tokens, longer than the context of {n_ctx}; "
                    f"keeping the last {kept}")


def multi_piece_notices(targets) -> None:
    """A notice for each --target that is several tokens: it is scored by its first."""
    from lmhead_cli import render

    for t in targets:
        if len(t.pieces) > 1:
            render.notice(f"target {t.token!r} is {len(t.pieces)} tokens {t.pieces}; using the first, {t.pieces[0]!r}")


def inspection_json(result, loaded) -> dict:
    """The documented `inspect --json` document."""
    from dataclasses import asdict

    return {
        "model": result.model,
        "random_weights": result.random_weights,
        "tied": result.tied,
        "engine": result.engine,
        "device": result.device,
        "dtype": result.dtype,
        "prompt_tokens": [asdict(t) for t in result.prompt_tokens],
        "truncated": result.truncated,
        "shapes": asdict(result.shapes),
        "top": [asdict(t) for t in result.top],
        "targets": [asdict(t) for t in result.targets],
        "entropy": result.entropy,
        "entropy_bits": result.entropy_bits,
        "tie": tie_json(loaded.tie),
    }


@command("tie")
def tie_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    engine: EngineOpt = "auto",
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Prove weight tying: is the output matrix the very same tensor as the embedding table?

    Example: lmhead tie --model random:gpt2 --engine transformers
    """
    from lmhead_cli import render
    from lmhead_cli.render.inspect import tie_report

    loaded = load(model, device, dtype, engine, allow_pickle)
    if json_out:
        render.print_json({"model": loaded.source, "random_weights": loaded.random_weights,
                           "engine": loaded.engine.name, **tie_json(loaded.tie)})
    else:
        tie_report(loaded)


# ==== generate / greedy / sample / softcap (issue 3) =============================================
# The four decoding commands share one option list (generate's) and one body (_decode); the named
# ones only fix the mode. The knob options are also used by `inspect --stages`.
DEFAULT_PROMPT = "The keys on the table"
TemperatureOpt = Annotated[
    Optional[float], typer.Option("--temperature", help="Divide the logits by T > 0 before softmax (1 = as is).")
]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="Keep only the k most likely tokens.")]
TopPOpt = Annotated[
    Optional[float], typer.Option("--top-p", help="Keep the most likely tokens until their probability sums to p, in (0, 1].")
]
MinPOpt = Annotated[
    Optional[float], typer.Option("--min-p", help="Drop tokens less likely than min-p × the best one's probability, in [0, 1).")
]
SoftcapOpt = Annotated[
    Optional[float], typer.Option("--softcap", "--cap", help="Squash the logits with c·tanh(z/c) first (Gemma 2: c = 30).")
]
PresetOpt = Annotated[
    Optional[str], typer.Option("--preset", help="Named settings from configs/presets.toml (creative, precise, "
                                "gemma-softcap) or a .toml file; flags override it.")
]


@command("generate")
def generate_cmd(
    prompt: Annotated[
        Optional[str], typer.Argument(help="The text to continue; - reads stdin.", show_default=DEFAULT_PROMPT)
    ] = None,
    max_new_tokens: Annotated[
        Optional[int], typer.Option("--max-new-tokens", "-n", help="How many tokens to make at most.", show_default="40")
    ] = None,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    softcap: SoftcapOpt = None,
    preset: PresetOpt = None,
    seed: Annotated[
        Optional[int], typer.Option("--seed", help="Seed for the draws; without it one is drawn and reported.")
    ] = None,
    greedy: Annotated[bool, typer.Option("--greedy", help="Take the most likely token every time.")] = False,
    beams: Annotated[
        int, typer.Option("--beams", help="Beam search over N beams, as transformers' num_beams (deterministic).")
    ] = 1,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Go on past <|endoftext|>.")] = False,
    show_steps: Annotated[
        int, typer.Option("--show-steps", help="After the text, a table per step with the K most probable tokens.")
    ] = 0,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    engine: EngineOpt = "auto",
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Generate text token by token: soft-cap -> temperature -> top-k -> top-p -> min-p -> softmax -> choose.

    Samples unless --greedy or --beams N; `greedy`, `sample` and `softcap` are the named forms.

    Example: lmhead generate "The keys on the table" --temperature 0.8 --seed 1 --show-steps 5
    """
    _decode("generate", **locals())


def _named(name: str, doc: str) -> None:
    """Register `lmhead NAME` with generate's options and body, in mode NAME."""

    @functools.wraps(generate_cmd)
    def run(**options) -> None:
        _decode(name, **options)

    run.__doc__ = doc
    command(name)(run)


_named("greedy", """Take the most likely token every step (the same tokens as transformers' do_sample=False).

    Example: lmhead greedy "The dog" --max-new-tokens 18 --show-steps 3
    """)
_named("sample", """Draw each token from the probabilities (seeded, so a run can be replayed).

    Example: lmhead sample --temperature 0.8 --top-p 0.95 --seed 1
    """)
_named("softcap", """Sample after Gemma-style soft-capping z -> c·tanh(z/c) (c = 30 unless --cap says otherwise).

    Example: lmhead softcap --cap 30 --seed 1
    """)


def _decode(command_name: str, prompt, preset, greedy, beams, ignore_eos, seed, show_steps, max_new_tokens,
            model, device, dtype, engine, allow_pickle, json_out, **knobs) -> None:
    """parse -> load -> generate (streaming) -> summary, shared by the four decoding commands."""
    from lmhead_cli import render
    from lmhead_cli.decoding.generate import generate, resolve
    from lmhead_cli.readings.inspect import check_prompt, encode_prompt
    from lmhead_cli.render import generate as show

    settings = resolve(command_name, preset=preset, greedy=greedy, beams=beams, ignore_eos=ignore_eos, seed=seed,
                       show_steps=show_steps, max_new_tokens=max_new_tokens, **knobs)
    text = check_prompt(sys.stdin.read().rstrip("\n") if prompt == "-" else DEFAULT_PROMPT if prompt is None
                        else prompt, "generate")
    loaded = load(model, device, dtype, engine, allow_pickle)
    ids, dropped = encode_prompt(loaded, text)
    warn_truncated(len(ids), dropped, loaded.engine.n_ctx)
    if not json_out:
        show.begin(loaded.tokenizer.decode(ids))
    result = generate(loaded, ids, settings, on_text=None if json_out else show.stream)
    if not json_out:
        show.end_text()
    if result.stop == "context":
        render.notice(f"stopped at the context limit: {len(ids)} prompt tokens + {len(result.generated_ids)} "
                      f"new fill the model's {loaded.engine.n_ctx} positions")
    if json_out:
        render.print_json(show.generation_json(result, loaded, text, preset))
        return
    if settings.show_steps:
        show.steps_table(result)
    show.summary(result)


def show_stages(knobs, result, rows: int, loaded, as_json: bool = False) -> dict:
    """`inspect --stages`: print the stage table, or return {"stages": ...} for the JSON document."""
    if knobs is None:
        return {}
    from lmhead_cli.decoding.stages import stage_table
    from lmhead_cli.render.generate import stage_report, stages_json

    table = stage_table(result.logits, knobs, rows, loaded.tokenizer.token_text)
    if as_json:
        return {"stages": stages_json(table)}
    stage_report(table)
    return {}


def stage_knobs(stages: bool, preset, temperature, top_k, top_p, min_p, softcap):
    """The stage settings for `inspect --stages` (any knob turns the table on), or None."""
    from lmhead_cli.decoding.presets import knobs

    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "softcap": softcap}
    if not stages and preset is None and all(v is None for v in given.values()):
        return None
    return knobs(preset, **given)


# ==== params / toy (issue 4) =====================================================================
# Arithmetic only unless --model is given: no torch import on this path (tests/test_startup.py).
MAX_TOY_DRAWS = 100_000


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
                     "folder, or random:NAME."),
    ] = None,
    batch: Annotated[int, typer.Option("--batch", help="Batch size B for the logits memory.")] = 1,
    seq: Annotated[
        Optional[int], typer.Option("--seq", help="Sequence length T for the logits memory (default: n_positions).")
    ] = None,
    vocab: Annotated[
        Optional[int],
        typer.Option("--vocab", help="Vocabulary size V for the logits memory, e.g. 32000 (default: the model's)."),
    ] = None,
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Where GPT-2's parameters live, what weight tying saves, and what the head's logits cost.

    Example: lmhead params --config gpt2-xl --batch 8 --seq 2048 --vocab 32000
    """
    from lmhead_cli.readings import params as count
    from lmhead_cli.loading.model_configs import load_config
    from lmhead_cli.render.params import render_params

    if config is not None and model is not None:
        raise UsageError("--config and --model are mutually exclusive: --config counts a bundled config by "
                         "arithmetic, --model counts a loaded model's tensors")
    for flag, value in (("--batch", batch), ("--seq", seq), ("--vocab", vocab)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1; got {value}")
    if model is None:
        name, counted_from = config or DEFAULT_MODEL, "config"
        acc = count.account_from_config(load_config(name))
    else:
        from lmhead_cli.loading.sources import load_model  # imports torch: only when real tensors are asked for

        loaded = load_model(model, device="cpu", dtype="float32", engine="lean", allow_pickle=allow_pickle)
        name, counted_from = model, "tensors"
        acc = count.account_from_tensors(loaded.module.named_parameters(remove_duplicate=False))
    cost = count.head_cost(acc.n_embd, acc.vocab_size)
    memory = count.logits_memory(batch, seq or acc.n_positions, vocab or acc.vocab_size)
    render_params(name, counted_from, acc, cost, memory, as_json=json_out)


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
    draws: Annotated[int, typer.Option("--draws", help="How many times to choose a word.")] = 20,
    json_out: JsonOpt = False,
) -> None:
    """The whole last step on four words you can check by hand: h -> logits -> softmax -> a word.

    Example: lmhead toy --hidden 0.5,1,2 --temperature 0.7
    """
    from lmhead_cli.readings import toy as toy_head
    from lmhead_cli.render.toy import render_toy

    h = toy_head.parse_hidden(hidden) if hidden is not None else toy_head.HIDDEN
    toy_head.check_temperature(temperature)
    if not 1 <= draws <= MAX_TOY_DRAWS:
        raise UsageError(f"--draws must be between 1 and {MAX_TOY_DRAWS:,}; got {draws}")
    render_toy(toy_head.toy_example(h, temperature, seed, draws), as_json=json_out)


# ==== lens / explore (issue 6) ===================================================================

def inspect_more(prompt, file, batch_size, explain, top_k, target, model, device, dtype, engine, allow_pickle,
                 json_out) -> None:
    """`inspect --file` (many prompts, batched) and `inspect --explain TOKEN` (one logit taken apart)."""
    from lmhead_cli import render
    from lmhead_cli.readings.inspect import check_prompt, check_targets

    if file is not None and explain is not None:
        raise UsageError("--explain takes apart one prompt's logit; it cannot be combined with --file")
    if file is not None and prompt is not None:
        raise UsageError("give a prompt or --file, not both")
    if top_k < 1:
        raise UsageError(f"--top-k must be at least 1 (got {top_k})")
    check_targets(target)
    if file is not None:
        from lmhead_cli.readings.batch import inspect_batch, read_prompts
        from lmhead_cli.render.batch import batch_table, summary

        if batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1 (got {batch_size})")
        prompts = read_prompts(file)  # before the load: a bad file fails in an instant
        if prompts.skipped_empty:
            render.notice(f"skipped {prompts.skipped_empty} empty line{'s' * (prompts.skipped_empty > 1)}")
        loaded = load(model, device, dtype, engine, allow_pickle)
        run = inspect_batch(loaded, prompts.prompts, top_k, target, batch_size)
        cut = [n for n, r in enumerate(run.results, 1) if r.truncated]
        if cut:
            render.warn(f"{len(cut)} prompts (lines {', '.join(map(str, cut[:5]))}{'…' * (len(cut) > 5)}) are "
                        f"longer than the context of {loaded.engine.n_ctx}; each keeps its last tokens")
        multi_piece_notices(run.results[0].targets)
        if json_out:
            for result in run.results:
                render.print_json(inspection_json(result, loaded), lines=True)
            render.err().print(summary(run), markup=False, style="dim")
        else:
            batch_table(run, loaded.source, loaded.random_weights)
        return

    from lmhead_cli.readings.explain import explain_logit
    from lmhead_cli.render.explain import explanation, explanation_json

    if prompt is None:
        raise UsageError('give a prompt, e.g. lmhead inspect "The keys on the table" --explain " are"')
    check_prompt(prompt)
    loaded = load(model, device, dtype, engine, allow_pickle)
    result = explain_logit(loaded, prompt, explain, top_k, target)
    warn_truncated(len(result.prompt_tokens), result.truncated, loaded.engine.n_ctx)
    if json_out:
        render.print_json(explanation_json(result))
    else:
        explanation(result)


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
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="How many of the last layer's top tokens the heat map shows.")] = 8,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    engine: EngineOpt = "auto",
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Logit lens: what the head would predict from the residual stream after the embeddings and each block.

    Example: lmhead lens "The keys on the table" --target " are" --heat
    """
    from lmhead_cli import render
    from lmhead_cli.readings.inspect import check_request
    from lmhead_cli.readings.lens import lens_prompt
    from lmhead_cli.render.lens import lens_heat, lens_json, lens_table

    check_request(prompt, target, top_k, "lens")
    loaded = load(model, device, dtype, engine, allow_pickle)
    result = lens_prompt(loaded, prompt, target, top_k)
    warn_truncated(len(result.prompt_tokens), result.truncated, loaded.engine.n_ctx)
    if json_out:
        render.print_json(lens_json(result))
    elif heat:
        lens_heat(result)
    else:
        lens_table(result)


@command("explore")
def explore_cmd(
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="How many tokens each table lists (:top-k).")] = 10,
    temperature: TemperatureOpt = None,  # the start values of :temp and :softcap
    softcap: SoftcapOpt = None,
    target: Annotated[
        Optional[list[str]], typer.Option("--target", "-t", help="Follow a token in every table (:target).")
    ] = None,
    threads: Annotated[
        Optional[int], typer.Option("--threads", help="CPU threads for torch [default: torch's count or 1, "
                                    "whichever answers a 10-token prompt faster at the start].")
    ] = None,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    engine: EngineOpt = "auto",
    allow_pickle: AllowPickleOpt = False,
) -> None:
    """An interactive session: the model loads once, each line you type is a prompt answered at once.

    Commands: :temp 0.8, :softcap 30, :top-k 20, :target " are", :gen 20, :lens, :help, :quit.
    Input can be piped, one prompt a line.

    Example: printf 'The keys on the table\\n:temp 0.5\\nThe key on the table\\n' | lmhead explore
    """
    import time

    from lmhead_cli.decoding import stages
    from lmhead_cli.readings import explore
    from lmhead_cli.readings.inspect import check_targets
    from lmhead_cli.render import explore as show

    stages.check({"temperature": temperature, "softcap": softcap, "top_k": top_k})  # before the load
    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads must be at least 1 (got {threads})")
        import torch

        torch.set_num_threads(threads)
    settings = explore.Settings(top_k=top_k, temperature=temperature, softcap=softcap,
                                targets=tuple(check_targets(target)))
    interactive = sys.stdin.isatty()
    start = time.perf_counter()
    loaded = load(model, device, dtype, engine, allow_pickle)
    n_threads = explore.warm_up(loaded, choose_threads=threads is None)
    show.intro(loaded.source, loaded.random_weights, time.perf_counter() - start, settings, interactive,
               n_threads if loaded.engine.device.type == "cpu" else None)
    session = explore.Session(loaded, settings, show)
    if not interactive:
        session.run(explore.piped_lines())
        return
    history = explore.History(explore.history_file())
    try:
        session.run(explore.terminal_lines(on_cancel=lambda: sys.stderr.write("\n")))
    finally:
        history.save()
        sys.stderr.write("\n")



# ==== score (issue 11) ===========================================================================

@command("score")
def score_cmd(
    text: Annotated[
        Optional[str], typer.Argument(help="The text to score; - reads it from stdin.")
    ] = None,
    file: Annotated[
        Optional[str], typer.Option("--file", "-f", help="Score every line of this file (- for stdin) as its own "
                                    "text, streamed; a corpus summary at the end.")
    ] = None,
    bos: Annotated[
        bool, typer.Option("--bos", help="Put <|endoftext|> before the text so its first token is scored too.")
    ] = False,
    stride: Annotated[
        Optional[int], typer.Option("--stride", help="Texts longer than the context go in windows of n_ctx tokens "
                                    "that begin every S tokens, 1 ≤ S ≤ n_ctx [default: n_ctx / 2].")
    ] = None,
    chunk: Annotated[
        Optional[int], typer.Option("--chunk", help="Positions per pass of the head: each pass holds N × V × 4 "
                                    "bytes of float32 logits (GPT-2: 201 kB a position) and as much again for "
                                    "their log-softmax [default: the most within 32 MiB, 166 for GPT-2].")
    ] = None,
    show_table: Annotated[
        bool, typer.Option("--table", help="Also list every token's figures (a long text: the first and last rows).")
    ] = False,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    engine: EngineOpt = "auto",
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Score every token of a text you already have: log-probability, rank, entropy, surprisal, perplexity.

    Each token is coloured by its rank (top-1, 10, 100, 1000, the rest); marked instead without colour.

    Example: lmhead score "The keys on the table are on the table." --table
    """
    from lmhead_cli.readings import score as scoring
    from lmhead_cli.render import score as show

    if stride is not None and stride < 1:
        raise UsageError(f"--stride must be at least 1 (got {stride})")
    scoring.check_chunk(chunk)
    if file is not None:
        if text is not None:
            raise UsageError("give a text or --file, not both")
        if show_table:
            raise UsageError("--table lists one text's tokens; it cannot be combined with --file")
        stream = scoring.open_texts(file)  # before the load: a bad path fails in an instant
        try:
            loaded = load(model, device, dtype, engine, allow_pickle)
            if stride is not None:
                scoring.check_stride(stride, loaded.engine.n_ctx)
            corpus = scoring.Corpus()
            items = scoring.score_lines(loaded, scoring.read_lines(stream, file), corpus, bos=bos, stride=stride,
                                        chunk=chunk)
            show.file_report(items, corpus, loaded.source, loaded.random_weights, json_out)
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()
        return
    if text is None:
        raise UsageError('give a text, e.g. lmhead score "The keys on the table are here." '
                         "(- reads stdin; --file PATH scores one text a line)")
    text = scoring.check_text(scoring.read_text(sys.stdin.buffer) if text == "-" else text)
    loaded = load(model, device, dtype, engine, allow_pickle)
    if stride is not None:
        scoring.check_stride(stride, loaded.engine.n_ctx)
    with show.Progress("scoring") as progress:
        result = scoring.score_text(loaded, text, bos=bos, stride=stride, chunk=chunk, progress=progress)
    if json_out:
        show.write_json(result)
    else:
        show.report(result, show_table)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
