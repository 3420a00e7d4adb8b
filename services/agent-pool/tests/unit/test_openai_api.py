"""openai_api: OpenAI request conversion and checks, response shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool.openai_api import openai_messages, openai_response, openai_tools
from molt.core.errors import InvalidInput

CALL = '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>'


# -- OpenAI requests ---------------------------------------------------------------------------------


def test_openai_messages_normalise() -> None:
    messages = openai_messages(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "2*"}, {"type": "text", "text": "3?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e":"6"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "6"},
        ]
    )
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2*3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"e": "6"}}}],
        },
        {"role": "tool", "content": "6", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": [], "content": "x"}], r"role \[\] is not one of"),  # unhashable: was a TypeError, HTTP 500
        ([{"role": {"a": 1}, "content": "x"}], "is not one of"),
        ([{"role": "user"}], "has no content"),
        ([{"role": "user", "content": 3}], "string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text content parts"),
        ([{"role": "assistant", "tool_calls": "c"}], "tool_calls must be a list"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}],
            "not a JSON object",
        ),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "not a JSON object"),
        ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], r"tool_calls\[0\] must be an object with function.name"),
        ([{"role": "assistant", "tool_calls": ["c"]}], r"tool_calls\[0\] must be an object with function.name"),
    ],
)
def test_openai_messages_refuse_malformed(raw: Any, error: str) -> None:
    with pytest.raises(InvalidInput, match=error):
        openai_messages(raw)


def test_empty_tool_arguments_are_an_empty_object_and_tools_are_checked() -> None:
    """Some clients send ``arguments: ""`` (or null) for a tool without parameters."""
    for empty in ("", "  ", None):
        call = {"id": "c", "function": {"name": "now", "arguments": empty}}
        (message,) = openai_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
        assert message["tool_calls"][0]["function"]["arguments"] == {}
    tool = {"type": "function", "function": {"name": "now", "parameters": {}}}
    assert openai_tools([tool]) == [tool] and openai_tools(None) is None
    for bad in ([1], "abc", [{"type": "function"}], [{"function": {"name": 3}}]):
        with pytest.raises(InvalidInput, match=r"function\.name"):
            openai_tools(bad)


def test_openai_response_shapes() -> None:
    with_call = fmt.parse_reply(CALL)
    response = openai_response(
        "id1",
        "m",
        [(with_call, "stop", None), (fmt.ParsedReply("hi"), "length", [{"token": "h"}])],
        prompt_tokens=5,
        completion_tokens=7,
        created=1,
    )
    first, second = response["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert json.loads(first["message"]["tool_calls"][0]["function"]["arguments"]) == {"e": "2*3"}
    assert first["logprobs"] is None
    assert second["finish_reason"] == "length" and second["message"] == {"role": "assistant", "content": "hi"}
    assert second["logprobs"] == {"content": [{"token": "h"}]}
    assert response["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
