"""gRPC serving shared by every molt service.

Owns the one mapping from molt's domain errors to gRPC status codes (with a
``google.rpc.ErrorInfo`` detail: ``reason``, ``domain`` = service, metadata),
the refusal of requests that do not decode (``RefuseUndecodable``), the aio
server with health checking and reflection, the Prometheus endpoint, and
graceful shutdown (NOT_SERVING on SIGTERM, then ``server.stop(grace)``).
The untyped grpc-health / grpc-status / reflection imports stay in this file.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from prometheus_client import start_http_server

from molt.core.auth import Access
from molt.core.errors import (
    Aborted,
    Backpressure,
    InvalidInput,
    MoltError,
    NotFound,
    TimedOut,
    Unavailable,
    WrongState,
)
from molt.core.stallwatch import StallWatch

log = logging.getLogger(__name__)

STATUS_CODES: dict[type[MoltError], int] = {
    InvalidInput: code_pb2.INVALID_ARGUMENT,
    WrongState: code_pb2.FAILED_PRECONDITION,
    Unavailable: code_pb2.UNAVAILABLE,
    Backpressure: code_pb2.RESOURCE_EXHAUSTED,
    NotFound: code_pb2.NOT_FOUND,
    TimedOut: code_pb2.DEADLINE_EXCEEDED,
    Aborted: code_pb2.ABORTED,
}

F = TypeVar("F", bound=Callable[..., Any])

# A peer that stops answering without closing its connection (a frozen process, a host gone without a
# reset) is found by HTTP/2 pings within a ping interval plus its timeout; without them a call waits for
# its deadline (long for a generation), and a stream for ever. Pings go only while calls are open, also
# when no data flows (a long unary call). gRPC times a ping out after ping_timeout_ms, not after
# keepalive_timeout_ms alone: both are set. Every molt server accepts pings this frequent
# (KEEPALIVE_SERVER): gRPC documents a server default that counts pings under 5 minutes apart without
# data as abuse, which other gRPC versions and clients may enforce.
KEEPALIVE_PING_S = 10
KEEPALIVE = [
    ("grpc.keepalive_time_ms", KEEPALIVE_PING_S * 1000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]
KEEPALIVE_SERVER = [
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_PING_S * 1000 // 2),
    ("grpc.keepalive_permit_without_calls", 1),
]


def _status_for(error: MoltError, domain: str) -> grpc.Status:
    code = next((c for cls, c in STATUS_CODES.items() if isinstance(error, cls)), code_pb2.INTERNAL)
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=domain, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=code, message=error.message, details=[detail]))


async def _abort(context: grpc.aio.ServicerContext, error: BaseException, domain: str, method: str) -> None:
    if not isinstance(error, MoltError):
        log.exception("unexpected error in %s", method, exc_info=error)
        error = MoltError(f"internal error in {method}: {type(error).__name__}: {error}", reason="INTERNAL")
    else:
        log.warning("%s failed: %s", method, error.message, extra={"reason": error.reason})
    await context.abort_with_status(_status_for(error, domain))


def grpc_errors(domain: str) -> Callable[[F], F]:
    """Decorates a servicer method (unary or server-streaming) so domain errors become gRPC statuses."""

    def decorate(method: F) -> F:
        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in method(self, request, context):
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:  # mapped once here; unexpected ones logged with traceback
                    await _abort(context, exc, domain, method.__name__)

            return stream  # type: ignore[return-value]

        @functools.wraps(method)
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await method(self, request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # mapped once here; unexpected ones logged with traceback
                await _abort(context, exc, domain, method.__name__)

        return unary  # type: ignore[return-value]

    return decorate


def error_info(error: grpc.aio.AioRpcError | grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo detail of a failed call (clients branch on ``reason``), or None."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


class _Undecodable:
    """What a request's bytes became when they did not parse as its method's message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Ends a call whose request does not parse as its method's message (garbage, a message cut short,
    a string field that is not UTF-8) with INVALID_ARGUMENT, reason ``UNDECODABLE_REQUEST``. gRPC's own
    answer is UNKNOWN ("Unexpected DecodeError"), which does not say that the caller is at fault.
    Methods that take a stream of requests are left as they are (molt has none)."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.handlers: dict[str, tuple[Any, Any]] = {}  # by method: (gRPC's handler, its lenient copy)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        known = self.handlers.get(details.method)
        if known is None or known[0] is not handler:
            known = (handler, self._lenient(handler, details.method))
            self.handlers[details.method] = known
        return known[1]

    def _lenient(self, handler: Any, method: str) -> Any:
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # DecodeError, or whatever a custom deserializer raises
                return _Undecodable(exc)

        async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
            error = InvalidInput(f"the request does not decode: {request.error}", reason="UNDECODABLE_REQUEST")
            await _abort(context, error, self.domain, method)

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                return await unary(request, context)

            return handler._replace(request_deserializer=deserialize, unary_unary=unary_call)
        stream = handler.unary_stream
        if inspect.isasyncgenfunction(stream):

            async def stream_call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                async for item in stream(request, context):
                    yield item

            return handler._replace(request_deserializer=deserialize, unary_stream=stream_call)

        async def writing_call(request: Any, context: grpc.aio.ServicerContext) -> Any:  # writes with context.write
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            return await stream(request, context)

        return handler._replace(request_deserializer=deserialize, unary_stream=writing_call)


