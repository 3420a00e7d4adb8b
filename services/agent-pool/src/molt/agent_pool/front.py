"""The HTTP front: where a ChatAgent's OpenAI and Anthropic requests enter the agent-pool.

Each episode gets a session (``sessions``): its own base URL (``/s/<session>/v1``)
and key (``Authorization: Bearer`` or ``x-api-key``). A request is checked here
(its key; its body: JSON, at most ``max_body_bytes``, else HTTP 413), waits for its
session's earlier turns, is answered from the session's cache when it is an
identical retry, and otherwise goes to ``openai_api`` or ``anthropic_api``; a client
that leaves meanwhile cancels it. Errors leave as the SDKs parse them (``front_errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import secrets
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from molt.agent_pool import anthropic_api, metrics, openai_api
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.front_errors import LEFT_EARLY, ClientLeft, TooLarge, Unauthorized, failure
from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.sessions import Session
from molt.agent_pool.streams import SessionStream
from molt.agent_pool.transcript import Transcript
from molt.core.errors import InvalidInput, NotFound

T = TypeVar("T")
DISCONNECT_POLL_S = 0.5  # how often a turn still generating asks whether its client is still there
Handler = Callable[[Session, dict[str, Any], str, Request], Awaitable[Response]]


class ChatFront:
    """The sessions of the running ChatAgent episodes, plus the FastAPI app serving them."""

    def __init__(
        self, tokenizer: Any, router: RouterClient, limits: TurnLimits, max_body_bytes: int = 4 * 1024 * 1024
    ) -> None:
        self.tokenizer = tokenizer
        self.router = router
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        # Plans run in worker threads on this tokenizer: a truncation or padding setting left in its
        # tokenizer.json would be switched off by the first encode, which needs it to itself.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend.no_truncation()
            backend.no_padding()
        self.sessions: dict[str, Session] = {}
        self.app = FastAPI(title="molt agent-pool front")
        self.app.post("/s/{session_id}/v1/chat/completions")(self.chat_completions)
        self.app.post("/s/{session_id}/v1/messages")(self.messages)
        self._http: dict[bool, tuple[Any, Any]] = {}

    async def chat_completions(self, session_id: str, request: Request) -> Response:
        handler = functools.partial(openai_api.chat_completions, self.router, self.limits)
        return await self._guard("openai", session_id, request, handler)

    async def messages(self, session_id: str, request: Request) -> Response:
        handler = functools.partial(anthropic_api.messages, self.router, self.limits)
        return await self._guard("anthropic", session_id, request, handler)

    def sdk_http_clients(self, blocking: bool = False) -> tuple[Any, Any]:
        """The HTTP clients every episode's SDK clients share (``run_chat_episode``): openai's and
        anthropic's, each of the kind its SDK needs; ``blocking``: the sync ones, for agents whose
        ``run`` is a plain method (httpx's sync client may be shared between threads). A fresh SDK
        client per episode would build its own connection pool and TLS context each time. The front
        is plain HTTP on loopback, so no certificates are loaded."""
        if blocking not in self._http:
            import anthropic  # the official SDKs, as the ChatAgents get them
            import openai

            options: dict[str, Any] = {"verify": False, "timeout": 600.0}
            if blocking:
                self._http[blocking] = (openai.DefaultHttpxClient(**options), anthropic.DefaultHttpxClient(**options))
            else:
                self._http[blocking] = (
                    openai.DefaultAsyncHttpxClient(**options),
                    anthropic.DefaultAsyncHttpxClient(**options),
                )
        return self._http[blocking]

    async def aclose(self) -> None:
        """Closes the shared SDK HTTP clients (call once the front is no longer used)."""
        for blocking, clients in self._http.items():
            for client in clients:
                if blocking:
                    client.close()
                else:
                    await client.aclose()
        self._http.clear()

    def open_session(self) -> Session:
        session = Session(uuid.uuid4().hex, secrets.token_urlsafe(24), Transcript(self.tokenizer))
        self.sessions[session.id] = session
        return session

    def close_session(self, session_id: str) -> Session:
        """Ends the session: a turn still running (the agent returned without waiting for it) is aborted
        when streamed and, either way, not recorded: the episode is what the agent saw."""
        session = self.sessions.pop(session_id)
        session.closed = True
        for task in session.streams:
            task.cancel()
        return session

    async def _guard(self, api: str, session_id: str, request: Request, handler: Handler) -> Response:
        """Runs ``handler`` on the request's session, its lock held, unless the request is an identical
        retry (its cached reply, nothing recorded); any error becomes the API's error response."""
        try:
            session, body, digest = await self._session(session_id, request)
            await session.lock.acquire()
            handed_over = False  # to a streamed turn's task, which releases it
            try:
                if digest in session.cache:  # an identical retry: same reply, nothing recorded
                    cached = session.cache[digest]
                    metrics.FRONT_REQUESTS.labels(api, "200").inc()
                    if isinstance(cached, list):
                        return StreamingResponse(iter(cached), media_type="text/event-stream")
                    return Response(cached, media_type="application/json")
                response = await _unless_client_leaves(request, handler(session, body, digest, request))
                handed_over = isinstance(response, SessionStream)
                metrics.FRONT_REQUESTS.labels(api, str(response.status_code)).inc()
                return response
            finally:
                if not handed_over:
                    session.lock.release()
        except Exception as exc:
            status, error = failure(api, exc, "request")
            metrics.FRONT_REQUESTS.labels(api, str(status)).inc()
            return JSONResponse(error, status_code=status)

    async def _session(self, session_id: str, request: Request) -> tuple[Session, dict[str, Any], str]:
        """The request's session (its key checked), its JSON body and the digest retries are known by."""
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r} (is the episode over?)")
        auth = request.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() or request.headers.get("x-api-key", "")
        if not secrets.compare_digest(key.encode(), session.key.encode()):  # as str, non-ASCII raises TypeError
            raise Unauthorized("missing or wrong API key for this session")
        try:
            body = json.loads(await self._body(request))
        except (ValueError, RecursionError) as exc:
            raise InvalidInput(f"request body is not JSON: {str(exc)[:200]}") from exc
        if not isinstance(body, dict):
            raise InvalidInput("request body must be a JSON object")
        digest = hashlib.sha256(f"{request.url.path}\0{json.dumps(body, sort_keys=True)}".encode()).hexdigest()
        return session, body, digest

    async def _body(self, request: Request) -> bytes:
        """The request's body, read no further than ``max_body_bytes``."""
        declared = request.headers.get("content-length", "")
        too_large = TooLarge(f"request body over {self.max_body_bytes} bytes ([agent_pool] http_max_body_bytes)")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect as exc:
            raise ClientLeft("the client left while sending its request") from exc
        return b"".join(chunks)


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled when the client disconnects meanwhile (its generation is then aborted at the
    router and nothing is recorded): a client that gave up waiting must not leave a turn it never saw."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                if task.done():  # it finished meanwhile: a stream handles its own client from here
                    return task.result()
                raise ClientLeft(LEFT_EARLY)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class FrontServer(uvicorn.Server):
    """uvicorn inside the service's event loop; signals stay with the gRPC host's graceful shutdown."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


async def start_front(front: ChatFront, listen: str) -> tuple[FrontServer, asyncio.Task[None], str]:
    host, port = listen.rsplit(":", 1)
    server = FrontServer(uvicorn.Config(front.app, host=host, port=int(port), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # raises the bind error
            raise OSError(f"the HTTP front could not start on {listen}")
        await asyncio.sleep(0.05)
    return server, task, f"http://{listen}"
