"""`lmhead explore`: an interactive session that loads the model once.

Each line is a prompt, answered at once with the top-k table after the decoding stages that are
set (soft-cap, temperature), or a `:command` that changes a setting or runs something on the last
prompt. Line editing and history come from `readline` when the input is a terminal; piped input is
read a line at a time with no prompt string, for scripts and tests.

The session owns the loop and the settings; the figures come from head/decoding/lens/generation
and are shown by render.explore. A domain error (a bad value) prints one line and the session goes on.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

from lmhead_cli.decoding import settings as one_settings
from lmhead_cli.decoding.settings import DEFAULT_MAX_NEW_TOKENS, Settings
from lmhead_cli.decoding.stages import from_text
from lmhead_cli.errors import BadValue, LmheadError, UsageError
from lmhead_cli.inputs import MAX_LINE_BYTES, check_text

PROMPT = "lmhead> "
HISTORY_LENGTH = 1000
DEFAULT_GEN_SEED = 0


@dataclass(frozen=True)
class State:
    """A session's state: the one decoding Settings (decoding/settings.py: the stages, the seed :gen
    samples with) and what the table shows (its rows, the tokens it follows). Made by `state`."""

    decoding: Settings  # checked (decoding.settings.make)
    top_k: int = 10  # rows in the table
    targets: tuple[str, ...] = ()

    @property
    def temperature(self) -> float | None:
        """As asked: 0 (the settings say greedy), a number, or None (off)."""
        return 0.0 if self.decoding.zero_temperature else self.decoding.knobs.temperature

    @property
    def softcap(self) -> float | None:
        return self.decoding.knobs.softcap

    @property
    def seed(self) -> int:
        return self.decoding.seed

    @property
    def grammar(self):
        """:gen's grammar (decoding/grammar.py: :schema FILE, :regex PATTERN), or None."""
        return self.decoding.grammar

    @property
    def knobs(self):
        """The stages the table runs (decoding.stages.Knobs): temperature 0 is the limit T -> 0, the greedy
        distribution (decoding.stages.temperature)."""
        return replace(self.decoding.knobs, temperature=self.temperature)

    def generation(self, n: int) -> Settings:
        """:gen's settings: the session's, for `n` tokens (checked with the rest: `state`)."""
        return _decoding(self.temperature, self.softcap, self.seed, self.grammar, n)


def state(*, top_k: int = 10, targets=(), temperature: float | None = None, softcap: float | None = None,
          seed: int = DEFAULT_GEN_SEED, grammar=None) -> State:
    """THE conversion of a session's values (the start-up options, every :temp, :softcap, :seed, :schema and
    :regex) into the one decoding settings object, checked there (decoding.settings.make: BadValue with
    the registry's advice)."""
    return State(_decoding(temperature, softcap, seed, grammar), top_k, tuple(targets))


def _decoding(temperature, softcap, seed, grammar, max_new_tokens: int | None = None) -> Settings:
    return one_settings.make(max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
                             seed=seed, softcap=softcap, temperature=temperature, grammar=grammar)


@dataclass(frozen=True)
class Reading:
    """One prompt's answer."""

    prompt: str
    n_tokens: int
    truncated: int
    rows: list  # head.TokenScore, `scaled` set (equal to `logit` when no stage is on), prob of the scaled logits
    targets: list  # head.TokenScore, the same
    entropy: float  # nats, of the distribution after the stages
    knobs: object  # decoding.stages.Knobs: the stages that were on
    elapsed_ms: float  # tokenise, forward, head, stages and the table's figures (not the printing)


@dataclass(frozen=True)
class Command:
    name: str  # canonical name, e.g. "temp"
    args: list[str] = field(default_factory=list)


# name -> (aliases, argument help, what it does); the order is the help's order.
COMMANDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "temp": (("temperature",), "T|off", "divide the logits by T before softmax (T > 0)"),
    "softcap": ((), "C|off", "soft-cap the logits: C·tanh(z/C), before the temperature"),
    "top-k": (("k",), "N", "how many tokens the table lists"),
    "target": (("t",), '" are"|clear', "follow a token's rank and probability (repeatable)"),
    "gen": (("generate",), "N", "sample N tokens after the last prompt with these settings"),
    "seed": ((), "N", "the seed :gen samples with"),
    "schema": ((), "FILE|off", "the text :gen makes is JSON that this JSON Schema file validates"),
    "regex": ((), "PATTERN|off", "the text :gen makes matches this regular expression whole"),
    "lens": ((), "", "the logit lens of the last prompt"),
    "settings": (("set",), "", "show the settings"),
    "help": (("h", "?"), "", "this list"),
    "quit": (("q", "exit"), "", "leave (Ctrl-D too)"),
}
_ALIASES = {alias: name for name, (aliases, _, _) in COMMANDS.items() for alias in (name, *aliases)}
# setting key (as the core names it in a BadValue) -> the command that sets it
SETS = {"temperature": "temp", "softcap": "softcap", "top_k": "top-k", "target": "target", "seed": "seed",
        "max_new_tokens": "gen", "json_schema": "schema", "regex": "regex"}


