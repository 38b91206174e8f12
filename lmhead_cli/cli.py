"""The command line. One Typer app, one function per command: parse -> load -> compute -> render.

No math and no torch at module top: `lmhead --help`, `params` and `toy` must start instantly.
Domain errors (lmhead_cli.errors) become one line and an exit code in `_boundary`, and only there;
that is also the one place where a setting's key (`top_k`) is spelled as the option the user typed.
"""

from __future__ import annotations

import functools
import inspect as pyinspect
import os
import sys
from dataclasses import dataclass
from typing import Annotated, Callable, Optional

import typer
from typer.core import TyperCommand

from lmhead_cli import __version__
from lmhead_cli.decoding.stages import GEMMA2_CAP, STAGES, option  # the registry: no torch
from lmhead_cli.errors import BadValue, LmheadError, ModeConflict, NoPrompt, OneToken, UnsupportedModel, UsageError

app = typer.Typer(
    name="lmhead",
    help="Make the last step of GPT-2 visible: hidden vector -> logits -> probabilities -> next token.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish and PowerShell
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

DEFAULT_MODEL = "gpt2"
DEFAULT_PROMPT = "The keys on the table"

# ---- shared options: declared once, before any command uses them --------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]
AllowPickleOpt = Annotated[
    bool, typer.Option("--allow-pickle", help="Allow pytorch_model.bin checkpoints (loaded with weights_only=True).")
]
TargetOpt = Annotated[
    Optional[list[str]], typer.Option("--target", "-t", help="A token to follow (repeatable), e.g. --target ' are'.")
]
PresetOpt = Annotated[
    Optional[str], typer.Option("--preset", help="Named settings from configs/presets.toml (creative, precise, "
                                "gemma-softcap) or a .toml file; flags override it.")
]


@dataclass(frozen=True)
class ModelChoice:
    """What --model, --device, --dtype, --engine, --allow-pickle and --threads asked for."""

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "float32"
    engine: str = "auto"
    allow_pickle: bool = False
    threads: int | None = None
    ignore_memory: bool = False

    def load(self):
        """Load the model (importing torch only now); every model command goes through here."""
        from lmhead_cli.engine.threads import prepare

        threads = prepare(self.threads)  # OpenMP's wait policy is read when torch is imported: before that
        from lmhead_cli.loading.sources import load_model
        from lmhead_cli.render import notice

        return load_model(self.model, device=self.device, dtype=self.dtype, engine=self.engine,
                          allow_pickle=self.allow_pickle, threads=threads, ignore_memory=self.ignore_memory,
                          announce=notice)


def _param(name: str, annotation, default) -> pyinspect.Parameter:
    return pyinspect.Parameter(name, pyinspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                               annotation=annotation)


# The options of every command that loads a model; the command receives them as one ModelChoice.
MODEL_OPTIONS = [
    _param("model", Annotated[str, typer.Option(
        "--model", "-m", envvar="LMHEAD_MODEL",
        help="Hub id (gpt2, distilgpt2, ...), a local folder, or random:NAME (seeded random weights, offline).")],
        DEFAULT_MODEL),
    _param("device", Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")], "auto"),
    _param("dtype", Annotated[str, typer.Option(
        "--dtype", help="float32, bfloat16 or float16 (softmax is always float32).")], "float32"),
    _param("engine", Annotated[str, typer.Option(
        "--engine", help="auto (lean for GPT-2 checkpoints, transformers otherwise), lean or transformers.")],
        "auto"),
    _param("allow_pickle", AllowPickleOpt, False),
    _param("threads", Annotated[Optional[int], typer.Option(
        "--threads", envvar="LMHEAD_THREADS", show_default="chosen by timing",
        help="CPU threads for torch. Default: torch's count or 1, whichever runs the work faster, timed on the "
        "first steps (batches, prompts) and again when speed drops.")], None),
    _param("ignore_memory", Annotated[bool, typer.Option(
        "--ignore-memory", help="Load even when the model's estimated memory exceeds what is available.")], False),
]


KNOB = "knob_"  # stage options' parameter names, apart from a command's own (inspect's top_k counts rows)


def stage_options(only: tuple[str, ...] | None = None,
                  rename: dict[str, tuple[tuple[str, ...], str]] | None = None) -> list[pyinspect.Parameter]:
    """One option per decoding stage, from the registry (decoding.stages.STAGES): its names, type and
    help. `only` keeps some stages; `rename` gives a stage other names and help where its own clash
    with the command's (inspect's --top-k counts rows, so its top-k stage is --filter-top-k)."""
    params = []
    for s in STAGES:
        if only is not None and s.key not in only:
            continue
        names, text = (rename or {}).get(s.key, (s.options or (s.option,), s.help))
        params.append(_param(KNOB + s.key, Annotated[Optional[s.type], typer.Option(*names, help=text)], None))
    return params


def _knobs(**values) -> dict:
    """{stage key: value given or None} from the stage options' values."""
    return {name.removeprefix(KNOB): value for name, value in values.items()}


def _splice(fn: Callable, groups: dict[str, tuple[list[pyinspect.Parameter], Callable]]) -> Callable:
    """Typer reads a command's options from its signature. For each `name: (options, pack)` in
    `groups`, put `options` where `fn` has the parameter `name`, and call `fn` with `name` set to
    pack(**their values). So a group of options is written once and each command takes one value."""
    signature = pyinspect.signature(fn, eval_str=True)
    params, members = [], {}
    for p in signature.parameters.values():
        if p.name in groups:
            options, pack = groups[p.name]
            members[p.name] = (pack, [o.name for o in options])
            params += options
        else:
            params.append(p)

    @functools.wraps(fn)
    def call(**kwargs):
        for name, (pack, keys) in members.items():
            kwargs[name] = pack(**{k: kwargs.pop(k) for k in keys})
        return fn(**kwargs)

    call.__signature__ = signature.replace(parameters=params)
    return call


# ---- ranges declared on the options (min=, max=), failing with lmhead's one line ----------------

# How a command quotes a bad value: params and toy say "; got 0", as their other messages do.
GOT = {"params": "; got {}", "toy": "; got {}"}


class _Command(TyperCommand):
    """Typer's command, but a number outside its option's `min=`/`max=` fails like every other bad
    value: one line, "--threads must be at least 1 (got 0)", exit code 2 (not click's usage panel)."""

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)
        try:
            return super().make_context(info_name, list(args), parent=parent, **extra)
        except typer.BadParameter as e:
            p = e.param
            low, high = getattr(p, "min", None), getattr(p, "max", None)
            ranged = low is not None or high is not None
            raw = self.make_parser(e.ctx).parse_args(args=given)[0].get(p.name) if ranged else None
            try:
                value = int(raw)
            except (TypeError, ValueError):
                raise e from None  # not a number, or no range: click's own message
            must = (f"at least {low:,}" if high is None else f"at most {high:,}" if low is None
                    else f"between {low:,} and {high:,}")
            _fail(f"{p.opts[0]} must be {must}{GOT.get(info_name, ' (got {})').format(value)}", 2)


# ---- the error boundary -------------------------------------------------------------------------

def _fail(message: str, code: int) -> None:
    from lmhead_cli.render import safe_text

    _say(f"lmhead: error: {safe_text(message)}")  # the message may quote a prompt, a path or a file's line
    raise typer.Exit(code)


def _spellings(fn) -> dict[str, str]:
    """How the user types each parameter of command `fn`: `--target` for an option, `the prompt` for an
    argument (read from the Annotated typer.Option / typer.Argument of its signature)."""
    from typing import get_args

    spelled = {}
    for p in pyinspect.signature(fn, eval_str=True).parameters.values():
        info = next((a for a in get_args(p.annotation)[1:] if isinstance(a, (typer.models.ParameterInfo))), None)
        if isinstance(info, typer.models.ArgumentInfo):
            spelled[p.name] = f"the {p.name.replace('_', ' ')}"
        elif info is not None:  # typer.Option("--target", "-t"): the first name can arrive as `default`
            names = [d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d.startswith("-")]
            if names:
                spelled[p.name] = next((d for d in names if d.startswith("--")), names[0])
    return spelled


def _say(line: str) -> None:
    """One line on stderr, if there is a stderr to write to."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr closed too: the exit code must do
        pass


def message(e: LmheadError, command: str) -> str:
    """A domain error as one line, with the settings, modes and examples spelled for `lmhead COMMAND`."""
    if isinstance(e, BadValue):
        return e.spelled(option(e.key))
    if isinstance(e, OneToken):
        return f"{e}: add --bos to score it after <|endoftext|>"
    if isinstance(e, NoPrompt):
        return f'{e}, e.g. lmhead {command} "{DEFAULT_PROMPT}"'
    if isinstance(e, ModeConflict):
        what = "--greedy" if "greedy" in e.asked else f"--beams {e.asked['beams']}"
        return (f"lmhead {command} draws tokens at random, which {what} does not; "
                f"use lmhead greedy{'' if 'greedy' in e.asked else ' ' + what}")
    return str(e)


def _boundary(fn, command: str):
    """Turn domain errors into one line on stderr and an exit code (1 runtime, 2 usage).

    Ctrl-C exits 130 and keeps what was printed; a closed pipe (`| head`) ends quietly.
    Any other exception is a bug: one line too, with LMHEAD_DEBUG=1 for the traceback.
    """
    spelled = _spellings(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            from lmhead_cli.inputs import check_args

            # bytes that are not UTF-8 in any argument: a usage error, before anything
            check_args(kwargs, lambda name: spelled.get(name) or f"--{name.replace('_', '-')}")
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except LmheadError as e:
            _fail(message(e, command), e.exit_code)
        except KeyboardInterrupt:
            sys.stdout.flush()
            sys.stderr.write("\ninterrupted\n")
            raise typer.Exit(130)
        except BrokenPipeError:
            # The reader went away (`lmhead ... | head`): stop quietly, and keep Python from
            # complaining when it flushes stdout at exit.
            _quiet_stdout()
            raise typer.Exit(0)
        except OutputError as e:
            _quiet_stdout()
            _fail(e.strerror, 1)
        except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
            if os.environ.get("LMHEAD_DEBUG"):
                raise
            _fail(f"unexpected {type(e).__name__}: {e} (set LMHEAD_DEBUG=1 for the traceback)", 1)

    return wrapper


def command(name: str | None = None, *, knobs: list[pyinspect.Parameter] | None = None):
    """`app.command(name)` with the error boundary around it. A parameter `source: ModelChoice` becomes
    the model options; a parameter `knobs: dict` becomes the stage options given in `knobs`."""

    def register(fn):
        groups = {"source": (MODEL_OPTIONS, ModelChoice)}
        if knobs is not None:
            groups["knobs"] = (knobs, _knobs)
        return app.command(name, cls=_Command)(_boundary(_splice(fn, groups), name or fn.__name__))

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


# ==== inspect / tie ==============================================================================

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

    Example: lmhead inspect "The keys on the table" --target " are" --target " is"
    """
    from lmhead_cli import render
    from lmhead_cli.readings.inspect import check_request, inspect_prompt
    from lmhead_cli.render.inspect import inspection, inspection_json

    chosen = stage_knobs(stages, preset, knobs)
    if chosen is not None and (file is not None or explain is not None):
        raise UsageError("--stages and its knobs take one prompt; not with --file or --explain")
    if file is not None:
        return inspect_file(prompt, file, batch_size, explain, top_k, target, source, json_out)
    if explain is not None:
        return inspect_explain(prompt, explain, top_k, target, source, json_out)
    check_request(prompt, target, top_k)
    loaded = source.load()
    result = inspect_prompt(loaded, prompt, top_k, target)
    render.truncated(len(result.prompt_tokens), result.truncated, loaded.engine.n_ctx)
    render.multi_piece_notices(result.targets)
    render.own_softcap_notice(loaded.engine.own_stages.get("softcap"), chosen and chosen.softcap)
    table = None
    if chosen is not None:
        from lmhead_cli.decoding.stages import stage_table

        table = stage_table(result.logits, chosen, top_k, loaded.tokenizer.token_text)
    if json_out:
        from lmhead_cli.render.generate import stages_json

        own = loaded.engine.own_stages.get("softcap")
        render.print_json(inspection_json(result, loaded.tie) | ({"stages": stages_json(table, own)} if table else {}))
        return
    inspection(result, loaded.tie)
    if table is not None:
        from lmhead_cli.render.generate import stage_report

        stage_report(table, loaded.engine.own_stages.get("softcap"))


def stage_knobs(stages: bool, preset: str | None, given: dict):
    """The stage settings for `inspect --stages` (any knob turns the table on), or None."""
    if not stages and preset is None and all(v is None for v in given.values()):
        return None
    from lmhead_cli.decoding.presets import knobs

    try:
        return knobs(preset, **given)
    except BadValue as e:
        if e.key == "top_k":  # inspect's own --top-k counts rows; this is the stage's
            raise UsageError(e.spelled("--filter-top-k")) from None
        raise


def inspect_file(prompt, file, batch_size, explain, top_k, target, source: ModelChoice, json_out) -> None:
    """`inspect --file`: read a batch of lines, compute it, write it, forget it; counts at the end.

    Under torchrun each rank computes every N-th batch and rank 0 writes them all in order (distributed.py)."""
    import dataclasses

    from lmhead_cli.distributed import Ranks
    from lmhead_cli.readings.batch import STDIN, BatchStats, PromptLines, inspect_stream
    from lmhead_cli.readings.inspect import check_targets
    from lmhead_cli.render.batch import JsonLinesWriter, TableWriter, file_notices
    from lmhead_cli.render.inspect import inspection_json

    if explain is not None:
        raise UsageError("--explain takes apart one prompt's logit; it cannot be combined with --file")
    if prompt is not None:
        raise UsageError("give a prompt or --file, not both")
    if top_k < 1:
        raise BadValue("top_k", f"must be at least 1 (got {top_k})")
    if batch_size < 1:
        raise BadValue("batch_size", f"must be at least 1 (got {batch_size})")
    targets = check_targets(target)
    ranks = Ranks.from_env()
    if ranks.world > 1 and file == STDIN:
        raise UsageError("under torchrun every rank reads the prompts itself: give --file a file, not - (stdin)")
    lines = PromptLines(file)
    lines.first()  # before the load: a missing, empty or undecodable file fails in an instant
    loaded = dataclasses.replace(source, device=ranks.start(source.device)).load()
    writer = (JsonLinesWriter(lambda r: inspection_json(r, loaded.tie)) if json_out
              else TableWriter(loaded.source, loaded.random_weights, targets)) if ranks.writer else None
    stats = BatchStats(batch_size, targets)
    mine = ranks.share(lines, batch_size)  # every line on one rank; all of them alone
    for batch in ranks.merge(inspect_stream(loaded, mine, top_k, targets, batch_size, stats)):
        writer.write(batch)  # rank 0 only: the others' merge yields nothing
    stats = BatchStats.merged(ranks.gather(stats))
    if ranks.writer:
        writer.end(stats)
        file_notices(lines, stats, loaded.engine.n_ctx)
    ranks.finish()


def inspect_explain(prompt, explain, top_k, target, source: ModelChoice, json_out) -> None:
    """`inspect --explain TOKEN`: one logit taken apart."""
    from lmhead_cli import render
    from lmhead_cli.readings.explain import explain_logit
    from lmhead_cli.readings.inspect import check_request
    from lmhead_cli.render.explain import explanation, explanation_json

    check_request(prompt, target, top_k)
    loaded = source.load()
    result = explain_logit(loaded, prompt, explain, top_k, target)
    render.truncated(len(result.prompt_tokens), result.truncated, loaded.engine.n_ctx)
    if json_out:
        render.print_json(explanation_json(result))
    else:
        explanation(result)


@command("tie")
def tie_cmd(source: ModelChoice = None, json_out: JsonOpt = False) -> None:
    """Prove weight tying: is the output matrix the very same tensor as the embedding table?

    Example: lmhead tie --model random:gpt2 --engine transformers
    """
    from lmhead_cli import render
    from lmhead_cli.render.inspect import tie_document, tie_report

    loaded = source.load()
    if json_out:
        render.print_json(tie_document(loaded))
    else:
        tie_report(loaded)


# ==== generate / greedy / sample / softcap =======================================================
# The four decoding commands share one option list (generate's) and one body (_decode); the named
# ones only fix what MODES says. Their stage options come from the registry, like inspect's.

# What each decoding command fixes before the preset and the flags (decoding.generate.resolve).
MODES: dict[str, dict] = {
    "generate": {},
    "greedy": {"greedy": True},
    "sample": {"draws": True},
    "softcap": {"draws": True, "defaults": {"softcap": GEMMA2_CAP}},
}
FormatOpt = Annotated[
    Optional[str], typer.Option("--format", help="text, json (the same as --json) or openai: one OpenAI chat "
                                "completion object, logprobs included.", show_default="text")
]
TopLogprobsOpt = Annotated[
    int, typer.Option("--top-logprobs", help="With --format openai: the N most probable tokens at every position, "
                      "from 0 up to the vocabulary size (no cap at 20).")
]
LogprobsOpt = Annotated[
    Optional[str], typer.Option("--logprobs", help="With --format openai: raw (the default: softmax of the model's "
                                "logits) or processed (after the stages: the distribution each token was drawn from).",
                                show_default="raw")
]


def output_kind(json_out: bool, output_format: str | None, top_logprobs: int, logprobs: str | None) -> str:
    """text, json or openai from --json / --format; the logprob options only mean something in openai."""
    kind = output_format or ("json" if json_out else "text")
    if kind not in ("text", "json", "openai"):
        raise UsageError(f"--format must be text, json or openai (got {kind!r})")
    if json_out and kind != "json":
        raise UsageError(f"--json and --format {kind} ask for two different outputs; give one")
    if kind != "openai" and (top_logprobs or logprobs is not None):
        given = "--top-logprobs" if top_logprobs else "--logprobs"
        raise UsageError(f"{given} is reported by --format openai only")
    return kind


def decoding_options(
    prompt: Annotated[
        Optional[str], typer.Argument(help="The text to continue; - reads stdin.", show_default=DEFAULT_PROMPT)
    ] = None,
    max_new_tokens: Annotated[
        Optional[int], typer.Option("--max-new-tokens", "-n", help="How many tokens to make at most.", show_default="40")
    ] = None,
    knobs: dict = None,
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
    source: ModelChoice = None,
    json_out: JsonOpt = False,
    output_format: FormatOpt = None,
    top_logprobs: TopLogprobsOpt = 0,
    logprobs: LogprobsOpt = None,
) -> None:
    """The options the four decoding commands share (`knobs`: one per stage of the registry)."""


def _decoding_command(name: str, doc: str) -> None:
    """Register `lmhead NAME` with generate's options and body, in mode NAME."""

    def run(**options) -> None:
        _decode(name, **options)

    run.__signature__ = pyinspect.signature(decoding_options, eval_str=True)
    run.__doc__ = doc
    command(name, knobs=stage_options())(run)


_decoding_command("generate", f"""Generate text token by token: {' -> '.join(s.name for s in STAGES)} -> softmax -> choose.

    Samples unless --greedy or --beams N; `greedy`, `sample` and `softcap` are the named forms.

    Example: lmhead generate "The keys on the table" --temperature 0.8 --seed 1 --show-steps 5
    """)
_decoding_command("greedy", """Take the most likely token every step (the same tokens as transformers' do_sample=False).

    Example: lmhead greedy "The dog" --max-new-tokens 18 --show-steps 3
    """)
_decoding_command("sample", """Draw each token from the probabilities (seeded, so a run can be replayed).

    Example: lmhead sample --temperature 0.8 --top-p 0.95 --seed 1
    """)
_decoding_command("softcap", """Sample after Gemma-style soft-capping z -> c·tanh(z/c) (c = 30 unless --cap says otherwise).

    Example: lmhead softcap --cap 30 --seed 1
    """)


def _decode(command_name: str, prompt, preset, greedy, beams, ignore_eos, seed, show_steps, max_new_tokens,
            knobs: dict, source: ModelChoice, json_out, output_format, top_logprobs, logprobs) -> None:
    """parse -> load -> generate (streaming) -> summary, shared by the four decoding commands."""
    from lmhead_cli import render
    from lmhead_cli.decoding.generate import generate, resolve
    from lmhead_cli.inputs import read_stdin
    from lmhead_cli.readings.inspect import check_prompt, encode_prompt
    from lmhead_cli.render import generate as show

    kind = output_kind(json_out, output_format, top_logprobs, logprobs)
    json_out = kind != "text"
    mode = MODES[command_name]
    settings = resolve(defaults=mode.get("defaults"), draws=mode.get("draws", False), preset=preset,
                       greedy=greedy or mode.get("greedy", False), beams=beams, ignore_eos=ignore_eos, seed=seed,
                       show_steps=show_steps, max_new_tokens=max_new_tokens, top_logprobs=top_logprobs,
                       logprobs=logprobs or "raw", **knobs)
    text = check_prompt(read_stdin("the prompt on stdin").rstrip("\n") if prompt == "-"
                        else DEFAULT_PROMPT if prompt is None else prompt)
    loaded = source.load()
    render.own_softcap_notice(loaded.engine.own_stages.get("softcap"), settings.knobs.softcap)
    ids, dropped = encode_prompt(loaded, text)
    render.truncated(len(ids), dropped, loaded.engine.n_ctx)
    if not json_out:
        from lmhead_cli.render.inspect import random_banner

        random_banner(loaded.source, loaded.random_weights)  # every output made from random weights says so
        show.begin(loaded.tokenizer.decode(ids))
    result = generate(loaded, ids, settings, on_text=None if json_out else show.stream)
    if not json_out:
        show.end_text()
    show.stop_notice(result, loaded.engine.n_ctx)
    if kind == "openai":
        show.openai_json(result, loaded)
        return
    if json_out:
        render.print_json(show.generation_json(result, loaded, text, preset))
        return
    if settings.show_steps:
        show.steps_table(result)
    if result.beams:
        show.beams_table(result)
    show.summary(result)


# ==== params / toy ===============================================================================
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
    from lmhead_cli.readings import params as count
    from lmhead_cli.loading.model_configs import load_config
    from lmhead_cli.render.params import render_params

    if config is not None and model is not None:
        raise UsageError("--config and --model are mutually exclusive: --config counts a bundled config by "
                         "arithmetic, --model counts a loaded model's tensors")
    if model is None:
        name, counted_from = config or DEFAULT_MODEL, "config"
        acc = count.account_from_config(load_config(name))
    else:
        from lmhead_cli.loading.sources import model_type

        kind = model_type(model, allow_pickle)  # the config only: refuse before reading any weights
        if kind != "gpt2":
            raise UnsupportedModel(f"params --model counts GPT-2-family tensors (wte, wpe, h.N, ln_f); "
                                   f"{model} is a {kind!r} model")
        # --model here counts tensors (no --device/--engine): imports torch only when asked
        loaded = ModelChoice(model, device="cpu", engine="lean", allow_pickle=allow_pickle).load()
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
    draws: Annotated[
        int, typer.Option("--draws", help="How many times to choose a word.",
                          min=1, max=MAX_TOY_DRAWS)
    ] = 20,
    json_out: JsonOpt = False,
) -> None:
    """The whole last step on four words you can check by hand: h -> logits -> softmax -> a word.

    Example: lmhead toy --hidden 0.5,1,2 --temperature 0.7
    """
    from lmhead_cli.readings import toy as toy_head
    from lmhead_cli.render.toy import render_toy

    h = toy_head.parse_hidden(hidden) if hidden is not None else toy_head.HIDDEN
    toy_head.check_temperature(temperature)
    render_toy(toy_head.toy_example(h, temperature, seed, draws), as_json=json_out)


