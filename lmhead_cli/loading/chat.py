"""Chat messages to one prompt: the checkpoint's own chat template, or a plain one.

A checkpoint that ships a chat template (`chat_template` in tokenizer_config.json, or a
chat_template.jinja file) has its messages rendered with it, in jinja2's sandbox as transformers
does. Otherwise (GPT-2 has none) the plain template below is used: one line "role: content" per
message, then "assistant:" for the reply.
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def own_template(folder: str | None) -> str | None:
    """The chat template a checkpoint folder ships, or None."""
    if folder is None:
        return None
    path = Path(folder)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    config = path / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            return None
        return template if isinstance(template, str) else None
    return None


def render(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` ([{"role", "content"}]); UsageError when the template fails."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from lmhead_cli.errors import UsageError

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                                add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise UsageError(f"the chat template refused the messages: {e}") from None