def parse_command(line: str) -> Command:
    """`:temp 0.8` -> Command("temp", ["0.8"]); quotes keep spaces: `:target " are"` -> [" are"]."""
    try:
        words = shlex.split(line[1:])
    except ValueError as e:  # an unclosed quote
        raise UsageError(f"cannot read {line.strip()!r}: {e}") from None
    if not words:
        return Command("help")
    name = _ALIASES.get(words[0].lower())
    if name is None:
        return Command("unknown", [words[0]])
    return Command(name, words[1:])


def _one(cmd: Command, example: str) -> str:
    if len(cmd.args) != 1:
        raise UsageError(f":{cmd.name} takes one value, e.g. :{cmd.name} {example}")
    return cmd.args[0]


def _number(cmd: Command, example: str, kind=float):
    text = _one(cmd, example)
    try:
        return kind(text)
    except ValueError:
        raise UsageError(f":{cmd.name} takes a{'n integer' if kind is int else ' number'}, e.g. "
                         f":{cmd.name} {example} (got {text!r})") from None


def apply(settings: State, cmd: Command) -> State:
    """The state after a setting command, its decoding values checked as every door's are (`state`);
    UsageError or BadValue (the state unchanged) for a bad value."""
    off = len(cmd.args) == 1 and cmd.args[0].lower() in ("off", "none")
    values = {"top_k": settings.top_k, "targets": settings.targets, "temperature": settings.temperature,
              "softcap": settings.softcap, "seed": settings.seed, "grammar": settings.grammar}
    if cmd.name == "temp":  # decoding settings: their text as a number, checked by the registry (`state`)
        values["temperature"] = None if off else from_text(_one(cmd, "0.8"))
    elif cmd.name == "softcap":
        values["softcap"] = None if off else from_text(_one(cmd, "30"))
    elif cmd.name == "top-k":
        rows = _number(cmd, "20", int)  # the table's rows, not the top-k stage (whose 0 and -1 mean off)
        if rows < 1:
            raise BadValue("top_k", f"must be at least 1 (got {rows})")
        values["top_k"] = rows
    elif cmd.name == "seed":
        values["seed"] = from_text(_one(cmd, "42"))
    elif cmd.name in ("schema", "regex"):
        values["grammar"] = None if off else _grammar(cmd)
    elif cmd.name == "target":
        text = _one(cmd, '" are"')
        if not text:
            raise UsageError(':target takes a token, e.g. :target " are" (quotes keep the space)')
        clear = text.lower() in ("clear", "off", "none")
        values["targets"] = () if clear else settings.targets + (text,)
    else:
        raise ValueError(f"not a setting command: {cmd.name}")
    return state(**values)


def _grammar(cmd: Command):
    """:schema FILE or :regex PATTERN as a checked grammar (decoding/grammar.py)."""
    from lmhead_cli.decoding import grammar
    from lmhead_cli.inputs import read_small_file

    if cmd.name == "regex":
        return grammar.from_regex(_one(cmd, "'[0-9]{3}'"))
    return grammar.from_json_schema(read_small_file(_one(cmd, "person.json"), "JSON schema file"))


