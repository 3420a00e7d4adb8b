"""The few typed errors molt's domain code raises.

Services map them to gRPC status codes in one place (``molt.core.serve``);
each carries a machine-readable ``reason`` (``ErrorInfo.reason``) that clients
branch on instead of the message text.
"""

from __future__ import annotations


class MoltError(Exception):
    """Base of molt's domain errors: an actionable message plus a stable reason."""

    reason = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata = metadata or {}


class ConfigError(MoltError):
    """A setting or recipe is invalid; the message names the key and value."""

    reason = "INVALID_CONFIG"


class InvalidInput(MoltError):
    """A request or payload is malformed (maps to INVALID_ARGUMENT)."""

    reason = "INVALID_ARGUMENT"


class WrongState(MoltError):
    """The call is valid but not now (maps to FAILED_PRECONDITION)."""

    reason = "FAILED_PRECONDITION"


class ConsumerNameTaken(WrongState):
    """Another queue reader holds this reader's consumer name (``molt.core.consumer_claim``): a reader
    that catches it stops without acknowledging anything, rather than handle it like another WrongState."""

    reason = "CONSUMER_NAME_TAKEN"


class Unavailable(MoltError):
    """A dependency (engine, Redis, peer) cannot be reached (maps to UNAVAILABLE)."""

    reason = "UNAVAILABLE"


class Backpressure(MoltError):
    """A bounded resource is full; retry later (maps to RESOURCE_EXHAUSTED)."""

    reason = "BACKPRESSURE"


class NotFound(MoltError):
    """An id is unknown (maps to NOT_FOUND)."""

    reason = "NOT_FOUND"


class TimedOut(MoltError):
    """A bounded wait ran out (maps to DEADLINE_EXCEEDED)."""

    reason = "TIMED_OUT"


class Aborted(MoltError):
    """A concurrent operation won a race; retry the whole operation (maps to ABORTED)."""

    reason = "ABORTED"
