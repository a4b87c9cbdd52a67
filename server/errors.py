"""The OpenAI error envelope, and how every failure becomes one.

`ErrorResponse` is the body ({"error": {message, type, param, code}}) with the HTTP status beside it;
`ProtocolError` is a request the server refuses (raised by the request models and the tokenizer; a ValueError, so
pydantic reports it with the offending field's path); `ApiError` is raised anywhere in a request and answered
with its envelope by the app; `error_response()` turns any validation failure into the envelope, with `param`.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from pydantic import BaseModel, Field

_STATUS_TYPES = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


def type_for_status(status: int) -> str:
    return _STATUS_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def param_path(loc: tuple) -> Optional[str]:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def type_name(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class ProtocolError(ValueError):
    """A request the server refuses. `loc` is the path of the offending field, relative to where it is
    raised (pydantic prepends the field path when raised inside a field validator)."""

    def __init__(self, message: str, *, loc: tuple = (), code: Optional[str] = "invalid_value",
                 status_code: int = 400, type: Optional[str] = None):
        super().__init__(message)
        self.message, self.loc, self.code, self.status_code = message, tuple(loc), code, status_code
        self.type = type or type_for_status(status_code)

    @property
    def param(self) -> Optional[str]:
        return param_path(self.loc)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
    status_code: int = Field(400, exclude=True)  # for the app's HTTP status; never serialised

    @classmethod
    def make(cls, message: str, status_code: int = 400, *, param: Optional[str] = None,
             code: Optional[Union[str, int]] = None, type: Optional[str] = None) -> "ErrorResponse":
        info = ErrorInfo(message=message, type=type or type_for_status(status_code), param=param, code=code)
        return cls(error=info, status_code=status_code)


class ApiError(Exception):
    """Raised anywhere in a request; the app answers with its envelope and status."""

    def __init__(self, error: ErrorResponse):
        super().__init__(error.error.message)
        self.error = error

    @classmethod
    def make(cls, message: str, status_code: int = 400, **kwargs: Any) -> "ApiError":
        return cls(ErrorResponse.make(message, status_code, **kwargs))


def model_not_found(model: str) -> ErrorResponse:
    return ErrorResponse.make(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")


def _describe(err: Mapping[str, Any]) -> tuple[str, Optional[str], Optional[str]]:
    """One pydantic error dict -> (message, param, code)."""
    kind, loc, msg = err.get("type", ""), tuple(err.get("loc", ())), err.get("msg", "")
    if loc and loc[0] == "body":  # FastAPI's RequestValidationError prefixes the body location
        loc = loc[1:]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ProtocolError):
        return cause.message, param_path(loc + cause.loc), cause.code
    if kind == "json_invalid":
        return f"Request body is not valid JSON: {(err.get('ctx') or {}).get('error', msg)}", None, "invalid_json"
    param = param_path(loc)
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        return "Request body must be a JSON object.", None, "invalid_type"
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: '{param}'.", param, "unknown_parameter"
    if kind == "literal_error":
        return f"Invalid value for '{param}': {msg} (got {err.get('input')!r}).", param, "invalid_value"
    if kind.endswith("_type") or kind == "is_instance_of":
        return f"Invalid type for '{param}': {msg} (got {type_name(err.get('input'))}).", param, "invalid_type"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"Invalid value for '{param}': {msg}.", param, "invalid_value"


def error_response(exc: BaseException) -> ErrorResponse:
    """Any request-validation failure -> OpenAI envelope. Accepts pydantic's ValidationError, FastAPI's
    RequestValidationError (anything with `.errors()`), a ProtocolError, or a plain ValueError (400)."""
    if isinstance(exc, ProtocolError):
        return ErrorResponse.make(exc.message, exc.status_code, param=exc.param, code=exc.code, type=exc.type)
    errors = exc.errors() if callable(getattr(exc, "errors", None)) else None
    if not errors:
        return ErrorResponse.make(str(exc) or type(exc).__name__, 400)
    described = [_describe(e) for e in errors]
    message, param, code = described[0]
    if len(described) > 1:
        message += " Also: " + " ".join(m for m, _, _ in described[1:4])
        if len(described) > 4:
            message += f" (and {len(described) - 4} more)"
    return ErrorResponse.make(message, 400, param=param, code=code)