def read(loaded, prompt: str, settings: State) -> Reading:
    """The top-k table (and targets) for `prompt` after the stages that are set."""
    import torch

    from lmhead_cli.decoding import stages
    from lmhead_cli.head import Distribution, TokenScore, clamp_top_k, encode_targets
    from lmhead_cli.readings.inspect import encode_prompt, last_logits

    start = time.perf_counter()
    ids, dropped = encode_prompt(loaded, prompt)
    target_ids = encode_targets(loaded.tokenizer, list(settings.targets))
    logits, _ = loaded.execution.run(lambda: last_logits(loaded, ids), len(ids))  # (V,) float32, the last position
    knobs = settings.knobs
    scaled = stages.process(logits, knobs.pipeline())  # (V,)
    dist = Distribution(scaled)  # the distribution after the stages
    logprobs = dist.logprobs
    k = clamp_top_k(settings.top_k, logits.shape[-1])
    top = torch.topk(scaled, k).indices  # (k,)
    tids = torch.tensor([tid[0] for _, tid in target_ids], dtype=torch.long, device=top.device)
    picked = torch.cat([top, tids])  # (k + targets,)
    # Ranks in one comparison; the rest in one transfer each.
    text = loaded.tokenizer.token_text
    rows = [TokenScore(rank=int(r), id=int(i), token=text(int(i)), logit=z, prob=math.exp(lp), logprob=lp, scaled=zs)
            for r, i, z, zs, lp in zip(dist.ranks(picked).tolist(), picked.tolist(), logits[picked].tolist(),
                                       scaled[picked].tolist(), logprobs[picked].tolist())]
    rows, targets = rows[:k], rows[k:]
    return Reading(prompt=prompt, n_tokens=len(ids), truncated=dropped, rows=rows, targets=targets,
                   entropy=dist.entropy, knobs=knobs,
                   elapsed_ms=(time.perf_counter() - start) * 1000)


def generate_after(loaded, prompt: str, n: int, settings: State, on_text: Callable[[str], None]):
    """Sample `n` tokens after `prompt` with the session's stages and seed (generation.generate)."""
    from lmhead_cli.decoding.generate import generate
    from lmhead_cli.readings.inspect import encode_prompt

    s = settings.generation(n)
    ids, _ = encode_prompt(loaded, prompt)
    return generate(loaded, ids, s, on_text=on_text)


# ---- the loop ---------------------------------------------------------------------------------

def history_file() -> Path:
    """~/.cache/lmhead/history (or under $XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lmhead" / "history"


class History:
    """readline's history, read at the start and merged into the file at the end; never an error if
    the file can't be read or written. Only a regular file is read or replaced (a FIFO there would
    block the start, and is left alone). Two sessions sharing the file keep both sessions' lines:
    `save` re-reads the file under a lock and adds this session's lines to what is there now."""

    def __init__(self, path: Path):
        self.path = path
        self.start = 0
        try:
            import readline  # noqa: F401 - importing it gives input() line editing and history
        except ImportError:  # Windows without pyreadline: plain input()
            self.readline = None
            return
        self.readline = readline
        readline.set_history_length(HISTORY_LENGTH)
        if _is_regular(path):
            try:
                readline.read_history_file(path)
            except (OSError, ValueError):
                pass
        self.start = readline.get_current_history_length()

    def new_lines(self) -> list[str]:
        """The lines typed in this session (readline counts its items from 1)."""
        rl = self.readline
        return [rl.get_history_item(i) for i in range(self.start + 1, rl.get_current_history_length() + 1)]

    def save(self) -> None:
        """Merge this session's lines into the file: under a lock, the file's lines as they are now, then
        this session's, the last HISTORY_LENGTH kept; written to a new file beside it and renamed over
        it, so nothing is written through a symlink and no other file is truncated."""
        if self.readline is None:
            return
        from lmhead_cli.outputs import replace_with

        rl, new = self.readline, self.new_lines()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path.with_name(self.path.name + ".lock")):
                if self.path.exists() and not _is_regular(self.path):
                    return  # a FIFO or a device: never read, never replaced
                rl.clear_history()
                if self.path.exists():
                    rl.read_history_file(self.path)
                for line in new:
                    rl.add_history(line)
                replace_with(self.path, rl.write_history_file)  # private, as mkstemp makes it: 0600
        except (OSError, ValueError):
            pass


def _is_regular(path: Path) -> bool:
    """True for a regular file (or a link to one); False for a missing path, a FIFO, a device, a folder."""
    import stat

    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


