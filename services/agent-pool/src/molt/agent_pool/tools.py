"""Tools an ``Env`` offers the model: a function, its schema, and whether its code is trusted.

``@tool`` turns a function into a ``Tool``: its schema (name, the docstring's first paragraph, JSON
types from the annotations) is rendered into the prompt, and ``Env.call_tools`` runs the model's calls
to it. A trusted tool runs in the pool's process (a plain function on a worker thread, a coroutine on
the event loop). A tool marked ``untrusted=True`` - one that runs what the model wrote, or touches
anything the model chose - runs in ``molt.agent_pool.sandbox`` instead: a fresh interpreter with no
network, no other process in sight, CPU, memory, file-size and wall-time limits and a scratch
directory. Its function is sent there as source, so it must be self-contained: its imports inside it,
the standard library only, no names from its module. A call that fails (an unknown tool, wrong
arguments, an exception, a limit) comes back to the model as an ``error: ...`` tool message; the
episode and the pool go on.

Example::

    @tool(untrusted=True, limits=SandboxLimits(cpu_s=2))
    def python(code: str) -> str:
        \"\"\"Runs Python code and returns what it printed.\"\"\"
        exec(code, {"__name__": "__main__"})
        return ""
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from molt.agent_pool.chat_formats import ParsedReply, ToolCall
from molt.agent_pool.sandbox import SandboxLimits, run_python

log = logging.getLogger(__name__)

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
# The sandbox's program after the tool's source: call it with the model's arguments, print the result.
CALL = """
import json as _json, sys as _sys
_result = {name}(**_json.loads({arguments!r}))
_sys.stdout.write(_result if isinstance(_result, str) else _json.dumps(_result))
"""


@dataclass(frozen=True)
class Tool:
    """A function the model may call (see the module docstring); build it with ``@tool``."""

    function: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]
    untrusted: bool = False
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    source: str = ""  # an untrusted tool's self-contained source, as the sandbox runs it

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema rendered into the prompt."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def call(self, arguments: dict[str, Any]) -> str:
        """Runs the tool on the model's ``arguments``; what it returned, as text for the tool message."""
        if self.untrusted:
            program = self.source + CALL.format(name=self.function.__name__, arguments=json.dumps(arguments))
            return (await run_python(program, self.limits)).for_the_model()
        if inspect.iscoroutinefunction(self.function):
            result = await self.function(**arguments)
        else:
            result = await asyncio.to_thread(self.function, **arguments)
        return result if isinstance(result, str) else json.dumps(result)


def _parameters(function: Callable[..., Any]) -> dict[str, Any]:
    """A JSON schema of the function's parameters, from their annotations (untyped ones take any value)."""
    hints = inspect.get_annotations(function, eval_str=True)
    properties: dict[str, Any] = {}
    required = []
    for name, parameter in inspect.signature(function).parameters.items():
        kind = JSON_TYPES.get(hints.get(name))  # type: ignore[arg-type]
        properties[name] = {"type": kind} if kind else {}
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def _source(function: Callable[..., Any]) -> str:
    """The function's own source without its decorators; ``ValueError`` when there is none to send."""
    if not inspect.isfunction(function) or function.__name__ == "<lambda>" or function.__closure__:
        raise ValueError(f"untrusted tool {function!r}: it must be a plain, module-level function (its source runs)")
    try:
        lines = textwrap.dedent(inspect.getsource(function)).splitlines()
    except (OSError, TypeError) as exc:
        raise ValueError(f"untrusted tool {function.__name__}: its source cannot be read ({exc})") from exc
    start = next(i for i, line in enumerate(lines) if line.startswith(("def ", "async def ")))
    if lines[start].startswith("async"):
        raise ValueError(f"untrusted tool {function.__name__}: it must be a plain def (it runs in its own process)")
    return "\n".join(lines[start:]) + "\n"


def tool(
    function: Callable[..., Any] | None = None,
    *,
    untrusted: bool = False,
    limits: SandboxLimits | None = None,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> Any:
    """``@tool`` or ``@tool(untrusted=True, ...)``: the function as a ``Tool`` (module docstring)."""

    def make(fn: Callable[..., Any]) -> Tool:
        doc = inspect.getdoc(fn) or ""
        return Tool(
            function=fn,
            name=name or fn.__name__,
            description=description if description is not None else doc.split("\n\n")[0].replace("\n", " "),
            parameters=parameters or _parameters(fn),
            untrusted=untrusted,
            limits=limits or SandboxLimits(),
            source=_source(fn) if untrusted else "",
        )

    return make(function) if function is not None else make


def tool_schemas(tools: Sequence[Tool | dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """An Env's ``tools`` as the schemas the prompt renders (plain schemas pass through)."""
    if tools is None:
        return None
    return [item.schema if isinstance(item, Tool) else item for item in tools]


async def call_tools(tools: Sequence[Tool | dict[str, Any]] | None, reply: ParsedReply) -> list[dict[str, Any]]:
    """Runs each of ``reply``'s tool calls against ``tools`` (in order); one ``tool`` message per call."""
    by_name = {item.name: item for item in tools or () if isinstance(item, Tool)}
    return [
        {"role": "tool", "tool_call_id": call.id, "content": await _call_one(by_name, call)}
        for call in reply.tool_calls
    ]


async def _call_one(by_name: dict[str, Tool], call: ToolCall) -> str:
    found = by_name.get(call.name)
    if found is None:
        return f"error: no tool named {call.name!r}; the tools are {sorted(by_name)}"
    problem = _argument_problem(found, call.arguments)
    if problem:
        return f"error: {call.name}: {problem}"
    try:
        return await found.call(call.arguments)
    except Exception as exc:  # the tool's own failure is the model's to see; the episode goes on
        log.info("a tool call failed", extra={"tool": call.name, "error": repr(exc)})
        return f"error: {call.name} failed: {type(exc).__name__}: {exc}"


def _argument_problem(found: Tool, arguments: dict[str, Any]) -> str:
    """Why ``arguments`` do not fit the tool's parameters ("" when they do): unknown or missing names,
    or a value of the wrong JSON type."""
    properties = found.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    missing = sorted(set(found.parameters.get("required", ())) - set(arguments))
    if unknown or missing:
        return f"unknown arguments {unknown}, missing {missing}; it takes {sorted(properties)}"
    for key, value in arguments.items():
        kind = properties[key].get("type")
        expected = next((t for t, name in JSON_TYPES.items() if name == kind), None)
        if expected is not None and not _fits(value, expected):
            article = "an" if str(kind)[0] in "aeiou" else "a"
            return f"argument {key!r} must be {article} {kind}, not {type(value).__name__}"
    return ""


def _fits(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)
