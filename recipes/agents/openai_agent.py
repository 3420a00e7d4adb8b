"""A ChatAgent written against the official ``openai`` SDK: arithmetic through Chat Completions.

Nothing molt-specific happens inside ``run``: the client is an ordinary
``openai.AsyncOpenAI`` whose base URL points at the agent-pool's front, so an
agent that already exists keeps its code and molt records the exact tokens.
"""

from __future__ import annotations

from typing import Any

from molt.agent_pool.agents import AgentResult, ChatAgent, Prompt


class OpenAIArithmetic(ChatAgent):
    async def run(self, client: Any, prompt: Prompt) -> AgentResult:
        response = await client.chat.completions.create(
            model="policy",
            messages=[
                {"role": "system", "content": "Answer with the number only."},
                {"role": "user", "content": f"{prompt['question']}="},
            ],
            max_tokens=8,
        )
        answer = (response.choices[0].message.content or "").strip()
        return AgentResult(reward=float(answer == str(prompt["answer"])))
