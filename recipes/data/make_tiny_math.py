"""Writes the tiny math recipe's data (``recipes/tiny-math-cpu.toml``), in a math dataset's file forms.

- ``tiny-math-train.parquet``: the training problems, columns ``id``, ``problem``, ``answer``; the
  answer is a string, as math datasets keep them (a number or LaTeX).
- ``tiny-math-test.jsonl``: the held-out problems, the same columns, one JSON object a line.
- ``tiny-math-sft.jsonl``: the SFT warm-up, ``{"messages": [...]}``: the messages the recipe's Env
  (``recipes/agents/tiny_math.py``) returns for the row, then the answer as the reply: in
  ``\\boxed{}`` for a quarter of the rows, bare for the rest, so that the warm-up teaches the sums
  and leaves most of the answer format to RL (as the tiny recipe's warm-up leaves stopping after
  the number to it); the training problems only, so no held-out problem is seen in SFT.

The problems are the arithmetic Env's (``recipes/agents/arithmetic.py``: a number below 100 plus a
digit, train and held-out disjoint), which the tiny model can learn. Deterministic.

    uv run python recipes/data/make_tiny_math.py
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from make_arithmetic_sft import load_env_module

from molt.agent_pool.envs.math import MathEnv

BOXED_EVERY = 4  # one SFT reply in this many is boxed

HERE = Path(__file__).resolve().parent


def rows(name: str, problems: list[tuple[str, int]]) -> list[dict[str, str]]:
    return [{"id": f"math-{name}-{q}", "problem": q, "answer": str(answer)} for q, answer in problems]


def sft_conversation(env: MathEnv, row: dict[str, str], boxed: bool) -> dict[str, list[dict[str, str]]]:
    """What ``env`` asks for ``row``, answered: rendered by the Env itself, so the two cannot drift."""
    messages = asyncio.run(env.reset(row | {"question": row["problem"]}))
    answer = f"\\boxed{{{row['answer']}}}" if boxed else row["answer"]
    return {"messages": [*messages, {"role": "assistant", "content": answer}]}


def recipe_env() -> MathEnv:
    """The recipe's Env (``recipes/agents/tiny_math.py``, a file, not an installed package)."""
    spec = importlib.util.spec_from_file_location("tiny_math_env", HERE.parent / "agents" / "tiny_math.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyMathEnv()


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the tiny math recipe's train, held-out and SFT data.")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    train_problems, test_problems = load_env_module().split()
    train, test = rows("train", train_problems), rows("test", test_problems)
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}, "train and held-out must be disjoint"
    pq.write_table(pa.Table.from_pylist(train), args.out / "tiny-math-train.parquet")
    (args.out / "tiny-math-test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in test))
    env = recipe_env()
    sft = "".join(
        json.dumps(sft_conversation(env, row, index % BOXED_EVERY == 0)) + "\n" for index, row in enumerate(train)
    )
    (args.out / "tiny-math-sft.jsonl").write_text(sft)


if __name__ == "__main__":
    main()
