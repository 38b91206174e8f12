"""Request bodies to work: each field checked (type, range) and turned into rows to compute.

Everything a client can send is checked here, before any work starts, and a bad value is a
`RequestError` naming the field (OpenAI's `param`) and the accepted range: a prompt's token ids
against the vocabulary, a prompt plus max_tokens against the context, and the cost of the
logprobs asked for (positions × (logprobs + 1), summed over the choices) against the server's
limit. Unknown fields are ignored, as OpenAI-compatible servers do; `model` is a label only: no
request can name a file or make the server load another model.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace

from lmhead_cli.api.choices import STAGES
from lmhead_cli.api.serving import Row, Settings, from_openai
from lmhead_cli.errors import BadValue

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class RequestError(Exception):
    """A request the server answers with an error: HTTP status, OpenAI's error fields, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}


def bad(param: str, message: str) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (see docs/serve.md, Limits)."""

    max_logprobs: int | None = None  # per position; None: up to the vocabulary
    max_entries: int = 2_000_000  # logprob entries in one response: positions × (logprobs + 1)
    max_choices: int = 256  # prompts × n in one request
    max_body: int = 8 * 2**20  # bytes


@dataclass(frozen=True)
class ModelInfo:
    """What checking a request needs to know of the model."""

    name: str
    vocab: int
    n_ctx: int
    eos: int | None


@dataclass
class Plan:
    """A checked request: one row per choice (prompt-major, n per prompt), and how to answer."""

    rows: list[Row]
    prompts: list[list[int]]  # each prompt's ids
    n: int
    echo: bool
    logprobs: int | None  # top tokens per position; None: no logprobs in the answer
    stream: bool
    include_usage: bool
    chat: bool = False
    extra: dict = field(default_factory=dict)


# ---- one field at a time ------------------------------------------------------------------------

def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def boolean(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"{key} must be a boolean (got {_kind(value)})")
    return value


def integer(body: dict, key: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"{key} must be an integer (got {_kind(value)})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad(key, f"{key} must be between {lo} and {hi} (got {value})" if hi is not None
                  else f"{key} must be at least {lo} (got {value})")
    return value


def number(body: dict, key: str, default: float | None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"{key} must be a number (got {_kind(value)})")
    if not math.isfinite(value):
        raise bad(key, f"{key} must be finite (got {value})")
    return float(value)


def string(body: dict, key: str, default: str | None, choices: tuple[str, ...] = ()) -> str | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(key, f"{key} must be a string (got {_kind(value)})")
    if choices and value not in choices:
        raise bad(key, f"{key} must be one of {', '.join(choices)} (got {value!r})")
    return value


def stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "stop must be a string or an array of strings")
    return tuple(items)  # how many, and not empty: decoding.settings.check_stop


def unsupported(body: dict) -> None:
    """Fields that would change the answer in ways lmhead does not do: refused, never ignored."""
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(key, f"{key} is not supported (only 0)")
    if body.get("logit_bias"):
        raise bad("logit_bias", "logit_bias is not supported")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "best_of is not supported (only 1)")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix is not supported")


# ---- prompts ------------------------------------------------------------------------------------

def prompt_ids(body: dict, tokenizer, info: ModelInfo) -> list[list[int]]:
    """`prompt` as a string, a list of strings, a list of token ids or a list of lists of ids."""
    value = body.get("prompt")
    shape = "prompt must be a string, an array of strings, an array of token ids or an array of arrays of token ids"
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        texts = value
    elif isinstance(value, list) and value and all(_is_id(t) for t in value):
        return [check_ids(value, info, "prompt")]
    elif isinstance(value, list) and value and all(isinstance(p, list) and all(_is_id(t) for t in p) for p in value):
        return [check_ids(p, info, f"prompt[{i}]") for i, p in enumerate(value)]
    else:
        raise bad("prompt", shape + (" (got an empty array)" if value == [] else f" (got {_kind(value)})"))
    out = []
    for i, text in enumerate(texts):
        if text == "":
            raise bad("prompt", "prompt must not be empty" if len(texts) == 1 else f"prompt[{i}] is empty")
        out.append(list(tokenizer.encode_long(text)))
    return out


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def check_ids(ids: list[int], info: ModelInfo, where: str, param: str = "prompt") -> list[int]:
    if not ids:
        raise bad(param, f"{where} is empty")
    for j, t in enumerate(ids):
        if not 0 <= t < info.vocab:
            raise bad(param, f"token id {t} at {where}[{j}] is outside the vocabulary (0 to {info.vocab - 1})")
    return ids


def check_context(ids: list[int], max_tokens: int, info: ModelInfo, where: str) -> None:
    if len(ids) + max_tokens > info.n_ctx:
        raise bad("max_tokens", f"{where} of {len(ids):,} tokens plus max_tokens {max_tokens:,} is "
                                f"{len(ids) + max_tokens:,} tokens, beyond the model's context of {info.n_ctx:,}")


# ---- the sampling settings both endpoints share -------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    settings: Settings  # decoding.settings.Settings: the stages, greedy, seed, stop, logprobs mode
    n: int


def sampling(body: dict, limits: Limits) -> Sampling:
    """The body's decoding fields, each of its JSON type, as the one settings object (decoding.settings's
    from_openai: every stage of the registry by its key, temperature 0 greedy) and the number of choices."""
    values = {st.key: (number(body, st.key, None) if st.type is float else integer(body, st.key, None))
              for st in STAGES}
    values.update(seed=integer(body, "seed", None), stop=stops(body),
                  logprobs_mode=string(body, "logprobs_mode", "raw", ("raw", "processed")))
    try:
        settings = from_openai(values)
    except BadValue as e:
        raise bad(e.key if e.key != "logprobs" else "logprobs_mode", str(e)) from None
    return Sampling(settings=settings, n=integer(body, "n", 1, lo=1, hi=limits.max_choices))


def rows_for(prompts: list[list[int]], s: Sampling, *, echo: bool, max_tokens: int, top: int,
             eos: int | None) -> list[Row]:
    """One row per choice: prompt i's choices are rows i·n … i·n + n - 1; choice j draws with seed + j."""
    rows = []
    for ids in prompts:
        base = s.settings.seed if s.settings.seed is not None else secrets.randbelow(2**32)
        for j in range(s.n):
            rows.append(replace(s.settings.row(ids, max_tokens=max_tokens, eos=eos, seed=(base + j) % 2**63, echo=echo),
                                top=top, alternatives=0))
    return rows


