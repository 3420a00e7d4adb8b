"""Local child processes that molt starts and must end: services, an embedded Redis, helpers.

``ChildProcess`` starts a command in its own session (so a terminal's Ctrl-C
reaches only the parent, which stops its children in order) with stdout and
stderr appended to a log file. ``stop`` sends SIGTERM to the leader (its
graceful shutdown, which may coordinate its own children), waits, then SIGKILLs
the leader and every process still in its session, so nothing outlives it.
``ServiceProcess`` adds the wait for a gRPC health check; ``RedisServer`` runs
``redis-server`` on a free loopback port. The test fixtures (``molt.core.testing``)
and the launcher (``molt up``) both use these. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from molt.core.auth import Access
from molt.core.ports import free_port
from molt.core.service_logs import log_tail


def ensure_ray_auth_token(ray_cli: str) -> None:
    """Makes sure a Ray auth token exists before a ``ray start`` head: that head turns token auth on,
    and clients (run with ``RAY_AUTH_MODE=token``) must find the same token. Generates
    ``~/.ray/auth_token`` with ``ray get-auth-token --generate`` when no token is configured."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    configured = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if Path(configured or Path.home() / ".ray" / "auth_token").expanduser().exists():
        return
    subprocess.run([ray_cli, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=120)


def start_ray_head(
    ray_cli: str,
    log_path: Path,
    *,
    num_cpus: int,
    num_gpus: int = 0,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    nice: int = 0,
) -> tuple[ChildProcess, str, Path]:
    """A Ray head of its own (``ray start --head --block``: ending its session ends Ray) with a
    private temp dir (so the ``ray_current_cluster`` of other Ray instances here is not touched) and
    free ports for its side servers. Returns the head, its address and its temp dir; stops it and
    raises ``RuntimeError`` when it does not come up (and stops it on any interruption). ``nice``: the
    scheduling niceness of the head and so of every Ray worker it starts."""
    ensure_ray_auth_token(ray_cli)
    port = port or free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="molt-ray-"))  # short: Ray's unix sockets live under it
    args = [ray_cli, "start", "--head", "--block", "--port", str(port)]
    args += ["--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus)]
    args += ["--disable-usage-stats", "--include-dashboard", "false", "--temp-dir", str(temp_dir)]
    for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port", "--metrics-export-port"):
        args += [flag, str(free_port())]  # their defaults are fixed ports another Ray may hold
    head = ChildProcess(args, log_path, env, nice)
    process = head.spawn()
    try:
        deadline = time.monotonic() + timeout_s
        while not (temp_dir / "ray_current_cluster").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start; {log_path} ends with:\n{log_tail(log_path)}")
            time.sleep(0.5)
    except BaseException:
        head.stop(timeout_s=10)
        raise
    return head, f"127.0.0.1:{port}", temp_dir


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.rsplit(")", 1)[1].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid apart from a reused one), or None."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def is_running(pid: int, ticks: int | None = None) -> bool:
    """Whether ``pid`` is a live (not zombie) process, and the same one that started at ``ticks`` if given."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return ticks is None or int(fields[19]) == ticks


def session_members(session_id: int) -> list[int]:
    """Live pids whose session id is ``session_id`` (a child started with ``start_new_session``
    has session id = its pid, and its descendants keep it unless they call setsid themselves)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == session_id:
            members.append(int(entry.name))
    return members


def kill_session(session_id: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILLs every live process of the session and waits (up to ``timeout_s``) until none is
    left running (SIGKILL is delivered asynchronously); returns the pids signalled."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while members := session_members(session_id):
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return killed


AUTOGROUPS = Path("/proc/sys/kernel/sched_autogroup_enabled")


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Sets the nice value of ``pid``'s scheduling autogroup (its session's, where the kernel groups
    sessions); False where it does not or the value cannot be set."""
    try:
        if AUTOGROUPS.read_text().strip() != "1":
            return False
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        return False
    return True


class ChildProcess:
    """A command run in its own session, its output appended to ``log_path``; with ``nice`` > 0 at that
    lower scheduling priority: ``nice -n`` (the command keeps its own pid; its children inherit it) and,
    where the kernel groups each session for scheduling (autogroup), the session's group too, since
    there a process's nice value only ranks it against the processes of its own session."""

    def __init__(
        self, args: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, nice: int = 0
    ) -> None:
        self.nice = nice
        self.args = ["nice", "-n", str(nice), *args] if nice else list(args)
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def spawn(self) -> subprocess.Popen[bytes]:
        """Starts the command (session id = its pid) and returns the handle."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        if self.nice:
            set_autogroup_nice(self.process.pid, self.nice)
        return self.process

    def stop(self, timeout_s: float = 60.0, sig: int = signal.SIGTERM) -> int | None:
        """``sig`` to the leader, SIGKILL after ``timeout_s``; then SIGKILL what is left of its session.
        Returns the leader's exit code (None if it was not started)."""
        if self.process is None:
            return None
        process, self.process = self.process, None
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        kill_session(process.pid)
        return process.returncode


