"""The Model methods a server needs (lmhead serve): the decoder, chat prompts, tokens.

`Model` takes these from the `Serving` mixin, so that the API stays the one door a front end goes
through: serve/ calls these methods and never a reading or an engine directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmhead_cli.api.checks import kinds
from lmhead_cli.decoding.settings import Settings, from_openai  # noqa: F401 - torch-free: the server's one conversion


class Serving:
    """Mixed into api.Model (which provides `self.loaded`)."""

    def decoder(self, *, max_rows: int | None = None, budget: int | None = None, chunk: int | None = None,
                arrivals=None, cancelled=None):
        """The model's decoder (decoding/decoder.py): `submit(key, Request)`, then `round()` (rows admitted
        fairly across requests, at most `max_rows` but one for a request with none running; prompts read,
        at most `budget` positions a round; one step) yields the Events as they are made. `arrivals()`
        gives the requests that came meanwhile, `cancelled(key)` whether a request's caller has gone. The
        server's worker drives one on the model's thread."""
        from lmhead_cli.decoding.decoder import Decoder

        return Decoder(self.loaded, max_rows=max_rows, budget=budget, chunk=chunk, arrivals=arrivals,
                       cancelled=cancelled)

    def prepare_grammar(self, grammar) -> None:
        """Compile a request's grammar (decoding/grammar.py) for this model's tokenizer now, where a
        request waits for it, and keep it: its rows then start in the decoding thread without compiling.
        BadValue("response_format") when this tokenizer cannot follow it."""
        from lmhead_cli.decoding.grammar import Matcher

        Matcher(grammar, self.tokenizer, self.loaded.engine.vocab_size, self.eos_token_id, key="response_format")

    @property
    def eos_token_id(self) -> int | None:
        return self.loaded.engine.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-text token: the tokenizer's own, else the config's, else the end-of-text token."""
        bos = self.loaded.tokenizer.bos_id
        bos = self.loaded.config.get("bos_token_id", self.eos_token_id) if bos is None else bos
        return bos[0] if isinstance(bos, list) else bos

    @property
    def adds_bos(self) -> bool:
        """Whether this model's tokenizer puts its beginning-of-text token before every text (Llama's do:
        tokenizer_config.json's add_bos_token, a GGUF's tokenizer.ggml.add_bos_token; GPT-2's does not).
        Every reading then reads the prompt after it, as transformers and llama.cpp do."""
        return self.loaded.tokenizer.add_bos

    @kinds(bos=bool)
    def wants_bos(self, bos: bool | None = None) -> bool:
        """`bos` as given (a reading's --bos / --no-bos), else what the model's tokenizer does (`adds_bos`)."""
        return self.adds_bos if bos is None else bool(bos)

    @property
    def chat_template(self) -> str:
        """The checkpoint's own chat template, or the plain one (loading/chat.py); read once."""
        from lmhead_cli.loading import chat

        if getattr(self, "_chat_template", None) is None:
            self._chat_template = chat.own_template(self.loaded.path) or chat.PLAIN_TEMPLATE
        return self._chat_template

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text for chat `messages` ([{"role", "content"}]) through the chat template."""
        from lmhead_cli.api import checks
        from lmhead_cli.loading import chat

        messages = checks.chat_messages(messages)
        text = self.tokenizer.token_text
        eos = "" if self.eos_token_id is None else text(self.eos_token_id)
        bos = "" if self.bos_token_id is None else text(self.bos_token_id)
        return chat.render(self.chat_template, messages, bos_token=bos, eos_token=eos)

    @kinds(n_tokens=int, bos=bool, stride=int)
    def scored_positions(self, n_tokens: int, *, bos: bool | None = None, stride: int | None = None) -> list[range]:
        """Which of a text's n_tokens positions `score` gives a logprob (the rest have nothing before them
        in their window): ranges of text positions, in order."""
        from lmhead_cli.readings.score import windows

        n_ctx, bos = self.n_ctx, self.wants_bos(bos)
        return [range(w.first - bos, w.end - bos)
                for w in windows(n_tokens + bos, n_ctx, n_ctx // 2 if stride is None else stride)]

    @property
    def chars_per_token(self) -> int | None:
        """The most characters one token can stand for, or None where no bound is known: GPT-2's
        byte-level BPE without a normalizer (a token is at most `max_token_bytes` bytes, a character at
        least one), so a text of more than n × this many characters cannot fit n tokens."""
        from tokenizers import pre_tokenizers

        tok = self.tokenizer
        inner = getattr(tok, "tok", None)
        if inner is None or inner.normalizer is not None or not isinstance(inner.pre_tokenizer, pre_tokenizers.ByteLevel):
            return None
        return tok.max_token_bytes

    @kinds(text=str)
    def encode(self, text: str) -> list[int]:
        """A text's token ids (any length; long texts are encoded in pieces, with the same ids)."""
        return list(self.tokenizer.encode_long(text))

    @kinds(text=str)
    def prompt_ids(self, text: str) -> list[int]:
        """The ids a completion of prompt `text` reads: its tokens, after the beginning-of-text token where
        the model's tokenizer puts one (`adds_bos`), as transformers and llama-server do."""
        ids = self.encode(text)
        return [self.bos_token_id] + ids if self.adds_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (each from 0 to the vocabulary's size - 1; BadValue otherwise)."""
        from lmhead_cli.api import checks

        return self.tokenizer.decode(checks.token_ids("ids", ids, self.loaded.engine.vocab_size))


def __getattr__(name: str):
    # The server's request and event types (decoding/request.py, torch-free) and the results an event
    # carries (decoding/rows.py: Echo, Token, imported with torch only when asked for), reached through
    # the API: serve/ imports nothing from decoding/ (tests/test_imports.py).
    if name in ("Request", "Event"):
        from lmhead_cli.decoding import request

        return getattr(request, name)
    if name in ("Echo", "Token"):
        from lmhead_cli.decoding import rows

        return getattr(rows, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