# ==== lens / explore =============================================================================

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
    top_k: Annotated[
        int, typer.Option("--top-k", "-k", help="How many of the last layer's top tokens the heat map shows.",
                          min=1)
    ] = 8,
    position: Annotated[
        Optional[int], typer.Option("--position", help="Read the prompt at token I (0-based; -1 the last): "
                                    "what each layer predicts after it.", show_default="the last")
    ] = None,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
) -> None:
    """Logit lens: what the head would predict from the residual stream after the embeddings and each block.

    Example: lmhead lens "The keys on the table" --target " are" --heat
    """
    from lmhead_cli import render
    from lmhead_cli.readings.inspect import check_request
    from lmhead_cli.readings.lens import lens_prompt
    from lmhead_cli.render.lens import lens_heat, lens_json, lens_table

    check_request(prompt, target, top_k)
    loaded = source.load()
    result = lens_prompt(loaded, prompt, target, top_k, position)
    render.truncated(len(result.prompt_tokens), result.truncated, loaded.engine.n_ctx)
    if json_out:
        render.print_json(lens_json(result))
    elif heat:
        lens_heat(result)
    else:
        lens_table(result)


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

    Example: printf 'The keys on the table\\n:temp 0.5\\nThe key on the table\\n' | lmhead explore
    """
    import time

    from lmhead_cli.decoding import stages
    from lmhead_cli.engine.threads import check as check_threads
    from lmhead_cli.readings import explore
    from lmhead_cli.readings.inspect import check_targets
    from lmhead_cli.render import explore as show

    stages.check(knobs)  # before the load
    check_threads(source.threads)
    settings = explore.Settings(top_k=top_k, **knobs, targets=tuple(check_targets(target)))
    if sys.stdin is None or sys.stdin.closed:
        raise UsageError("stdin is closed; explore reads its prompts from the terminal or a pipe")
    interactive = sys.stdin.isatty()
    start = time.perf_counter()
    loaded = source.load()
    show.own_softcap_notice(loaded.engine.own_stages.get("softcap"), knobs.get("softcap"))
    n_threads = explore.warm_up(loaded)
    show.intro(loaded.source, loaded.random_weights, time.perf_counter() - start, settings, interactive,
               n_threads if loaded.engine.device.type == "cpu" else None)
    session = explore.Session(loaded, settings, show.AsJson if json_out else show)
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

SCORE_LINES_PER_ROUND = 8  # under torchrun: the lines each rank scores before the ranks hand over


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
                                    "that begin every S tokens, 1 ≤ S ≤ n_ctx.", show_default="n_ctx / 2", min=1)
    ] = None,
    chunk: Annotated[
        Optional[int], typer.Option("--chunk", help="Positions per pass of the head: each pass holds N × V × 4 "
                                    "bytes of float32 logits (GPT-2: 201 kB a position) and one more buffer of "
                                    "that size.", show_default="the most within 32 MiB: 83 for GPT-2",
                                    min=1)
    ] = None,
    show_table: Annotated[
        bool, typer.Option("--table", help="Also list every token's figures (a long text: the first and last rows).")
    ] = False,
    source: ModelChoice = None,
    json_out: JsonOpt = False,
    output_format: FormatOpt = None,
    top_logprobs: TopLogprobsOpt = 0,
) -> None:
    """Score every token of a text you already have: log-probability, rank, entropy, surprisal, perplexity.

    Each token is coloured by its rank (top-1, 10, 100, 1000, the rest); marked instead without colour.

    Example: lmhead score "The keys on the table are on the table." --table
    """
    from lmhead_cli.decoding.stages import check
    from lmhead_cli.readings import score as scoring
    import collections
    import dataclasses

    from lmhead_cli.distributed import Ranks
    from lmhead_cli.readings.batch import STDIN, open_input
    from lmhead_cli.render import score as show

    kind = output_kind(json_out, output_format, top_logprobs, None)
    check({"top_logprobs": top_logprobs})
    if file is not None and kind == "openai":
        raise UsageError("--format openai scores one text; give it as an argument or on stdin, not with --file")
    if file is not None:
        if text is not None:
            raise UsageError("give a text or --file, not both")
        if show_table:
            raise UsageError("--table lists one text's tokens; it cannot be combined with --file")
        ranks = Ranks.from_env()  # under torchrun each rank scores every N-th group of lines (distributed.py)
        if ranks.world > 1 and file == STDIN:
            raise UsageError("under torchrun every rank reads the texts itself: give --file a file, not - (stdin)")
        stream = open_input(file, "text file")  # before the load: a bad path fails in an instant
        try:
            loaded = dataclasses.replace(source, device=ranks.start(source.device)).load()
            if stride is not None:
                scoring.check_stride(stride, loaded.engine.n_ctx)
            corpus = scoring.Corpus()
            items = ranks.spread(scoring.read_lines(stream, file), SCORE_LINES_PER_ROUND,
                                 lambda lines: scoring.score_lines(loaded, lines, corpus, bos=bos, stride=stride,
                                                                   chunk=chunk))

            def totalled():  # every rank's items, then every rank's counts in `corpus`, for the summary
                yield from items
                for name, value in vars(scoring.Corpus.merged(ranks.gather(corpus))).items():
                    setattr(corpus, name, value)

            size = os.fstat(stream.fileno()).st_size if stream is not sys.stdin.buffer else None
            if ranks.writer:
                show.file_report(totalled(), corpus, loaded.source, loaded.random_weights, kind == "json", size)
            else:
                collections.deque(totalled(), maxlen=0)  # compute and hand over; rank 0 writes
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()
            ranks.finish()
        return
    if text is None:
        raise UsageError('give a text, e.g. lmhead score "The keys on the table are here." '
                         "(- reads stdin; --file PATH scores one text a line)")
    text = scoring.check_text(scoring.read_text(sys.stdin.buffer) if text == "-" else text)
    loaded = source.load()
    if stride is not None:
        scoring.check_stride(stride, loaded.engine.n_ctx)
    doc = show.openai_document(loaded, text) if kind == "openai" else None  # written as each chunk is scored
    with show.Progress("scoring") as progress:
        result = scoring.score_text(loaded, text, bos=bos, stride=stride, chunk=chunk, progress=progress,
                                    top_logprobs=top_logprobs, on_rows=doc.rows if doc else None)
    if doc is not None:
        show.openai_end(doc, result)
    elif kind == "json":
        show.write_json(result)
    else:
        show.report(result, show_table)


# ==== diff / attribute (issue 12) ================================================================

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

    Example: lmhead diff "The key on the table" "The keys on the table" --target " is" --target " are"
    """
    from lmhead_cli import render
    from lmhead_cli.readings.diff import diff_prompts
    from lmhead_cli.readings.inspect import check_request
    from lmhead_cli.render.diff import diff_json, diff_report

    if prompt_a is None or prompt_b is None:
        raise UsageError('give two prompts, e.g. lmhead diff "The key on the table" "The keys on the table"')
    check_request(prompt_a, target, top_k)
    check_request(prompt_b, target, top_k)
    loaded = source.load()
    result = diff_prompts(loaded, prompt_a, prompt_b, top_k, target, movers)
    for side in (result.a, result.b):
        render.truncated(len(side.prompt_tokens), side.truncated, loaded.engine.n_ctx)
    render.multi_piece_notices(result.targets)
    if json_out:
        render.print_json(diff_json(result))
    else:
        diff_report(result)


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

    Example: lmhead attribute "The keys on the table" --target " are" --vs " is" --heads
    """
    from lmhead_cli import render
    from lmhead_cli.readings.attribute import attribute_logit, check_attribute
    from lmhead_cli.render.attribute import attribution, attribution_json

    if target is None and prompt is not None:
        raise UsageError("attribute needs --target: the token whose logit to take apart, e.g. --target ' are'")
    check_attribute(prompt, target, vs)
    loaded = source.load()
    result = attribute_logit(loaded, prompt, target, vs)
    render.truncated(len(result.prompt_tokens), result.truncated, loaded.engine.n_ctx)
    render.multi_piece_notices([t for t in (result.target, result.vs) if t is not None])
    if json_out:
        render.print_json(attribution_json(result))
    else:
        attribution(result, heads)


class OutputError(OSError):
    """Writing to stdout failed for another reason than a closed pipe (a full disk, /dev/full)."""


class _GuardedStdout:
    """sys.stdout, with a failed write or flush raised as OutputError (a closed pipe stays
    BrokenPipeError), so the boundary can tell our output's failures from a file's."""

    def __init__(self, stream):
        self._stream = stream
        self.pipe_closed = False  # set on the first closed-pipe error, whoever catches it (click, rich)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _guard(self, method, *args):
        try:
            return method(*args)
        except BrokenPipeError:
            self.pipe_closed = True
            raise
        except OSError as e:
            raise OutputError(e.errno, f"cannot write the output: {e.strerror or e}") from None

    def write(self, text):
        return self._guard(self._stream.write, text)

    def flush(self):
        return self._guard(self._stream.flush)


def _quiet_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush of a dead stdout says nothing."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is not a real file (tests)
        pass


def _streams_for_any_terminal() -> None:
    """Output that any stdout can take: a stdout whose encoding is not UTF-8 (PYTHONIOENCODING=ascii,
    a latin-1 terminal) gets non-ASCII escaped instead of a UnicodeEncodeError; stdin hands bytes
    that are not UTF-8 over as lone surrogates, for inputs.check_text to name."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and "utf" not in (getattr(stream, "encoding", "") or "").lower():
            try:
                stream.reconfigure(errors="backslashreplace")
            except (AttributeError, ValueError):
                pass
    if sys.stdin is not None:
        try:
            sys.stdin.reconfigure(errors="surrogateescape")
        except (AttributeError, ValueError):
            pass


def main() -> None:
    """Console-script entry point: the app, and the one place where a closed or full stdout ends,
    --help and --version included: one line on stderr and exit 1, or exit 0 for a closed pipe."""
    if sys.stdout is None:  # started with stdout closed (>&-)
        _say("lmhead: error: stdout is closed; there is nowhere to write the output")
        sys.exit(1)
    _streams_for_any_terminal()
    sys.stdout = guarded = _GuardedStdout(sys.stdout)
    try:
        app()
        code = 0
    except SystemExit as e:
        # click and rich (the help) end a closed pipe themselves with exit 1: a closed pipe all the same.
        code = 0 if guarded.pipe_closed else e.code
    except BrokenPipeError:
        code = 0
    except OutputError as e:  # --help or --version into a full disk: click lets it through
        _say(f"lmhead: error: {e.strerror}")
        code = 1
    try:  # what is still buffered must get out too
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    except OSError as e:
        _say(f"lmhead: error: {e.strerror}")
        code = code or 1
    finally:
        _quiet_stdout_if_dead()
    sys.exit(code)


def _quiet_stdout_if_dead() -> None:
    try:
        sys.stdout.flush()
    except OSError:
        _quiet_stdout()


if __name__ == "__main__":
    main()
