"""Request bodies as pydantic models, and the one conversion of a checked request to the decoder's
Request (api.serving.Request: the one Settings and the prompts) that the worker runs.

As vLLM's entrypoints/openai/protocol.py does: each endpoint's body is a model whose fields carry
their types and ranges (lmhead's extension fields declared beside OpenAI's, so /openapi.json shows
them; the decoding fields generated from the registry and checked by its one check, in `settings`),
and a bad value is a 400 naming the field (OpenAI's `param`) and the accepted range.
What depends on the model or the server's limits (token ids against the vocabulary, a prompt plus
max_tokens against the context, the logprobs asked for against the server's budget) is checked by
the one conversion, `Sampled.request`, before any work starts.

Unknown fields are ignored, as OpenAI-compatible servers do; fields that would change the answer in a
way lmhead does not do (penalties, logit_bias, best_of, suffix; chat's tools and tool_choice) are
refused, never ignored. response_format json_schema and json_object constrain the text (a grammar
compiled with llguidance, decoding/grammar.py), in chat and, as vLLM and llama-server accept it, in
completions. `model` is a label only: no request can name a file or
make the server load another model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, field_validator

from lmhead_cli.serve.refusals import RequestError, bad, shaped, validation_error  # noqa: F401 - re-exported

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(frozen=True)
class Limits:
    """What requests may ask for (see docs/serve.md, Limits)."""

    max_logprobs: int | None = None  # per position; None: up to the vocabulary
    max_entries: int = 500_000  # logprob entries, positions × (logprobs + 1), in all answers being built
    max_choices: int = 256  # prompts × n in one request
    max_body: int = 8 * 2**20  # bytes


@dataclass(frozen=True)
class ModelInfo:
    """What checking a request needs to know of the model."""

    name: str
    vocab: int
    n_ctx: int
    eos: int | None
    chars_per_token: int | None = None  # the most characters a token stands for (None: unknown)


@dataclass
class Plan:
    """A checked request: the decoder's Request (its choices prompt-major, n per prompt), and how to answer."""

    request: Any  # api.serving.Request
    prompts: list[list[int]]  # each prompt's ids
    n: int
    echo: bool
    logprobs: int | None  # top tokens per position; None: no logprobs in the answer
    stream: bool
    include_usage: bool
    chat: bool = False
    entries: int = 0  # logprob entries the answer holds (the server's memory budget counts them)
    extra: dict = field(default_factory=dict)
    uncertainty: bool = False  # entropy, varentropy and margin beside each position's logprob


class Body(BaseModel):
    """A request body: strict types (no "5" for 5, no true for 1), finite numbers, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _refuse_unless(value, default_ok, key: str, message: str):
    if value not in default_ok:
        raise ValueError(f"{key} {message}")
    return value


# ---- the fields completions and chat share ------------------------------------------------------

Stop = Annotated[Union[str, list[str], None], shaped("stop must be a string or an array of strings")]


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    """response_format.json_schema: OpenAI's {name, description, schema, strict}; the schema is followed."""

    name: Optional[str] = Field(None, description="A label (OpenAI requires it; lmhead does not read it).")
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="The JSON Schema the text follows.")
    strict: Optional[bool] = Field(None, description="lmhead always follows the schema (docs/serve.md lists what "
                                                     "it cannot follow, which is refused).")


class ResponseFormat(Body):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


# The decoding fields a request takes from the registry (decoding/stages.py): every stage by its key, and
# these of the loop's own settings. Their values are checked by the registry's one check, in the one
# conversion (from_openai): pydantic only documents them (type, bounds, default, meaning) in /openapi.json.
REGISTRY_FIELDS = ("seed", "n")


def registry(key: str, help: str | None = None):
    """The registry's setting `key` as a field's type: its type, bounds and help (`help` in its place) for
    /openapi.json; the value passes as the JSON gave it, to the registry's one check."""
    from lmhead_cli.api.choices import SETTINGS

    st = SETTINGS[key]
    return Annotated[Optional[float if st.type is float else st.type],
                     Field(description=f"{help or st.help} Must be {st.rule.must}.".lstrip(), **st.rule.bounds()),
                     WrapValidator(lambda value, handler: value)]


