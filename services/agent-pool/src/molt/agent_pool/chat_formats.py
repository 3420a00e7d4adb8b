"""What the OpenAI and Anthropic halves of the front share: molt's internal chat shape and field checks.

Internally a conversation is a list of OpenAI-style messages (what the chat
template renders): ``{"role", "content": str, "tool_calls": [...], "tool_call_id"}``.
Replies are parsed from the model's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
markup becomes structured tool calls, which ``openai_api`` and ``anthropic_api`` render in
their API's shape. A malformed request field raises ``InvalidInput`` (HTTP 400).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from molt.agent_pool.agents import Message
from molt.core.errors import InvalidInput

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
INT64 = 1 << 63


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


def text(content: Any, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts (the only parts supported)."""
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


def integer(body: dict[str, Any], name: str, low: int, high: int = INT64 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"{name} must be an integer in [{low}, {high}], got {json.dumps(value)[:40]}")
    return value


def number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"{name} must be a number, got {json.dumps(value)[:40]}")
    return float(value)


def flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false, got {json.dumps(value)[:40]}")
    return value


def stops(body: dict[str, Any], name: str, single: bool) -> tuple[str, ...]:
    """A list of strings (or, where the API allows it, one string)."""
    value = body.get(name)
    if value is None:
        return ()
    if single and isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidInput(f"{name} must be {'a string or ' if single else ''}a list of strings")
    return tuple(value)
