"""The suite's forking launcher: `python -m lmhead_cli ARGS` started by fork from a process that has
already imported torch and lmhead's other heavy, settings-free dependencies, instead of a fresh
interpreter that imports them again (~2 of a fresh `lmhead`'s ~3 s of CPU on 2 cores, a few dozen times
a suite run). tests/helpers.py's `launch`, `start` and `serving` use it where a fork runs what a fresh
interpreter would; everything that depends on how an interpreter starts keeps a fresh one (see
helpers.forkable).

    python tests/zygote.py SOCKET

listens on the Unix socket SOCKET. A request is one connection: a length-prefixed JSON message
{"argv", "env", "cwd", "unbuffered"} carrying three file descriptors (the child's stdin, stdout and
stderr). For each the launcher forks a monitor, which forks the child and writes back the child's pid,
then its exit code as subprocess gives it (-N for signal N), each a signed 64-bit integer. The child
takes the descriptors as 0, 1 and 2, the request's environment, working folder and argv, new sys.stdin,
stdout and stderr as a fresh interpreter makes them for those descriptors, and runs lmhead_cli as
`python -m` does; it ends as an interpreter does (atexit, threads, flushing). Nothing of lmhead is
imported here, so no lmhead module state is shared. The launcher ends when its parent does.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import signal
import socket
import struct
import sys

sys.dont_write_bytecode = False  # as tests/conftest.py: the first fork caches lmhead_cli's compiled modules

# imported once, before any fork: what a fresh `lmhead` spends most of its start on. None of them reads
# a setting at import that a test changes (helpers.forkable keeps a fresh interpreter for those that
# torch's OpenMP and Python's start-up read); transformers and huggingface_hub, which read HF_* at
# import, are not here.
import numpy  # noqa: F401
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import typer  # noqa: F401
import rich.console  # noqa: F401
import rich.table  # noqa: F401

try:  # the server's
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError:
    pass


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < 4:
        raise ConnectionError("short request")
    (size,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("short request")
        body += more
    return json.loads(body), fds


def _stdio(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr over descriptors 0, 1 and 2, as a fresh interpreter makes them: the
    encoding and errors of this process's (same locale), stdout line-buffered on a terminal, stderr
    always, the binary layer left out under PYTHONUNBUFFERED."""
    def writer(fd: int, errors: str, line: bool):
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding=sys.__stdout__.encoding, errors=errors, line_buffering=line,
                                write_through=unbuffered)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=sys.__stdin__.encoding, errors=sys.__stdin__.errors)
    sys.stdout = sys.__stdout__ = writer(1, sys.__stdout__.errors, os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


def serve(path: str) -> dict:
    """Accept requests until the parent goes; returns (in the child only) the request to run."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    print("ready", flush=True)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:  # the monitor
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:  # the child
                conn.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                for fd in fds:
                    if fd > 2:
                        os.close(fd)
                return request
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(struct.pack("!q", pid))
                _, status = os.waitpid(pid, 0)
                conn.sendall(struct.pack("!q", os.waitstatus_to_exitcode(status)))
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()
    sys.exit(0)


if __name__ == "__main__":
    job = serve(sys.argv[1])
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    _stdio(job["unbuffered"])
    sys.argv = ["lmhead_cli", *job["argv"]]
    sys.path[0] = os.getcwd()  # as `python -m` puts it, where this script's folder was
    del job
    runpy.run_module("lmhead_cli", run_name="__main__", alter_sys=True)