def check_cost(rows: list[Row], top: int | None, limits: Limits) -> None:
    """The answer's size before any work: choices, and logprob entries (positions × (top + 1))."""
    if len(rows) > limits.max_choices:
        raise bad("n", f"prompts × n is {len(rows):,} choices; the server answers at most {limits.max_choices:,} "
                       "in one request")
    if top is None:
        return
    positions = sum((len(r.ids) if r.echo else 0) + r.max_tokens for r in rows)
    entries = positions * (top + 1)
    if entries > limits.max_entries:
        raise bad("logprobs", f"{positions:,} positions × ({top:,} logprobs + 1) is {entries:,} entries; the "
                              f"server answers at most {limits.max_entries:,} in one request")


def check_top(value: int | None, key: str, info: ModelInfo, limits: Limits) -> int | None:
    hi = info.vocab if limits.max_logprobs is None else min(info.vocab, limits.max_logprobs)
    if value is not None and not 0 <= value <= hi:
        raise bad(key, f"{key} must be between 0 and {hi:,} (got {value})"
                  + (" (--max-logprobs)" if limits.max_logprobs is not None and value <= info.vocab else ""))
    return value


# ---- the two endpoints --------------------------------------------------------------------------

def completion_plan(body: dict, tokenizer, info: ModelInfo, limits: Limits) -> Plan:
    unsupported(body)
    string(body, "model", None)
    prompts = prompt_ids(body, tokenizer, info)
    max_tokens = integer(body, "max_tokens", DEFAULT_MAX_TOKENS, lo=0)
    echo = boolean(body, "echo")
    top = integer(body, "logprobs", None)
    check_top(top, "logprobs", info, limits)
    s = sampling(body, limits)
    for i, ids in enumerate(prompts):
        check_context(ids, max_tokens, info, "the prompt" if len(prompts) == 1 else f"prompt[{i}]")
    rows = rows_for(prompts, s, echo=echo and top is not None, max_tokens=max_tokens, top=top or 0, eos=info.eos)
    check_cost(rows, top, limits)
    stream = boolean(body, "stream")
    return Plan(rows=rows, prompts=prompts, n=s.n, echo=echo, logprobs=top, stream=stream,
                include_usage=stream and _include_usage(body))


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad("stream_options", "stream_options must be an object")
    return boolean(options, "include_usage")


def messages(body: dict) -> list[dict]:
    """[{"role", "content"}] with the content as text (OpenAI's array of text parts is joined)."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise bad("messages", "messages must be a non-empty array of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("messages", f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad("messages", f"messages[{i}].content may hold text parts only")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad("messages", f"messages[{i}].content must be a string or an array of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def chat_plan(body: dict, prompt: list[int], info: ModelInfo, limits: Limits) -> Plan:
    """A chat request whose messages the caller rendered to `prompt` (see `messages`)."""
    unsupported(body)
    string(body, "model", None)
    if not prompt:
        raise bad("messages", "the messages render to no tokens")
    check_ids(prompt, info, "the rendered messages")
    room = info.n_ctx - len(prompt)
    max_tokens = integer(body, "max_completion_tokens", None, lo=1)
    max_tokens = integer(body, "max_tokens", max_tokens, lo=1)
    if max_tokens is None:
        if room < 1:
            raise bad("messages", f"the messages are {len(prompt):,} tokens, which leaves no room in the "
                                  f"model's context of {info.n_ctx:,}")
        max_tokens = room
    check_context(prompt, max_tokens, info, "the rendered messages")
    want = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", None)
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    check_top(top, "top_logprobs", info, limits)
    top = (top or 0) if want else None
    s = sampling(body, limits)
    rows = rows_for([prompt], s, echo=False, max_tokens=max_tokens, top=top or 0, eos=info.eos)
    check_cost(rows, top, limits)
    stream = boolean(body, "stream")
    return Plan(rows=rows, prompts=[prompt], n=s.n, echo=False, logprobs=top, stream=stream,
                include_usage=stream and _include_usage(body), chat=True)
