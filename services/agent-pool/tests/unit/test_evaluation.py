"""Evaluation cadence and settings (the passes themselves run against a real router in tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from molt.agent_pool.config import EvalSettings
from molt.agent_pool.evaluation import due


def test_first_pass_is_always_due() -> None:
    assert due(None, 0, 0) and due(None, 7, 3)


@pytest.mark.parametrize(
    ("last", "current", "every", "expected"),
    [
        (0, 1, 2, False),  # 1 is not a multiple of 2 and none was crossed
        (0, 2, 2, True),
        (1, 2, 2, True),
        (2, 3, 2, False),
        (3, 9, 4, True),  # jumped over 4 and 8: one pass, at 9
        (4, 4, 1, False),  # same version: nothing new to evaluate
        (0, 100, 0, False),  # every_versions = 0: start and stop only
    ],
)
def test_a_pass_is_due_when_the_version_crosses_a_multiple(last: int, current: int, every: int, expected: bool) -> None:
    assert due(last, current, every) is expected


def test_enabled_eval_needs_data() -> None:
    with pytest.raises(ValidationError, match=r"\[agent_pool.eval\] path is not set"):
        EvalSettings(enabled=True)
    assert EvalSettings(enabled=True, path="test.jsonl").samples_per_prompt == 1
    assert not EvalSettings().enabled


def test_a_pass_in_which_every_episode_failed_is_not_recorded_as_a_reward(tmp_path: Path) -> None:
    """Nothing measured is not a reward of 0: the pass fails (logged), writes nothing, and the version
    stays due."""
    import asyncio

    from molt.agent_pool.evaluation import Evaluator

    async def broken(prompt: dict) -> None:
        raise RuntimeError("router down")

    out = tmp_path / "eval.jsonl"
    evaluator = Evaluator(
        EvalSettings(enabled=True, path="test.jsonl"),
        [{"question": "1+1", "answer": 2}],
        broken,
        lambda: 3,
        out,
        5.0,
        2,
    )
    with pytest.raises(RuntimeError, match="every one of the 1 evaluation episodes at version 3 failed"):
        asyncio.run(evaluator.run_pass())
    assert evaluator.results == [] and not out.exists() and evaluator.last_version is None
