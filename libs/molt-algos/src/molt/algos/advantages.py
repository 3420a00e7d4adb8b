"""Advantage estimators: rewards (and critic values, teacher logprobs) in, advantages out.

* **Group estimators** (``reinforce_baseline``, ``rloo``, ``grpo``, ``dr_grpo``) take one
  entry per *segment* (``rewards``, ``group_ids``, ``rollout_ids``: ``[S]``) and return
  ``[S]``. An episode split into several segments (context compaction) counts **once**:
  segments are merged by ``rollout_id`` before the group statistics, and every segment
  gets its episode's advantage. Broadcast to tokens with ``advantages[:, None] * loss_mask``.
* **Token estimators** (``reinforce``, ``gae``, ``on_policy_distill``) work on ``[B, T]``
  with a ``loss_mask`` (1 on tokens the policy sampled) and return ``[B, T]``, 0 off it.

Statistics in float64, cast back to the input's dtype; every output is detached. ``whiten`` is a
separate step over the step's loss tokens (the original whitens ``reinforce``, ``reinforce_baseline``, ``gae``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from molt.algos.checks import (
    check_band,
    check_finite,
    check_float,
    check_ids,
    check_ndim,
    check_same_shape,
    mask_as_float,
)

F64 = torch.float64


def clip_rewards(rewards: Tensor, low: float, high: float) -> Tensor:
    """``clamp(rewards, low, high)``, applied to each rollout's scalar reward before any estimator.

    rewards: any shape. The original system's default band is [-10, 10].
    """
    check_band(low, high)
    check_finite(rewards=rewards)
    return rewards.detach().clamp(low, high)


def _episodes(rewards: Tensor, group_ids: Tensor, rollout_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merges segments into episodes.

    Returns ``(episode_rewards [E] float64, episode_group [E] in 0..G-1, segment_episode [S])``.
    Segments of one rollout must agree on reward and group, else the caller mixed up ids.
    """
    check_ndim(1, rewards=rewards)
    check_float(rewards=rewards)
    check_ids(group_ids=group_ids, rollout_ids=rollout_ids)
    check_same_shape(rewards=rewards, group_ids=group_ids, rollout_ids=rollout_ids)
    check_finite(rewards=rewards)
    r = rewards.detach().to(F64)
    _, segment_episode = torch.unique(rollout_ids, return_inverse=True)
    n_episodes = int(segment_episode.max().item()) + 1 if segment_episode.numel() else 0
    episode_rewards = torch.zeros(n_episodes, dtype=F64, device=r.device).scatter_(0, segment_episode, r)
    episode_gids = torch.zeros(n_episodes, dtype=group_ids.dtype, device=r.device)
    episode_gids.scatter_(0, segment_episode, group_ids)
    for name, per_segment, per_episode in (("rewards", r, episode_rewards), ("group_ids", group_ids, episode_gids)):
        bad = (per_episode[segment_episode] != per_segment).nonzero()
        if bad.numel():
            i = int(bad[0].item())
            raise ValueError(
                f"segments of rollout_ids={int(rollout_ids[i].item())} disagree on {name}: every segment "
                f"of an episode must carry the episode's {name[:-1]}"
            )
    _, episode_group = torch.unique(episode_gids, return_inverse=True)
    return episode_rewards, episode_group, segment_episode


def _centred(episode_rewards: Tensor, episode_group: Tensor) -> tuple[Tensor, Tensor]:
    """``(r - mean(group), group size)`` per episode, both ``[E]`` float64.

    Deviations are taken from the group's max before averaging: a mean of n equal floats
    can be off by an ulp, and ulp / (std + eps) is not small, so without the shift a
    constant group would not give exact zeros.
    """
    n_groups = int(episode_group.max().item()) + 1 if episode_group.numel() else 0
    zeros = torch.zeros(n_groups, dtype=F64, device=episode_rewards.device)
    ref = zeros.scatter_reduce(0, episode_group, episode_rewards, reduce="amax", include_self=False)
    deviation = episode_rewards - ref[episode_group]
    count = torch.bincount(episode_group, minlength=n_groups).to(F64)
    mean_deviation = zeros.index_add(0, episode_group, deviation) / count
    return deviation - mean_deviation[episode_group], count[episode_group]


