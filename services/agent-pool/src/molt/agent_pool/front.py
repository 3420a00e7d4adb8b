"""The HTTP front: OpenAI Chat Completions and Anthropic Messages for ChatAgent episodes.

Each episode gets a session: its own base URL (``/s/<session>/v1``) and key
(``Authorization: Bearer`` or ``x-api-key``). Turns of one session are
serialised; a turn is planned on the session's transcript, generated through
the router and committed only when generation succeeded; an identical retried
request gets the cached reply and records nothing. A streamed turn holds its
session until it is committed, and the router has accepted it before the
response starts, so a refused request is an HTTP error, never a cut stream.
Protected sampling values are forwarded to the router, which refuses overrides
(HTTP 400 here). ``max_tokens`` is an upper bound: clamped to the router's cap
and to the room left in the model's context. Request fields are type-checked
(HTTP 400), bodies above ``max_body_bytes`` refused (HTTP 413).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool import metrics
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.router_client import GenerationRequest, RouterClient, Sample
from molt.agent_pool.transcript import Transcript, TurnPlan
from molt.core.errors import InvalidInput, MoltError, NotFound, Unavailable

log = logging.getLogger(__name__)
CACHE_SIZE = 8  # replies a session keeps for identical retries: at most this many,
CACHE_BYTES = 16 * 1024 * 1024  # and at most this many bytes (a streamed reply with top_logprobs is ~1.6 KB a token)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
INT64 = 1 << 63
Chunks = AsyncGenerator[tuple[int, Any], None]  # (sample index, chunk) as the router streams them
T = TypeVar("T")
LEFT_EARLY = "the client left before its reply was ready"
DISCONNECT_POLL_S = 0.5  # how often a turn still generating asks whether its client is still there


@dataclass(frozen=True)
class Commit:
    """What a streamed turn records once every event of it has gone out (its events generator yields it)."""

    plan: TurnPlan
    sample: Sample
    reply: fmt.ParsedReply


class Unauthorized(MoltError):
    reason = "UNAUTHORIZED"


class TooLarge(MoltError):
    reason = "PAYLOAD_TOO_LARGE"


class ClientLeft(MoltError):
    """The client disconnected before its reply was out: nothing of the turn is recorded."""

    reason = "CLIENT_DISCONNECTED"


# The router's names of request fields that each API names otherwise (the rest are the same, less the prefix).
ROUTER_FIELDS = {
    "openai": {"sample_count": "n", "top_logprob_count": "top_logprobs", "stop_strings": "stop"},
    "anthropic": {"stop_strings": "stop_sequences"},
}
HTTP_STATUS = {InvalidInput: 400, Unauthorized: 401, NotFound: 404, TooLarge: 413, ClientLeft: 499, Unavailable: 503}


def _integer(body: dict[str, Any], name: str, low: int, high: int = INT64 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"{name} must be an integer in [{low}, {high}], got {json.dumps(value)[:40]}")
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"{name} must be a number, got {json.dumps(value)[:40]}")
    return float(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false, got {json.dumps(value)[:40]}")
    return value


def _stops(body: dict[str, Any], name: str, single: bool) -> tuple[str, ...]:
    """A list of strings (or, where the API allows it, one string)."""
    value = body.get(name)
    if value is None:
        return ()
    if single and isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidInput(f"{name} must be {'a string or ' if single else ''}a list of strings")
    return tuple(value)


@dataclass
class Session:
    """One episode's conversation state on the front."""

    id: str
    key: str
    transcript: Transcript
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cache: OrderedDict[str, bytes | list[str]] = field(default_factory=OrderedDict)  # JSON body or SSE lines
    turns: int = 0
    closed: bool = False  # the episode is over: nothing more is recorded
    streams: set[asyncio.Task[None]] = field(default_factory=set)  # its streamed turns' tasks, until they end


