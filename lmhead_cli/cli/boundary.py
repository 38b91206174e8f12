"""The CLI's one error boundary, and the stdout it writes to.

Domain errors (lmhead_cli.errors) become one line and an exit code here, and only here; this is also
the one place where a setting's key (`top_k`) is spelled as the option the user typed (`--top-k`).
"""

from __future__ import annotations

import functools
import inspect as pyinspect
import os
import sys

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.24 carries its own copy of click
    from typer._click.exceptions import NoArgsIsHelpError, NoSuchOption, UsageError as ClickUsageError
except ImportError:  # older typer: click itself
    from click.exceptions import NoSuchOption, UsageError as ClickUsageError

    NoArgsIsHelpError = None
try:
    from typer._click.globals import get_current_context
except ImportError:
    from click import get_current_context

from lmhead_cli.api.choices import option  # the registry: no torch
from lmhead_cli.errors import (BadValue, LmheadError, ModeConflict, NoPrompt, OneToken, is_library_panic,
                               library_panic)

DEFAULT_PROMPT = "The keys on the table"

# How a command quotes a bad value: params and toy say "; got 0", as their other messages do.
GOT = {"params": "; got {}", "toy": "; got {}"}


class FlagsShowAsFlags:
    """Boolean flags without a type in the rich help: `--json` alone, not `--json <bool>`.

    Typer's rich help writes each option's type, `<bool>` for a flag too, unless the option has a
    metavar; an empty metavar, given here to every flag (help and completion options included), is the
    plain way to leave the column empty (Option(metavar="") on each would not reach --help, which
    click builds itself)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params

    def format_help(self, ctx, formatter):
        """Rich's panels where the terminal holds them; on a narrower one, click's plain help, which
        wraps every line and cuts nothing (rich's columns would end option names and paths in "…")."""
        width = help_width()
        if width >= RICH_HELP_WIDTH:
            return super().format_help(ctx, formatter)
        formatter.width = max(width - 2, 30)  # click's own default never goes below 50
        mode, self.rich_markup_mode = self.rich_markup_mode, None
        try:
            return super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = mode


# The narrowest terminal on which no command's rich help cuts a word (tests/test_help.py checks it).
RICH_HELP_WIDTH = 70


def help_width() -> int:
    """The width --help is laid out for: Typer's TERMINAL_WIDTH if set, else the terminal's (COLUMNS)."""
    from rich.console import Console
    from typer import rich_utils

    return rich_utils.MAX_WIDTH or Console().width


class Group(FlagsShowAsFlags, TyperGroup):
    """The `lmhead` group: flags show as flags in its help."""


class Command(FlagsShowAsFlags, TyperCommand):
    """Typer's command, but a whole number that is not one, or is outside its option's `min=`/`max=` or
    a 64-bit integer, fails like every other bad value: one line that names where the value came from
    (the flag, or the environment variable that set it) and the bound it broke, "--threads must be at
    least 1 (got 0)", exit code 2 (not click's usage panel).

    Why this re-parses argv: click's BadParameter for a range carries the option but not the value
    the user typed, and the ranges must stay on the options (click shows them in --help as `x>=1`);
    re-parsing the arguments (without the range callbacks) is the one way to quote the value."""

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)
        try:
            ctx = super().make_context(info_name, list(args), parent=parent, **extra)
        except typer.BadParameter as e:
            fail(self._number_message(e, given, info_name) or one_line(e), 2)
        except ClickUsageError as e:  # an unknown option, a missing value, an extra argument
            if NoArgsIsHelpError is not None and isinstance(e, NoArgsIsHelpError):
                raise  # `lmhead inspect` alone: click shows the help
            fail(one_line(e), 2)
        check_whole_numbers(ctx, info_name)
        return ctx

    def _number_message(self, e, given, info_name) -> str | None:
        """The one line for a whole-number option click refused (not a number, or out of its range);
        None for any other option (click's own reason is shown)."""
        p, ctx = e.param, e.ctx
        if p is None or ctx is None or not whole_number(p):
            return None
        if from_environment(ctx, p):
            raw = os.environ.get(p.envvar)
        else:
            raw = self.make_parser(ctx).parse_args(args=given)[0].get(p.name)
        try:
            value = int(raw)
        except (TypeError, ValueError):
            if raw is None:
                return None
            return f"{source(ctx, p)} must be a whole number (got {raw!r})"
        return bound_message(ctx, p, value, info_name)


