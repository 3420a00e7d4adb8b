"""The public agent API: what a user writes to make an agent trainable.

Two shapes, chosen in the recipe by ``agent = "package.module:Class"`` or ``"path/to/file.py:Class"``:
``Env``, where molt drives the LLM loop (``reset(prompt)`` gives the first messages, ``step(action_text)``
the next observation, reward and done flag; observation tokens are masked out of the loss), and
``ChatAgent``, your own loop (``run(client, prompt)`` gets OpenAI and Anthropic SDK clients pointed at
molt's HTTP front, which records the exact sampled tokens, and returns the episode's reward).
Methods may be plain or ``async``; how each runs, on the pool's loop or the episode's thread: ``calls``.
One instance serves one episode (molt makes a fresh one per episode), so instance state is safe;
state shared across episodes must be thread-safe when methods are plain.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # chat_formats and tools import this module
    from molt.agent_pool.chat_formats import ParsedReply
    from molt.agent_pool.tools import Tool

Message = dict[str, Any]  # an OpenAI-style chat message: {"role": ..., "content": ..., ["tool_calls"]}
Prompt = dict[str, Any]  # one row of the prompt dataset (molt.agent_pool.dataset)


@dataclass
class StepResult:
    """What ``Env.step`` returns. ``observation``: messages to append (tool output, feedback); None when done."""

    observation: list[Message] | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentResult:
    """What ``ChatAgent.run`` returns: the episode's reward and optional named components for logging."""

    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """An environment molt drives: the model's text goes in, observations and rewards come out.

    Class attributes: ``tools`` (``@tool`` functions, ``molt.agent_pool.tools``, or plain OpenAI tool
    schemas, rendered into the prompt; ``call_tools`` runs the model's calls to the former), ``max_turns``,
    ``max_tokens`` (sampled tokens per turn; ``None``: the pool's ``max_tokens``; an Env may set it
    per episode in ``reset``, and it never exceeds the pool's).

    Example::

        class Countdown(Env):
            async def reset(self, prompt):
                self.target = prompt["answer"]
                return [{"role": "user", "content": prompt["question"]}]

            async def step(self, action):
                return StepResult(reward=float(action.strip() == self.target), done=True)
    """

    tools: list[Tool | dict[str, Any]] | None = None
    max_turns: int = 8
    max_tokens: int | None = None

    async def call_tools(self, reply: ParsedReply) -> list[Message]:
        """Runs the reply's tool calls against this Env's ``@tool`` functions (untrusted ones in the
        sandbox); one ``tool`` message per call, an ``error: ...`` one for a call that failed."""
        from molt.agent_pool.tools import call_tools

        return await call_tools(self.tools, reply)

    @abstractmethod
    def reset(self, prompt: Prompt) -> list[Message] | Awaitable[list[Message]]:
        """The first messages of the episode (system and/or user)."""

    @abstractmethod
    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Reacts to the model's reply text (tool calls appear as ``<tool_call>...</tool_call>`` markup)."""


class ChatAgent(ABC):
    """An agent with its own loop, talking to molt's OpenAI/Anthropic-compatible front."""

    @abstractmethod
    def run(self, client: Any, prompt: Prompt) -> AgentResult | float | Awaitable[AgentResult | float]:
        """Runs one episode with ``client`` (an ``openai.AsyncOpenAI``) or ``self.anthropic`` (an
        ``anthropic.AsyncAnthropic`` on the same episode). A plain ``def run`` runs on the episode's
        thread and gets ``openai.OpenAI`` and ``anthropic.Anthropic`` instead."""

    anthropic: Any = None


def load_agent(spec: str) -> type[Env] | type[ChatAgent]:
    """Resolves ``module:Class`` or ``path/file.py:Class`` to an Env or ChatAgent subclass."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"agent {spec!r} must look like 'package.module:Class' or 'path/to/file.py:Class'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"agent file {path} does not exist")
        module_name = f"molt_agent_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"cannot load {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    cls = getattr(module, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, (Env, ChatAgent))):
        raise ValueError(f"{spec!r} is not an Env or ChatAgent subclass")
    if cls in (Env, ChatAgent) or inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ())) or ["everything"]
        raise ValueError(f"{spec!r} is abstract: it does not implement {', '.join(missing)}")
    return cls
