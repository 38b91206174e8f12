"""Domain errors. The core raises these; cli.py turns each into one line and an exit code."""

from __future__ import annotations


class LmheadError(Exception):
    """Base class: a failure the user can act on. ``exit_code`` 1 = runtime, 2 = usage."""

    exit_code = 1


class UsageError(LmheadError):
    """The user asked for something invalid (a bad value, an unknown name)."""

    exit_code = 2


class ModelNotFound(LmheadError):
    """A model source that is neither a cached/reachable hub id, a local folder nor a random: name."""


class UnknownConfig(UsageError):
    """A bundled config or random:NAME that does not exist."""


class UnsafeCheckpoint(LmheadError):
    """Only pickle weights were found and --allow-pickle was not given."""


class CorruptCheckpoint(LmheadError):
    """A weights file that cannot be read (truncated, wrong format, missing tensors)."""


class NonFiniteLogits(LmheadError):
    """The head produced NaN or infinite logits (for example from a NaN weight)."""


class UnsupportedModel(UsageError):
    """The model lacks what a command needs (for example a residual stream that is a plain sum of parts)."""