def reinforce_baseline(rewards: Tensor, group_ids: Tensor, rollout_ids: Tensor) -> Tensor:
    """``A = r - mean_{group}(r)`` per episode, broadcast to its segments. ``[S] -> [S]``.

    A group of one gets 0. The original system whitens this estimator afterwards.
    """
    episode_rewards, episode_group, segment_episode = _episodes(rewards, group_ids, rollout_ids)
    centred, _ = _centred(episode_rewards, episode_group)
    return centred[segment_episode].to(rewards.dtype)


def dr_grpo(rewards: Tensor, group_ids: Tensor, rollout_ids: Tensor) -> Tensor:
    """Dr. GRPO: ``A = r - mean_{group}(r)``, no division by the std, not whitened. ``[S] -> [S]``.

    The same numbers as ``reinforce_baseline``; what makes it Dr. GRPO is the loss
    aggregation, which must not normalise by each sequence's length. Use the
    ``token_mean`` aggregation (``aggregation.token_mean``) with a constant
    denominator, ``global_token_count = sequences_per_step * max_response_tokens``
    (the paper's choice), or the step's real token count (also free of per-sequence
    length normalisation); never ``seq_mean_token_mean``. A group of one gets 0.
    """
    return reinforce_baseline(rewards, group_ids, rollout_ids)


def rloo(rewards: Tensor, group_ids: Tensor, rollout_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i - (sum_{group} r - r_i) / (n - 1)``. ``[S] -> [S]``.

    Computed as ``n / (n - 1) * (r_i - mean)``, the same value. A group of one has no
    leave-one-out baseline and keeps its raw reward, as in the original system.
    """
    episode_rewards, episode_group, segment_episode = _episodes(rewards, group_ids, rollout_ids)
    centred, count = _centred(episode_rewards, episode_group)
    loo = torch.where(count > 1, centred * count / (count - 1).clamp(min=1), episode_rewards)
    return loo[segment_episode].to(rewards.dtype)


def grpo(rewards: Tensor, group_ids: Tensor, rollout_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """GRPO: ``A = (r - mean_{group}) / (std_{group} + eps)``, sample std (n - 1). ``[S] -> [S]``.

    A constant group gives exactly 0 (not NaN); a group of one has std 0 and gets 0.
    The original system used ``eps = 1e-9``.
    """
    episode_rewards, episode_group, segment_episode = _episodes(rewards, group_ids, rollout_ids)
    centred, count = _centred(episode_rewards, episode_group)
    n_groups = int(episode_group.max().item()) + 1 if episode_group.numel() else 0
    square_sum = torch.zeros(n_groups, dtype=F64, device=centred.device).index_add(0, episode_group, centred**2)
    std = (square_sum[episode_group] / (count - 1).clamp(min=1)).sqrt()
    return (centred / (std + eps))[segment_episode].to(rewards.dtype)


def whiten(advantages: Tensor, loss_mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """``(A - mu) / sqrt(max(var, eps))`` with mu and the population var over loss tokens, re-masked.

    advantages, loss_mask: ``[B, T]``. Call it once on the whole optimizer step (all
    micro-batches and data-parallel ranks), not per micro-batch. No loss token gives 0.
    """
    check_same_shape(advantages=advantages, loss_mask=loss_mask)
    check_finite(advantages=advantages)
    m = mask_as_float(loss_mask, F64)
    a = advantages.detach().to(F64)
    n = m.sum().clamp(min=1)
    mean = (a * m).sum() / n
    var = (((a - mean) * m) ** 2).sum() / n
    return ((a - mean) * var.clamp(min=eps).rsqrt() * m).to(advantages.dtype)


def token_rewards(rewards: Tensor, loss_mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token reward ``r_t = -kl_coef * kl_t`` on loss tokens, plus the scalar reward at the last one.

    rewards: ``[B]``; loss_mask, kl: ``[B, T]``; returns ``[B, T]`` float64. A row with no
    loss token gets no reward at all (it contributes nothing).
    """
    check_ndim(2, loss_mask=loss_mask)
    check_ndim(1, rewards=rewards)
    check_float(rewards=rewards)
    if rewards.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} rows, loss_mask has {loss_mask.shape[0]}")
    check_finite(rewards=rewards)
    m = mask_as_float(loss_mask, F64)
    r = torch.zeros_like(m)
    if kl is not None:
        check_same_shape(kl=kl, loss_mask=loss_mask)
        check_finite(kl=kl)
        r = -kl_coef * kl.detach().to(F64) * m
    last = m.shape[1] - 1 - m.flip(1).argmax(1)  # argmax returns the first max: the last loss token
    has_tokens = (m.sum(1) > 0).to(F64)
    return r.scatter_add(1, last[:, None], (rewards.detach().to(F64) * has_tokens)[:, None])