def _registry_fields() -> type[Body]:
    """One field per stage of the registry and per REGISTRY_FIELDS setting, with its type, bounds, default
    and help; values reach the registry's check as the JSON gave them. Absent: the default (a stage off)."""
    from pydantic import create_model

    from lmhead_cli.api.choices import SETTINGS, STAGES

    return create_model("RegistryFields", __base__=Body, **{
        st.key: (registry(st.key), st.default) for st in [*STAGES, *(SETTINGS[k] for k in REGISTRY_FIELDS)]})


class Sampled(_registry_fields()):
    """The sampling fields both endpoints share, OpenAI's and lmhead's extension fields (the decoding
    fields come from the registry: _registry_fields)."""

    model: Optional[str] = Field(None, description="A label only: the server serves its one model.")
    stop: Stop = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs_mode: Annotated[Literal["raw", "processed"], WrapValidator(lambda value, handler: value)] = Field(
        "raw", description="raw: the softmax of the logits; processed: after the stages (checked by decoding's make).")
    presence_penalty: Optional[float] = Field(None, description="Refused unless 0.")
    frequency_penalty: Optional[float] = Field(None, description="Refused unless 0.")
    logit_bias: Optional[dict[str, Any]] = Field(None, description="Refused unless empty.")
    uncertainty: bool = Field(False, description="lmhead: entropy, varentropy and margin per position of the "
                                                 "logprobs, raw or processed as logprobs_mode says (needs logprobs).")
    response_format: Optional[ResponseFormat] = Field(
        None, description="json_schema ({type, json_schema: {name, schema}}) or json_object: the text follows it, "
                          "a grammar compiled with llguidance (docs/grammar.md); text: no constraint.")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info):
        return _refuse_unless(v, (None, 0, 0.0), info.field_name, "is not supported (only 0)")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        return _refuse_unless(v or None, (None,), "logit_bias", "is not supported")

    def needs_logprobs(self, wanted: bool, how: str) -> None:
        """lmhead's `uncertainty` adds to the logprobs: refused where none are asked for (`how` says how)."""
        if self.uncertainty and not wanted:
            raise bad("uncertainty", f"uncertainty adds to the logprobs: it needs {how}")

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def settings(self):
        """THE conversion: the checked body's decoding fields as the one settings object
        (decoding.settings.from_openai: every stage of the registry by its key, temperature 0 greedy, a
        stage's off values off, seed, stop strings, logprobs_mode), checked once there."""
        from lmhead_cli.api.choices import STAGES
        from lmhead_cli.api.serving import from_openai
        from lmhead_cli.errors import BadValue

        values = {key: getattr(self, key) for key in [st.key for st in STAGES] + list(REGISTRY_FIELDS)}
        values.update(logprobs_mode=self.logprobs_mode,
                      stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()), **self._format())
        try:
            return from_openai(values)
        except BadValue as e:
            if e.key in ("json_schema", "json_object"):  # the grammar's: named as the body names it
                where = "response_format.json_schema.schema" if e.key == "json_schema" else "response_format"
                raise bad("response_format", f"{where} {e.problem}") from None
            key = e.key if e.key != "logprobs" else "logprobs_mode"
            raise bad(key, e.spelled(key)) from None

    def _format(self) -> dict:
        """response_format as from_openai's keys: {"json_schema": schema} or {"json_object": True}, or {}."""
        f = self.response_format
        if f is None or f.type == "text":
            return {}
        if f.type == "json_object":
            return {"json_object": True}
        if f.json_schema is None or f.json_schema.schema_ is None:
            raise bad("response_format", "response_format.json_schema.schema is required with type json_schema: "
                                         "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return {"json_schema": f.json_schema.schema_}

    def request(self, prompts: list[list[int]], info: ModelInfo, limits: Limits, *, echo: bool, max_tokens: int,
                top: int | None) -> tuple[Any, int]:
        """The decoder's request (api.serving.Request: the settings, each prompt's n choices; choice j draws
        with seed + j), and the logprob entries the answer will hold. Whatever depends on the model or the
        server's limits is checked here: token ids, the context, choices and entries."""
        from lmhead_cli.api.serving import Request

        for i, ids in enumerate(prompts):
            check_ids(ids, info, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            check_context(ids, max_tokens, info, "the prompt" if len(prompts) == 1 else f"prompt[{i}]")
        check_top(top, "logprobs", info, limits)
        settings = self.settings()
        if settings.grammar is not None and info.eos is None:
            raise bad("response_format", "response_format needs the model's end-of-text token to end the text, and "
                                         "this model has none")
        if len(prompts) * settings.n > limits.max_choices:
            raise bad("n", f"prompts × n is {len(prompts) * settings.n:,} choices; the server answers at most "
                           f"{limits.max_choices:,} in one request")
        request = Request.of(settings, prompts, max_tokens, eos=info.eos, echo=echo and top is not None,
                             top=top or 0, uncertainty=self.uncertainty)
        return request, check_cost(request, top, limits)


# ---- the endpoints' bodies ----------------------------------------------------------------------

PROMPT_SHAPE = "prompt must be a string, an array of strings, an array of token ids or an array of arrays of token ids"
Prompt = Annotated[Union[str, list[str], list[int], list[list[int]]], shaped(PROMPT_SHAPE)]


class CompletionRequest(Sampled):
    """POST /v1/completions."""

    prompt: Prompt = Field(description="A string, strings, token ids, or arrays of token ids: a choice each (× n).")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=0, description="0 with echo scores without generating.")
    echo: bool = Field(False, description="The prompt's own tokens first, with their logprobs.")
    logprobs: registry("top_logprobs", "Top tokens per position, 0 to the vocabulary.") = None
    best_of: Optional[int] = Field(None, description="Refused unless 1.")
    suffix: Optional[str] = Field(None, description="Refused.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if v == []:
            raise ValueError(PROMPT_SHAPE + " (got an empty array)")
        if v == "":
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and "" in v:
            raise ValueError(f"prompt[{v.index('')}] is empty")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        return _refuse_unless(v, (None, 1), "best_of", "is not supported (only 1)")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        return _refuse_unless(v, (None, ""), "suffix", "is not supported")

    @property
    def texts(self) -> list[str] | None:
        """The prompts to encode, or None when they are token ids already."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        return self.prompt if self.prompt and isinstance(self.prompt[0], str) else None

    @property
    def ids(self) -> list[list[int]]:
        return [self.prompt] if self.prompt and isinstance(self.prompt[0], int) else self.prompt

    def plan(self, prompts: list[list[int]], info: ModelInfo, limits: Limits) -> Plan:
        self.needs_logprobs(self.logprobs is not None, "logprobs (0 or more)")
        request, entries = self.request(prompts, info, limits, echo=self.echo, max_tokens=self.max_tokens,
                                        top=self.logprobs)
        return Plan(request=request, prompts=prompts, n=request.settings.n, echo=self.echo, logprobs=self.logprobs, stream=self.stream,
                    include_usage=self.include_usage, entries=entries, uncertainty=self.uncertainty)


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: str
    content: Annotated[Union[str, list[TextPart], None],
                       shaped("content must be a string or an array of text parts")] = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatRequest(Sampled):
    """POST /v1/chat/completions."""

    messages: Messages = Field(description="[{role, content}], rendered with the checkpoint's chat template.")
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: registry("top_logprobs") = None
    tools: Optional[list[Any]] = Field(None, description="Refused: lmhead does not call tools.")
    tool_choice: Optional[Any] = Field(None, description="Refused unless \"none\".")
    functions: Optional[list[Any]] = Field(None, description="Refused.")
    function_call: Optional[Any] = Field(None, description="Refused unless \"none\".")

    @field_validator("messages", mode="wrap")
    @classmethod
    def _messages(cls, v, handler):
        if not isinstance(v, list) or not v:
            raise ValueError("messages must be a non-empty array of {role, content} objects")
        for i, m in enumerate(v):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string role")
            try:
                ChatMessage.model_validate(m)
            except ValidationError:
                raise ValueError(f"messages[{i}].content must be a string or an array of text parts") from None
        return handler(v)

    @field_validator("tools", "functions")
    @classmethod
    def _tools(cls, v, info):
        return _refuse_unless(v or None, (None,), info.field_name, "is not supported: lmhead does not call tools; "
                              "the model's text would be answered as if it had")

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _tool_choice(cls, v, info):
        return _refuse_unless(v, (None, "none"), info.field_name, "is not supported (only \"none\"): lmhead does "
                              "not call tools")

    @property
    def message_list(self) -> list[dict]:
        """[{"role", "content"}] with the content as text (OpenAI's array of text parts joined)."""
        return [{"role": m.role, "content": m.text} for m in self.messages]

    def plan(self, prompt: list[int], info: ModelInfo, limits: Limits) -> Plan:
        """A chat request whose messages the caller rendered to `prompt`."""
        if not prompt:
            raise bad("messages", "the messages render to no tokens")
        check_ids(prompt, info, "the rendered messages", "messages")
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        if max_tokens is None:
            if info.eos is None:  # nothing would end the answer but the context (up to 131,072 tokens)
                raise bad("max_tokens", f"this model has no end-of-text token, so an answer without max_tokens "
                                        f"would run to the end of its context of {info.n_ctx:,} tokens: give it")
            if info.n_ctx - len(prompt) < 1:
                raise bad("messages", f"the messages are {len(prompt):,} tokens, which leaves no room in the "
                                      f"model's context of {info.n_ctx:,}")
            max_tokens = info.n_ctx - len(prompt)
        check_context(prompt, max_tokens, info, "the rendered messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        check_top(self.top_logprobs, "top_logprobs", info, limits)
        top = (self.top_logprobs or 0) if self.logprobs else None
        self.needs_logprobs(self.logprobs, "logprobs: true")
        request, entries = self.request([prompt], info, limits, echo=False, max_tokens=max_tokens, top=top)
        return Plan(request=request, prompts=[prompt], n=request.settings.n, echo=False, logprobs=top, stream=self.stream,
                    include_usage=self.include_usage, chat=True, entries=entries, uncertainty=self.uncertainty)


class TokenizeRequest(Body):
    """POST /tokenize: a prompt, or chat messages through the template (vLLM's shape)."""

    prompt: Optional[str] = None
    messages: Optional[Messages] = None
    add_special_tokens: bool = True

    @property
    def message_list(self) -> list[dict]:
        return [{"role": m.role, "content": m.text} for m in self.messages or ()]

    def check(self) -> None:
        if self.prompt is None and self.messages is None:
            raise bad("prompt", "prompt must be a string (or give messages)")


class DetokenizeRequest(Body):
    """POST /detokenize."""

    tokens: Annotated[list[int], shaped("tokens must be an array of token ids")]


# ---- what depends on the model and the limits ---------------------------------------------------

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


def check_chars(texts: list[str], room: int, info: ModelInfo, param: str, where: str = "the prompt") -> None:
    """Before encoding: a text with more characters than `room` tokens can hold cannot fit, whatever
    its tokens (a token stands for at most info.chars_per_token characters), so it is refused without
    tokenizing it."""
    if info.chars_per_token is None:
        return
    most = max(room, 0) * info.chars_per_token
    for i, text in enumerate(texts):
        if len(text) > most:
            name = where if len(texts) == 1 else f"{param}[{i}]"
            raise bad(param, f"{name} is {len(text):,} characters, more than the {max(room, 0):,} tokens left in the "
                             f"model's context of {info.n_ctx:,} can hold (at most {most:,} characters)")


def check_cost(request, top: int | None, limits: Limits) -> int:
    """The answer's logprob entries (positions × (top + 1)) before any work, against --max-entries."""
    if top is None:
        return 0
    positions = request.positions
    entries = positions * (top + 1)
    if entries > limits.max_entries:
        raise bad("logprobs", f"{positions:,} positions × ({top:,} logprobs + 1) is {entries:,} entries; the "
                              f"server answers at most {limits.max_entries:,} at once (--max-entries)")
    return entries


def check_top(value: int | None, key: str, info: ModelInfo, limits: Limits) -> int | None:
    """The top tokens per position: the registry's top_logprobs (type, 0 or more), then the vocabulary."""
    from lmhead_cli.api.choices import checked
    from lmhead_cli.errors import BadValue

    try:
        checked("top_logprobs", value)
    except BadValue as e:  # completions name it logprobs
        raise bad(key, e.spelled(key)) from None
    hi = info.vocab if limits.max_logprobs is None else min(info.vocab, limits.max_logprobs)
    if value is not None and not 0 <= value <= hi:
        raise bad(key, f"{key} must be between 0 and {hi:,} (got {value})"
                  + (" (--max-logprobs)" if limits.max_logprobs is not None and value <= info.vocab else ""))
    return value