@dataclass(frozen=True)
class Turn:
    """One requested generation, in internal form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    sample_count: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    logprobs: bool = False


class ChatFront:
    """Sessions plus the FastAPI app serving them."""

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

    def sdk_http_clients(self, blocking: bool = False) -> tuple[Any, Any]:
        """The HTTP clients every episode's SDK clients share (``run_chat_episode``): openai's and
        anthropic's, each of the kind its SDK needs; ``blocking``: the sync ones, for agents whose
        ``run`` is a plain method (httpx's sync client may be shared between threads). A fresh SDK
        client per episode would build its own connection pool and TLS context (~0.1 s each,
        measured with bench/agent_pool.py). The front is plain HTTP on loopback, so no
        certificates are loaded."""
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

    # -- shared turn logic --------------------------------------------------------------------

    async def _session(self, session_id: str, request: Request) -> tuple[Session, dict[str, Any], str]:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r} (is the episode over?)")
        auth = request.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() or request.headers.get("x-api-key", "")
        if not secrets.compare_digest(key, session.key):
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

    async def _plan(self, session: Session, turn: Turn) -> TurnPlan:
        """The turn planned on the session's transcript, off the event loop (rendering and tokenizing a long
        conversation takes seconds that every other session would wait)."""
        return await asyncio.to_thread(session.transcript.plan, turn.messages, turn.tools)

    def _request(self, session: Session, turn: Turn, plan: TurnPlan) -> GenerationRequest:
        max_tokens = self.limits.budget(turn.max_tokens, len(plan.prompt_ids))
        if max_tokens < 1:
            raise InvalidInput(
                f"the conversation ({len(plan.prompt_ids)} tokens) fills the model's context "
                f"({self.limits.max_model_len})",
                reason="CONTEXT_FULL",
            )
        session.turns += 1
        return GenerationRequest(
            request_id=f"{session.id}-{session.turns}-{uuid.uuid4().hex[:8]}",
            session_id=session.id,
            prompt_ids=plan.prompt_ids,
            max_tokens=max_tokens,
            sample_count=turn.sample_count,
            stop_strings=turn.stop,
            seed=turn.seed,
            top_logprob_count=turn.top_logprobs,
            temperature=turn.temperature,
            top_p=turn.top_p,
            top_k=turn.top_k,
            min_p=turn.min_p,
            repetition_penalty=turn.repetition_penalty,
        )

    def _reply(self, session: Session, turn: Turn, sample: Sample, id_prefix: str = "call_") -> fmt.ParsedReply:
        """The sample's text, with tool calls parsed only when the request offered tools."""
        text = session.transcript.reply_text(sample.token_ids)
        return fmt.parse_reply(text, id_prefix) if turn.tools else fmt.ParsedReply(text)

    def _commit(self, session: Session, plan: TurnPlan, sample: Sample, reply: fmt.ParsedReply) -> None:
        if session.closed:
            raise NotFound(f"session {session.id!r} ended before this turn finished: not recorded")
        session.transcript.commit(plan, sample.token_ids, sample.logprobs, sample.versions, fmt.internal_reply(reply))

    async def _open_stream(self, session: Session, turn: Turn, plan: TurnPlan) -> Chunks:
        """The router's stream for this turn, its first chunk already received: a request the router
        refuses raises here, before the HTTP response starts."""
        chunks = self.router.stream(self._request(session, turn, plan))
        try:
            first = await anext(chunks, None)
        except BaseException:
            await chunks.aclose()
            raise

        async def primed() -> Chunks:
            try:
                if first is not None:
                    yield first
                async for item in chunks:
                    yield item
            finally:
                await chunks.aclose()

        return primed()

    async def _stream_text(
        self, session: Session, chunks: Chunks, sample: Sample, live: bool
    ) -> AsyncIterator[tuple[str, int]]:
        """Yields text deltas of sample 0 as tokens arrive (all at the end when ``live`` is False), each
        with the number of sampled tokens its text covers so far."""
        sent = ""
        async with contextlib.aclosing(chunks):  # closed here (the router's call cancelled) if this fails
            async for _, chunk in chunks:
                sample.extend(chunk)
                text = session.transcript.reply_text(sample.token_ids)
                if live and not text.endswith("\ufffd") and len(text) > len(sent):  # hold back a split character
                    yield text[len(sent) :], len(sample.token_ids)
                    sent = text
        text = session.transcript.reply_text(sample.token_ids)
        if live and len(text) > len(sent):  # whatever was held back (bytes that never formed a character)
            yield text[len(sent) :], len(sample.token_ids)

    # -- OpenAI -------------------------------------------------------------------------------

    def _openai_turn(self, body: dict[str, Any]) -> Turn:
        for name in ("frequency_penalty", "presence_penalty"):
            if _number(body, name):
                raise InvalidInput(f"{name} is protected: leave it unset", reason="PROTECTED_SAMPLING_OVERRIDE")
        stream, logprobs = _flag(body, "stream"), _flag(body, "logprobs")
        top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise InvalidInput("top_logprobs needs logprobs = true")
        max_tokens = _integer(body, "max_completion_tokens", 1)
        sample_count = _integer(body, "n", 1, 2**31 - 1) or 1
        if stream and sample_count > 1:
            raise InvalidInput("n > 1 is not supported with stream = true")
        return Turn(
            messages=fmt.openai_messages(body.get("messages")),
            tools=fmt.openai_tools(body.get("tools")),
            max_tokens=(max_tokens if max_tokens is not None else _integer(body, "max_tokens", 1)) or 0,
            sample_count=sample_count,
            stop=_stops(body, "stop", single=True),
            seed=_integer(body, "seed", -INT64),
            top_logprobs=top_logprobs or 0,
            temperature=_number(body, "temperature"),
            top_p=_number(body, "top_p"),
            top_k=_integer(body, "top_k", -1, 2**31 - 1),  # vLLM-style extras: the router refuses overrides
            min_p=_number(body, "min_p"),
            repetition_penalty=_number(body, "repetition_penalty"),
            stream=stream,
            logprobs=logprobs,
        )

    async def chat_completions(self, session_id: str, request: Request) -> Response:
        return await self._guard("openai", session_id, request, self._chat_completions)

    async def _chat_completions(
        self, session: Session, body: dict[str, Any], digest: str, request: Request
    ) -> Response:
        turn = self._openai_turn(body)
        plan = await self._plan(session, turn)
        model, created, cid = str(body.get("model", "molt")), int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if turn.stream:
            chunks = await self._open_stream(session, turn, plan)
            events = self._openai_events(session, turn, plan, chunks, model, created, cid, body)
            return self._sse("openai", session, digest, events, request)
        samples = await self.router.generate(self._request(session, turn, plan))
        replies = [self._reply(session, turn, s) for s in samples]
        await _still_there(request)
        self._commit(session, plan, samples[0], replies[0])
        logprobs = [self._openai_logprobs(s) if turn.logprobs else None for s in samples]
        reply = fmt.openai_response(
            cid,
            model,
            [(r, s.finish_reason, lp) for r, s, lp in zip(replies, samples, logprobs, strict=True)],
            len(plan.prompt_ids),
            sum(len(s.token_ids) for s in samples),
            created,
        )
        return self._remember(session, digest, reply)

    def _openai_logprobs(self, sample: Sample, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        """OpenAI's per-token logprobs entries of ``sample``'s tokens ``start:end``."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.tokenizer.decode([token_id])
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        tokens = sample.token_ids[start:end]
        tops = sample.top_logprobs[start:end] or [None] * len(tokens)
        return [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in zip(*top, strict=True)] if top else []}
            for t, lp, top in zip(tokens, sample.logprobs[start:end], tops, strict=True)
        ]

    async def _openai_events(
        self,
        session: Session,
        turn: Turn,
        plan: TurnPlan,
        chunks: Chunks,
        model: str,
        created: int,
        cid: str,
        body: dict[str, Any],
    ) -> AsyncIterator[str | Commit]:
        sample = Sample()
        covered = 0  # tokens whose logprobs went out (with the text they make up)

        def chunk(delta: dict[str, Any], finish: str | None = None, upto: int | None = None) -> str:
            nonlocal covered
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if turn.logprobs:
                upto = len(sample.token_ids) if upto is None else upto
                choice["logprobs"] = {"content": self._openai_logprobs(sample, covered, upto), "refusal": None}
                covered = upto
            return json.dumps(
                {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
            )

        yield chunk({"role": "assistant", "content": ""}, upto=0)
        async with contextlib.aclosing(self._stream_text(session, chunks, sample, live=not turn.tools)) as texts:
            async for delta, upto in texts:
                yield chunk({"content": delta}, upto=upto)
        reply = self._reply(session, turn, sample)
        yield Commit(plan, sample, reply)
        final = fmt.openai_response(
            cid, model, [(reply, sample.finish_reason, None)], len(plan.prompt_ids), len(sample.token_ids), created
        )
        message = final["choices"][0]["message"]
        if turn.tools and message["content"]:
            yield chunk({"content": message["content"]})
        if "tool_calls" in message:
            yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]})
        yield chunk({}, final["choices"][0]["finish_reason"])
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            yield json.dumps(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": final["usage"],
                }
            )
        yield "[DONE]"

    # -- Anthropic ----------------------------------------------------------------------------

    def _anthropic_turn(self, body: dict[str, Any]) -> Turn:
        max_tokens = _integer(body, "max_tokens", 1)
        if max_tokens is None:
            raise InvalidInput("max_tokens is required")
        return Turn(
            messages=fmt.anthropic_messages(body.get("system"), body.get("messages")),
            tools=fmt.anthropic_tools(body.get("tools")),
            max_tokens=max_tokens,
            stop=_stops(body, "stop_sequences", single=False),
            temperature=_number(body, "temperature"),
            top_p=_number(body, "top_p"),
            top_k=_integer(body, "top_k", -1, 2**31 - 1),  # the router refuses an override
            stream=_flag(body, "stream"),
        )

    async def messages(self, session_id: str, request: Request) -> Response:
        return await self._guard("anthropic", session_id, request, self._messages)

    async def _messages(self, session: Session, body: dict[str, Any], digest: str, request: Request) -> Response:
        turn = self._anthropic_turn(body)
        plan = await self._plan(session, turn)
        model, mid = str(body.get("model", "molt")), f"msg_{uuid.uuid4().hex}"
        if turn.stream:
            chunks = await self._open_stream(session, turn, plan)
            return self._sse(
                "anthropic", session, digest, self._anthropic_events(session, turn, plan, chunks, model, mid), request
            )
        (sample,) = await self.router.generate(self._request(session, turn, plan))
        reply = self._reply(session, turn, sample, "toolu_")
        await _still_there(request)
        self._commit(session, plan, sample, reply)
        return self._remember(
            session,
            digest,
            fmt.anthropic_response(
                mid,
                model,
                reply,
                sample.finish_reason,
                sample.stop_reason,
                list(turn.stop),
                len(plan.prompt_ids),
                len(sample.token_ids),
            ),
        )

    async def _anthropic_events(
        self, session: Session, turn: Turn, plan: TurnPlan, chunks: Chunks, model: str, mid: str
    ) -> AsyncIterator[str | Commit]:
        def event(kind: str, **data: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}"

        sample = Sample()
        start = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(plan.prompt_ids), "output_tokens": 0},
        }
        yield event("message_start", message=start)
        text_open = False
        async with contextlib.aclosing(self._stream_text(session, chunks, sample, live=not turn.tools)) as texts:
            async for delta, _ in texts:
                if not text_open:
                    yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                    text_open = True
                yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
        reply = self._reply(session, turn, sample, "toolu_")
        yield Commit(plan, sample, reply)
        final = fmt.anthropic_response(
            mid,
            model,
            reply,
            sample.finish_reason,
            sample.stop_reason,
            list(turn.stop),
            len(plan.prompt_ids),
            len(sample.token_ids),
        )
        blocks = final["content"]
        if text_open:  # the text block was streamed live: close it
            yield event("content_block_stop", index=0)
            blocks = [b for b in blocks if b["type"] != "text"]
        for index, block in enumerate(blocks, start=int(text_open)):
            if block["type"] == "text":
                yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
            else:
                tool = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                yield event("content_block_start", index=index, content_block=tool)
                partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield event("content_block_delta", index=index, delta=partial)
            yield event("content_block_stop", index=index)
        yield event(
            "message_delta",
            delta={"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
            usage={"output_tokens": len(sample.token_ids)},
        )
        yield event("message_stop")

    # -- plumbing -----------------------------------------------------------------------------

    def _remember(self, session: Session, digest: str, reply: Any) -> Response:
        body = JSONResponse(reply).body  # serialized once: sent, and kept for an identical retry
        self._cache(session, digest, body)
        return Response(body, media_type="application/json")

    @staticmethod
    def _cache(session: Session, digest: str, reply: bytes | list[str]) -> None:
        """Keeps ``reply`` for an identical retry, dropping the oldest beyond CACHE_SIZE or CACHE_BYTES
        (a retry of a dropped one is a new turn)."""
        session.cache[digest] = reply

        def size(item: bytes | list[str]) -> int:
            return len(item) if isinstance(item, bytes) else sum(len(line) for line in item)

        while len(session.cache) > CACHE_SIZE or (
            len(session.cache) > 1 and sum(size(item) for item in session.cache.values()) > CACHE_BYTES
        ):
            session.cache.popitem(last=False)

    def _sse(
        self, api: str, session: Session, digest: str, events: AsyncGenerator[str | Commit, None], request: Request
    ) -> Response:
        """Streams ``events`` as server-sent events. They run in a task of their own, which holds the
        session's lock (``_guard`` hands it over) until the turn is recorded or has failed: no other
        turn of the session runs meanwhile. Each event waits until the one before it was handed to
        the client's connection, and the turn is recorded only once the last one was: a client that
        goes away before that cancels it (the generation is aborted, nothing recorded). An error once
        streaming has begun ends the stream with an error event."""
        lines: asyncio.Queue[str | None] = asyncio.Queue()

        def line(item: str) -> str:
            return f"{item}\n\n" if api == "anthropic" else f"data: {item}\n\n"

        async def produce() -> None:
            sent: list[str] = []
            commit: Commit | None = None
            try:
                async with contextlib.aclosing(events):  # closed here when cancelled: the router's call with it
                    async for item in events:
                        if isinstance(item, Commit):
                            commit = item
                        elif item:
                            sent.append(line(item))
                            lines.put_nowait(sent[-1])
                            await lines.join()  # out to the client before the next one (and the record)
                if commit is not None:
                    if session.closed:  # the agent returned without waiting for its turn's end
                        log.warning("a streamed turn ended after its episode: not recorded")
                        return
                    if await request.is_disconnected():  # its last lines may not have gone out
                        log.info("a streamed turn's client left at its end: not recorded")
                        return
                    self._commit(session, commit.plan, commit.sample, commit.reply)
                self._cache(session, digest, sent)  # complete: a retry replays it
            except Exception as exc:
                error = json.dumps(_failure(api, exc, "stream")[1])
                lines.put_nowait(line(f"event: error\ndata: {error}" if api == "anthropic" else error))
            finally:
                lines.put_nowait(None)

        def done(task: asyncio.Task[None]) -> None:
            # Here, not in ``produce``: a task cancelled before its first step never runs its body.
            lines.put_nowait(None)  # (so the stream ends then too; a second end marker is never read)
            session.lock.release()
            session.streams.discard(task)

        task = asyncio.create_task(produce())
        session.streams.add(task)  # also holds it: the event loop keeps only weak references to tasks
        task.add_done_callback(done)

        async def body() -> AsyncIterator[str]:
            try:
                while (item := await lines.get()) is not None:
                    yield item  # resumes once the server has written it to the connection
                    lines.task_done()
            finally:
                task.cancel()  # nothing once the task is done; else the client left

        return SessionStream(body(), media_type="text/event-stream")

    async def _guard(
        self,
        api: str,
        session_id: str,
        request: Request,
        handler: Callable[[Session, dict[str, Any], str, Request], Awaitable[Response]],
    ) -> Response:
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
            status, error = _failure(api, exc, "request")
            metrics.FRONT_REQUESTS.labels(api, str(status)).inc()
            return JSONResponse(error, status_code=status)


class SessionStream(StreamingResponse):
    """A streamed turn; its task holds the session's lock until the turn is over."""


async def _still_there(request: Request) -> None:
    """Raises ClientLeft when the client has gone: checked right before a plain turn is recorded."""
    if await request.is_disconnected():
        raise ClientLeft(LEFT_EARLY)


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


def _failure(api: str, exc: Exception, what: str) -> tuple[int, dict[str, Any]]:
    """The HTTP status and error body for ``exc`` (called while it is handled), logged: a refusal
    (MoltError) as a warning (a client that left: info), anything else with its traceback."""
    status = next((code for cls, code in HTTP_STATUS.items() if isinstance(exc, cls)), 500)
    if isinstance(exc, MoltError):
        message = _http_names(api, exc.message)
        log.log(
            logging.INFO if isinstance(exc, ClientLeft) else logging.WARNING,
            "front %s refused",
            what,
            extra={"api": api, "status": status, "reason": exc.reason, "error": message},
        )
        return status, error_body(api, status, message)
    log.exception("front %s failed", what, extra={"api": api})
    return status, error_body(api, status, f"internal error: {type(exc).__name__}")


def _http_names(api: str, message: str) -> str:
    """A router refusal in the terms of the client's request: its field names, not the router's."""
    for router_name, name in ROUTER_FIELDS[api].items():
        message = message.replace(f"sampling_params.{router_name}", name)
    return message.replace("sampling_params.", "")


def error_body(api: str, status: int, message: str) -> dict[str, Any]:
    """An error in the shape the API's official SDK parses."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
    }.get(status, "api_error")
    if api == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "code": status}}


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
