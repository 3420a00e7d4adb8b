"""What one optimizer step minimises: the step's advantages and each micro-batch's share of the loss.

Every term comes from ``molt.algos``; this module only wires them in the order
the learner applies them: ``step_advantages`` over the whole step (or
``gae_targets`` from the critic's values; ``distill_advantages`` per micro-batch
for ``on_policy_distill``), then ``micro_loss`` per micro-batch, reduced with the
step-wide row weights so that the micro-batch losses of all ranks add up to the
step's loss. With one optimizer step per batch the old-policy logprobs equal the
current ones detached: the policy that would have scored the batch before the
update is the one being trained, and the IS weights compare the trainer with the
engine. With mini-batches or epochs they are the proximal policy's, scored once
before the batch's first update (``minibatches.py``: decoupled PPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algos import advantages as estimators
from molt.algos.aggregation import aggregate, masked_mean, row_weights
from molt.algos.importance import is_weights
from molt.algos.kl import kl_penalty
from molt.algos.losses import cispo_loss, gspo_loss, ppo_loss
from molt.learner.batch import StepBatch, padded
from molt.learner.config import AlgorithmSettings

GROUP_ESTIMATORS = {
    "grpo": estimators.grpo,
    "dr_grpo": estimators.dr_grpo,
    "rloo": estimators.rloo,
    "reinforce_baseline": estimators.reinforce_baseline,
}
# The reference system whitens these (and gae) over all loss tokens of the step.
WHITENED = ("reinforce", "reinforce_baseline")


def step_advantages(batch: StepBatch, algo: AlgorithmSettings, kl: Tensor | None = None, kl_coef: float = 0) -> Tensor:
    """Per-token advantages of the whole step, ``[S, T]`` float32 on the next-token axis, 0 off the mask:
    rewards clipped, then the configured estimator over the whole step (group estimators merge segments
    by rollout id), broadcast to the loss tokens, whitened for ``reinforce`` / ``reinforce_baseline``.
    ``kl`` ``[S, T]`` (``kl_in_reward``): ``reinforce``'s returns gain ``-kl_coef * KL_t`` per token."""
    mask = padded([s.loss_mask for s in batch.samples])
    rewards = estimators.clip_rewards(batch.rewards, -algo.reward_clip, algo.reward_clip)
    if algo.estimator == "reinforce":
        advantages = estimators.reinforce(rewards, mask, kl=kl, kl_coef=kl_coef)
    elif algo.estimator in GROUP_ESTIMATORS:
        per_segment = GROUP_ESTIMATORS[algo.estimator](rewards, batch.group_ids, batch.rollout_ids)
        advantages = per_segment[:, None] * mask
    else:
        raise ValueError(f"estimator {algo.estimator!r} is not supported by the learner")
    if algo.estimator in WHITENED:
        advantages = estimators.whiten(advantages, mask)
    return advantages


def gae_targets(
    batch: StepBatch, algo: AlgorithmSettings, values: Tensor, kl: Tensor | None = None, kl_coef: float = 0
) -> tuple[Tensor, Tensor]:
    """``gae`` for the whole step from the critic's values ``[S, >= T]`` before this step's update (the
    learner takes one step per batch, as for the old logprobs): the advantages
    (whitened over the step's loss tokens, as for ``reinforce``) and the returns the critic regresses on.
    The scalar reward sits on each sample's last loss token; a segment of a compacted episode is a
    sample of its own, ending in the episode's reward."""
    mask = padded([s.loss_mask for s in batch.samples])
    rewards = estimators.clip_rewards(batch.rewards, -algo.reward_clip, algo.reward_clip)
    advantages, returns = estimators.gae(
        rewards, values[:, : mask.shape[1]], mask, gamma=algo.gae_gamma, lam=algo.gae_lambda, kl=kl, kl_coef=kl_coef
    )
    return estimators.whiten(advantages, mask), returns


