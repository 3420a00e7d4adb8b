"""Test support shared by every molt test suite (loaded as the pytest plugin ``molt.core.testing``).

``RedisServer`` (a real ``redis-server`` on a free loopback port) and
``ServiceProcess`` (a molt service as a child process, ready at its health
check) live in ``molt.core.processes`` and are re-exported here; both end
exactly the processes they started. Fixtures: one Redis server per session plus a flushed database per
test, and the tiny model built once per session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from molt.core.processes import RedisServer, ServiceProcess, free_port
from molt.core.tiny_model import build

__all__ = ["RedisServer", "ServiceProcess", "free_port", "redis_client", "redis_server", "tiny_model"]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the test session."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the session's server, on a database flushed before each test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model and tokenizer (seed 0), built once per test session."""
    return build(tmp_path_factory.mktemp("models") / "tiny", seed=0)
