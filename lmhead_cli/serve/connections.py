"""Connections under bounds: uvicorn's own settings, and two things it leaves open.

* **Idle connections close.** uvicorn times out a keep-alive connection only after a response; a
  connection that never sends a byte would be held for ever (10,000 of them exhaust the file
  descriptors). Here the keep-alive timer (IDLE_S) also starts when the connection is made.
* **A bounded number of connections.** Past max_connections (the descriptors the process may open,
  less a reserve for the accept backlog, the model's files and the log), a new connection is closed
  at once, so /health and the clients already connected keep working; uvicorn's limit_concurrency
  answers 503 past the same number of requests.
* **No traceback storms.** The event loop's error reports (an accept() that failed for lack of
  descriptors, a socket reset) become one line each, through the one JSON encoder, and the same
  report at most once a minute with a count of those left out.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

IDLE_S = 5  # a connection idle this long (before its first request too) is closed
BACKLOG = 128  # connections waiting to be accepted
RESERVE_FDS = 2 * BACKLOG  # descriptors kept for what the process opens besides connections
MAX_HEADER_BYTES = 16 * 1024  # h11's largest incomplete event: request line and headers
REPEAT_S = 60.0


def max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, min(4096, soft - RESERVE_FDS))


def protocol(most: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with the idle timer from the first moment and at most `most` connections."""

    class Bounded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > most:
                transport.abort()
                return
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    return Bounded


class QuietLoopErrors:
    """The event loop's exception handler: one line per report, each kind at most once a minute."""

    def __init__(self, log):
        self.log = log
        self.last: dict[tuple, float] = {}
        self.left_out: dict[tuple, int] = {}

    def __call__(self, loop, context: dict) -> None:
        e = context.get("exception")
        key = (context.get("message", ""), type(e).__name__ if e else "")
        now = time.monotonic()
        if now - self.last.get(key, -REPEAT_S) < REPEAT_S:
            self.left_out[key] = self.left_out.get(key, 0) + 1
            return
        self.last[key] = now
        line = {"event": key[0], "error": f"{type(e).__name__}: {e}" if e else None}
        if self.left_out.get(key):
            line["repeats_left_out"] = self.left_out.pop(key)
        self.log(line)


def listen(host: str, port: int):
    """A socket bound to host:port, before anything says it is serving: a port another program holds
    (or an address this machine lacks) is one LmheadError naming it, not uvicorn's log line and exit 3."""
    import socket

    from lmhead_cli.errors import LmheadError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise LmheadError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind(address)
    except OSError as e:
        sock.close()
        advice = ("; another program is listening on it: stop it or choose another port with --port"
                  if e.errno == errno.EADDRINUSE else "")
        raise LmheadError(f"cannot listen on {host}:{port}: {e.strerror or e}{advice}") from None
    sock.set_inheritable(True)
    return sock


def run(app, host: str, port: int, sock=None) -> None:
    """Serve `app` until interrupted: one uvicorn process, h11, the bounds above; on `sock` (from
    listen()) when given, else on a socket uvicorn binds to host:port."""
    import uvicorn

    from lmhead_cli.serve.door import log

    most = max_connections()
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, http=protocol(most),
                            timeout_keep_alive=IDLE_S, limit_concurrency=most, backlog=BACKLOG,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES, lifespan="off")
    server = uvicorn.Server(config)

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(QuietLoopErrors(log))
        await server.serve(sockets=[sock] if sock is not None else None)

    asyncio.run(main())
