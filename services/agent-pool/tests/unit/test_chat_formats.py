"""chat_formats: tool-call parsing and the internal reply both APIs share."""

from __future__ import annotations

import pytest

from molt.agent_pool import chat_formats as fmt

CALL = '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>'


# -- parsing the model's reply ---------------------------------------------------------------------


def test_well_formed_tool_calls_become_structured() -> None:
    reply = fmt.parse_reply(f"Let me compute.\n{CALL}\n{CALL.replace('2*3', '4+5')}")
    assert reply.text == "Let me compute."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("calc", {"e": "2*3"}), ("calc", {"e": "4+5"})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in reply.tool_calls)
    assert len({c.id for c in reply.tool_calls}) == 2
    assert fmt.parse_reply(CALL, "toolu_").tool_calls[0].id.startswith("toolu_")


def test_arguments_default_to_empty() -> None:
    (call,) = fmt.parse_reply('<tool_call>{"name": "now"}</tool_call>').tool_calls
    assert call.name == "now" and call.arguments == {}


@pytest.mark.parametrize(
    "markup",
    [
        '<tool_call>{"name": "calc", "arguments": </tool_call>',  # not JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "calc", "arguments": "2*3"}</tool_call>',  # arguments not an object
        '<tool_call>["calc"]</tool_call>',  # not an object
        '<tool_call>{"name": "calc"}',  # never closed
    ],
)
def test_malformed_tool_calls_stay_text(markup: str) -> None:
    text = f"before {markup} after"
    reply = fmt.parse_reply(text)
    assert reply.tool_calls == [] and reply.text == text  # untouched, not even stripped


def test_a_malformed_call_beside_a_good_one_stays_in_the_text() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    reply = fmt.parse_reply(f"{bad}{CALL}")
    assert len(reply.tool_calls) == 1 and reply.text == bad


def test_internal_reply_keeps_arguments_as_objects() -> None:
    message = fmt.internal_reply(fmt.parse_reply(f"ok {CALL}"))
    assert message["role"] == "assistant" and message["content"] == "ok"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "calc", "arguments": {"e": "2*3"}}
    assert "tool_calls" not in fmt.internal_reply(fmt.ParsedReply("plain"))
