"""Per-token policy surrogates (PPO, GSPO, CISPO), the clipped value loss and the entropy bonus.

Every loss takes ``[B, T]`` tensors aligned token for token with a ``loss_mask`` and returns
``(loss [B, T], stats)``: the loss is 0 off the mask and still has to be aggregated
(``molt.algos.aggregation``); importance-sampling weights (``molt.algos.importance``) multiply
it before that. ``logprobs`` are the current policy's (they carry the gradient);
``old_logprobs`` and ``advantages`` are constants, detached here. The log-ratio is clamped to
+-30 before ``exp`` so a finite but wild input cannot overflow; NaN/inf inputs are rejected.
``stats`` are detached 0-d tensors, token means over this call's loss tokens: combine them
across micro-batches weighted by ``loss_mask.sum()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from molt.algos.aggregation import masked_mean
from molt.algos.checks import check_finite, check_float, check_ndim, check_same_shape, mask_as_float

MAX_LOG_RATIO = 30.0


def _policy_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Checks the four policy-loss inputs; returns the mask as ``logprobs.dtype``."""
    check_ndim(2, logprobs=logprobs)
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask)
    check_float(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    check_finite(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    return mask_as_float(loss_mask, logprobs.dtype)


def _clip_range(clip_low: float, clip_high: float) -> None:
    if not (0.0 <= clip_low <= 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token. All inputs ``[B, T]``; returns ``([B, T], stats)``.

    ``r = exp(logprobs - old_logprobs)``,
    ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (asymmetric range; e.g.
    0.2 / 0.28 "clip-higher"). With ``dual_clip = c > 1``, tokens with ``A < 0`` are
    capped at ``loss <= -c A``, so a huge ratio on a bad token cannot blow up the step.
    stats: ``clip_fraction`` (clipped term chosen), ``dual_clip_fraction``, ``ratio_mean``,
    ``policy_kl`` (``mean(old - new)``, the k1 estimate of KL(old || new)).
    """
    m = _policy_inputs(logprobs, old_logprobs, advantages, loss_mask)
    _clip_range(clip_low, clip_high)
    a = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    ratio = log_ratio.exp()
    loss, clipped = _clipped_surrogate(ratio, a, clip_low, clip_high)
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (a cap of -c*A on negative advantages), got {dual_clip}")
        cap = -dual_clip * a
        dual = (a < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    stats = {
        "clip_fraction": masked_mean(clipped.to(m.dtype), m),
        "dual_clip_fraction": masked_mean(dual.to(m.dtype), m),
        "ratio_mean": masked_mean(ratio.detach(), m),
        "policy_kl": masked_mean(-log_ratio.detach(), m),
    }
    return loss * m, stats


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (token form): one importance ratio per sequence, clipped like PPO. ``[B, T]``.

    ``s_i = exp(mean_{t in mask_i} (logprobs - old_logprobs))`` is the sequence ratio; token t
    uses ``s_it = sg(s_i) * pi(y_t) / sg(pi(y_t))``, whose value is ``s_i`` and whose gradient
    is ``s_i * grad log pi(y_t)``, so per-token advantages still work. Then
    ``loss = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))``. Padding does not
    enter the mean; an outlier token is averaged, not clipped alone. Clip ranges are
    typically tiny (3e-4 / 4e-4). No dual clip: it is defined for token ratios only.
    stats: ``clip_fraction`` (per token), ``seq_ratio_mean`` (over rows with a loss token),
    ``policy_kl``.
    """
    m = _policy_inputs(logprobs, old_logprobs, advantages, loss_mask)
    _clip_range(clip_low, clip_high)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    seq_log_ratio = masked_mean(log_ratio.detach(), m, dim=1)
    ratio = (logprobs - logprobs.detach() + seq_log_ratio[:, None]).exp()
    loss, clipped = _clipped_surrogate(ratio, advantages.detach(), clip_low, clip_high)
    stats = {
        "clip_fraction": masked_mean(clipped.to(m.dtype), m),
        "seq_ratio_mean": masked_mean(seq_log_ratio.exp(), (m.sum(1) > 0).to(m.dtype)),
        "policy_kl": masked_mean(-log_ratio.detach(), m),
    }
    return loss * m, stats


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_high: float,
    clip_low: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight. ``[B, T]``.

    ``loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprobs``, r as in PPO. Unlike
    PPO no token loses its gradient: clipping bounds the weight, not the update's support.
    ``clip_low = 1`` (the default) leaves the weight unbounded below, as in MiniMax-M1. The
    original system took an absolute ceiling ``eps_high >= 1``; that is ``1 + clip_high`` here.
    The loss *value* (``-w A log pi``) is not an objective to monitor; its gradient is.
    stats: ``clip_fraction`` (weight changed by the clip), ``ratio_mean``, ``policy_kl``.
    """
    m = _policy_inputs(logprobs, old_logprobs, advantages, loss_mask)
    _clip_range(clip_low, clip_high)
    log_ratio = (logprobs.detach() - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages.detach() * logprobs
    stats = {
        "clip_fraction": masked_mean((weight != ratio).to(m.dtype), m),
        "ratio_mean": masked_mean(ratio, m),
        "policy_kl": masked_mean(-log_ratio, m),
    }
    return loss * m, stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, *, clip: float = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``. ``[B, T]``.

    ``values`` carry the gradient; ``old_values`` (critic at rollout time) and ``returns``
    (from ``advantages.gae``) are constants. ``clip = inf`` disables clipping.
    stats: ``value_clip_fraction`` (clipped term chosen), ``value_error`` (mean (V - R)^2 / 2).
    """
    check_ndim(2, values=values)
    check_same_shape(values=values, old_values=old_values, returns=returns, loss_mask=loss_mask)
    check_float(values=values, old_values=old_values, returns=returns)
    check_finite(values=values, old_values=old_values, returns=returns)
    if not clip >= 0.0:
        raise ValueError(f"clip must be >= 0, got {clip}")
    m = mask_as_float(loss_mask, values.dtype)
    v_old, r = old_values.detach(), returns.detach()
    unclipped = 0.5 * (values - r) ** 2
    clipped = 0.5 * (v_old + (values - v_old).clamp(-clip, clip) - r) ** 2
    stats = {
        "value_clip_fraction": masked_mean((clipped > unclipped).to(m.dtype), m),
        "value_error": masked_mean(unclipped.detach(), m),
    }
    return torch.maximum(unclipped, clipped) * m, stats


def entropy_from_logprobs(logprobs: Tensor) -> Tensor:
    """``H = -sum_v exp(l_v) * l_v`` from a full log-distribution ``l = log_softmax(z)``. ``[..., V] -> [...]``.

    No checks and no host sync: for callers that already hold the log-softmax (the learner's fused logprob
    head, which may run under ``torch.compile``) and check the result themselves.
    """
    return -(logprobs.exp() * logprobs).sum(-1)
