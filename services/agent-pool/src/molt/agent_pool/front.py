"""The HTTP front: OpenAI Chat Completions and Anthropic Messages for ChatAgent episodes.

Each episode gets a session: its own base URL (``/s/<session>/v1``) and key
(``Authorization: Bearer`` or ``x-api-key``). Turns of one session are
serialised; a turn is planned on the session's transcript, generated through
the router and committed only when generation succeeded; an identical retried
request gets the cached reply and records nothing. Protected sampling values
are forwarded to the router, which refuses overrides (HTTP 400 here).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool import metrics
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.router_client import GenerationRequest, RouterClient, Sample
from molt.agent_pool.transcript import Transcript, TurnPlan
from molt.core.errors import InvalidInput, MoltError, NotFound, Unavailable

log = logging.getLogger(__name__)
CACHE_SIZE = 8
HTTP_STATUS = {InvalidInput: 400, NotFound: 404, Unavailable: 503}


class Unauthorized(MoltError):
    reason = "UNAUTHORIZED"


@dataclass
class Session:
    """One episode's conversation state on the front."""

    id: str
    key: str
    transcript: Transcript
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cache: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    turns: int = 0


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


class ChatFront:
    """Sessions plus the FastAPI app serving them."""

    def __init__(self, tokenizer: Any, router: RouterClient, limits: TurnLimits) -> None:
        self.tokenizer = tokenizer
        self.router = router
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        self.app = FastAPI(title="molt agent-pool front")
        self.app.post("/s/{session_id}/v1/chat/completions")(self.chat_completions)
        self.app.post("/s/{session_id}/v1/messages")(self.messages)
        self._http: tuple[Any, Any] | None = None

    def sdk_http_clients(self) -> tuple[Any, Any]:
        """The HTTP clients every episode's SDK clients share (``run_chat_episode``): openai's and
        anthropic's, each of the kind its SDK needs. A fresh SDK client per episode would build its
        own connection pool and TLS context (~0.1 s each, measured with bench/agent_pool.py). The
        front is plain HTTP on loopback, so no certificates are loaded."""
        if self._http is None:
            import anthropic  # the official SDKs, as the ChatAgents get them
            import openai

            options: dict[str, Any] = {"verify": False, "timeout": 600.0}
            self._http = (openai.DefaultAsyncHttpxClient(**options), anthropic.DefaultAsyncHttpxClient(**options))
        return self._http

    async def aclose(self) -> None:
        """Closes the shared SDK HTTP clients (call once the front is no longer used)."""
        if self._http is not None:
            for client in self._http:
                await client.aclose()
            self._http = None

    def open_session(self) -> Session:
        session = Session(uuid.uuid4().hex, secrets.token_urlsafe(24), Transcript(self.tokenizer))
        self.sessions[session.id] = session
        return session

    def close_session(self, session_id: str) -> Session:
        return self.sessions.pop(session_id)

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
            body = json.loads(await request.body())
        except ValueError as exc:
            raise InvalidInput(f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise InvalidInput("request body must be a JSON object")
        digest = hashlib.sha256(f"{request.url.path}\0{json.dumps(body, sort_keys=True)}".encode()).hexdigest()
        return session, body, digest

    def _request(self, session: Session, turn: Turn, plan: TurnPlan) -> GenerationRequest:
        room = self.limits.max_model_len - len(plan.prompt_ids)
        if room < 1:
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
            max_tokens=min(turn.max_tokens or self.limits.max_tokens, room),
            sample_count=turn.sample_count,
            stop_strings=turn.stop,
            seed=turn.seed,
            top_logprob_count=turn.top_logprobs,
            temperature=turn.temperature,
            top_p=turn.top_p,
        )

    def _reply(self, session: Session, turn: Turn, sample: Sample, id_prefix: str = "call_") -> fmt.ParsedReply:
        """The sample's text, with tool calls parsed only when the request offered tools."""
        text = session.transcript.reply_text(sample.token_ids)
        return fmt.parse_reply(text, id_prefix) if turn.tools else fmt.ParsedReply(text)

    def _commit(self, session: Session, plan: TurnPlan, sample: Sample, reply: fmt.ParsedReply) -> None:
        session.transcript.commit(plan, sample.token_ids, sample.logprobs, sample.versions, fmt.internal_reply(reply))

    async def _stream_text(
        self, session: Session, turn: Turn, plan: TurnPlan, sample: Sample, live: bool
    ) -> AsyncIterator[str]:
        """Yields text deltas of sample 0 as tokens arrive (all at the end when ``live`` is False)."""
        sent = ""
        async for _, chunk in self.router.stream(self._request(session, turn, plan)):
            sample.extend(chunk)
            text = session.transcript.reply_text(sample.token_ids)
            if live and not text.endswith("\ufffd") and len(text) > len(sent):  # hold back a split character
                yield text[len(sent) :]
                sent = text
        text = session.transcript.reply_text(sample.token_ids)
        if live and len(text) > len(sent):  # whatever was held back (bytes that never formed a character)
            yield text[len(sent) :]

    # -- OpenAI -------------------------------------------------------------------------------

    def _openai_turn(self, body: dict[str, Any]) -> Turn:
        for name in ("frequency_penalty", "presence_penalty"):
            if body.get(name):
                raise InvalidInput(f"{name} is protected: leave it unset", reason="PROTECTED_SAMPLING_OVERRIDE")
        stop = body.get("stop") or ()
        turn = Turn(
            messages=fmt.openai_messages(body.get("messages")),
            tools=body.get("tools") or None,
            max_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or 0),
            sample_count=int(body.get("n") or 1),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            seed=body.get("seed"),
            top_logprobs=int(body.get("top_logprobs") or (1 if body.get("logprobs") else 0)),
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
        )
        if body.get("stream") and turn.sample_count > 1:
            raise InvalidInput("n > 1 is not supported with stream = true")
        return turn

    async def chat_completions(self, session_id: str, request: Request) -> Response:
        return await self._guard("openai", session_id, request, self._chat_completions)

    async def _chat_completions(self, session: Session, body: dict[str, Any], digest: str) -> Response:
        turn = self._openai_turn(body)
        plan = session.transcript.plan(turn.messages, turn.tools)
        model, created, cid = str(body.get("model", "molt")), int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            return self._sse(session, digest, self._openai_events(session, turn, plan, model, created, cid, body))
        samples = await self.router.generate(self._request(session, turn, plan))
        replies = [self._reply(session, turn, s) for s in samples]
        self._commit(session, plan, samples[0], replies[0])
        logprobs = [self._openai_logprobs(s) if body.get("logprobs") else None for s in samples]
        reply = fmt.openai_response(
            cid,
            model,
            [(r, s.finish_reason, lp) for r, s, lp in zip(replies, samples, logprobs, strict=True)],
            len(plan.prompt_ids),
            sum(len(s.token_ids) for s in samples),
            created,
        )
        return self._remember(session, digest, reply)

    def _openai_logprobs(self, sample: Sample) -> list[dict[str, Any]]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.tokenizer.decode([token_id])
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in zip(*top, strict=True)] if top else []}
            for t, lp, top in zip(
                sample.token_ids, sample.logprobs, sample.top_logprobs or [None] * len(sample.token_ids), strict=True
            )
        ]

    async def _openai_events(
        self, session: Session, turn: Turn, plan: TurnPlan, model: str, created: int, cid: str, body: dict[str, Any]
    ) -> AsyncIterator[str]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return json.dumps(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
            )

        sample = Sample()
        yield chunk({"role": "assistant", "content": ""})
        async for delta in self._stream_text(session, turn, plan, sample, live=not turn.tools):
            yield chunk({"content": delta})
        reply = self._reply(session, turn, sample)
        self._commit(session, plan, sample, reply)
        final = fmt.openai_response(
            cid, model, [(reply, sample.finish_reason, None)], len(plan.prompt_ids), len(sample.token_ids), created
        )
        message = final["choices"][0]["message"]
        if turn.tools and message["content"]:
            yield chunk({"content": message["content"]})
        if "tool_calls" in message:
            yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]})
        yield chunk({}, final["choices"][0]["finish_reason"])
        if (body.get("stream_options") or {}).get("include_usage"):
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
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
            raise InvalidInput("max_tokens is required and must be a positive integer")
        if body.get("top_k") is not None:
            raise InvalidInput("top_k is protected: leave it unset", reason="PROTECTED_SAMPLING_OVERRIDE")
        return Turn(
            messages=fmt.anthropic_messages(body.get("system"), body.get("messages")),
            tools=fmt.anthropic_tools(body.get("tools")),
            max_tokens=body["max_tokens"],
            stop=tuple(body.get("stop_sequences") or ()),
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
        )

    async def messages(self, session_id: str, request: Request) -> Response:
        return await self._guard("anthropic", session_id, request, self._messages)

    async def _messages(self, session: Session, body: dict[str, Any], digest: str) -> Response:
        turn = self._anthropic_turn(body)
        plan = session.transcript.plan(turn.messages, turn.tools)
        model, mid = str(body.get("model", "molt")), f"msg_{uuid.uuid4().hex}"
        if body.get("stream"):
            return self._sse(session, digest, self._anthropic_events(session, turn, plan, model, mid), named=True)
        (sample,) = await self.router.generate(self._request(session, turn, plan))
        reply = self._reply(session, turn, sample, "toolu_")
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
        self, session: Session, turn: Turn, plan: TurnPlan, model: str, mid: str
    ) -> AsyncIterator[str]:
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
        async for delta in self._stream_text(session, turn, plan, sample, live=not turn.tools):
            if not text_open:
                yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                text_open = True
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
        reply = self._reply(session, turn, sample, "toolu_")
        self._commit(session, plan, sample, reply)
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
        session.cache[digest] = reply
        while len(session.cache) > CACHE_SIZE:
            session.cache.popitem(last=False)
        return JSONResponse(reply)

    def _sse(self, session: Session, digest: str, events: AsyncIterator[str], named: bool = False) -> Response:
        async def body() -> AsyncIterator[str]:
            sent: list[str] = []
            async for item in events:
                if not item:
                    continue
                line = f"{item}\n\n" if named else f"data: {item}\n\n"
                sent.append(line)
                yield line
            session.cache[digest] = sent  # complete: a retry replays it
            while len(session.cache) > CACHE_SIZE:
                session.cache.popitem(last=False)

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _guard(
        self, api: str, session_id: str, request: Request, handler: Callable[[Session, dict[str, Any], str], Any]
    ) -> Response:
        try:
            session, body, digest = await self._session(session_id, request)
            async with session.lock:
                if digest in session.cache:  # an identical retry: same reply, nothing recorded
                    cached = session.cache[digest]
                    metrics.FRONT_REQUESTS.labels(api, "200").inc()
                    if isinstance(cached, list):
                        return StreamingResponse(iter(cached), media_type="text/event-stream")
                    return JSONResponse(cached)
                response: Response = await handler(session, body, digest)
                metrics.FRONT_REQUESTS.labels(api, str(response.status_code)).inc()
                return response
        except MoltError as exc:
            status = (
                401
                if isinstance(exc, Unauthorized)
                else next((code for cls, code in HTTP_STATUS.items() if isinstance(exc, cls)), 500)
            )
            log.warning(
                "front request refused",
                extra={"api": api, "status": status, "reason": exc.reason, "error": exc.message},
            )
            metrics.FRONT_REQUESTS.labels(api, str(status)).inc()
            return error_response(api, status, exc.message)


def error_response(api: str, status: int, message: str) -> JSONResponse:
    """An error body in the shape the API's official SDK parses."""
    if api == "anthropic":
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "api_error"
        )
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "api_error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
