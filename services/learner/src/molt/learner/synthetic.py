"""Hand-built ``TrajectoryGroup`` messages for the learner's tests and the queue-fed integration test.

Token ids are deterministic functions of the names, inside the tiny model's
vocabulary; rollout logprobs default to ``log(1/320)``, close to what the tiny
random model (320 ids, near-uniform) assigns, so IS ratios stay near 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from molt.learner.batch import StepBatch, assemble, build_group
from molt.v1 import common_pb2

UNIFORM_LOGPROB = -math.log(320)


def trajectory(
    tid: str,
    prompt: Sequence[int],
    response: Sequence[int],
    *,
    reward: float = 0.0,
    mask: Sequence[bool] | None = None,
    versions: Sequence[int] | None = None,
    rollout_id: str | None = None,
) -> common_pb2.Trajectory:
    """One segment; every response token sampled (mask 1) at version 0 unless told otherwise."""
    n = len(response)
    loss_mask = [True] * n if mask is None else [bool(m) for m in mask]
    return common_pb2.Trajectory(
        trajectory_id=tid,
        rollout_id=rollout_id or f"r-{tid}",
        prompt_token_ids=list(prompt),
        response_token_ids=list(response),
        rollout_logprobs=[UNIFORM_LOGPROB if m else 0.0 for m in loss_mask],
        loss_mask=loss_mask,
        policy_versions=[0] * n if versions is None else list(versions),
        reward=reward,
    )


def group_of(
    group_id: str, trajectories: Sequence[common_pb2.Trajectory], *, run_id: str = "molt", sample_count: int = 0
) -> common_pb2.TrajectoryGroup:
    """A group of the given segments; ``sample_count`` defaults to their number."""
    return common_pb2.TrajectoryGroup(
        group_id=group_id,
        prompt_id=f"p-{group_id}",
        run_id=run_id,
        sample_count=sample_count or len(trajectories),
        trajectories=list(trajectories),
    )


def named_group(
    name: str,
    rewards: Sequence[float],
    *,
    prompt_len: int = 6,
    response_len: int = 8,
    run_id: str = "molt",
    version: int = 0,
) -> common_pb2.TrajectoryGroup:
    """One sample per reward; sample i has ``response_len + i`` tokens, ids in [3, 253)."""
    base = sum(map(ord, name))
    samples = [
        trajectory(
            f"{name}-{i}",
            [(base + 7 * k) % 250 + 3 for k in range(prompt_len)],
            [(base + 13 * i + 5 * k) % 250 + 3 for k in range(response_len + i)],
            reward=reward,
            versions=[version] * (response_len + i),
        )
        for i, reward in enumerate(rewards)
    ]
    return group_of(name, samples, run_id=run_id)


def step_batch(groups: dict[str, list[float]], vocab_size: int = 320) -> StepBatch:
    """The learner's ``StepBatch`` of ``named_group(name, rewards)`` for each entry, at version 0."""
    samples = []
    for name, rewards in groups.items():
        outcome = build_group(
            named_group(name, rewards),
            vocab_size=vocab_size,
            current_version=0,
            max_staleness=100,
            consumed=set(),
            needs_groups=True,
        )
        samples += outcome.samples
    return assemble(samples)
