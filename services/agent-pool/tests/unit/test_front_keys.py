"""The front's key check: a key that is not the session's, whatever its bytes, gets 401 in the API's shape."""

from __future__ import annotations

from fastapi.testclient import TestClient

from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.front import ChatFront


def test_a_key_that_is_not_ascii_gets_401_not_500() -> None:
    """Header values arrive as latin-1 text; compared as str, a non-ASCII one raised TypeError (HTTP 500)."""
    front = ChatFront(None, None, TurnLimits(8, 512))  # type: ignore[arg-type]  # refused before any use
    session = front.open_session()
    with TestClient(front.app) as client:
        for path, headers in (
            ("/v1/chat/completions", {"authorization": b"Bearer cl\xe9"}),
            ("/v1/messages", {"x-api-key": b"\xff\xfe"}),
            ("/v1/messages", {"x-api-key": b"wrong"}),
        ):
            reply = client.post(f"/s/{session.id}{path}", headers=headers, content=b"{}")
            error = reply.json()["error"]
            assert reply.status_code == 401 and error["type"] == "authentication_error", reply.text
