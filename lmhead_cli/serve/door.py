"""The one door every request comes through: the Host it names, its body, and every answer's JSON.

* **Host.** A browser page on another origin can reach 127.0.0.1 through a name that resolves to it
  (DNS rebinding): its requests then carry that name in `Host`. Only 127.0.0.1, localhost, [::1],
  the `--host` given (any address literal when that is 0.0.0.0 or ::) and the names `--allow-host`
  adds are answered; anything else gets 403 before any route runs.
* **Body.** A POST body is read by `read_json`: `Content-Type: application/json` (else 415, so that a
  cross-origin write always needs a CORS preflight: a `text/plain` fetch or an HTML form cannot send
  one), at most `--max-body` bytes (413, at once when `Content-Length` says so), nested at most
  MAX_DEPTH deep, no NaN or Infinity, no lone surrogate in any string (400): then the route's
  pydantic model (serve/requests.py) checks the fields, and its errors come out as 400s naming the
  field. A client that goes away in the middle of its body ends its request quietly.
* **Names.** The model is shown by its name, never by a path (`model_name`: a folder's last part).
* **Answers.** Every JSON answer, error and log line is written by render.dumps, which escapes DEL,
  the C1 controls and U+2028/9 as the streamed events do.

`DoorRoute` is the route class of every router (the API's and the page's): it reads the body through
the door and turns whatever a route raises into OpenAI's error shape, with one log line for a
failure of the server itself and never a traceback.
"""

from __future__ import annotations

import ipaddress
import json
import sys

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from lmhead_cli.errors import BadValue, LmheadError, UsageError
from lmhead_cli.render import dumps, safe_text
from lmhead_cli.serve.requests import RequestError, validation_error

MAX_DEPTH = 64  # arrays and objects inside each other; an OpenAI request needs 4
DEFAULT_MAX_BODY = 8 * 2**20


class Answer(JSONResponse):
    """A JSON answer written by the one encoder (render.dumps: controls escaped)."""

    def render(self, content) -> bytes:
        return dumps(content, separators=(",", ":"), allow_nan=False).encode("utf-8")


class Disconnected(Exception):
    """The client went away before its answer: nothing is sent, nothing is logged."""


def error_response(e: RequestError) -> Answer:
    return Answer({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}},
                  status_code=e.status, headers=e.headers)


def log(line: dict) -> None:
    """One line on stderr, as JSON through the one encoder: nothing a client sent reaches the terminal raw."""
    print("lmhead serve: " + dumps(line), file=sys.stderr, flush=True)


# ---- the body -----------------------------------------------------------------------------------

async def read_json(request, limit: int) -> dict:
    """The body as a JSON object, or a RequestError (415, 413, 400); Disconnected if the client goes."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise RequestError(415, "the body must be JSON, sent with Content-Type: application/json (got "
                           + (repr(safe_text(kind)) if kind else "none") + ")", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.strip().isdigit() and int(declared) > limit:
        raise too_large(limit)
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise too_large(limit)
    except ClientDisconnect:
        raise Disconnected() from None

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(data, parse_constant=no_constants)
    except RecursionError:
        raise nested_too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object", code="invalid_json")
    check_values(body)
    request._body = bytes(data)  # what FastAPI reads next: the door has read it
    request._json = body
    return body


def too_large(limit: int) -> RequestError:
    return RequestError(413, f"the request body is over the server's limit of {limit:,} bytes (--max-body)",
                        code="request_too_large")


def nested_too_deep() -> RequestError:
    return RequestError(400, f"the body nests arrays and objects more than {MAX_DEPTH} deep", code="invalid_json")


def check_values(body: dict) -> None:
    """Depth at most MAX_DEPTH, and no lone surrogate (a valid JSON escape such as \\ud800, but no
    text): both walked without recursion, each value once."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, top = stack.pop()
        if depth > MAX_DEPTH:
            raise nested_too_deep()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, v in items:
            where = top if top is not None else key
            for s in (key, v):
                if isinstance(s, str) and _lone_surrogate(s):
                    raise RequestError(400, f"{where} holds a lone surrogate (an escape such as \\ud800 that is "
                                            "half of a character), which is not text", param=where,
                                       code="invalid_value")
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, where))


def _lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---- the route class ----------------------------------------------------------------------------

def as_request_error(e: Exception) -> RequestError:
    """Whatever a route raised, as the answer to send."""
    from lmhead_cli.serve.worker import Busy

    if isinstance(e, RequestError):
        return e
    if isinstance(e, Busy):
        return RequestError(503, "the server's queue is full (--max-queue); retry shortly", type="server_error",
                            code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, RequestValidationError):
        return validation_error(e.errors())
    if isinstance(e, BadValue):
        return RequestError(400, str(e), param=e.key, code="invalid_value")
    if isinstance(e, UsageError):
        return RequestError(400, str(e), param=getattr(e, "key", None), code="invalid_value")
    if isinstance(e, LmheadError):
        return RequestError(500, str(e), type="server_error", code="model_error")
    if isinstance(e, MemoryError):
        return RequestError(500, "the model ran out of memory on this request", type="server_error", code="model_error")
    return RequestError(500, f"internal error: {type(e).__name__}", type="server_error")


def route_class(max_body: int = DEFAULT_MAX_BODY) -> type[APIRoute]:
    """The route class that reads every body through the door, with `max_body` bytes at most."""

    class DoorRoute(APIRoute):
        def get_route_handler(self):
            inner = super().get_route_handler()

            async def handler(request):
                try:
                    if request.method == "POST":
                        await read_json(request, max_body)
                    return await inner(request)
                except Disconnected:
                    return Answer(None, status_code=499)
                except Exception as e:  # noqa: BLE001 - every failure is an answer, never a traceback
                    answer = as_request_error(e)
                    if answer.status == 500 and not isinstance(e, (LmheadError, MemoryError)):
                        log({"status": 500, "method": request.method, "path": request.url.path,
                             "error": f"{type(e).__name__}: {e}"})
                    return error_response(answer)

            return handler

    return DoorRoute


# ---- the Host ------------------------------------------------------------------------------------

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def model_name(source: str) -> str:
    """The name the server shows for its model (/v1/models, the page's /api/info): a local folder by its
    last part, so that no path leaves the server."""
    from pathlib import Path

    path = Path(source).expanduser()
    return path.name if path.exists() else source


def host_name(header: str) -> str:
    """The name in a Host header, without its port; an IPv6 literal without its brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheck:
    """ASGI middleware: 403 for a Host header this server does not answer to (see the module's text)."""

    def __init__(self, app, bound: str, allowed: tuple[str, ...] = ()):
        self.app = app
        self.any_host = "*" in allowed
        self.names = {host_name(n) for n in (*LOOPBACK_NAMES, bound, *allowed)}
        self.any_address = bound in ("0.0.0.0", "::", "")

    def allows(self, header: str | None) -> bool:
        if self.any_host:
            return True
        if not header:
            return False
        name = host_name(header)
        return name in self.names or (self.any_address and _is_address(name))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if self.allows(header):
            return await self.app(scope, receive, send)
        shown = ", ".join(sorted(self.names))
        e = RequestError(403, f"this server does not answer to the host {header!r} (only {shown}; "
                              "--allow-host adds a name)", code="host_not_allowed")
        await error_response(e)(scope, receive, send)


class Head:
    """ASGI middleware: HEAD wherever GET is served (RFC 9110): the GET's status and headers, no body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
