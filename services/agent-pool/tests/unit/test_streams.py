"""The front's streamed-turn plumbing (``streams.sse``) against a real uvicorn server and httpx client.

The events come from a stand-in for the router's stream (named as such: an endless generator that notes
when it is closed); what is tested is what the front does with them when the client goes away."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncGenerator
from pathlib import Path

import httpx
from fastapi import Request
from transformers import AutoTokenizer

from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.front import ChatFront, start_front
from molt.agent_pool.streams import Commit, sse
from molt.core.testing import free_port


def test_a_stream_whose_client_leaves_closes_its_source_at_once_and_one_cancelled_at_start_ends(
    tiny_model: Path,
) -> None:
    front = ChatFront(AutoTokenizer.from_pretrained(tiny_model), None, TurnLimits(16, 512))  # type: ignore[arg-type]
    closed = asyncio.Event()

    async def router_stand_in() -> AsyncGenerator[str | Commit, None]:
        try:
            while True:
                yield json.dumps({"delta": "x" * 4096})
                await asyncio.sleep(0)
        finally:
            closed.set()

    async def stream(request: Request, cancel_at_once: bool = False) -> object:
        session = front.open_session()
        await session.lock.acquire()  # as _guard does before it hands the lock to the stream
        response = sse("openai", session, "digest", router_stand_in(), request)
        if cancel_at_once:  # the episode ends in the same turn: the stream's task never starts
            front.close_session(session.id)
        return response

    front.app.get("/stream")(stream)

    async def main() -> None:
        server, task, base_url = await start_front(front, f"127.0.0.1:{free_port()}")
        try:
            async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
                async with client.stream("GET", "/stream") as response:
                    lines = response.aiter_lines()
                    for _ in range(3):
                        await anext(lines)
                # The client left while the stream waited for its next line to go out: the source (the
                # router's call) is closed now, not when the garbage collector finds it.
                await asyncio.wait_for(closed.wait(), 5)
                reply = await client.get("/stream", params={"cancel_at_once": True})
                assert reply.status_code == 200 and reply.text == ""  # ended, not left open until a timeout
            assert all(not s.lock.locked() for s in front.sessions.values())  # each stream let go of its session
        finally:
            server.should_exit = True
            await task
            await front.aclose()

    gc.disable()  # the source must not be closed by a collection that happens to run meanwhile
    try:
        asyncio.run(main())
    finally:
        gc.enable()
