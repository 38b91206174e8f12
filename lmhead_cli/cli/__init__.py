"""The command line: one Typer app, one short function per command: parse -> lmhead_cli.api -> render.

    options.py   the app and the options several commands share (model, stages, output format)
    boundary.py  the one error boundary: domain errors -> one line and an exit code; stdout guarded
    inspect.py, generate.py, params.py, explore.py, score.py, calibrate.py, diff.py, neurons.py, compare.py, serve.py: the commands, in --help's order

No math and no torch at module top: `lmhead --help`, `params` and `toy` start instantly.
"""

from lmhead_cli.cli.options import app
from lmhead_cli.cli import inspect, generate, params, explore, score, calibrate, diff, neurons, compare, serve  # noqa: E401,F401 - registers, in order
from lmhead_cli.cli.boundary import message, run

__all__ = ["app", "main", "message"]


def main() -> None:
    """Console-script entry point (pyproject's `lmhead`, and `python -m lmhead_cli`): the command owns
    its process, so it may tune it (before torch is imported), unlike a program using the API."""
    from lmhead_cli.api import own_process

    own_process()
    run(app)