# The one rule for numbers on the command line: click parses them (a non-number, nan or 1e309 for a
# whole number is refused by Command above, naming the flag or the environment variable it came
# from), the option's min=/max= bound them, the core checks its own ranges (BadValue), and no whole
# number beyond a 64-bit integer reaches the core, where it would overflow in torch or itertools.
MAX_WHOLE = 2**63 - 1


def whole_number(p) -> bool:
    """Whether option `p` takes one whole number (typer's type descriptor, or click's INT/IntRange)."""
    descriptor = getattr(p, "type_descriptor", None)
    if descriptor is not None:
        return descriptor.annotation is int
    return getattr(getattr(p, "type", None), "name", None) in ("integer", "integer range")


def from_environment(ctx, p) -> bool:
    """Whether `p`'s value came from its environment variable, not the command line."""
    where = ctx.get_parameter_source(p.name)
    return getattr(p, "envvar", None) is not None and getattr(where, "name", None) == "ENVIRONMENT"


def source(ctx, p) -> str:
    """Where a value came from, as a message names it: the flag, or the environment variable that set it."""
    flag_name = next((o for o in p.opts if o.startswith("--")), p.opts[0] if p.opts else p.name)
    if from_environment(ctx, p):
        return f"the environment variable {p.envvar} (for {flag_name})"
    return flag_name


def bound_message(ctx, p, value: int, info_name: str) -> str | None:
    """"--x must be at least 1 (got 0)": the bound `value` breaks, on the side it broke: the option's
    own min=/max=, else a 64-bit integer's; None when it breaks neither."""
    low, high = getattr(p, "min", None), getattr(p, "max", None)
    if low is not None and high is not None and not low <= value <= high:
        must = f"be between {low:,} and {high:,}"
    elif low is not None and value < low:
        must = f"be at least {low:,}"
    elif high is not None and value > high:
        must = f"be at most {high:,}"
    elif abs(value) > MAX_WHOLE:
        side = f"at least {-MAX_WHOLE - 1:,}" if value < 0 else f"at most {MAX_WHOLE:,}"
        return f"{source(ctx, p)} must be a 64-bit integer, {side} (got {value:,})"
    else:
        return None
    return f"{source(ctx, p)} must {must}{GOT.get(info_name, ' (got {})').format(value)}"


def check_whole_numbers(ctx, info_name: str = "") -> None:
    """The 64-bit and min=/max= bounds of whole-number options; a decoding setting's option is the
    registry's to check (cli/options.py setting_option: its text reaches the core as the number it spells)."""
    from lmhead_cli.api.choices import from_text

    for p in ctx.command.params:
        value = ctx.params.get(p.name)
        if getattr(getattr(getattr(p, "type_descriptor", None), "parameter_info", None), "parser", None) is from_text:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            wrong = bound_message(ctx, p, value, info_name)
            if wrong is not None:
                fail(wrong, 2)


def one_line(e) -> str:
    """click's message for a usage error, on one line, with the command's --help as the way on."""
    text = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    where = f"; lmhead {ctx.info_name} --help lists the options" if ctx is not None and isinstance(
        e, NoSuchOption) else ""
    return text + where


def fail(message: str, code: int) -> None:
    from lmhead_cli.render import safe_text

    say(f"lmhead: error: {safe_text(message)}")  # the message may quote a prompt, a path or a file's line
    raise typer.Exit(code)


def spellings(fn) -> dict[str, str]:
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


