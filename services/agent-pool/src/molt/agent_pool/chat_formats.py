"""OpenAI Chat Completions and Anthropic Messages, translated to and from molt's internal chat shape.

Internally a conversation is a list of OpenAI-style messages (what the chat
template renders): ``{"role", "content": str, "tool_calls": [...], "tool_call_id"}``.
Requests are checked here (bad roles, missing content, unsupported parts →
``InvalidInput``, which the front answers with HTTP 400); replies are parsed
from the model's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
markup becomes structured ``tool_calls`` / ``tool_use`` blocks.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from molt.agent_pool.agents import Message
from molt.core.errors import InvalidInput

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedReply:
    """A model reply split into text and tool calls."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_reply(text: str, id_prefix: str = "call_") -> ParsedReply:
    """Extracts well-formed tool calls (ids ``<id_prefix><hex>``); malformed markup stays in the text."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return match.group(0)
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return match.group(0)
        calls.append(ToolCall(f"{id_prefix}{uuid.uuid4().hex[:24]}", name, arguments))
        return ""

    rest = TOOL_CALL.sub(take, text)
    return ParsedReply(rest.strip() if calls else rest, calls)


def internal_reply(reply: ParsedReply) -> Message:
    """The assistant message as molt records it (and as a client echoing it back normalises to)."""
    message: Message = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    return message


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidInput(f"{where}: only text content parts are supported, got {json.dumps(part)[:80]}")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidInput(f"{where}: content must be a string or a list of text parts")


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
        if role not in OPENAI_ROLES:
            raise InvalidInput(f"{where}.role {role!r} is not one of {sorted(OPENAI_ROLES)}")
        if "content" not in item and not item.get("tool_calls"):
            raise InvalidInput(f"{where} has no content")
        message: Message = {
            "role": "system" if role == "developer" else role,
            "content": _text(item.get("content"), where),
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
        messages.append({"role": "system", "content": _text(system, "system")})
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
            texts.append(_text(block.get("text"), where))
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
                    "content": _text(block.get("content"), where),
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


def openai_response(
    completion_id: str,
    model: str,
    choices: list[tuple[ParsedReply, str, list[dict[str, Any]] | None]],
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


def anthropic_response(
    message_id: str,
    model: str,
    reply: ParsedReply,
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