class _locked:
    """An exclusive flock on `path` (created if needed) for the length of a `with`, waiting up to 5 s for
    another session's save; without fcntl (Windows), or if the lock file can't be made, no lock."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl

            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            for _ in range(100):
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.05)
        except (ImportError, OSError):
            pass
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock


def terminal_lines(prompt: str = PROMPT, on_cancel: Callable[[], None] = lambda: None) -> Iterator[str]:
    """Lines typed at a terminal: Ctrl-C cancels the line being typed, Ctrl-D ends."""
    while True:
        try:
            yield input(prompt)
        except KeyboardInterrupt:
            on_cancel()
        except EOFError:
            return


def piped_lines(stream=None, max_bytes: int = MAX_LINE_BYTES) -> Iterator[str | UsageError]:
    """Lines from a pipe or file (stdin unless `stream`), without a prompt string.

    stdin is read a line at a time with a limit: a longer line is skipped (drained, never held)
    and handed over as a UsageError for the session to show; bytes that are not UTF-8 arrive as
    lone surrogates, for Session.handle to name."""
    if stream is not None:
        for line in stream:
            yield line.rstrip("\n").removesuffix("\r")
        return
    source = sys.stdin.buffer
    number = 0
    while raw := source.readline(max_bytes + 1):
        number += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = source.readline(max_bytes + 1)
            yield UsageError(f"line {number:,} is longer than {max_bytes:,} bytes, the limit for one prompt; skipped")
            continue
        yield raw.decode("utf-8", "surrogateescape").rstrip("\n").removesuffix("\r")


class View(Protocol):
    """What a session shows, and how (render.explore.Terminal, render.explore.AsJson)."""

    def reading(self, r: Reading) -> None: ...
    def lens(self, result) -> None: ...  # an api.results.LensResult
    def generation_start(self, prompt: str) -> None: ...
    def text(self, piece: str) -> None: ...
    def generation_end(self, gen) -> None: ...  # a decoding.generate.Generation
    def settings(self, s: State) -> None: ...
    def help(self, commands: dict) -> None: ...
    def unknown(self, name: str, commands: dict) -> None: ...
    def error(self, message: str) -> None: ...
    def cancelled(self) -> None: ...
    def own_softcap_notice(self, own: float | None, asked: float | None) -> None: ...


class Session:
    """The settings, the last prompt, and what to do with each line.

    `model` answers (the API's Model: explore_reading, lens, explore_generate, own_softcap); `show`
    shows each answer (a View)."""

    def __init__(self, model, settings: State, show: View):
        self.model = model
        self.settings = settings
        self.show = show
        self.last_prompt: str | None = None

    def run(self, lines: Iterable[str]) -> None:
        for line in lines:
            if isinstance(line, LmheadError):  # a line the source could not hand over
                self.show.error(str(line))
                continue
            try:
                if not self.handle(line):
                    return
            except KeyboardInterrupt:  # Ctrl-C while computing cancels that line only
                self.show.cancelled()
            except BadValue as e:  # the value of a :command, named as the user typed it
                self.show.error(e.spelled(f":{SETS[e.key]}") if e.key in SETS else str(e))
            except LmheadError as e:
                self.show.error(str(e))

    def handle(self, line: str) -> bool:
        """Answer one line; False once the session should end."""
        check_text(line, "this line")  # bytes that are not UTF-8: one error, and the session goes on
        if not line.strip():
            return True  # an empty line is ignored
        if not line.startswith(":"):
            self.show.reading(self.model.explore_reading(line, self.settings))
            self.last_prompt = line
            return True
        cmd = parse_command(line)
        if cmd.name == "quit":
            return False
        if cmd.name == "help":
            self.show.help(COMMANDS)
        elif cmd.name == "unknown":
            self.show.unknown(cmd.args[0], COMMANDS)
        elif cmd.name == "settings":
            self.show.settings(self.settings)
        elif cmd.name == "lens":
            self.show.lens(self.model.lens(self._last(cmd), targets=self.settings.targets))
        elif cmd.name == "gen":
            n = from_text(_one(cmd, "20"))
            self.settings.generation(n)  # checked (the registry's max_new_tokens) before the prompt is shown
            prompt = self._last(cmd)
            self.show.generation_start(prompt)
            self.show.generation_end(self.model.explore_generate(prompt, n, self.settings, self.show.text))
        else:
            self.settings = apply(self.settings, cmd)
            self.show.settings(self.settings)
            if cmd.name == "softcap":
                self.show.own_softcap_notice(self.model.own_softcap, self.settings.softcap)
        return True

    def _last(self, cmd: Command) -> str:
        if self.last_prompt is None:
            raise UsageError(f":{cmd.name} works on the last prompt; type a prompt first")
        return self.last_prompt


def warm_up(loaded) -> int:
    """Forwards after the load, so the first prompt is answered as fast as the rest; returns torch's
    thread count for the session.

    On the CPU (unless --threads fixed it), 10-token forwards are timed with torch's thread count and
    with one thread, and the faster is kept (engine/threads.py; each prompt is timed too, and both
    counts are tried again when prompts slow down): on a machine whose cores are busy with other work,
    two threads can take several times longer than one, while an idle machine gains from them.
    """
    from lmhead_cli.readings.inspect import last_logits

    ids = [loaded.engine.eos_token_id or 0] * 10
    last_logits(loaded, ids)
    return loaded.execution.settle(lambda: last_logits(loaded, ids), len(ids))
