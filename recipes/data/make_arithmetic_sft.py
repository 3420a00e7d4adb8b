"""Writes ``recipes/data/arithmetic-sft.jsonl``: chat data for the tiny recipe's SFT warm-up.

One conversation per line, ``{"messages": [system, user, assistant]}``, rendered
exactly as ``ArithmeticEnv`` (``recipes/agents/arithmetic.py``) prompts: the
system message ``SYSTEM``, the user turn ``"<question>="`` and, as the
assistant's reply, the answer alone. The problems are the Env's training
split (``split()``), so none of the held-out test problems is seen in SFT.
Deterministic: the same seed writes the same file.

    uv run python recipes/data/make_arithmetic_sft.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ENV_FILE = HERE.parent / "agents" / "arithmetic.py"


def load_env_module() -> ModuleType:
    """``recipes/agents/arithmetic.py`` (a file, not an installed package), for its prompt and split."""
    spec = importlib.util.spec_from_file_location("arithmetic_env", ENV_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conversations(seed: int, fraction: float) -> list[dict[str, list[dict[str, str]]]]:
    """A ``fraction`` of the training problems (shuffled with ``seed``), as chat conversations."""
    env = load_env_module()
    train, test = env.split()
    held_out = {question for question, _ in test}
    chosen = list(train)
    random.Random(seed).shuffle(chosen)
    chosen = chosen[: max(1, round(len(chosen) * fraction))]
    assert not held_out & {question for question, _ in chosen}, "SFT data must not contain test problems"
    return [
        {
            "messages": [
                {"role": "system", "content": env.SYSTEM},
                {"role": "user", "content": f"{question}="},
                {"role": "assistant", "content": str(answer)},
            ]
        }
        for question, answer in chosen
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the arithmetic SFT warm-up data.")
    parser.add_argument("--out", type=Path, default=HERE / "arithmetic-sft.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed of the chosen problems")
    parser.add_argument("--fraction", type=float, default=1.0, help="share of the training problems to use")
    args = parser.parse_args()
    lines = [json.dumps(record) for record in conversations(args.seed, args.fraction)]
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
