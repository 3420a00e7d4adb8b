"""Anthropic Messages on the front: a request checked and made a Turn, its reply shaped back.

``messages`` answers one turn of a session, once the front has checked its key and
its retries: plain, one JSON message with text and tool_use blocks; streamed, the
Messages API's events. ``system`` and the content blocks (text, tool_use,
tool_result) become molt's internal messages; a final assistant message
(prefill) is refused.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool.agents import Message
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.front_errors import still_there
from molt.agent_pool.router_client import RouterClient, Sample
from molt.agent_pool.sessions import Session, Turn
from molt.agent_pool.streams import Chunks, Commit, open_stream, sse, stream_text
from molt.agent_pool.transcript import TurnPlan
from molt.core.errors import InvalidInput


def anthropic_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions as the OpenAI-style schemas the chat template renders."""
    if not raw:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in raw):
        raise InvalidInput("tools must be a list of objects with a name")
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {}),
            },
        }
        for t in raw
    ]


def anthropic_messages(system: Any, raw: Any) -> list[Message]:
    """Checks and converts Anthropic ``system`` + ``messages`` (text, tool_use, tool_result blocks)."""
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("messages must be a non-empty list")
    messages: list[Message] = []
    if system:
        messages.append({"role": "system", "content": fmt.text(system, "system")})
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict) or item.get("role") not in ("user", "assistant"):
            raise InvalidInput(f"{where}.role must be 'user' or 'assistant'")
        if "content" not in item:
            raise InvalidInput(f"{where} has no content")
        content = item["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise InvalidInput(f"{where}.content must be a string or a list of blocks")
        messages.extend(_anthropic_blocks(item["role"], blocks, where))
    if raw[-1].get("role") == "assistant":
        raise InvalidInput(
            "a final assistant message (prefill) is not supported: the reply would not continue it",
            reason="PREFILL_UNSUPPORTED",
        )
    return messages


def _anthropic_blocks(role: str, blocks: list[Any], where: str) -> list[Message]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[Message] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(fmt.text(block.get("text"), where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise InvalidInput(f"{where}: a tool_use block needs a name and an object input")
            calls.append(
                {
                    "id": block.get("id", ""),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": block.get("input", {})},
                }
            )
        elif kind == "tool_result" and role == "user":
            results.append(
                {
                    "role": "tool",
                    "content": fmt.text(block.get("content"), where),
                    "tool_call_id": block.get("tool_use_id", ""),
                }
            )
        else:
            raise InvalidInput(f"{where}: unsupported content block {kind!r} for role {role!r}")
    if role == "assistant":
        message: Message = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def anthropic_response(
    message_id: str,
    model: str,
    reply: fmt.ParsedReply,
    finish: str,
    stop_reason: str,
    stop_sequences: list[str],
    input_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    """An Anthropic Messages response with text and tool_use blocks."""
    content: list[dict[str, Any]] = []
    if reply.text:
        content.append({"type": "text", "text": reply.text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in reply.tool_calls]
    matched = stop_reason if stop_reason in stop_sequences else None
    reason = (
        "tool_use"
        if reply.tool_calls
        else "max_tokens"
        if finish == "length"
        else "stop_sequence"
        if matched
        else "end_turn"
    )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": matched,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def anthropic_turn(body: dict[str, Any]) -> Turn:
    """A Messages request body, its fields checked, as a Turn."""
    max_tokens = fmt.integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise InvalidInput("max_tokens is required")
    return Turn(
        messages=anthropic_messages(body.get("system"), body.get("messages")),
        tools=anthropic_tools(body.get("tools")),
        max_tokens=max_tokens,
        stop=fmt.stops(body, "stop_sequences", single=False),
        temperature=fmt.number(body, "temperature"),
        top_p=fmt.number(body, "top_p"),
        top_k=fmt.integer(body, "top_k", -1, 2**31 - 1),  # the router refuses an override
        stream=fmt.flag(body, "stream"),
    )


async def messages(
    router: RouterClient, limits: TurnLimits, session: Session, body: dict[str, Any], digest: str, request: Request
) -> Response:
    """One turn of ``session``: streamed as events, or answered as one JSON message kept for a retry."""
    turn = anthropic_turn(body)
    plan = await session.plan(turn)
    model, mid = str(body.get("model", "molt")), f"msg_{uuid.uuid4().hex}"
    if turn.stream:
        chunks = await open_stream(router, session.generation_request(turn, plan, limits))
        return sse("anthropic", session, digest, _events(session, turn, plan, chunks, model, mid), request)
    (sample,) = await router.generate(session.generation_request(turn, plan, limits))
    reply = session.reply(turn, sample, "toolu_")
    await still_there(request)
    session.commit(plan, sample, reply)
    return session.remember(digest, _response(mid, model, turn, plan, sample, reply))


async def _events(
    session: Session, turn: Turn, plan: TurnPlan, chunks: Chunks, model: str, mid: str
) -> AsyncIterator[str | Commit]:
    """The turn's Messages events (text live unless tools were offered), with its Commit before the
    closing ones."""

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
    async with contextlib.aclosing(stream_text(session, chunks, sample, live=not turn.tools)) as texts:
        async for delta, _ in texts:
            if not text_open:
                yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                text_open = True
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
    reply = session.reply(turn, sample, "toolu_")
    yield Commit(plan, sample, reply)
    final = _response(mid, model, turn, plan, sample, reply)
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


def _response(
    mid: str, model: str, turn: Turn, plan: TurnPlan, sample: Sample, reply: fmt.ParsedReply
) -> dict[str, Any]:
    """The Messages response of a finished turn (plain, or what a stream's closing events carry)."""
    return anthropic_response(
        mid,
        model,
        reply,
        sample.finish_reason,
        sample.stop_reason,
        list(turn.stop),
        len(plan.prompt_ids),
        len(sample.token_ids),
    )
