"""The same arithmetic agent written as blocking code, on the official ``openai`` SDK's sync client.

An agent that exists as plain (non-``async``) code keeps it: molt runs a plain
``run`` on a thread of its episode's own and hands it an ``openai.OpenAI``
(and ``self.anthropic``, an ``anthropic.Anthropic``) pointed at the front, so
a blocking call holds only its own episode.
"""

from __future__ import annotations

from typing import Any

from molt.agent_pool.agents import AgentResult, ChatAgent, Prompt


class BlockingOpenAIArithmetic(ChatAgent):
    def run(self, client: Any, prompt: Prompt) -> AgentResult:
        response = client.chat.completions.create(
            model="policy",
            messages=[
                {"role": "system", "content": "Answer with the number only."},
                {"role": "user", "content": f"{prompt['question']}="},
            ],
            max_tokens=8,
        )
        answer = (response.choices[0].message.content or "").strip()
        return AgentResult(reward=float(answer == str(prompt["answer"])))
