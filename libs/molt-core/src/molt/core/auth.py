"""Who may talk to a run's services: the run's bearer token, optional TLS, and the Redis password.

A run has one secret, the token in ``[run] token_file`` (``molt up`` writes a fresh one per run, mode
0600, under ``<run_dir>/secrets``). When it is set, every gRPC server of the run refuses a call without
``authorization: Bearer <token>`` metadata with UNAUTHENTICATED before the request is even parsed,
and every client molt opens sends it. Only the standard health check stays open, so that a load
balancer or ``grpc_health_probe`` needs no secret. With ``tls_cert`` and ``tls_key`` the servers speak
TLS; with ``tls_ca`` as well, clients verify the servers against that CA and servers require client
certificates signed by it (mTLS). A file holding a secret must be readable by its owner only: a token
others can read is no secret, and the service refuses to start on it.

No setting here is itself a secret: the config names files, and ``settings.json``, ``config.toml``,
logs and metrics hold only their paths.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import redis
import redis.asyncio as aioredis

from molt.core.errors import ConfigError

log = logging.getLogger(__name__)

# Open without the token: liveness must be checkable by tools that hold no secret.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
HEADER = "authorization"
Options = Sequence[tuple[str, Any]]


def write_token(path: Path) -> None:
    """A fresh random token in ``path`` (mode 0600, its directory 0700), replacing any older one at once
    (a reader never sees a partly written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    os.replace(staged, path)


def store_namespace(token: str | None) -> str:
    """The prefix of every key of the weight group's store (``""`` without a token).

    torch's TCPStore has no authentication: anyone who reaches its port may read and write keys. Derived
    from the token, the prefix keeps the group's keys out of reach of a peer without it: such a peer
    cannot find the broadcaster's go for a refit, rendezvous with the group's ranks, or release a refit
    by writing its ready key. It can still write keys of its own (memory) - the store binds only to
    ``[broadcaster] store_host`` for that reason.
    """
    if not token:
        return ""
    return "molt-" + hmac.new(token.encode(), b"molt weight group", "sha256").hexdigest()[:32] + "/"


def read_secret(path: Path, what: str) -> bytes:
    """The contents of a secret file; ``ConfigError`` when it is missing, empty, or readable by others."""
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{what} {path} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it: a shared secret "
            "is no secret"
        )
    if not data.strip():
        raise ConfigError(f"{what} {path} is empty")
    return data


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncDetails(_CallDetails, grpc.ClientCallDetails):
    """The sync API takes any object with these attributes; it must also be a ``ClientCallDetails``."""


def _with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    return [*(tuple(item) for item in (metadata or ())), (HEADER, f"Bearer {token}")]


class _SyncBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a sync channel."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, details: Any) -> _SyncDetails:
        return _SyncDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self.token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioBearer:
    """Adds the token to the calls of an aio channel. gRPC files each aio interceptor under the first
    kind it is an instance of, so each kind gets its own subclass (``_aio_bearers``)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*_with_token(details.metadata, self.token)))


class _AioUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def _aio_bearers(token: str) -> list[Any]:
    return [kind(token) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but the health check that lacks the run's token, with UNAUTHENTICATED.

    The refusal replaces the method's handler with one of the same kind that takes the raw bytes: an
    unauthenticated caller's request is never parsed, and nothing of the service runs for it.
    """

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        given = next((str(v) for k, v in details.invocation_metadata or () if k == HEADER), "")
        if hmac.compare_digest(given.encode(), self.expected):
            return handler
        log.warning("refused a call without the run's token", extra={"method": details.method})
        return _refusal(handler, "no token" if not given else "wrong token")


def _refusal(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{why}: this service needs the run's bearer token")

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(refuse, response_serializer=handler.response_serializer)  # type: ignore[operator]


@dataclass(frozen=True)
class Access:
    """What one process needs to serve and to call the run's services and its Redis."""

    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    redis_password: str | None = None

    @classmethod
    def of(cls, run: Any) -> Access:
        """From the ``[run]`` table (``molt.core.config.RunSettings``): reads the files it names."""
        token = read_secret(run.token_file, "[run] token_file").decode().strip() if run.token_file else None
        key = read_secret(run.tls_key, "[run] tls_key") if run.tls_key else None
        cert = run.tls_cert.read_bytes() if run.tls_cert else None
        ca = run.tls_ca.read_bytes() if run.tls_ca else None
        if (cert is None) != (key is None):
            raise ConfigError("[run] tls_cert and tls_key go together: set both, or neither")
        password = None
        if run.redis_password_file:
            password = read_secret(run.redis_password_file, "[run] redis_password_file").decode().strip()
        return cls(token, cert, key, ca, password)

    @property
    def tls(self) -> bool:
        return self.cert is not None or self.ca is not None

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The server side: the token check when the run has a token."""
        return [TokenCheck(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, listen: str) -> int:
        """Binds ``listen`` with TLS when the run has a certificate; returns the port (0: failed)."""
        if self.cert is None or self.key is None:
            return server.add_insecure_port(listen)
        credentials = grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.ca is not None
        )
        return server.add_secure_port(listen, credentials)

    def _credentials(self) -> grpc.ChannelCredentials:
        mutual = self.ca is not None and self.cert is not None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca or self.cert,
            private_key=self.key if mutual else None,
            certificate_chain=self.cert if mutual else None,
        )

    def channel(self, address: str, options: Options = ()) -> grpc.Channel:
        """A sync channel to one of the run's services that sends the token."""
        options = list(options)
        raw = (
            grpc.secure_channel(address, self._credentials(), options)
            if self.tls
            else grpc.insecure_channel(address, options)
        )
        return grpc.intercept_channel(raw, _SyncBearer(self.token)) if self.token else raw

    def aio_channel(self, address: str, options: Options = ()) -> grpc.aio.Channel:
        """An aio channel to one of the run's services that sends the token."""
        interceptors = _aio_bearers(self.token) if self.token else None
        if self.tls:
            return grpc.aio.secure_channel(address, self._credentials(), list(options), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, list(options), interceptors=interceptors)

    def redis(self, url: str, **kwargs: Any) -> redis.Redis:
        """A client of the run's Redis, with its password when the run has one."""
        if self.redis_password is not None:
            kwargs.setdefault("password", self.redis_password)
        return redis.Redis.from_url(url, **kwargs)

    def aio_redis(self, url: str, **kwargs: Any) -> aioredis.Redis:
        if self.redis_password is not None:
            kwargs.setdefault("password", self.redis_password)
        return aioredis.Redis.from_url(url, **kwargs)
