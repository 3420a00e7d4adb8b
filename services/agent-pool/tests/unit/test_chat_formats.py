"""chat_formats: tool-call parsing, OpenAI/Anthropic request conversion and checks, response shapes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.front import ChatFront, Turn
from molt.agent_pool.router_client import RouterClient, Sample
from molt.core.errors import InvalidInput

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


# -- OpenAI requests ---------------------------------------------------------------------------------


def test_openai_messages_normalise() -> None:
    messages = fmt.openai_messages(
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
        fmt.openai_messages(raw)


def test_empty_tool_arguments_are_an_empty_object_and_tools_are_checked() -> None:
    """Some clients send ``arguments: ""`` (or null) for a tool without parameters."""
    for empty in ("", "  ", None):
        call = {"id": "c", "function": {"name": "now", "arguments": empty}}
        (message,) = fmt.openai_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
        assert message["tool_calls"][0]["function"]["arguments"] == {}
    tool = {"type": "function", "function": {"name": "now", "parameters": {}}}
    assert fmt.openai_tools([tool]) == [tool] and fmt.openai_tools(None) is None
    for bad in ([1], "abc", [{"type": "function"}], [{"function": {"name": 3}}]):
        with pytest.raises(InvalidInput, match=r"function\.name"):
            fmt.openai_tools(bad)


def test_openai_response_shapes() -> None:
    with_call = fmt.parse_reply(CALL)
    response = fmt.openai_response(
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


# -- Anthropic requests ------------------------------------------------------------------------------


def test_anthropic_messages_with_tool_use_and_results() -> None:
    messages = fmt.anthropic_messages(
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
    messages = fmt.anthropic_messages(
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
        fmt.anthropic_messages(None, raw)


def test_anthropic_tools_become_openai_schemas() -> None:
    assert fmt.anthropic_tools(None) is None and fmt.anthropic_tools([]) is None
    (tool,) = fmt.anthropic_tools([{"name": "calc", "input_schema": {"type": "object"}}])
    assert tool == {
        "type": "function",
        "function": {"name": "calc", "description": "", "parameters": {"type": "object"}},
    }
    with pytest.raises(InvalidInput, match="with a name"):
        fmt.anthropic_tools([{"description": "nameless"}])


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
    response = fmt.anthropic_response("m1", "m", reply, finish, stop_reason, ["END"], 3, 4)
    assert response["stop_reason"] == expected
    assert response["stop_sequence"] == ("END" if expected == "stop_sequence" else None)
    assert response["usage"] == {"input_tokens": 3, "output_tokens": 4}
    kinds = [block["type"] for block in response["content"]]
    assert kinds == (["tool_use"] if expected == "tool_use" else ["text"])


# -- the front parses tool calls only when the request offered tools ----------------------------------


def test_tool_calls_are_parsed_only_when_tools_were_offered(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer.encode(f"sure {CALL}", add_special_tokens=False)

    async def replies() -> tuple[fmt.ParsedReply, fmt.ParsedReply]:
        router = RouterClient("127.0.0.1:9")  # never called: parsing needs no generation
        front = ChatFront(tokenizer, router, TurnLimits(8, 512))
        session = front.open_session()
        offered = Turn(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}], max_tokens=8)
        plain = Turn(messages=[{"role": "user", "content": "x"}], tools=None, max_tokens=8)
        sample = Sample(token_ids=ids)
        result = front._reply(session, offered, sample, "toolu_"), front._reply(session, plain, sample)
        await router.close()
        return result

    with_tools, without_tools = asyncio.run(replies())
    assert [c.name for c in with_tools.tool_calls] == ["calc"] and with_tools.text == "sure"
    assert without_tools.tool_calls == [] and without_tools.text == f"sure {CALL}"
