"""The run's token, TLS and Redis ACL (``molt.core.auth``), against real gRPC servers and a real
redis-server on loopback.

The served WeightService here is a stand-in, named as such (its methods answer fixed values): what is
under test is the server's token check and the clients' channels, which every molt service shares
(``ServiceHost``); each real service's refusal is checked in ``tests/e2e``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from molt.core.auth import Access, read_secret, write_token
from molt.core.config import RunSettings
from molt.core.errors import ConfigError
from molt.core.processes import RedisServer
from molt.core.queue import TrajectoryQueue
from molt.core.serve import Registration, ServiceHost
from molt.core.testing import tls_certificate, trajectory_group
from molt.v1 import weights_pb2, weights_pb2_grpc

NAME = weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name


class StandInWeights(weights_pb2_grpc.WeightServiceServicer):  # a stand-in: fixed answers, counts its calls
    def __init__(self) -> None:
        self.calls = 0

    async def GetPolicyVersion(self, request: Any, context: Any) -> weights_pb2.GetPolicyVersionResponse:
        self.calls += 1
        reply = weights_pb2.GetPolicyVersionResponse()
        reply.policy_version.version = 7
        return reply

    async def WatchPolicyVersion(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.calls += 1
        message = weights_pb2.WatchPolicyVersionResponse()
        message.policy_version.version = 7
        yield message


def token_access(tmp_path: Path, **run: Any) -> Access:
    write_token(tmp_path / "secrets" / "token")
    return Access.of(RunSettings(token_file=tmp_path / "secrets" / "token", **run))


async def calls(access: Access, server: Access, service: StandInWeights) -> dict[str, str]:
    """Each kind of call through a channel of ``access`` to a host serving with ``server``: its status."""
    host = ServiceHost("stand-in", "127.0.0.1:0", [Registration(
        weights_pb2_grpc.add_WeightServiceServicer_to_server, service, NAME)], access=server)  # fmt: skip
    port = await host.start()
    seen: dict[str, str] = {}
    try:
        async with access.aio_channel(f"127.0.0.1:{port}") as channel:
            stub = weights_pb2_grpc.WeightServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            checks = {
                "unary": stub.GetPolicyVersion(weights_pb2.GetPolicyVersionRequest(), timeout=10),
                "stream": _first(stub.WatchPolicyVersion(weights_pb2.WatchPolicyVersionRequest(), timeout=10)),
                "health": health.Check(health_pb2.HealthCheckRequest(service=NAME), timeout=10),
            }
            for kind, call in checks.items():
                try:
                    await call
                    seen[kind] = "OK"
                except grpc.aio.AioRpcError as exc:
                    seen[kind] = exc.code().name
        with access.channel(f"127.0.0.1:{port}") as sync:  # the sync client (the learner's, the launcher's)
            try:
                await asyncio.to_thread(
                    weights_pb2_grpc.WeightServiceStub(sync).GetPolicyVersion,
                    weights_pb2.GetPolicyVersionRequest(),
                    timeout=10,
                )
                seen["sync"] = "OK"
            except grpc.RpcError as exc:
                seen["sync"] = exc.code().name  # type: ignore[attr-defined]
    finally:
        await host.stop()
    return seen


async def _first(call: Any) -> Any:
    async for message in call:
        return message
    return None


def test_calls_without_the_token_are_refused_and_reach_nothing(tmp_path: Path) -> None:
    server = token_access(tmp_path / "a")
    other = token_access(tmp_path / "b")
    service = StandInWeights()
    refused = asyncio.run(calls(Access(), server, service))
    wrong = asyncio.run(calls(other, server, service))
    assert (
        refused
        == wrong
        == {"unary": "UNAUTHENTICATED", "stream": "UNAUTHENTICATED", "health": "OK", "sync": "UNAUTHENTICATED"}
    )
    assert service.calls == 0  # the servicer never ran for them
    assert asyncio.run(calls(server, server, service)) == dict.fromkeys(("unary", "stream", "health", "sync"), "OK")
    assert service.calls == 3


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "token"
    write_token(path)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert len(read_secret(path, "token").strip()) >= 32
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        Access.of(RunSettings(token_file=path))
    path.write_text("\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="empty"):
        Access.of(RunSettings(token_file=path))


def test_mutual_tls_with_the_token(tmp_path: Path) -> None:
    _, ca_path, ca_key, ca = tls_certificate(tmp_path, "ca")
    server_key, server_cert, _, _ = tls_certificate(tmp_path, "server", (ca_key, ca))
    client_key, client_cert, _, _ = tls_certificate(tmp_path, "client", (ca_key, ca))
    _, stranger_cert, _, _ = tls_certificate(tmp_path, "stranger")  # self-signed: not the run's CA
    server = token_access(tmp_path, tls_cert=server_cert, tls_key=server_key, tls_ca=ca_path)
    client = token_access(tmp_path / "c", tls_cert=client_cert, tls_key=client_key, tls_ca=ca_path)
    client = Access(server.token, client.cert, client.key, client.ca)
    service = StandInWeights()
    assert asyncio.run(calls(client, server, service)) == dict.fromkeys(("unary", "stream", "health", "sync"), "OK")
    # No client certificate, or one the run's CA did not sign: the handshake fails, even the health check.
    no_cert = Access(server.token, None, None, ca_path.read_bytes())
    stranger = Access(server.token, stranger_cert.read_bytes(), client.key, ca_path.read_bytes())
    for access in (no_cert, stranger, Access(server.token)):
        assert set(asyncio.run(calls(access, server, service)).values()) == {"UNAVAILABLE"}


def test_the_embedded_redis_lets_only_the_run_user_touch_the_runs_keys(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", password="s3cret-token", key_prefix="molt:run-a:")
    server.start()
    try:
        assert "s3cret-token" not in (tmp_path / "redis" / "users.acl").read_text()
        assert (tmp_path / "redis" / "users.acl").stat().st_mode & 0o777 == 0o600
        anonymous = redis.Redis(port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        wrong = redis.Redis.from_url(server.url, password="guess")
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        client = Access(redis_password="s3cret-token").redis(server.url)
        queue = TrajectoryQueue(client, "run-a", consumer="learner-0")
        group = trajectory_group(run_id="run-a")
        assert queue.put(group).entry_id is not None
        assert [e.group.group_id for e in queue.read(count=4)] == [group.group_id]
        with pytest.raises(redis.exceptions.NoPermissionError):
            TrajectoryQueue(client, "run-b").put(trajectory_group(run_id="run-b"))  # another run's keys
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
    finally:
        server.stop()


def test_the_embedded_redis_keeps_script_writes_across_a_crash(tmp_path: Path) -> None:
    """The queue settles entries in Lua scripts, which the append-only file records as MULTI/EXEC; a
    redis-server replays that file as its default user, so a default user that may not run them lost
    every ack, skip and dead letter on a restart (and the producer's pacing with them)."""
    server = RedisServer(tmp_path / "redis", appendonly=True, password="s3cret-token", key_prefix="molt:run-a:")
    server.start()
    try:
        client = Access(redis_password="s3cret-token").redis(server.url)
        queue = TrajectoryQueue(client, "run-a", consumer="learner-0")
        groups = [trajectory_group(run_id="run-a") for _ in range(3)]
        for group in groups:
            queue.put(group)
        entries = queue.read(count=3)
        queue.skip([entries[0].entry_id])
        queue.ack([entries[1].entry_id])
        before = (queue.skipped(), queue.stats())
        port = server.port
        server.kill()
        server.start(port)
        client = Access(redis_password="s3cret-token").redis(server.url)
        after = TrajectoryQueue(client, "run-a")  # a reader: the first one still holds the consumer name
        assert (after.skipped(), after.stats()) == before
        assert before[0] == 1 and before[1].depth == 1
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()  # the default user is on, but nobody has its password
    finally:
        server.stop()