def reinforce(
    rewards: Tensor, loss_mask: Tensor, *, gamma: float = 1.0, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """REINFORCE(++) return: ``A_t = G_t = r_t + gamma * G_next`` over loss tokens. ``[B], [B, T] -> [B, T]``.

    ``r_t`` comes from ``token_rewards`` (KL penalty per token, reward at the last loss
    token). ``G_next`` is the return of the next *loss* token: tool and environment
    tokens are not steps of the policy, so they neither add reward nor advance the
    discount (the original advanced the discount over them; equal when gamma = 1).
    With gamma = 1 and no KL every loss token gets the episode reward (plain REINFORCE).
    """
    r = token_rewards(rewards, loss_mask, kl, kl_coef)
    on = mask_as_float(loss_mask, F64).bool()
    returns = torch.zeros_like(r)
    carry = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        g = r[:, t] + gamma * carry
        returns[:, t] = torch.where(on[:, t], g, 0.0)
        carry = torch.where(on[:, t], g, carry)
    return returns.to(rewards.dtype)


def gae(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over loss tokens. Returns ``(advantages, returns)``, ``[B, T]``.

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    ``returns = A + V``, where "next" is the next *loss* token: a tool/environment gap
    inside the sequence is skipped, so the value bootstraps across it, while after the
    last loss token ``V_next = A_next = 0`` (terminal). ``values``: the critic's ``V_t``
    per token (ignored off the mask). ``r_t`` as in ``token_rewards``. Both outputs are 0
    off the mask; whiten the advantages (not the returns) afterwards, as the original did.
    """
    check_same_shape(values=values, loss_mask=loss_mask)
    check_finite(values=values)
    r = token_rewards(rewards, loss_mask, kl, kl_coef)
    v = values.detach().to(F64)
    on = mask_as_float(loss_mask, F64).bool()
    advantages = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])
    next_advantage = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_advantage
        advantages[:, t] = torch.where(on[:, t], a, 0.0)
        next_value = torch.where(on[:, t], v[:, t], next_value)
        next_advantage = torch.where(on[:, t], a, next_advantage)
    returns = (advantages + v) * on
    return advantages.to(values.dtype), returns.to(values.dtype)


def on_policy_distill(
    student_logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor, *, coef: float = 1.0
) -> Tensor:
    """On-policy distillation: ``A_t = -coef * (log pi_student(y_t) - log pi_teacher(y_t))``. ``[B, T]``.

    The sampled tokens come from the student, so this is the per-token reverse-KL
    signal (k1 estimator): tokens the teacher likes more than the student get a
    positive advantage. No scalar reward, no baseline, no discount. ``student_logprobs``
    are the logprobs at sampling time (old or rollout), not the ones being trained.
    """
    check_same_shape(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, loss_mask=loss_mask)
    check_finite(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs)
    m = mask_as_float(loss_mask, F64)
    diff = student_logprobs.detach().to(F64) - teacher_logprobs.detach().to(F64)
    return (-coef * diff * m).to(student_logprobs.dtype)
