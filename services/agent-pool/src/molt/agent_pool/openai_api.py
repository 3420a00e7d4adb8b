"""OpenAI Chat Completions on the front: a request checked and made a Turn, its reply shaped back.

``chat_completions`` answers one turn of a session, once the front has checked its
key and its retries: plain, one JSON body (``n`` samples; the first one is recorded);
streamed, ``chat.completion.chunk`` events. Protected sampling values (the penalties)
are refused (HTTP 400); vLLM-style extras go to the router, which refuses overrides.
"""

from __future__ import annotations

import contextlib
import json
import time
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

OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


def openai_messages(raw: Any) -> list[Message]:
    """Checks and normalises OpenAI ``messages`` to the internal shape."""
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("messages must be a non-empty list")
    messages: list[Message] = []
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise InvalidInput(f"{where} must be an object")
        role = item.get("role")
        if not isinstance(role, str) or role not in OPENAI_ROLES:  # a list or an object is not hashable
            raise InvalidInput(f"{where}.role {role!r} is not one of {sorted(OPENAI_ROLES)}")
        if "content" not in item and not item.get("tool_calls"):
            raise InvalidInput(f"{where} has no content")
        message: Message = {
            "role": "system" if role == "developer" else role,
            "content": fmt.text(item.get("content"), where),
        }
        if role == "assistant" and item.get("tool_calls"):
            calls = item["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidInput(f"{where}.tool_calls must be a list")
            message["tool_calls"] = [_openai_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
        if role == "tool":
            message["tool_call_id"] = item.get("tool_call_id", "")
        messages.append(message)
    return messages


def _openai_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidInput(f"{where} must be an object with function.name")
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"), where)},
    }


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):  # a tool without arguments, as some clients send it
        return {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{where}: function.arguments is not a JSON object") from exc
    if not isinstance(value, dict):
        raise InvalidInput(f"{where}: function.arguments is not a JSON object")
    return value


def openai_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Checks OpenAI tool definitions (what the chat template renders)."""
    if not raw:
        return None
    if not isinstance(raw, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in raw
    ):
        raise InvalidInput("tools must be a list of objects with function.name")
    return raw


def openai_response(
    completion_id: str,
    model: str,
    choices: list[tuple[fmt.ParsedReply, str, list[dict[str, Any]] | None]],
    prompt_tokens: int,
    completion_tokens: int,
    created: int,
) -> dict[str, Any]:
    """A Chat Completions response; each choice is (reply, engine finish reason, logprobs content or None)."""
    out = []
    for index, (reply, finish, logprobs) in enumerate(choices):
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.text if reply.text or not reply.tool_calls else None,
        }
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in reply.tool_calls
            ]
        reason = "tool_calls" if reply.tool_calls else ("length" if finish == "length" else "stop")
        out.append(
            {
                "index": index,
                "message": message,
                "finish_reason": reason,
                "logprobs": None if logprobs is None else {"content": logprobs},
            }
        )
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def openai_turn(body: dict[str, Any]) -> Turn:
    """A Chat Completions request body, its fields checked, as a Turn."""
    for name in ("frequency_penalty", "presence_penalty"):
        if fmt.number(body, name):
            raise InvalidInput(f"{name} is protected: leave it unset", reason="PROTECTED_SAMPLING_OVERRIDE")
    stream, logprobs = fmt.flag(body, "stream"), fmt.flag(body, "logprobs")
    top_logprobs = fmt.integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise InvalidInput("top_logprobs needs logprobs = true")
    max_tokens = fmt.integer(body, "max_completion_tokens", 1)
    sample_count = fmt.integer(body, "n", 1, 2**31 - 1) or 1
    if stream and sample_count > 1:
        raise InvalidInput("n > 1 is not supported with stream = true")
    return Turn(
        messages=openai_messages(body.get("messages")),
        tools=openai_tools(body.get("tools")),
        max_tokens=(max_tokens if max_tokens is not None else fmt.integer(body, "max_tokens", 1)) or 0,
        sample_count=sample_count,
        stop=fmt.stops(body, "stop", single=True),
        seed=fmt.integer(body, "seed", -fmt.INT64),
        top_logprobs=top_logprobs or 0,
        temperature=fmt.number(body, "temperature"),
        top_p=fmt.number(body, "top_p"),
        top_k=fmt.integer(body, "top_k", -1, 2**31 - 1),  # vLLM-style extras: the router refuses overrides
        min_p=fmt.number(body, "min_p"),
        repetition_penalty=fmt.number(body, "repetition_penalty"),
        stream=stream,
        logprobs=logprobs,
    )


async def chat_completions(
    router: RouterClient, limits: TurnLimits, session: Session, body: dict[str, Any], digest: str, request: Request
) -> Response:
    """One turn of ``session``: streamed as events, or answered as one JSON body kept for a retry."""
    turn = openai_turn(body)
    plan = await session.plan(turn)
    model, created, cid = str(body.get("model", "molt")), int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    if turn.stream:
        chunks = await open_stream(router, session.generation_request(turn, plan, limits))
        events = _events(session, turn, plan, chunks, model, created, cid, body)
        return sse("openai", session, digest, events, request)
    samples = await router.generate(session.generation_request(turn, plan, limits))
    replies = [session.reply(turn, s) for s in samples]
    await still_there(request)
    session.commit(plan, samples[0], replies[0])
    logprobs = [_logprobs(session, s) if turn.logprobs else None for s in samples]
    reply = openai_response(
        cid,
        model,
        [(r, s.finish_reason, lp) for r, s, lp in zip(replies, samples, logprobs, strict=True)],
        len(plan.prompt_ids),
        sum(len(s.token_ids) for s in samples),
        created,
    )
    return session.remember(digest, reply)


def _logprobs(session: Session, sample: Sample, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's per-token logprobs entries of ``sample``'s tokens ``start:end``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = session.transcript.tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    tokens = sample.token_ids[start:end]
    tops = sample.top_logprobs[start:end] or [None] * len(tokens)
    return [
        {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in zip(*top, strict=True)] if top else []}
        for t, lp, top in zip(tokens, sample.logprobs[start:end], tops, strict=True)
    ]


async def _events(
    session: Session,
    turn: Turn,
    plan: TurnPlan,
    chunks: Chunks,
    model: str,
    created: int,
    cid: str,
    body: dict[str, Any],
) -> AsyncIterator[str | Commit]:
    """The turn's ``chat.completion.chunk`` events (text live unless tools were offered), with its Commit
    before the closing ones."""
    sample = Sample()
    covered = 0  # tokens whose logprobs went out (with the text they make up)

    def chunk(delta: dict[str, Any], finish: str | None = None, upto: int | None = None) -> str:
        nonlocal covered
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if turn.logprobs:
            upto = len(sample.token_ids) if upto is None else upto
            choice["logprobs"] = {"content": _logprobs(session, sample, covered, upto), "refusal": None}
            covered = upto
        return json.dumps(
            {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
        )

    yield chunk({"role": "assistant", "content": ""}, upto=0)
    async with contextlib.aclosing(stream_text(session, chunks, sample, live=not turn.tools)) as texts:
        async for delta, upto in texts:
            yield chunk({"content": delta}, upto=upto)
    reply = session.reply(turn, sample)
    yield Commit(plan, sample, reply)
    final = openai_response(
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
