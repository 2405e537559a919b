"""Errors a client can see, in OpenAI's or Anthropic's shape.

Every failure a client can fix is a 4xx with a message that says what to change; anything else is
a 500 that carries the request id under which the traceback was logged.
"""

from __future__ import annotations

import json
from typing import Any, Optional

# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


class APIError(Exception):
    """An HTTP error answered as JSON; ``param`` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: Optional[str] = None,
        code: Optional[str] = None,
        param: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or default_type(status)
        self.headers = headers or {}
        self.anthropic_message: Optional[str] = None  # when Anthropic clients expect other words


def default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_overflow(prompt_tokens: int, max_context: int, param: str = "messages") -> APIError:
    """A prompt that does not fit the context, in the words clients match on (litellm's and Claude
    Code's fallbacks): OpenAI's sentence with code ``context_length_exceeded``, Anthropic's
    "prompt is too long". The answer needs one position, so the longest prompt is one less."""
    err = APIError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, your messages "
        f"resulted in {prompt_tokens} tokens. Shorten the prompt to at most {max_context - 1} "
        "tokens (the answer needs room).",
        code="context_length_exceeded",
        param=param,
    )
    err.anthropic_message = f"prompt is too long: {prompt_tokens} tokens > {max_context - 1} maximum"
    return err


def openai_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def anthropic_body(err: APIError) -> dict:
    return {
        "type": "error",
        "error": {
            "type": _ANTHROPIC_TYPES.get(err.status, "api_error"),
            "message": err.anthropic_message or err.message,
        },
    }


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(err: APIError, path: str) -> dict:
    return anthropic_body(err) if is_anthropic_path(path) else openai_body(err)


def error_bytes(err: APIError, path: str) -> bytes:
    return json.dumps(error_body(err, path)).encode()


def param_from_loc(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a request path: ('messages', 0, 'content') -> messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            part in ("str", "int", "float", "bool")
            or "[" in str(part)
            or str(part).startswith(("list", "dict", "function-", "literal"))
        ):
            continue  # union member tags added by pydantic, not request fields
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def describe_validation_error(errors: list[dict]) -> APIError:
    """One 400 from pydantic's errors: the first problem, named by its field path."""
    # Prefer the error that is not a union alternative's type mismatch, when there is one.
    first = errors[0]
    param = param_from_loc(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    kind = first.get("type", "")
    if kind == "missing":
        message = f"missing required field '{param}'"
    elif kind == "extra_forbidden":
        message = f"unknown field '{param}'"
    else:
        given = first.get("input")
        shown = json.dumps(given)[:80] if _jsonable(given) else type(given).__name__
        message = f"invalid value for '{param}': {msg} (got {shown})"
    if len(errors) > 1:
        message += f"; {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in the request"
    return APIError(
        400, message, param=param, code="invalid_value" if kind != "missing" else "missing_required_parameter"
    )


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
