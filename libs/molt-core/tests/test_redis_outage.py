"""Waiting out a real Redis going away and coming back (a redis-server of this test's own)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from molt.core.errors import Unavailable
from molt.core.processes import RedisServer
from molt.core.redis_outage import RedisOutage


def test_a_call_waits_out_a_restart_and_gives_up_past_its_budget(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    # No retries of redis-py's own (its default rides out a few seconds), so the outage reaches the caller.
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    client.set("kept", "1")
    port = server.port
    server.stop()
    restart = threading.Timer(1.5, server.start, kwargs={"port": port})
    restart.start()
    try:
        outage = RedisOutage(budget_s=60)
        assert outage.call("reading a key", client.get, "kept") == b"1"  # the append-only file kept it
        assert outage.outages == 1
        assert outage.call("reading a key", client.get, "kept") == b"1" and outage.outages == 1
        server.stop()
        with pytest.raises(Unavailable, match=r"stayed unreachable .* while reading a key"):
            RedisOutage(budget_s=0.5).call("reading a key", client.get, "kept")
    finally:
        restart.join()
        server.stop()


def test_errors_redis_answered_are_not_retried(redis_client: redis.Redis) -> None:
    redis_client.set("text", "x")
    calls = []

    def wrong_type() -> object:
        calls.append(1)
        return redis_client.lpush("text", "y")

    with pytest.raises(redis.ResponseError):
        RedisOutage(budget_s=60).call("pushing", wrong_type)
    assert calls == [1]
