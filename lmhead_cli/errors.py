"""Domain errors. The core raises these; cli/boundary.py turns each into one line and an exit code.

The core names a setting or parameter by its neutral key (`top_k`, `device`), never by a command-line
spelling: a message holds each name as a `Param` part (`BadValue` carries its key apart too), and the
boundary that knows how the user typed it (the CLI: `--top-k`; explore: `:top-k`) spells it.
"""

from __future__ import annotations


class Param(str):
    """A parameter's name inside an error's message: LmheadError("unknown ", Param("device"), " 'tpu'").
    str(error) writes it as the API's keyword (`device`); a front end writes its own spelling with
    `error.spelled_with(spell)` (the CLI: `--device`; explore: `:top-k`)."""


class Notice(str):
    """A notice (not an error) given in parts, as an error's message: str is the API's spelling,
    `spelled_with(spell)` a front end's (the CLI: `--model`)."""

    def __new__(cls, *parts: str):
        line = super().__new__(cls, "".join(parts))
        line.parts = parts
        return line

    def spelled_with(self, spell) -> str:
        return "".join(spell(p) if isinstance(p, Param) else p for p in self.parts)


class LmheadError(Exception):
    """Base class: a failure the user can act on. ``exit_code`` 1 = runtime, 2 = usage.

    The message is given in parts: text, and Param(name) wherever it names a parameter."""

    exit_code = 1

    def __init__(self, *parts: str):
        self.parts = parts
        super().__init__("".join(parts))

    def spelled_with(self, spell) -> str:
        """The message with each Param spelled by `spell(name)`."""
        return "".join(spell(p) if isinstance(p, Param) else p for p in self.parts)


class UsageError(LmheadError):
    """The user asked for something invalid (a bad value, an unknown name)."""

    exit_code = 2


class BadValue(UsageError, ValueError):
    """One setting's value is out of its range: `key` is the setting, `problem` what is wrong with it.
    A ValueError too, so that a program's `except ValueError` catches it.

    str() is neutral ("top_k must be at least 1 (got 0)"); `spelled(name)` puts the user's spelling
    of the setting in its place ("--top-k must be at least 1 (got 0)").
    """

    def __init__(self, key: str, problem: str):
        super().__init__(Param(key), f" {problem}")
        self.key = key
        self.problem = problem

    def spelled(self, name: str) -> str:
        return f"{name} {self.problem}"


class BadType(BadValue, TypeError):
    """A parameter given a value of the wrong type (`top_k=1.5`, `bos="no"`, `targets="abc"`): a BadValue
    that names it, and a TypeError too (api/checks.py's `typed` raises it)."""


class NoPrompt(UsageError):
    """No prompt was given (`given` False), or only white space (`given` True). The CLI shows an example."""

    def __init__(self, given: bool):
        super().__init__("the prompt is empty; give some text" if given else "give a prompt")
        self.given = given


class NoTokens(UsageError):
    """A prompt with text in it that the model's tokenizer turns into no token at all (a normalizer that
    drops every character it holds): there is nothing to run the model on."""

    def __init__(self, chars: int):
        super().__init__(f"the prompt ({chars:,} characters) encodes to no tokens with this model's tokenizer; "
                         "give text that it keeps")
        self.chars = chars


class ModeConflict(UsageError):
    """A decoding mode that draws at random was asked to choose deterministically (greedy or beams).

    `asked` is what was asked: {"greedy": True} or {"beams": N}. The CLI names the command and flags.
    """

    def __init__(self, asked: dict):
        key, value = next(iter(asked.items()))
        super().__init__(f"this mode draws tokens at random, which {key}={value} does not")
        self.asked = asked


class OneToken(UsageError):
    """A text of a single token: the first token has nothing before it to be predicted from, so there is
    nothing to score. The CLI says how to put a beginning-of-text token before it."""

    def __init__(self, token: str):
        super().__init__(f"the text is one token ({token!r}), and the first token has nothing before it to be "
                         "predicted from")
        self.token = token


class BadPath(UsageError):
    """A path the user gave (a model folder or file, a tuned lens, an input file) that does not exist,
    cannot be read, or is a folder where a file is wanted (or the other way round): a usage error
    wherever it is given."""


class ModelNotFound(LmheadError):
    """A model source that is neither a cached/reachable hub id, a local folder nor a random: name."""


class ModelPathNotFound(ModelNotFound, BadPath):
    """A model source written as a path (`./x`, `/x`, `~/x`, `a/b/c`, `x.gguf`) that does not exist or is
    the wrong kind: a ModelNotFound, and a usage error (exit 2) as every bad path is."""


class HubUnreachable(ModelNotFound):
    """A hub id that is not in the local cache while the hub is offline (HF_HUB_OFFLINE) or cannot be
    reached: the one case in which the default model gives way to the bundled one."""


class UnknownConfig(UsageError):
    """A bundled config or random:NAME that does not exist."""


class UnsafeCheckpoint(LmheadError):
    """Only pickle weights were found and --allow-pickle was not given."""


class CorruptCheckpoint(LmheadError):
    """A weights file that cannot be read (truncated, wrong format, missing tensors)."""


class NonFiniteLogits(LmheadError):
    """The head produced NaN or infinite logits (for example from a NaN weight)."""


class UnsupportedModel(LmheadError):
    """A model lmhead cannot run, or a reading this model cannot give; the message names what it lacks."""


class WrongLens(LmheadError):
    """A tuned-lens file trained for another model (another shape, or the same shape with other weights)."""


def is_library_panic(e: BaseException) -> bool:
    """A Rust library's panic surfacing in Python (tokenizers, safetensors): pyo3's PanicException,
    which derives from BaseException, so `except Exception` lets it through."""
    return type(e).__name__ == "PanicException"


def library_panic(e: BaseException) -> LmheadError:
    """A panic as the one line the boundary prints (a library's bug or a file it cannot handle)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return LmheadError(f"a library lmhead uses failed ({type(e).__name__}: {(lines[0] if lines else '')[:200]}); "
                       "the input or a checkpoint file made it panic")
