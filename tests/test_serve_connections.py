"""The server's bound on connections (serve/connections.py), with few file descriptors: a peer holding
every connection the bound allows leaves /health answering, 200 when some are idle, 503 in OpenAI's
shape when all have a request in flight. A real `lmhead serve` process with RLIMIT_NOFILE lowered to
256, so that the bound is its floor, 16 connections."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers import free_port, web

LIMIT = 256  # descriptors: max_connections() is 16 here


@pytest.fixture(scope="module")
def low_fds(tiny):
    """(port, pid) of a server whose process may open LIMIT descriptors."""
    import resource

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lmhead_cli", "serve", "--model", str(tiny[0]), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT)))
    lines: list[bytes] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")), daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.TransportError):
                if web.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(lines)[-3000:]
            time.sleep(0.3)
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = b"".join(lines).decode(errors="replace")
    assert "Traceback" not in log, log[-3000:]


@contextlib.contextmanager
def connections(port: int, count: int, send: bytes = b""):
    """`count` connections to the server (each sending `send`), all closed at the end."""
    socks = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(s)
            if send:
                s.sendall(send)
        time.sleep(1)  # the server accepts the last of them
        yield socks
    finally:
        for s in socks:
            s.close()


def test_idle_connections_past_the_bound_leave_health_answering_at_once(low_fds):
    """300 idle connections against a bound of 16: the newcomer closes the one idle longest, so the
    first /health asked answers 200 (before the fix it was closed at once, until the idle ones timed out)."""
    port, pid = low_fds
    with connections(port, 300):
        got = web.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert got.status_code == 200 and got.json()["status"] == "ok"
        held = len(os.listdir(f"/proc/{pid}/fd"))
        assert held < LIMIT // 2, f"the server holds {held} descriptors of {LIMIT}: the reserve is gone"
        assert web.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200


def test_when_every_connection_has_a_request_in_flight_a_newcomer_gets_a_503(low_fds):
    """16 requests waiting for their bodies hold every connection: /health is answered 503 in OpenAI's
    error shape and closed, not left without an answer; once they go, it answers 200."""
    port, _ = low_fds
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            "content-length: 100\r\n\r\n").encode("ascii")
    with connections(port, 16, head):
        got = web.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert got.status_code == 503, got.text
        error = got.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "too_many_connections", error
        assert got.headers["retry-after"] == "1"
    deadline = time.monotonic() + 30
    while web.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "/health never answered 200 once the requests went"
        time.sleep(0.3)
