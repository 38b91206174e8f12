"""A request the server refuses: RequestError (the HTTP status and OpenAI's error fields), `bad` (a 400
naming the field), and pydantic's errors as OpenAI's (`validation_error`, `shaped`)."""

from __future__ import annotations

from pydantic import ValidationError, WrapValidator


class RequestError(Exception):
    """A request the server answers with an error: HTTP status, OpenAI's error fields, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}


def bad(param: str, message: str) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


_WANTS = {"int_type": "an integer", "bool_type": "a boolean", "float_type": "a number", "string_type": "a string",
          "list_type": "an array", "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object", "finite_number": "a finite number", "none_required": "null"}


def validation_error(errors: list[dict]) -> RequestError:
    """The first of pydantic's errors (FastAPI's RequestValidationError) as a 400 naming the field."""
    if not errors:
        return RequestError(400, "the body is not valid", code="invalid_value")
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    param = str(loc[0]) if loc else None
    where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc)) or "the body"
    kind, ctx, got = e.get("type", ""), e.get("ctx") or {}, e.get("input")
    if kind == "value_error":
        message = str(ctx.get("error", e.get("msg", "")))
    elif kind in _WANTS:
        message = f"{where} must be {_WANTS[kind]} (got {_kind(got)})"
    elif kind == "literal_error":
        message = f"{where} must be {ctx.get('expected')} (got {got!r})"
    elif kind == "missing":
        message = f"{where} is required"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = {"greater_than_equal": f"at least {ctx.get('ge')}", "greater_than": f"more than {ctx.get('gt')}",
                 "less_than_equal": f"at most {ctx.get('le')}", "less_than": f"less than {ctx.get('lt')}"}[kind]
        message = f"{where} must be {bound} (got {got!r})"
    elif kind in ("too_long", "too_short"):
        message = f"{where} must hold {'at most' if kind == 'too_long' else 'at least'} " \
                  f"{ctx.get('max_length', ctx.get('min_length'))} items"
    else:
        message = f"{where}: {e.get('msg', 'not valid')}"
    return RequestError(400, message, param=param, code="invalid_value")


def shaped(message: str):
    """A field whose shape errors (a union's, a list's) are one message: `message (got <kind>)`."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"{message} (got {_kind(value)})") from None

    return WrapValidator(check)
