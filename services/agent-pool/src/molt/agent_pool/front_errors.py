"""How a refused or failed front request leaves: its HTTP status, and an error body its SDK parses.

Refusals (``MoltError``) are logged as warnings in the client's terms (its API's
field names, not the router's); anything else is an internal error, logged with
its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request

from molt.core.errors import InvalidInput, MoltError, NotFound, Unavailable

log = logging.getLogger(__name__)
LEFT_EARLY = "the client left before its reply was ready"


class Unauthorized(MoltError):
    reason = "UNAUTHORIZED"


class TooLarge(MoltError):
    reason = "PAYLOAD_TOO_LARGE"


class ClientLeft(MoltError):
    """The client disconnected before its reply was out: nothing of the turn is recorded."""

    reason = "CLIENT_DISCONNECTED"


# The router's names of request fields that each API names otherwise (the rest are the same, less the prefix).
ROUTER_FIELDS = {
    "openai": {"sample_count": "n", "top_logprob_count": "top_logprobs", "stop_strings": "stop"},
    "anthropic": {"stop_strings": "stop_sequences"},
}
HTTP_STATUS = {InvalidInput: 400, Unauthorized: 401, NotFound: 404, TooLarge: 413, ClientLeft: 499, Unavailable: 503}


async def still_there(request: Request) -> None:
    """Raises ClientLeft when the client has gone: checked right before a plain turn is recorded."""
    if await request.is_disconnected():
        raise ClientLeft(LEFT_EARLY)


def failure(api: str, exc: Exception, what: str) -> tuple[int, dict[str, Any]]:
    """The HTTP status and error body for ``exc`` (called while it is handled), logged: a refusal
    (MoltError) as a warning (a client that left: info), anything else with its traceback."""
    status = next((code for cls, code in HTTP_STATUS.items() if isinstance(exc, cls)), 500)
    if isinstance(exc, MoltError):
        message = _http_names(api, exc.message)
        log.log(
            logging.INFO if isinstance(exc, ClientLeft) else logging.WARNING,
            "front %s refused",
            what,
            extra={"api": api, "status": status, "reason": exc.reason, "error": message},
        )
        return status, error_body(api, status, message)
    log.exception("front %s failed", what, extra={"api": api})
    return status, error_body(api, status, f"internal error: {type(exc).__name__}")


def _http_names(api: str, message: str) -> str:
    """A router refusal in the terms of the client's request: its field names, not the router's."""
    for router_name, name in ROUTER_FIELDS[api].items():
        message = message.replace(f"sampling_params.{router_name}", name)
    return message.replace("sampling_params.", "")


def error_body(api: str, status: int, message: str) -> dict[str, Any]:
    """An error in the shape the API's official SDK parses."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
    }.get(status, "api_error")
    if api == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "code": status}}
