"""Arithmetic: the default recipe's Env. Exact grader, single turn, small enough for the tiny model.

Prompts (``recipes/data/arithmetic-*.jsonl``) hold a question like ``"37+5"`` (a number
below 100 plus a digit) and its answer; the train and test files hold disjoint problems.
The task has structure a tiny model can learn (digit-wise addition with a carry), so what is
learned on the training problems can carry over to the held-out ones. The reply earns
1.0 when it is exactly the answer (whitespace around it ignored), else 0.0. Regenerate the data with
``uv run python recipes/agents/arithmetic.py --out recipes/data``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from molt.agent_pool.agents import Env, Message, Prompt, StepResult

SYSTEM = "Answer with the number only."


class ArithmeticEnv(Env):
    """One question, one answer, exact match. Its methods never block, so they are ``async``: they run
    on the pool's loop, where a plain method would cost a hand-over to the episode's thread and back
    (~80 us each; recipes/agents/calculator.py is an Env with plain methods)."""

    max_turns = 1

    async def reset(self, prompt: Prompt) -> list[Message]:
        self.answer = str(prompt["answer"])
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{prompt['question']}="}]

    async def step(self, action: str) -> StepResult:
        return StepResult(reward=float(action.strip() == self.answer), done=True)


def problems(max_first: int = 99, max_second: int = 9) -> list[tuple[str, int]]:
    """Every sum ``a+b`` with ``a`` in [0, max_first] and ``b`` in [0, max_second] (1000 by default)."""
    return [(f"{a}+{b}", a + b) for a in range(max_first + 1) for b in range(max_second + 1)]


def split(seed: int = 0, test_fraction: float = 0.1) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Disjoint train / held-out problem sets."""
    shuffled = problems()
    random.Random(seed).shuffle(shuffled)
    cut = int(len(shuffled) * test_fraction)
    return shuffled[cut:], shuffled[:cut]


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the arithmetic prompt sets.")
    parser.add_argument("--out", type=Path, default=Path("recipes/data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, chosen in zip(("train", "test"), split(), strict=True):
        lines = [json.dumps({"id": f"{name}-{q}", "question": q, "answer": a}) for q, a in chosen]
        (args.out / f"arithmetic-{name}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