@dataclass
class Registration:
    """One servicer to serve: its ``add_XServicer_to_server`` function and full service name."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    service_name: str


@dataclass
class ServiceHost:
    """An aio gRPC server with health, reflection, a metrics endpoint and an event-loop stall watch."""

    name: str
    listen: str
    registrations: Sequence[Registration]
    max_message_bytes: int = 16 * 1024 * 1024
    metrics_port: int = 0
    grace_s: float = 5.0
    access: Access = field(default_factory=Access)  # the run's token and TLS (molt.core.auth)
    server: grpc.aio.Server = field(init=False)
    health: health.aio.HealthServicer = field(init=False)
    port: int = field(init=False, default=0)
    stall_watch: StallWatch | None = field(init=False, default=None)

    async def start(self) -> int:
        """Binds, starts serving and marks every service SERVING; returns the bound port."""
        options = [
            # gRPC sets SO_REUSEPORT by default: a second server on a taken port would then share it silently.
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            *KEEPALIVE_SERVER,
        ]
        # The token first: a caller without it gets UNAUTHENTICATED before its bytes are even parsed.
        interceptors = [*self.access.interceptors(), RefuseUndecodable(self.name)]
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [r.service_name for r in self.registrations]
        for registration in self.registrations:
            registration.add(registration.servicer, self.server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = self.access.add_port(self.server, self.listen)
        if self.port == 0:
            raise OSError(f"{self.name}: cannot listen on {self.listen}")
        await self.server.start()
        for service in ("", *names):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.metrics_port:
            start_http_server(self.metrics_port, addr=self.listen.rsplit(":", 1)[0] or "127.0.0.1")
        self.stall_watch = StallWatch(self.name)
        self.stall_watch.start()
        if not self.access.token:
            log.warning("serving without authentication: [run] token_file is not set (docs/security.md)")
        extra = {"listen": self.listen, "port": self.port, "metricsPort": self.metrics_port, "tls": self.access.tls}
        log.info("serving", extra=extra)
        return self.port

    async def stop(self) -> None:
        """NOT_SERVING first (load balancers drain), then stop with a grace period."""
        if self.stall_watch is not None:
            self.stall_watch.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)

    async def serve_until_signal(self, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Runs until SIGTERM/SIGINT, then shuts down gracefully and runs ``on_stop``."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down")
        await self.stop()
        if on_stop is not None:
            await on_stop()


def port_taken(address: str) -> bool:
    """Whether ``host:port`` cannot be listened on now (port 0, any free one, never is)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not int(port):
        return False
    host = host.strip("[]") or "0.0.0.0"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no obstacle
        try:
            probe.bind((host, int(port)))
        except OSError:
            return True
    return False


def ports_taken(settings: object) -> list[str]:
    """``"listen: port 50051 is in use ..."`` for each of a service's ``listen`` and ``metrics_port`` that
    another process holds: checked at start, before the slow part (a router's engines), not after it."""
    taken = []
    listen = getattr(settings, "listen", None)
    if isinstance(listen, str) and port_taken(listen):
        taken.append(f"listen: port {listen.rpartition(':')[2]} is in use (another run, or another program)")
    metrics = getattr(settings, "metrics_port", None)
    if isinstance(metrics, int) and port_taken(f"0.0.0.0:{metrics}"):
        taken.append(f"metrics_port: port {metrics} is in use (another run, or another program)")
    return taken
