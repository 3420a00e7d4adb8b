"""Test support shared by every molt test suite (loaded as the pytest plugin ``molt.core.testing``).

``RedisServer`` starts a real ``redis-server`` on a free loopback port;
``ServiceProcess`` starts a molt service (or any gRPC server) as a child
process and waits for its health check. Both end exactly the process they
started. Fixtures: one Redis server per session plus a flushed database per
test, and the tiny model built once per session.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from molt.core.tiny_model import build


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the caller retries if it is taken before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1 with its data in ``data_dir``."""

    def __init__(self, data_dir: Path, *, appendonly: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server; .ci/run does this)")
        self.binary = binary
        self.data_dir = data_dir
        self.appendonly = appendonly
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)

    def start(self, port: int | None = None) -> None:
        """Starts the server (on ``port`` if given, else a free one) and waits until it answers PING."""
        for _ in range(5):
            self.port = port or free_port()
            args = [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--save",
                "",
                "--daemonize",
                "no",
                "--logfile",
                str(self.data_dir / "redis.log"),
            ]
            if self.appendonly:
                args += ["--appendonly", "yes", "--appendfsync", "always"]
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return
            self.stop()
            if port is not None:
                break
        raise RuntimeError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def _wait_ready(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return False
            try:
                if self.client().ping():
                    return True
            except redis.ConnectionError:
                time.sleep(0.02)
        return False

    def stop(self) -> None:
        """Ends the process this object started (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def kill(self) -> None:
        """Ends the process abruptly (SIGKILL), as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


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


class ServiceProcess:
    """A service started as a child process, ready once its gRPC health check says SERVING."""

    def __init__(
        self, args: Sequence[str], address: str, log_path: Path, env: dict[str, str] | None = None, service: str = ""
    ) -> None:
        self.args = list(args)
        self.address = address
        self.service = service  # the health-checked service name: proves the right server answers
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.args[:3]} exited with {self.process.returncode}; see {self.log_path}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=self.service), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.args[:3]} not serving after {timeout_s} s; see {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process is None:
            return None
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process = None
        return code


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model and tokenizer (seed 0), built once per test session."""
    return build(tmp_path_factory.mktemp("models") / "tiny", seed=0)
