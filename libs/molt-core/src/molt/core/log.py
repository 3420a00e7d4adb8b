"""Structured logs: one JSON object per line on stderr, with run_id and service.

Extra fields passed as ``log.info("msg", extra={...})`` are included.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line; ``context`` (run_id, service, ...) is added to every line."""

    def __init__(self, context: dict[str, Any]) -> None:
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self.context,
        }
        event.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


def setup_logging(service: str, run_id: str, level: str = "INFO") -> None:
    """Routes every logger to one JSON-lines handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter({"service": service, "run_id": run_id}))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
