"""The Typer app and the options several commands share, each declared once.

No math and no torch here: `lmhead --help`, `params` and `toy` must start instantly.
"""

from __future__ import annotations

import functools
import inspect as pyinspect
from dataclasses import dataclass
from typing import Annotated, Callable, Optional

import typer

from lmhead_cli import __version__
from lmhead_cli.cli import complete
from lmhead_cli.cli.boundary import DEFAULT_PROMPT, Command, Group, boundary
from lmhead_cli.api.choices import SETTINGS, STAGES, chunk_default, from_text  # the registry: no torch

app = typer.Typer(
    name="lmhead",
    cls=Group,
    help="Make the last step of GPT-2 visible: hidden vector -> logits -> probabilities -> next token.\n\n"
    "--model defaults to gpt2 (from the Hugging Face hub or its cache; bundled:tiny, said in one line, on a "
    "machine that has neither); the environment variable LMHEAD_MODEL "
    "sets another default, e.g. LMHEAD_MODEL=random:gpt2 (seeded random weights, offline) or "
    "LMHEAD_MODEL=bundled:tiny (a small trained model that ships with lmhead, offline). The examples in "
    "each command's --help use --model random:gpt2, so they run offline as written.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish and PowerShell
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

DEFAULT_MODEL = "gpt2"
__all__ = ["DEFAULT_MODEL", "DEFAULT_PROMPT", "app", "command", "ModelChoice", "stage_options"]

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
FormatOpt = Annotated[
    Optional[str], typer.Option("--format", help="text, json (the same as --json) or openai: one OpenAI chat "
                                "completion object, logprobs included.", show_default="text",
                                autocompletion=complete.formats)
]


def setting_option(key: str, *names: str, help: str | None = None, **more):
    """The option of the registry's setting `key` (decoding/stages.py): its names and help (the registry's
    unless given), and its text handed to the registry as the number it spells (api.choices.from_text),
    so that its one check (type, off values, range) says what a bad value is, as at every door."""
    s = SETTINGS[key]
    return typer.Option(*(names or s.options or (s.option,)), help=s.help if help is None else help,
                        parser=from_text, metavar="<int>" if s.type is int else "<float>", **more)


TopLogprobsOpt = Annotated[
    int, setting_option("top_logprobs", help="With --format openai: the N most probable tokens at every position, "
                        "from 0 up to the vocabulary size (no cap at 20).")
]
LogprobsOpt = Annotated[
    Optional[str], typer.Option("--logprobs", help="With --format openai: raw (the default: softmax of the model's "
                                "logits) or processed (after the stages: the distribution each token was drawn from).",
                                show_default="raw", autocompletion=complete.logprob_kinds)
]


# ---- the options of the commands that read a whole text in windows (score, compare) --------------
BosOpt = Annotated[
    bool, typer.Option("--bos", help="Put the BOS token (GPT-2: <|endoftext|>) before the text so its first token "
                       "is predicted too; the default where the model's tokenizer adds BOS (Llama).")
]
NoBosOpt = Annotated[bool, typer.Option("--no-bos", help="No BOS token, even where the model's tokenizer adds one.")]


def bos_choice(bos: bool, no_bos: bool) -> bool | None:
    """--bos (True), --no-bos (False), or neither (None: as the model's tokenizer says)."""
    if bos and no_bos:
        from lmhead_cli.errors import UsageError

        raise UsageError("--bos and --no-bos contradict each other; give one of them")
    return True if bos else False if no_bos else None
StrideOpt = Annotated[
    Optional[int], typer.Option("--stride", help="Texts longer than the context go in windows of n_ctx tokens "
                                "that begin every S tokens, 1 ≤ S ≤ n_ctx.", show_default="n_ctx / 2", min=1)
]


def chunk_option(per_pass: str, command: str):
    """--chunk, the positions a pass of the head takes: `per_pass` says what a pass holds (the command's
    own); the default shown is `command`'s, computed for GPT-2 (api.choices.chunk_default)."""
    return Annotated[
        Optional[int], typer.Option("--chunk", help=f"Positions per pass of {per_pass}.",
                                    show_default=chunk_default(command), min=1)
    ]


@dataclass(frozen=True)
class ModelChoice:
    """What --model, --device, --dtype, --engine, --allow-pickle and --threads asked for."""

    model: str | None = None  # None: not named (DEFAULT_MODEL, or bundled:tiny offline: api.load)
    device: str = "auto"
    dtype: str = "float32"
    engine: str = "auto"
    allow_pickle: bool = False
    threads: int | None = None
    ignore_memory: bool = False

    def load(self, device: str | None = None):
        """lmhead_cli.load() with these options (on `device` instead, under torchrun): an api.Model."""
        from lmhead_cli.api import load

        return load(self.model, device=device or self.device, dtype=self.dtype, engine=self.engine,
                    allow_pickle=self.allow_pickle, threads=self.threads, ignore_memory=self.ignore_memory,
                    announce=_notice)


def _notice(line: str) -> None:
    """The loader's notices, with an API parameter spelled as the flag (source -> --model)."""
    from lmhead_cli.cli.boundary import flag
    from lmhead_cli.errors import Notice
    from lmhead_cli.render import notice

    notice(line.spelled_with(flag) if isinstance(line, Notice) else line)


def _param(name: str, annotation, default) -> pyinspect.Parameter:
    return pyinspect.Parameter(name, pyinspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                               annotation=annotation)


# The options of every command that loads a model; the command receives them as one ModelChoice.
MODEL_OPTIONS = [
    _param("model", Annotated[Optional[str], typer.Option(
        "--model", "-m", envvar="LMHEAD_MODEL", autocompletion=complete.models,
        show_default=f"{DEFAULT_MODEL}; bundled:tiny when {DEFAULT_MODEL} is neither cached nor reachable",
        help="Hub id (gpt2, distilgpt2, ...), a local folder, a GGUF file (FILE.gguf: GPT-2 or Llama), "
             "random:NAME (seeded random weights, offline), or bundled:tiny (a small GPT-2 trained on the King "
             "James Bible that ships with lmhead).")],
        None),
    _param("device", Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.",
                                                                autocompletion=complete.devices)], "auto"),
    _param("dtype", Annotated[str, typer.Option(
        "--dtype", help="float32, bfloat16, float16, or int8 (weights quantised at load, lean engine; activations "
        "float32). Softmax is always float32.",
        autocompletion=complete.dtypes)], "float32"),
    _param("engine", Annotated[str, typer.Option(
        "--engine", help="auto (lean for GPT-2 checkpoints, transformers otherwise), lean or transformers.",
        autocompletion=complete.engines)],
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
    """One option per decoding stage, from the registry (api.choices.STAGES): its names, type and
    help. `only` keeps some stages; `rename` gives a stage other names and help where its own clash
    with the command's (inspect's --top-k counts rows, so its top-k stage is --filter-top-k)."""
    params = []
    for s in STAGES:
        if only is not None and s.key not in only:
            continue
        names, text = (rename or {}).get(s.key, (s.options or (s.option,), s.help))
        params.append(_param(KNOB + s.key, Annotated[Optional[s.type], setting_option(s.key, *names, help=text)],
                             None))
    return params


def _knobs(**values) -> dict:
    """{stage key: value given or None} from the stage options' values."""
    return {name.removeprefix(KNOB): value for name, value in values.items()}


def _splice(fn: Callable, groups: dict[str, tuple[list[pyinspect.Parameter], Callable]]) -> Callable:
    """Typer reads a command's options from its signature. For each `name: (options, pack)` in
    `groups`, put `options` where `fn` has the parameter `name`, and call `fn` with `name` set to
    pack(**their values). So a group of options is written once and each command takes one value.

    Why this stays: Typer (0.12-0.29) has no option groups: a command's options are its function's
    parameters, so without this the seven model options would be written out in every one of the
    eleven model commands and the five stage options in five. Click's own decorators would work but
    give up Typer's Annotated help and types everywhere else."""
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


def command(name: str | None = None, *, knobs: list[pyinspect.Parameter] | None = None):
    """`app.command(name)` with the error boundary around it. A parameter `source: ModelChoice` becomes
    the model options; a parameter `knobs: dict` becomes the stage options given in `knobs`."""

    def register(fn):
        groups = {"source": (MODEL_OPTIONS, ModelChoice)}
        if knobs is not None:
            groups["knobs"] = (knobs, _knobs)
        return app.command(name, cls=Command)(boundary(_splice(fn, groups), name or fn.__name__))

    return register


def output_kind(json_out: bool, output_format: str | None, top_logprobs: int, logprobs: str | None) -> str:
    """text, json or openai from --json / --format; the logprob options only mean something in openai."""
    from lmhead_cli.errors import UsageError

    kind = output_format or ("json" if json_out else "text")
    if kind not in ("text", "json", "openai"):
        raise UsageError(f"--format must be text, json or openai (got {kind!r})")
    if json_out and kind != "json":
        raise UsageError(f"--json and --format {kind} ask for two different outputs; give one")
    if kind != "openai" and (top_logprobs or logprobs is not None):
        given = "--top-logprobs" if top_logprobs else "--logprobs"
        raise UsageError(f"{given} is reported by --format openai only")
    return kind


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


def one_text(text: str | None, file: str | None, example: str) -> str:
    """The one text of a command that reads a whole text (compare, calibrate): TEXT, - (stdin) or
    --file PATH (read whole, as one text), checked once; `example` is the command line the usage error
    shows."""
    from lmhead_cli.api import checks
    from lmhead_cli.api.files import read_text_file
    from lmhead_cli.errors import UsageError
    from lmhead_cli.inputs import read_text

    if file is not None:
        checks.prompt_or_file(text, file, "a text")
        text = read_text_file(file)
    elif text is None:
        raise UsageError(f"give a text, e.g. {example} (- reads stdin; --file PATH reads a file as one text)")
    elif text == "-":
        text = read_text("the text on stdin")
    return checks.text(text)
