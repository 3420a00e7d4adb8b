"""A streamed turn: the router's chunks in, server-sent events out, the turn recorded once all went out.

The router has accepted a streamed turn before its response starts (``open_stream``),
so a refused request is an HTTP error, never a cut stream. The events run in a task
of their own that holds the session's lock until the turn is recorded or has failed
(``sse``); a client that leaves before the last event went out cancels the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool.front_errors import failure
from molt.agent_pool.router_client import GenerationRequest, RouterClient, Sample
from molt.agent_pool.sessions import Session
from molt.agent_pool.transcript import TurnPlan

log = logging.getLogger(__name__)
Chunks = AsyncGenerator[tuple[int, Any], None]  # (sample index, chunk) as the router streams them


@dataclass(frozen=True)
class Commit:
    """What a streamed turn records once every event of it has gone out (its events generator yields it)."""

    plan: TurnPlan
    sample: Sample
    reply: fmt.ParsedReply


class SessionStream(StreamingResponse):
    """A streamed turn; its task holds the session's lock until the turn is over."""


async def open_stream(router: RouterClient, request: GenerationRequest) -> Chunks:
    """The router's stream for this turn, its first chunk already received: a request the router
    refuses raises here, before the HTTP response starts."""
    chunks = router.stream(request)
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


async def stream_text(session: Session, chunks: Chunks, sample: Sample, live: bool) -> AsyncIterator[tuple[str, int]]:
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


def sse(
    api: str, session: Session, digest: str, events: AsyncGenerator[str | Commit, None], request: Request
) -> Response:
    """Streams ``events`` as server-sent events. They run in a task of their own, which holds the
    session's lock (the front hands it over) until the turn is recorded or has failed: no other
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
                session.commit(commit.plan, commit.sample, commit.reply)
            session.keep_reply(digest, sent)  # complete: a retry replays it
        except Exception as exc:
            error = json.dumps(failure(api, exc, "stream")[1])
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
