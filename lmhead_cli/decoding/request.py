"""What the decoder (decoding/decoder.py) takes and gives: a `Request` (checked Settings and prompts) in,
`Event`s (a prompt's scores, each token with its record, each choice's finish) out. No torch here: a
front end builds a Request before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmhead_cli.decoding.settings import Settings


@dataclass(frozen=True)
class Request:
    """Each prompt's `settings.n` choices, continued as `settings` say: choice j of a prompt draws with
    seed + j (Settings.choice_seeds, one draw per prompt when no seed is given). Choices are numbered
    prompt-major: prompt i's are i·n … i·n + n - 1."""

    prompts: tuple[tuple[int, ...], ...]  # each at least one token, all in the vocabulary
    settings: Settings  # checked (decoding.settings.make)
    max_tokens: tuple[int, ...]  # per prompt: tokens to generate at most (0: score only)
    eos: int | None = None  # the token that ends a choice (settings.ignore_eos: none)
    echo: bool = False  # score the prompt's own tokens first
    top: int | None = None  # top tokens per position (None: settings.top_logprobs)
    uncertainty: bool = False  # entropy, varentropy and margin of each position too

    @classmethod
    def of(cls, settings: Settings, prompts, max_tokens, **extra) -> Request:
        """A request for `prompts` (token id lists); `max_tokens` one int for every prompt or one per prompt."""
        prompts = tuple(tuple(p) for p in prompts)
        per = (max_tokens,) * len(prompts) if isinstance(max_tokens, int) else tuple(max_tokens)
        return cls(prompts, settings, per, **extra)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.settings.n

    @property
    def positions(self) -> int:
        """Positions the answer holds: each choice's echoed prompt (with echo) and its generated tokens."""
        return self.settings.n * sum((len(p) if self.echo else 0) + m for p, m in zip(self.prompts, self.max_tokens))

    def rows(self) -> list:
        """decoding.rows.Row's, one per choice, prompt-major."""
        from lmhead_cli.decoding.rows import Row

        s, out = self.settings, []
        for ids, max_tokens in zip(self.prompts, self.max_tokens):
            for seed in s.choice_seeds():
                out.append(Row(ids, echo=self.echo, max_tokens=max_tokens,
                               top=s.top_logprobs if self.top is None else self.top, mode=s.logprobs,
                               knobs=s.knobs, greedy=s.greedy, seed=seed or 0, stop=s.stop,
                               eos=None if s.ignore_eos else self.eos, alternatives=s.show_steps,
                               uncertainty=self.uncertainty, grammar=s.grammar))
        return out


@dataclass(frozen=True)
class Event:
    """One thing the decoder made for choice `index` of request `key`, in order per choice:
    "admit" (the choice joined the running rows), "echo" (its prompt's scores), "token" (each token,
    with its whole record in token.step), "finish" (why it ended: "eos", "stop" or "length"; `tail`,
    the text held back until then). A beam request (settings.beams > 1) gives one "finish" per prompt,
    once its search ends, with the search (its finished beams, the best one's steps)."""

    key: Any
    index: int
    kind: str
    echo: Any = None  # decoding.rows.Echo
    token: Any = None  # decoding.rows.Token
    reason: str | None = None
    tail: str = ""
    at: float | None = None  # "admit": time.perf_counter() when the choice was admitted
    search: Any = None  # "finish" of a beam request's prompt: its decoding.beams.BeamSearch, done
