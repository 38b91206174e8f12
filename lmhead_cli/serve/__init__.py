"""`lmhead serve`: an OpenAI-compatible local server with the logprobs other servers don't give.

serve/requests.py checks a request, serve/worker.py batches the work on the model's one thread
(continuous batching on decoding/batch.py, through the API), serve/answer.py builds the answer with
render/openai.py, serve/app.py holds the routes, serve/door.py is the one door every request comes
through (Host, body, JSON), serve/connections.py bounds the connections. Nothing heavy is imported
here: `lmhead --help` stays fast.
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class Options:
    """The server's settings, as `lmhead serve` takes them."""

    model: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_logprobs: int | None = None
    max_entries: int = 500_000
    max_body: int = 8 * 2**20
    max_queue: int = 1024
    max_batch: int = 16
    batch_tokens: int = 4096
    cors: tuple[str, ...] = ()
    device: str = "auto"
    dtype: str = "float32"
    engine: str = "auto"
    threads: int | None = None
    name: str | None = None
    allow_hosts: tuple[str, ...] = ()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url(host: str, port: int) -> str:
    """The API's base URL on `host`: an IPv6 address in brackets (http://[::1]:8000/v1, RFC 3986), its zone's
    % written %25 (RFC 6874)."""
    return f"http://[{host.replace('%', '%25')}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def check(options: Options) -> list[str]:
    """UsageError for a bad setting; the warnings to print before serving."""
    from lmhead_cli.errors import BadValue

    if not 0 <= options.port <= 65535:
        raise BadValue("port", f"must be between 0 and 65535 (got {options.port})")
    for key in ("max_entries", "max_body", "max_queue", "max_batch", "batch_tokens"):
        if getattr(options, key) < 1:
            raise BadValue(key, f"must be at least 1 (got {getattr(options, key)})")
    if options.max_logprobs is not None and options.max_logprobs < 0:
        raise BadValue("max_logprobs", f"must be 0 or more (got {options.max_logprobs})")
    if options.api_key is not None:
        if not options.api_key.strip():
            raise BadValue("api_key", "is empty (an unset variable in --api-key \"$KEY\"?): every request would "
                                      "need an empty key; give a key, or leave --api-key out")
        if not all("\x21" <= c <= "\x7e" for c in options.api_key):
            raise BadValue("api_key", "must be printable ASCII without spaces: HTTP headers carry no other "
                                      "characters, so no request could ever send it")
    if "*" in options.cors and not options.api_key:
        raise BadValue("cors", "'*' without --api-key would let every web site a browser visits use the model "
                               "and read its answers; give --api-key, or name the origins")
    for name in options.allow_hosts:
        if not name or any(c in name for c in "/ \t\r\n") or not name.isascii():
            raise BadValue("allow_host", f"must be a host name, an address or * (got {name!r})")
    warnings = []
    if not is_loopback(options.host) and not options.api_key:
        warnings.append(f"serving on {options.host}, which other machines can reach, without --api-key: anyone "
                        "who can reach it can use the model")
    return warnings


def build(options: Options, model):
    """The FastAPI app serving `model` (an api.Model) with these options."""
    from lmhead_cli.serve.app import Served, build_app
    from lmhead_cli.serve.door import model_name
    from lmhead_cli.serve.requests import Limits
    from lmhead_cli.serve.worker import Worker

    worker = Worker(model, max_rows=options.max_batch, max_tokens=options.batch_tokens, max_queue=options.max_queue)
    limits = Limits(max_logprobs=options.max_logprobs, max_entries=options.max_entries,
                    max_choices=min(options.max_queue, 1024), max_body=options.max_body)
    served = Served(model=model, worker=worker, name=options.name or model_name(options.model), limits=limits,
                    api_key=options.api_key, cors=options.cors, host=options.host, allow_hosts=options.allow_hosts)
    return build_app(served)


def serve(options: Options, model, say=lambda line: print(line, file=sys.stderr, flush=True)) -> None:
    """Serve until interrupted (uvicorn, one process; the model's work on its own thread)."""
    from lmhead_cli.api import hand_over
    from lmhead_cli.serve.connections import listen, run

    sock = listen(options.host, options.port)  # a busy port fails here, before the line that says it serves
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    app = build(options, model)
    hand_over()  # the model's thread alone runs parallel work from here (the loading ran on this one)
    say(f"lmhead serve: {app.state.served.name} at {url(options.host, port)} "
        f"(OpenAI API; Ctrl-C stops)")
    run(app, options.host, port, sock=sock)
