"""anthropic_api: Anthropic request conversion and checks, response shapes."""

from __future__ import annotations

from typing import Any

import pytest

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool.anthropic_api import anthropic_messages, anthropic_response, anthropic_tools
from molt.core.errors import InvalidInput

CALL = '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>'


# -- Anthropic requests ------------------------------------------------------------------------------


def test_anthropic_messages_with_tool_use_and_results() -> None:
    messages = anthropic_messages(
        [{"type": "text", "text": "be brief"}],
        [
            {"role": "user", "content": "what is 2*3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "computing"},
                    {"type": "tool_use", "id": "t1", "name": "calc", "input": {"e": "2*3"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "6"},
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
    )
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2*3?"},
        {
            "role": "assistant",
            "content": "computing",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "calc", "arguments": {"e": "2*3"}}}],
        },
        {"role": "tool", "content": "6", "tool_call_id": "t1"},
        {"role": "user", "content": "and now?"},
    ]


def test_a_user_turn_of_only_tool_results_adds_no_empty_user_message() -> None:
    messages = anthropic_messages(
        None, [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]}]
    )
    assert messages == [{"role": "tool", "content": "1", "tool_call_id": "t"}]


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ([], "non-empty list"),
        ([{"role": "system", "content": "x"}], "role must be 'user' or 'assistant'"),
        ([{"role": "user"}], "has no content"),
        ([{"role": "user", "content": 5}], "string or a list of blocks"),
        ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}], "unsupported content block"),
        ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}], "unsupported"),
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "'image'"),
        ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}], "needs a name"),
        ([{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "The sum is"}], "prefill"),
    ],
)
def test_anthropic_messages_refuse_malformed(raw: Any, error: str) -> None:
    with pytest.raises(InvalidInput, match=error):
        anthropic_messages(None, raw)


def test_anthropic_tools_become_openai_schemas() -> None:
    assert anthropic_tools(None) is None and anthropic_tools([]) is None
    (tool,) = anthropic_tools([{"name": "calc", "input_schema": {"type": "object"}}])
    assert tool == {
        "type": "function",
        "function": {"name": "calc", "description": "", "parameters": {"type": "object"}},
    }
    with pytest.raises(InvalidInput, match="with a name"):
        anthropic_tools([{"description": "nameless"}])


@pytest.mark.parametrize(
    ("reply", "finish", "stop_reason", "expected"),
    [
        (fmt.parse_reply(CALL, "toolu_"), "stop", "", "tool_use"),
        (fmt.ParsedReply("x"), "length", "", "max_tokens"),
        (fmt.ParsedReply("x"), "stop", "END", "stop_sequence"),
        (fmt.ParsedReply("x"), "stop", "<|im_end|>", "end_turn"),  # a stop token, not a requested sequence
    ],
)
def test_anthropic_stop_reasons(reply: fmt.ParsedReply, finish: str, stop_reason: str, expected: str) -> None:
    response = anthropic_response("m1", "m", reply, finish, stop_reason, ["END"], 3, 4)
    assert response["stop_reason"] == expected
    assert response["stop_sequence"] == ("END" if expected == "stop_sequence" else None)
    assert response["usage"] == {"input_tokens": 3, "output_tokens": 4}
    kinds = [block["type"] for block in response["content"]]
    assert kinds == (["tool_use"] if expected == "tool_use" else ["text"])
