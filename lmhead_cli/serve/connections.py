"""Connections under bounds: uvicorn's own settings, and two things it leaves open.

* **Idle connections close.** uvicorn times out a keep-alive connection only after a response; a
  connection that never sends a byte would be held for ever (10,000 of them exhaust the file
  descriptors). Here the keep-alive timer (IDLE_S) also starts when the connection is made.
* **A bounded number of connections.** At most max_connections (the descriptors the process may
  open, less a reserve for the accept backlog, the model's files and the log) are held, so the
  process never runs out of descriptors. A new connection past that makes room by closing the
  connection idle the longest (none with a request in flight), so a newcomer (/health, a client)
  still gets its answer however many idle connections a peer opened; when every one has a request
  in flight, the newcomer is answered 503 in OpenAI's error shape and closed.
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


def full_answer() -> bytes:
    """The raw 503 a connection gets when every connection held has a request in flight."""
    from lmhead_cli.render import dumps

    body = dumps({"error": {"message": "the server holds as many connections as it may, each with a request "
                                       "in flight; retry shortly", "type": "server_error", "param": None,
                            "code": "too_many_connections"}}, separators=(",", ":")).encode("utf-8")
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
            "\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def protocol(most: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with the idle timer from the first moment and at most `most` connections:
    past that, the one idle longest is closed for the newcomer, or the newcomer is answered 503."""
    full = full_answer()

    class Bounded(H11Protocol):
        active_at = 0.0  # when the connection was made or last received bytes

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.active_at = self.loop.time()
            held = [c for c in self.connections if c is not self and not c.transport.is_closing()]
            if len(held) >= most and not self.make_room(held):
                transport.write(full)
                transport.close()
                return
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            self.active_at = self.loop.time()
            super().data_received(data)

        @staticmethod
        def make_room(held: list) -> bool:
            """Close the connection idle the longest (no request in flight); False when none is idle."""
            idle = [c for c in held if c.cycle is None or c.cycle.response_complete]
            if not idle:
                return False
            min(idle, key=lambda c: c.active_at).transport.close()
            return True

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
    # uvicorn answers 503 once len(connections) >= limit_concurrency: at `most` that would refuse every
    # request while the server is full of idle connections; connections stay <= most, so most + 1
    # bounds only the requests in flight
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, http=protocol(most),
                            timeout_keep_alive=IDLE_S, limit_concurrency=most + 1, backlog=BACKLOG,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES, lifespan="off")
    server = uvicorn.Server(config)

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(QuietLoopErrors(log))
        await server.serve(sockets=[sock] if sock is not None else None)

    asyncio.run(main())
