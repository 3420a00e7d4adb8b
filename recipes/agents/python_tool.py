"""Python tool: a multi-turn Env whose tool runs Python code the model wrote, in molt's sandbox.

The model may call ``<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>``;
the code is untrusted, so it runs through ``molt.agent_pool.sandbox.run_python`` (no network, no
other process in sight, ``nobody`` when the pool is root, CPU/memory/file-size/wall limits, a
scratch directory) and what it printed, or why it failed, comes back as the ``tool`` message. A
reply without a tool call is the final answer: reward 1.0 when it is exactly the expected answer.
Prompts: any file with ``question`` and ``answer`` keys (e.g. ``recipes/data/arithmetic-*.jsonl``).
"""

from __future__ import annotations

from molt.agent_pool.agents import Env, Message, Prompt, StepResult
from molt.agent_pool.chat_formats import parse_reply
from molt.agent_pool.sandbox import SandboxLimits, run_python

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs Python code (standard library only, no network) and returns what it printed.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "e.g. print(12*(3+4))"}},
            "required": ["code"],
        },
    },
}
SYSTEM = "Solve the problem. You may run Python with the python tool. Reply with the final answer only."


class PythonToolEnv(Env):
    tools = [PYTHON_TOOL]  # noqa: RUF012 (read-only; the shape Env declares)
    max_turns = 4
    limits = SandboxLimits(cpu_s=2, wall_s=5.0)

    async def reset(self, prompt: Prompt) -> list[Message]:
        self.answer = str(prompt["answer"]).strip()
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(prompt["question"])}]

    async def step(self, action: str) -> StepResult:
        reply = parse_reply(action)
        if not reply.tool_calls:
            return StepResult(reward=float(reply.text.strip() == self.answer), done=True)
        messages: list[Message] = []
        for call in reply.tool_calls:
            code = str(call.arguments.get("code", "")) if call.name == "python" else ""
            output = (await run_python(code, self.limits)).for_the_model() if code else "error: call python with code"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        return StepResult(observation=messages)
