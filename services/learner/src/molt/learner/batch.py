"""From queue payloads to training samples: ``TrajectoryGroup`` protobufs in, ``Sample`` tensors out.

``build_group`` turns one group into samples the moment it is read and drops,
counted by reason (``DropReason``), what must not be trained on; ``assemble``
gives the samples of one optimizer step the integer group and rollout ids the
estimators in ``molt.algos.advantages`` take; ``padded`` lays per-token arrays on
an ``[S, T]`` grid for the step-wide statistics (advantages, aggregation weights).

Token arrays use the *next-token* axis: entry ``k`` of ``loss_mask``,
``rollout_logprobs`` and ``policy_versions`` describes ``input_ids[k + 1]``, the
token the model predicts from position ``k``. The prompt is never empty (the
queue checks it), so every response token has a predecessor. ``Sample.routing``
(routing replay, docs/moe.md) is on the token axis instead: row ``t`` holds the
experts used when ``input_ids[t]`` was the model's input.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from molt.core import expert_routing
from molt.v1 import common_pb2

log = logging.getLogger(__name__)

DropReason = Literal[
    "invalid_token",
    "invalid_logprob",
    "invalid_version",
    "stale",
    "future_version",
    "too_long",
    "duplicate",
    "no_loss_tokens",
    "no_routing",
    "group_of_one",
]  # the loop adds "refused_step": samples of a step the trainer refused (a non-finite value)


@dataclass(frozen=True)
class Sample:
    """One trajectory (segment) as the learner trains on it."""

    trajectory_id: str
    group_key: str  # the queue entry's id (else TrajectoryGroup.group_id): samples normalised together
    rollout_key: str  # group_key + Trajectory.rollout_id: segments of one episode share it
    input_ids: Tensor  # [L] int64: prompt + response
    loss_mask: Tensor  # [L - 1] bool, next-token axis: true where input_ids[k + 1] was sampled by the policy
    rollout_logprobs: Tensor  # [L - 1] float32, next-token axis; 0 off the mask
    policy_versions: Tensor  # [L - 1] int64, next-token axis; the prompt positions repeat the first version
    reward: float
    # [L, layers, top_k] int16 (-1: none), token axis: the engine's experts, read only under routing replay
    routing: Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class GroupOutcome:
    """What ``build_group`` kept, and what it dropped by reason (counted in trajectories)."""

    samples: list[Sample]
    dropped: Counter[str]


def _sample(key: str, t: common_pb2.Trajectory) -> Sample:
    prompt = torch.tensor(list(t.prompt_token_ids), dtype=torch.int64)
    response = torch.tensor(list(t.response_token_ids), dtype=torch.int64)
    mask = torch.tensor(list(t.loss_mask), dtype=torch.bool)
    versions = torch.tensor(list(t.policy_versions), dtype=torch.int64)
    first_version = versions[:1] if versions.numel() else torch.zeros(1, dtype=torch.int64)
    pad = prompt.numel() - 1  # prompt positions that predict prompt tokens
    return Sample(
        trajectory_id=t.trajectory_id,
        group_key=key,
        rollout_key=f"{key}/{t.rollout_id}",
        input_ids=torch.cat([prompt, response]),
        loss_mask=torch.cat([torch.zeros(pad, dtype=torch.bool), mask]),
        rollout_logprobs=torch.cat([torch.zeros(pad), torch.tensor(list(t.rollout_logprobs), dtype=torch.float32)]),
        policy_versions=torch.cat([first_version.expand(pad), versions]),
        reward=float(t.reward),
    )


def _invalid_token(group: common_pb2.TrajectoryGroup, vocab_size: int) -> str | None:
    """A description of the first out-of-vocabulary token id of the group, or None (one vectorised check)."""
    ids = torch.tensor(
        [i for t in group.trajectories for field in (t.prompt_token_ids, t.response_token_ids) for i in field],
        dtype=torch.int64,
    )
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if not bad.numel():
        return None
    return f"token id {int(ids[bad[0, 0]])} is outside the vocabulary [0, {vocab_size})"


def _invalid_version(group: common_pb2.TrajectoryGroup) -> str | None:
    """A description of the group's policy version below 0, or None: versions count from 0, and one
    below would pass the staleness check as merely old."""
    versions = torch.tensor([v for t in group.trajectories for v in t.policy_versions], dtype=torch.int64)
    if not versions.numel() or int(versions.min()) >= 0:
        return None
    return f"policy version {int(versions.min())} is below 0"


def _routing(t: common_pb2.Trajectory, shape: tuple[int, int]) -> Tensor | str:
    """The trajectory's routing, ``[L, layers, top_k]`` int16, or what makes it unusable for a policy of
    ``shape`` = (decoder layers, experts per token)."""
    if not t.HasField("routed_experts"):
        return "the trajectory carries no routed_experts"
    routing = t.routed_experts
    wrong = expert_routing.problem(routing, len(t.prompt_token_ids) + len(t.response_token_ids))
    if wrong is None and (routing.layer_count, routing.top_k) != shape:
        wrong = (
            f"routed_experts has {routing.layer_count} layers and top_k {routing.top_k}; "
            f"the policy has {shape[0]} and {shape[1]}"
        )
    return wrong if wrong is not None else torch.from_numpy(expert_routing.unpack(routing))


# Why samples are dropped, in the order they are checked: a group's first reason names it.
DROP_REASONS = (
    "invalid_token",
    "invalid_logprob",
    "invalid_version",
    "group_of_one",
    "duplicate",
    "too_long",
    "no_loss_tokens",
    "no_routing",
    "future_version",
    "stale",
)


def first_reason(dropped: Counter[str]) -> str:
    """The reason, of those in ``dropped``, that is checked first (another name as it is; "unknown": none)."""
    return next((r for r in DROP_REASONS if dropped.get(r)), next(iter(dropped), "unknown"))


def _whole_group_problem(
    group: common_pb2.TrajectoryGroup, vocab_size: int, needs_groups: bool
) -> tuple[str, str, dict[str, object]] | None:
    """(reason, log message, log fields) of what drops ``group`` whole, in precedence order, or None."""
    problem = _invalid_token(group, vocab_size)
    if problem is not None:
        return "invalid_token", "dropping a group with an invalid token", {"problem": problem}
    bad = next((t for t in group.trajectories if not all(map(math.isfinite, t.rollout_logprobs))), None)
    if bad is not None:
        return (
            "invalid_logprob",
            "dropping a group with a logprob that is not finite",
            {"trajectoryId": bad.trajectory_id},
        )
    problem = _invalid_version(group)
    if problem is not None:
        return "invalid_version", "dropping a group with a policy version below 0", {"problem": problem}
    if needs_groups and group.sample_count < 2:
        message = "dropping a group produced with sample_count < 2: the estimator compares samples of one prompt"
        return "group_of_one", message, {"sampleCount": group.sample_count, "trajectories": len(group.trajectories)}
    return None


def build_group(
    group: common_pb2.TrajectoryGroup,
    *,
    vocab_size: int,
    current_version: int,
    max_staleness: int,
    consumed: Container[str],
    needs_groups: bool,
    key: str | None = None,
    max_length: int | None = None,
    routing_shape: tuple[int, int] | None = None,
) -> GroupOutcome:
    """Samples of ``group`` that may be trained on at ``current_version``; the rest counted by reason.

    A producer's bug drops the whole group before anything else is looked at, so it is reported as
    what it is (docs/queue.md, "Drop reasons"): ``invalid_token``, then ``invalid_logprob``, then
    ``invalid_version``, ``group_of_one``, ``duplicate``; then each sample on its own: ``too_long``,
    ``no_loss_tokens``, ``no_routing``, ``future_version``, ``stale``.

    ``consumed``: trajectory ids already trained on (an entry holding one came again after a crash).
    ``needs_groups``: the estimator normalises within a group, so a group produced with
    ``sample_count`` < 2 carries no signal and is dropped whole ("group_of_one").
    ``key``: the group's identity in the step (the queue entry id; default its ``group_id``).
    ``max_length``: the most prompt + response tokens of a sample trained on (longer: "too_long").
    ``routing_shape``: (decoder layers, experts per token) of the policy when routing replay is on: a
    sample must carry readable ``routed_experts`` of that shape over all its tokens ("no_routing"),
    kept in ``Sample.routing``; None (replay off): routing is not read.
    Entries that reuse a ``group_id`` or ``rollout_id`` are never merged.
    """
    whole = _whole_group_problem(group, vocab_size, needs_groups)
    if whole is not None:
        reason, message, extra = whole
        log.warning(message, extra={"groupId": group.group_id, **extra})
        return GroupOutcome([], Counter({reason: len(group.trajectories)}))
    if any(t.trajectory_id in consumed for t in group.trajectories):
        # Delivered again after its step's checkpoint (the learner died before the ack), which counted
        # its other drops and trained the rest: all of it is a copy.
        return GroupOutcome([], Counter({"duplicate": len(group.trajectories)}))
    dropped: Counter[str] = Counter()
    samples: list[Sample] = []
    for trajectory in group.trajectories:
        length = len(trajectory.prompt_token_ids) + len(trajectory.response_token_ids)
        if max_length is not None and length > max_length:
            log.warning(
                "dropping a sample longer than the learner trains",
                extra={"trajectoryId": trajectory.trajectory_id, "tokens": length, "maxLength": max_length},
            )
            dropped["too_long"] += 1
            continue
        sample = _sample(key or group.group_id, trajectory)
        if not sample.loss_tokens:
            dropped["no_loss_tokens"] += 1
            continue
        if routing_shape is not None:
            routing = _routing(trajectory, routing_shape)
            if isinstance(routing, str):
                log.warning(
                    "dropping a sample without usable expert routing (routing replay is on)",
                    extra={"trajectoryId": trajectory.trajectory_id, "problem": routing},
                )
                dropped["no_routing"] += 1
                continue
            sample = replace(sample, routing=routing)
        versions = sample.policy_versions[sample.loss_mask]
        if int(versions.max()) > current_version:
            log.warning(
                "dropping a sample of a policy version newer than the learner's",
                extra={
                    "trajectoryId": trajectory.trajectory_id,
                    "version": int(versions.max()),
                    "learnerVersion": current_version,
                },
            )
            dropped["future_version"] += 1
            continue
        if current_version - int(versions.min()) > max_staleness:
            dropped["stale"] += 1
            continue
        samples.append(sample)
    return GroupOutcome(samples, dropped)


@dataclass(frozen=True)
class StepBatch:
    """The samples of one optimizer step (the global batch, identical on every rank) and their ids."""

    samples: list[Sample]
    group_ids: Tensor  # [S] int64, 0..G-1 in first-seen order
    rollout_ids: Tensor  # [S] int64, 0..E-1 in first-seen order; segments of one episode share one
    rewards: Tensor  # [S] float32

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.samples]

    @property
    def trajectory_ids(self) -> list[str]:
        return [s.trajectory_id for s in self.samples]


def _dense_ids(keys: Sequence[str]) -> Tensor:
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.int64)


def assemble(samples: Sequence[Sample]) -> StepBatch:
    """Gives the step's samples dense integer group and rollout ids (the estimators' inputs)."""
    if not samples:
        raise ValueError("a step needs at least one sample")
    return StepBatch(
        samples=list(samples),
        group_ids=_dense_ids([s.group_key for s in samples]),
        rollout_ids=_dense_ids([s.rollout_key for s in samples]),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
    )


def padded(rows: Sequence[Tensor], width: int | None = None) -> Tensor:
    """Right-pads 1-D tensors with zeros (False) to ``[len(rows), width]`` (default: the longest row)."""
    width = max(int(r.numel()) for r in rows) if width is None else width
    out = torch.zeros((len(rows), width), dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def batch_stats(batch: StepBatch, current_version: int) -> dict[str, float]:
    """Reward statistics per episode (an episode's segments count once), staleness per loss token and
    response length (sampled tokens per sample)."""
    _, first = torch.unique(batch.rollout_ids, return_inverse=True)
    episodes = int(first.max()) + 1
    rewards = torch.zeros(episodes, dtype=torch.float64).scatter_(0, first, batch.rewards.double())
    age = torch.cat([current_version - s.policy_versions[s.loss_mask] for s in batch.samples]).double()
    lengths = torch.tensor([s.loss_tokens for s in batch.samples], dtype=torch.float64)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "samples": float(len(batch.samples)),
        "episodes": float(episodes),
        "groups": float(int(batch.group_ids.max()) + 1),
        "staleness/mean": float(age.mean()),
        "staleness/max": float(age.max()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
    }
