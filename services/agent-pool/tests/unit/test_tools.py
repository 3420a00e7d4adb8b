"""``@tool`` functions of an Env (``molt.agent_pool.tools``): the schema the prompt shows, a trusted
tool run in the pool's process, an untrusted one run in the sandbox (real subprocesses, real
namespaces) where what it tries against the pool fails, and the error messages a bad call gets back,
after which the Env and the pool go on."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

from molt.agent_pool.agents import Env, StepResult
from molt.agent_pool.chat_formats import ParsedReply, ToolCall
from molt.agent_pool.sandbox import SandboxLimits
from molt.agent_pool.tools import tool, tool_schemas

FAST = SandboxLimits(cpu_s=1, memory_bytes=256 * 1024 * 1024, file_bytes=64 * 1024, wall_s=3.0)
TRUSTED_CALLS: list[int] = []


@tool
def add(a: int, b: int = 0) -> int:
    """Adds two integers.

    Longer notes stay out of the schema."""
    TRUSTED_CALLS.append(a + b)  # the pool's own memory: proof that it ran here
    return a + b


@tool(untrusted=True, limits=FAST)
def inspect_world(host_pid: int, port: int) -> dict:
    """Reports what the code can see and do from where it runs."""
    import os
    import socket

    seen = {"pid": os.getpid(), "killed_host": False, "connected": False}
    try:
        os.kill(host_pid, 0)
        seen["killed_host"] = True
    except OSError:
        pass
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        seen["connected"] = True
    except OSError:
        pass
    return seen


@tool(untrusted=True, limits=FAST)
def spin() -> str:
    """Never returns."""
    while True:
        pass


@tool
def broken() -> str:
    """Always fails."""
    raise RuntimeError("the tool's own bug")


class Tools(Env):
    tools = [add, inspect_world, spin, broken]  # noqa: RUF012

    def reset(self, prompt: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def step(self, action: str) -> StepResult:
        return StepResult(done=True)


def calls(*items: tuple[str, dict[str, Any]]) -> list[str]:
    reply = ParsedReply("", [ToolCall(f"call_{i}", name, args) for i, (name, args) in enumerate(items)])
    messages = asyncio.run(Tools().call_tools(reply))
    assert [m["tool_call_id"] for m in messages] == [f"call_{i}" for i in range(len(items))]
    return [m["content"] for m in messages]


def test_the_schema_comes_from_the_signature_and_the_docstring() -> None:
    (schema, *_) = tool_schemas(Tools.tools) or []
    assert schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a"],
            },
        },
    }
    assert tool_schemas([{"type": "function", "function": {"name": "raw"}}]) == [
        {"type": "function", "function": {"name": "raw"}}
    ]


def test_a_trusted_tool_runs_here_and_an_untrusted_one_in_the_sandbox() -> None:
    TRUSTED_CALLS.clear()
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the pool's own loopback service
        port = listener.getsockname()[1]
        listener.settimeout(0.5)
        out = calls(("add", {"a": 2, "b": 3}), ("inspect_world", {"host_pid": os.getpid(), "port": port}))
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody came
    assert out[0] == "5" and TRUSTED_CALLS == [5]
    assert out[1] == '{"pid": 1, "killed_host": false, "connected": false}'


def test_bad_calls_come_back_as_errors_and_the_next_call_works() -> None:
    out = calls(
        ("nope", {}),
        ("add", {"b": 1}),
        ("add", {"a": "two"}),
        ("add", {"a": 1, "c": 2}),
        ("broken", {}),
        ("spin", {}),
        ("add", {"a": 1}),
    )
    assert out[0].startswith("error: no tool named 'nope'")
    assert out[1] == "error: add: unknown arguments [], missing ['a']; it takes ['a', 'b']"
    assert out[2] == "error: add: argument 'a' must be an integer, not str"
    assert out[3].startswith("error: add: unknown arguments ['c']")
    assert out[4] == "error: broken failed: RuntimeError: the tool's own bug"
    assert out[5] == "error: the code ran past its CPU time limit and was stopped"
    assert out[6] == "1"


def test_an_untrusted_tool_must_be_a_plain_function_it_can_send() -> None:
    offset = 3
    with pytest.raises(ValueError, match="plain, module-level function"):
        tool(untrusted=True)(lambda x: x)
    with pytest.raises(ValueError, match="plain, module-level function"):

        def closure(x: int) -> int:
            return x + offset

        tool(untrusted=True)(closure)

    async def coroutine() -> str:
        return ""

    with pytest.raises(ValueError, match="plain def"):
        tool(untrusted=True)(coroutine)