def say(line: str) -> None:
    """One line on stderr, if there is a stderr to write to."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr closed too: the exit code must do
        pass


# The API's parameter names that the command line spells otherwise than `--name` (load(source=) is --model).
FLAGS = {"source": "--model"}


def flag(key: str) -> str:
    """How the command line spells an API parameter or setting: `top_k` -> `--top-k`, `source` -> `--model`;
    the environment variable instead where the running command took the value from it (LMHEAD_THREADS)."""
    spelled = FLAGS.get(key) or option(key)
    ctx = get_current_context(silent=True)
    given = next((p for p in ctx.command.params if spelled in p.opts), None) if ctx is not None else None
    return source(ctx, given) if given is not None else spelled


def message(e: LmheadError, command: str) -> str:
    """A domain error as one line, with the settings, modes and examples spelled for `lmhead COMMAND`."""
    if isinstance(e, BadValue):
        return e.spelled(flag(e.key))
    if isinstance(e, OneToken):
        return f"{e}: add --bos to score it after <|endoftext|>"
    if isinstance(e, NoPrompt):
        return f'{e}, e.g. lmhead {command} "{DEFAULT_PROMPT}"'
    if isinstance(e, ModeConflict):
        what = ("--greedy" if "greedy" in e.asked else "--temperature 0 (greedy)" if "temperature" in e.asked
                else f"--beams {e.asked['beams']}")
        return (f"lmhead {command} draws tokens at random, which {what} does not; "
                f"use lmhead greedy{' ' + what if 'beams' in e.asked else ''}")
    return e.spelled_with(flag)


def boundary(fn, command: str):
    """Turn domain errors into one line on stderr and an exit code (1 runtime, 2 usage).

    Ctrl-C exits 130 and keeps what was printed; a closed pipe (`| head`) ends quietly.
    Any other exception is a bug: one line too, with LMHEAD_DEBUG=1 for the traceback.
    """
    spelled = spellings(fn)

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
            fail(message(e, command), e.exit_code)
        except KeyboardInterrupt:
            sys.stdout.flush()
            sys.stderr.write("\ninterrupted\n")
            raise typer.Exit(130)
        except BrokenPipeError:
            # The reader went away (`lmhead ... | head`): stop quietly, and keep Python from
            # complaining when it flushes stdout at exit.
            quiet_stdout()
            raise typer.Exit(0)
        except OutputError as e:
            quiet_stdout()
            fail(e.strerror, 1)
        except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
            if os.environ.get("LMHEAD_DEBUG"):
                raise
            fail(f"unexpected {type(e).__name__}: {e} (set LMHEAD_DEBUG=1 for the traceback)", 1)
        except BaseException as e:  # a Rust library's panic (pyo3's PanicException) is a BaseException
            if not is_library_panic(e) or os.environ.get("LMHEAD_DEBUG"):
                raise
            fail(str(library_panic(e)), 1)

    return wrapper


class OutputError(OSError):
    """Writing to stdout failed for another reason than a closed pipe (a full disk, /dev/full)."""


class GuardedStdout:
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


def quiet_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush of a dead stdout says nothing."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is not a real file (tests)
        pass


def streams_for_any_terminal() -> None:
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


def run(app) -> None:
    """Console-script body: the app, and the one place where a closed or full stdout ends,
    --help and --version included: one line on stderr and exit 1, or exit 0 for a closed pipe."""
    if sys.stdout is None:  # started with stdout closed (>&-)
        say("lmhead: error: stdout is closed; there is nowhere to write the output")
        sys.exit(1)
    from lmhead_cli.inputs import check_working_directory

    try:
        check_working_directory()  # before any command can import torch, which dies in a deleted folder
    except LmheadError as e:
        say(f"lmhead: error: {e}")
        sys.exit(e.exit_code)
    streams_for_any_terminal()
    sys.stdout = guarded = GuardedStdout(sys.stdout)
    try:
        app()
        code = 0
    except SystemExit as e:
        # click and rich (the help) end a closed pipe themselves with exit 1: a closed pipe all the same.
        code = 0 if guarded.pipe_closed else e.code
    except BrokenPipeError:
        code = 0
    except OutputError as e:  # --help or --version into a full disk: click lets it through
        say(f"lmhead: error: {e.strerror}")
        code = 1
        quiet_stdout()  # said once: what is still buffered goes nowhere, not into a second error line
    try:  # what is still buffered must get out too
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    except OSError as e:
        say(f"lmhead: error: {e.strerror}")
        code = code or 1
    finally:
        quiet_stdout_if_dead()
    sys.exit(code)


def quiet_stdout_if_dead() -> None:
    try:
        sys.stdout.flush()
    except OSError:
        quiet_stdout()
