"""`lmhead explore`'s session through the API: the settings checked once, and the session that answers
each line with the Model's methods (readings/explore.py owns the loop, the :commands and the history).
A front end picks where the lines come from (piped_lines, terminal_lines) and how answers show (a View)."""

from __future__ import annotations

from lmhead_cli.api.checks import kinds
from lmhead_cli.readings.explore import (History, Session, State, View, history_file, piped_lines,  # noqa: F401
                                         terminal_lines)

__all__ = ["History", "Session", "State", "View", "history_file", "piped_lines", "settings", "session",
           "terminal_lines"]


@kinds(top_k=int, targets=list, threads=int)  # temperature, softcap: the registry's check (readings.explore.state)
def settings(top_k: int = 10, *, temperature: float | None = None, softcap: float | None = None,
             targets=(), threads: int | None = None) -> State:
    """A session's starting settings, every value checked (api/checks.py) before any model loads;
    `threads` (the load's own) is checked here too, so that a bad count fails before the wait."""
    from lmhead_cli.api import checks

    from lmhead_cli.readings.explore import state

    checks.at_least_one("top_k", top_k)
    start = state(top_k=top_k, temperature=temperature, softcap=softcap, targets=checks.targets(targets))
    checks.threads(threads)
    return start


def session(model, start: State, view: View) -> Session:
    """A session over `model` (an api.Model) from the settings `start`; `session.run(lines)` answers each."""
    return Session(model, start, view)
