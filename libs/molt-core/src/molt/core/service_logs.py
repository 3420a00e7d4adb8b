"""Reading a service's log after the fact: its tail, its JSON records, and the line that says why it
failed (the launcher's messages and the end-to-end tests use these)."""

from __future__ import annotations

import json
import re
from pathlib import Path


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (so a failure report shows the cause, e.g. on CI)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def log_records(path: Path, message: str | None = None) -> list[dict[str, object]]:
    """The JSON records of a service's log (Ray and vLLM write plain lines there too), in file order;
    with ``message``, only the records of that message."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and (message is None or record.get("message") == message):
                records.append(record)
    return records


def failure_cause(path: Path, lines: int = 80, last_line: bool = True) -> str:
    """The line of a service's log that most likely says why it failed: the last error-level log
    record's message (with its ``error``/``reason`` field), else the last line of a traceback
    (``SomeError: ...``), else (with ``last_line``) the last line that is not an info or debug
    record; "" when the log is empty or unreadable, or says nothing more."""
    tail = [line.strip() for line in log_tail(path, lines).splitlines() if line.strip()]
    if not tail or tail[0].startswith("(unreadable"):
        return ""
    for line in reversed(tail):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("level") in ("error", "critical"):
                exception = str(record.get("exception") or "").strip().splitlines()
                detail = record.get("error") or record.get("reason") or _exception_line(exception)
                return f"{record.get('message', '')}{': ' + str(detail) if detail else ''}"[:500]
    for line in reversed(tail):
        if TRACEBACK_END.match(line):
            return line[:500]
    if not last_line:
        return ""
    return next((line[:500] for line in reversed(tail) if not ROUTINE_RECORD.match(line)), "")


def _exception_line(exception: list[str]) -> str:
    """A traceback's ``SomeError: ...`` line, with the ``details = ...`` line a gRPC error prints below
    it (its last line is a lone ``>``)."""
    lines = [line.strip() for line in exception]
    ends = [i for i, line in enumerate(lines) if TRACEBACK_END.match(line)]
    if not ends:
        return lines[-1] if lines else ""
    details = next((line for line in lines[ends[-1] :] if line.startswith("details = ")), "")
    return f"{lines[ends[-1]]} {details}".strip()


ROUTINE_RECORD = re.compile(r'^\{.*"level": ?"(info|debug)"')  # a JSON log record of no failure
TRACEBACK_END = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")
