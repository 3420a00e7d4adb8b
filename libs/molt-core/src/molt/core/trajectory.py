"""Checks on the queue's payload, ``molt.v1.TrajectoryGroup``.

Producers call ``group_problems`` before queueing and the queue's reader calls
it again on every entry, so a malformed group (wrong array lengths, missing
ids) is refused at the door or dead-lettered, never handed to the learner.
Only structure is checked here (and per-trajectory numbers: a finite reward, one
reward per episode): anything per token would cost more than the Redis round
trip (even summing a group's logprobs made the check ten times slower). Token
ids are checked against the vocabulary, and logprobs for finiteness, by the
learner, vectorised, when it turns them into tensors.
"""

from __future__ import annotations

import math

from molt.core import expert_routing
from molt.v1 import common_pb2


def trajectory_problems(trajectory: common_pb2.Trajectory) -> list[str]:
    """Every way ``trajectory`` breaks the contract in common.proto; empty when valid."""
    problems: list[str] = []
    name = trajectory.trajectory_id or "<no trajectory_id>"
    if not trajectory.trajectory_id:
        problems.append("trajectory_id is empty")
    if not trajectory.rollout_id:
        problems.append(f"{name}: rollout_id is empty")
    if trajectory.segment_index < 0:
        problems.append(f"{name}: segment_index {trajectory.segment_index} < 0")
    if not trajectory.prompt_token_ids:
        problems.append(f"{name}: prompt_token_ids is empty")
    n = len(trajectory.response_token_ids)
    for field in ("rollout_logprobs", "loss_mask", "policy_versions"):
        length = len(getattr(trajectory, field))
        if length != n:
            problems.append(f"{name}: {field} has {length} entries, response_token_ids has {n}")
    if trajectory.HasField("routed_experts"):
        wrong = expert_routing.problem(trajectory.routed_experts, len(trajectory.prompt_token_ids) + n)
        if wrong is not None:
            problems.append(f"{name}: {wrong}")
    if not math.isfinite(trajectory.reward):
        problems.append(f"{name}: reward {trajectory.reward} is not finite")
    return problems


def group_problems(group: common_pb2.TrajectoryGroup, run_id: str | None = None) -> list[str]:
    """Every way ``group`` breaks the contract (and, if given, does not belong to ``run_id``)."""
    problems: list[str] = []
    if not group.group_id:
        problems.append("group_id is empty")
    if run_id is not None and group.run_id != run_id:
        problems.append(f"run_id {group.run_id!r} does not match the queue's run {run_id!r}")
    if not group.trajectories:
        problems.append("group has no trajectories")
    ids = [t.trajectory_id for t in group.trajectories]
    if len(set(ids)) != len(ids):
        problems.append("trajectory_id repeated within the group")
    rewards: dict[str, float] = {}
    for trajectory in group.trajectories:
        problems.extend(trajectory_problems(trajectory))
        first = rewards.setdefault(trajectory.rollout_id, trajectory.reward)
        if first != trajectory.reward and not math.isnan(trajectory.reward):
            problems.append(
                f"segments of rollout {trajectory.rollout_id!r} disagree on the episode's reward "
                f"({first} and {trajectory.reward})"
            )
            rewards[trajectory.rollout_id] = trajectory.reward  # one line per disagreement
    return problems