def distill_advantages(
    rollout_logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    algo: AlgorithmSettings,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's ``on_policy_distill`` advantages ``-coef * (log pi_rollout - log pi_teacher)``
    (the sampling policy's logprobs are the student's, as the estimator defines) and the k1 estimate of
    the reverse KL(student || teacher) over its loss tokens. With ``ref_logprobs`` (``kl_in_reward``) each
    token's advantage also gains ``-kl_coef * KL_t(pi_rollout || pi_ref)``: a pull back toward the
    reference beside the pull toward the teacher."""
    advantages = estimators.on_policy_distill(rollout_logprobs, teacher_logprobs, loss_mask, coef=algo.distill_coef)
    if ref_logprobs is not None:
        kl = kl_penalty(rollout_logprobs, ref_logprobs, loss_mask, algo.kl_estimator)
        advantages = advantages - kl_coef * kl.to(advantages.dtype)
    reverse_kl = masked_mean((rollout_logprobs - teacher_logprobs).detach(), loss_mask)
    return advantages, {"distill/reverse_kl": reverse_kl.to(torch.float64)}


def step_row_weights(batch: StepBatch, algo: AlgorithmSettings) -> Tensor:
    """``[S]`` float64 aggregation weights of the whole step (all micro-batches, all ranks)."""
    return row_weights(padded([s.loss_mask for s in batch.samples]), algo.aggregation, batch.group_ids)


@dataclass(frozen=True)
class MicroInputs:
    """One micro-batch on the ``[B, T]`` grid; ``logprobs`` (and ``entropy``) carry the gradient."""

    logprobs: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    weights: Tensor  # [B], this micro-batch's slice of step_row_weights
    entropy: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None  # pi_prox (minibatches.py); None: ``logprobs`` detached


def _policy_loss(inputs: MicroInputs, old: Tensor, algo: AlgorithmSettings) -> tuple[Tensor, dict[str, Tensor]]:
    args = (inputs.logprobs, old, inputs.advantages, inputs.loss_mask)
    if algo.loss == "ppo":
        return ppo_loss(*args, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip)
    if algo.loss == "gspo":
        return gspo_loss(*args, clip_low=algo.clip_low, clip_high=algo.clip_high)
    return cispo_loss(*args, clip_high=algo.clip_high)


def micro_loss(
    inputs: MicroInputs, algo: AlgorithmSettings, scale: float, kl_coef: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the step loss (times ``scale``, the data-parallel world size, because
    FSDP averages gradients over ranks) and its stats: detached token means over its loss tokens.
    Per token ``policy_loss * is_weight (+ kl_coef * kl) (- entropy_coef * H)``, reduced with the
    step-wide row weights (``aggregation.row_weights``): no division by the accumulation count.
    ``kl_coef``: the KL term's coefficient now (adaptive KL); default ``algo.kl_coef``."""
    old = inputs.logprobs.detach() if inputs.old_logprobs is None else inputs.old_logprobs
    ism = algo.importance_sampling
    weights, stats = is_weights(
        old, inputs.rollout_logprobs, inputs.loss_mask, level=ism.level, mode=ism.mode, low=ism.low, high=ism.high
    )
    policy, policy_stats = _policy_loss(inputs, old, algo)
    stats = {**stats, **policy_stats, "loss/policy": masked_mean(policy.detach(), inputs.loss_mask)}
    per_token = policy * weights
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, inputs.loss_mask, algo.kl_estimator)
        if not algo.kl_in_reward:  # else it is in the advantages already; measured all the same
            per_token = per_token + (algo.kl_coef if kl_coef is None else kl_coef) * kl
        stats["kl"] = masked_mean(kl.detach(), inputs.loss_mask)
    if inputs.entropy is not None:
        stats["entropy"] = masked_mean(inputs.entropy.detach(), inputs.loss_mask)
        if algo.entropy_coef > 0:
            per_token = per_token - algo.entropy_coef * inputs.entropy
    loss = aggregate(per_token, inputs.loss_mask, inputs.weights) * scale
    return loss, {k: v.detach().to(torch.float64) for k, v in stats.items()}


def advantage_stats(advantages: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """Mean, std, min and max of the advantages over the step's loss tokens."""
    values = advantages[loss_mask.bool()].double()
    if not values.numel():
        return {}
    return {
        "advantage/mean": float(values.mean()),
        "advantage/std": float(values.std(unbiased=False)),
        "advantage/min": float(values.min()),
        "advantage/max": float(values.max()),
    }
