"""`lmhead serve`: the model behind an OpenAI-compatible HTTP API (lmhead_cli/serve/)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer

from lmhead_cli.cli.options import DEFAULT_MODEL, ModelChoice, command

ROUTES = ("GET  /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
          "POST /detokenize", "GET  /tokenizer_info", "GET  /health")


@command("serve")
def serve_cmd(
    host: Annotated[str, typer.Option("--host", help="The address to listen on; anything but a loopback "
                                      "address lets other machines in (give --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="The TCP port.", min=0, max=65535)] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LMHEAD_API_KEY",
                                                   help="Requests must send Authorization: Bearer KEY (else 401).")] = None,
    max_logprobs: Annotated[Optional[int], typer.Option(
        "--max-logprobs", min=0, show_default="the vocabulary size",
        help="The most logprobs / top_logprobs a request may ask for per position.")] = None,
    max_entries: Annotated[int, typer.Option(
        "--max-entries", min=1, help="The most logprob entries, positions × (logprobs + 1), in the answers being "
        "built at once (one request past it: 400; past it with others: 503); an entry takes about 0.9 KB at its "
        "peak.")] = 500_000,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", min=1, help="Choices (prompts × n) waiting at most; past it, 503 with Retry-After.")] = 1024,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Choices run together in one batch (a request with none running may join a full batch, up to twice this).")] = 16,
    max_body: Annotated[int, typer.Option("--max-body", min=1, help="The largest request body, bytes (else 413).")]
    = 8 * 2**20,
    cors: Annotated[Optional[list[str]], typer.Option(
        "--cors", help="Let web pages from this origin call the API (repeatable); CORS is off without it. "
        "'*' needs --api-key.")] = None,
    allow_host: Annotated[Optional[list[str]], typer.Option(
        "--allow-host", help="Also answer requests whose Host header names this (repeatable; '*': any). Only "
        "127.0.0.1, localhost, [::1] and --host are answered without it (DNS rebinding).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Load the model, check the settings, print what "
                                          "would be served, and exit.")] = False,
    source: ModelChoice = None,
) -> None:
    """Serve the model over the OpenAI API: completions with the prompt's own logprobs (echo), chat,
    tokenize; many clients batched on one model. Binds 127.0.0.1 unless --host says otherwise.

    Example: lmhead serve --model random:gpt2 --port 8000 --dry-run
    """
    from lmhead_cli import serve
    from lmhead_cli.cli.boundary import say as say_raw
    from lmhead_cli.render import safe_text

    def say(line: str) -> None:  # the served name is a folder's: ESC, BEL or a C1 byte would drive the terminal
        say_raw(safe_text(line))

    options = serve.Options(model=source.model or DEFAULT_MODEL, host=host, port=port, api_key=api_key, max_logprobs=max_logprobs,
                            max_entries=max_entries, max_queue=max_queue, max_batch=max_batch, max_body=max_body,
                            cors=tuple(cors or ()), device=source.device, dtype=source.dtype, engine=source.engine,
                            threads=source.threads, allow_hosts=tuple(allow_host or ()))
    for line in serve.check(options):
        say(f"lmhead: warning: {line}")
    model = source.load()
    if source.model is None:  # not named (gpt2, or bundled:tiny offline): served under the name of the one that ran
        options = dataclasses.replace(options, model=model.source)
    if dry_run:
        app = serve.build(options, model)
        access = f"{'an API key' if api_key else 'no API key'}; CORS {'for ' + ', '.join(cors) if cors else 'off'}"
        typer.echo(safe_text(f"would serve {app.state.served.name} at {serve.url(host, port)} ({access})"))
        for route in ROUTES:
            typer.echo(f"  {route}")
        return
    serve.serve(options, model, say)
