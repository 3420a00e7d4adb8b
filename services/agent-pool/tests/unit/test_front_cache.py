"""The replies a front session keeps for identical retries: bounded in count and in bytes."""

from __future__ import annotations

from molt.agent_pool.front import CACHE_BYTES, CACHE_SIZE, ChatFront, Session
from molt.agent_pool.transcript import Transcript


def test_the_retry_cache_keeps_the_newest_replies_within_its_count_and_bytes() -> None:
    session = Session("s", "k", Transcript(None))
    for i in range(CACHE_SIZE + 3):
        ChatFront._cache(session, f"small-{i}", b"{}")
    assert list(session.cache) == [f"small-{i}" for i in range(3, CACHE_SIZE + 3)]
    third = CACHE_BYTES // 3
    for i in range(3):  # streamed replies: lists of SSE lines
        ChatFront._cache(session, f"big-{i}", ["x" * third])
    assert "big-0" in session.cache and sum(1 for d in session.cache if d.startswith("small")) <= CACHE_SIZE - 3
    ChatFront._cache(session, "big-3", ["x" * third])  # four thirds: the oldest big one goes, with the small ones
    assert [d for d in session.cache if d.startswith("big")] == ["big-1", "big-2", "big-3"]
    ChatFront._cache(session, "huge", ["x" * (2 * CACHE_BYTES)])  # over the bound alone: kept, alone
    assert list(session.cache) == ["huge"]
