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
from lmhead_cli.errors import LmheadError

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
    str, typer.Option("--engine", help="lean (plain-torch GPT-2, default) or transformers.")
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
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
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
# (commands are added above this line by the foundation work)

# ==== generate / greedy / sample / softcap (issue 3) =============================================

# ==== params / toy (issue 4) =====================================================================

# ==== lens / explore (issue 6) ===================================================================


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
