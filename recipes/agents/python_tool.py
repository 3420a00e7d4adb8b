"""Python tool: a multi-turn Env whose tool runs Python code the model wrote, in molt's sandbox.

The model may call ``<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>``.
The tool is marked ``untrusted`` (``molt.agent_pool.tools``), so ``call_tools`` runs it through
``molt.agent_pool.sandbox`` (no network, no other process in sight, ``nobody`` when the pool is root,
CPU/memory/file-size/wall limits, a scratch directory), and what the code printed, or why it failed,
comes back as the ``tool`` message. A reply without a tool call is the final answer: reward 1.0 when it
is exactly the expected answer. Prompts: any file with ``question`` and ``answer`` keys (e.g.
``recipes/data/arithmetic-*.jsonl``).
"""

from __future__ import annotations

from molt.agent_pool.agents import Env, Message, Prompt, StepResult
from molt.agent_pool.chat_formats import parse_reply
from molt.agent_pool.sandbox import SandboxLimits
from molt.agent_pool.tools import tool

SYSTEM = "Solve the problem. You may run Python with the python tool. Reply with the final answer only."


@tool(untrusted=True, limits=SandboxLimits(cpu_s=2, wall_s=5.0))
def python(code: str) -> str:
    """Runs Python code (standard library only, no network) and returns what it printed, e.g.
    print(12*(3+4))."""
    exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
    return ""


class PythonToolEnv(Env):
    tools = [python]  # noqa: RUF012 (read-only; the shape Env declares)
    max_turns = 4

    async def reset(self, prompt: Prompt) -> list[Message]:
        self.answer = str(prompt["answer"]).strip()
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(prompt["question"])}]

    async def step(self, action: str) -> StepResult:
        reply = parse_reply(action)
        if not reply.tool_calls:
            return StepResult(reward=float(reply.text.strip() == self.answer), done=True)
        return StepResult(observation=await self.call_tools(reply))