class ServiceProcess(ChildProcess):
    """A service started as a child process, ready once its gRPC health check says SERVING."""

    def __init__(
        self,
        args: Sequence[str],
        address: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        service: str = "",
    ) -> None:
        super().__init__(args, log_path, env)
        self.address = address
        self.service = service  # the health-checked service name: proves the right server answers

    def start(self, timeout_s: float = 300.0) -> None:
        """Starts the process and waits until it serves; stops it and raises if it does not."""
        process = self.spawn()
        try:
            wait_serving(self.address, self.service, timeout_s, process)
        except RuntimeError as exc:
            self.stop(timeout_s=10)
            raise RuntimeError(
                f"{self.args[:3]}: {exc}; {self.log_path} ends with:\n{log_tail(self.log_path)}"
            ) from exc


def wait_serving(
    address: str,
    service: str,
    timeout_s: float,
    process: subprocess.Popen[bytes] | None = None,
    access: Access | None = None,
) -> None:
    """Polls ``address``'s health check until ``service`` is SERVING; raises ``RuntimeError`` when
    ``process`` exits first or ``timeout_s`` passes. ``access``: the run's TLS (the check needs no token)."""
    deadline = time.monotonic() + timeout_s
    with (access or Access()).channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"exited with {process.returncode} before serving")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"not serving at {address} after {timeout_s} s")


def health_status(address: str, service: str = "", timeout_s: float = 2.0, access: Access | None = None) -> str:
    """One health check: 'SERVING', 'NOT_SERVING', ... or 'UNREACHABLE'."""
    with (access or Access()).channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1 with its data in ``data_dir``.

    With ``password`` one ACL user, ``molt``, must AUTH with the password and may touch only keys and
    channels under ``key_prefix`` and no administrative command (the ``@dangerous`` category: CONFIG,
    FLUSHALL, DEBUG, ...). The ACL file holds the password's SHA-256, not the password. The default
    user has the same rules and a password nobody holds.
    """

    USER = "molt"

    def __init__(
        self, data_dir: Path, *, appendonly: bool = False, password: str | None = None, key_prefix: str = "molt:"
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server; .ci/run does this)")
        self.binary = binary
        self.data_dir = data_dir
        self.appendonly = appendonly
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.password = password
        data_dir.mkdir(parents=True, exist_ok=True)
        self.acl_file = data_dir / "users.acl"
        if password is not None:
            digest = hashlib.sha256(password.encode()).hexdigest()
            self.acl_file.unlink(missing_ok=True)
            fd = os.open(self.acl_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            rules = f"~{key_prefix}* &{key_prefix}* +@all -@dangerous"
            # The default user stays on, with the same rules and a password nobody knows (drawn here and
            # never kept): redis-server replays its append-only file as the default user and checks each
            # MULTI/EXEC there against that user's rules. With the default user off, every Lua script's
            # writes (the queue's acks, skips and dead letters) were silently refused on a restart.
            unknown = hashlib.sha256(secrets.token_bytes(32)).hexdigest()
            with os.fdopen(fd, "w") as out:
                out.write(f"user default on #{unknown} {rules}\n")
                out.write(f"user {self.USER} on #{digest} {rules}\n")

    @property
    def url(self) -> str:
        user = f"{self.USER}@" if self.password is not None else ""
        return f"redis://{user}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        if self.password is None:
            return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)
        return redis.Redis(
            host="127.0.0.1", port=self.port, username=self.USER, password=self.password, socket_timeout=30
        )

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
            if self.password is not None:
                args += ["--aclfile", str(self.acl_file)]
            self.process = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
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
