"""The long-tailed workload of ``bench/async.py``: an Env whose response budget per episode is heavy-tailed.

Each episode draws its per-turn token budget (``Env.max_tokens``) from a Pareto
distribution with scale 16 tokens and shape 1.5, capped at ``CAP``: median ~25,
p90 ~74, p99 ~345, mean ~43 tokens before the cap. The tiny random model
rarely samples the end-of-turn token, so most responses use their whole
budget; the bench prints the lengths it measured. The reward (does the reply
contain the digit 7) only has to vary within a group so that GRPO has
something to weigh; nothing here is meant to be learned.
"""

from __future__ import annotations

import random

from molt.agent_pool.agents import Env, Message, Prompt, StepResult

SCALE = 16
SHAPE = 1.5
CAP = 512


def budget(rng: random.Random) -> int:
    """One draw: ``min(CAP, floor(SCALE * Pareto(SHAPE)))``."""
    return min(CAP, int(SCALE * rng.paretovariate(SHAPE)))


class LongTailEnv(Env):
    """One turn; the budget of the turn is drawn per episode."""

    max_turns = 1
    rng = random.Random(0)

    def reset(self, prompt: Prompt) -> list[Message]:
        self.max_tokens = budget(self.rng)
        return [{"role": "user", "content": f"Tell me about {prompt['question']}."}]

    def step(self, action: str) -> StepResult:
        return StepResult(reward=float("7" in action), done=True)
