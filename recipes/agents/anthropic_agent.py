"""A ChatAgent written against the official ``anthropic`` SDK: arithmetic through the Messages API.

``self.anthropic`` is an ordinary ``anthropic.AsyncAnthropic`` pointed at the
agent-pool's front for this episode.
"""

from __future__ import annotations

from typing import Any

from molt.agent_pool.agents import AgentResult, ChatAgent, Prompt


class AnthropicArithmetic(ChatAgent):
    async def run(self, client: Any, prompt: Prompt) -> AgentResult:
        message = await self.anthropic.messages.create(
            model="policy",
            system="Answer with the number only.",
            messages=[{"role": "user", "content": f"{prompt['question']}="}],
            max_tokens=8,
        )
        answer = "".join(block.text for block in message.content if block.type == "text").strip()
        return AgentResult(reward=float(answer == str(prompt["answer"])))
