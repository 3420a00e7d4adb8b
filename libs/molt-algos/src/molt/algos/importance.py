"""Importance-sampling correction for the mismatch between the rollout engine and the trainer.

The engine (vLLM) and the trainer compute slightly different logprobs for the same weights
and tokens (kernels, precision, MoE routing, prefix caching); the per-token ratio
``rho_t = exp(old_logprobs_t - rollout_logprobs_t)`` measures it (``old_logprobs``: the
trainer's logprobs of the sampling policy). ``is_weights`` turns the ratios into detached
per-token weights that multiply the policy loss. The level is the unit tested against
``[low, high]``: ``off`` (weight 1), ``token`` (``rho_t``), ``seq`` (their product over the
mask), ``geo`` (their geometric mean); the mode, what happens outside: ``mask`` zeroes it,
``clip`` clamps it, ``trunc`` caps it at ``high``. ``seq`` and ``geo`` only reject. Schemes:
token+trunc = TIS, token+mask = IcePop, geo+mask = seq-mask-tis, seq+mask = product-ratio rejection.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from molt.algos.aggregation import masked_mean, masked_sum
from molt.algos.checks import check_band, check_finite, check_float, check_ndim, check_same_shape, mask_as_float

ISLevel = Literal["off", "token", "seq", "geo"]
ISMode = Literal["mask", "clip", "trunc"]
MAX_LOG_RATIO = 30.0


def _check_level_mode(level: str, mode: str, low: float, high: float) -> None:
    if level not in get_args(ISLevel):
        raise ValueError(f"unknown IS level {level!r}; expected one of {get_args(ISLevel)}")
    if mode not in get_args(ISMode):
        raise ValueError(f"unknown IS mode {mode!r}; expected one of {get_args(ISMode)}")
    if level in ("seq", "geo") and mode != "mask":
        raise ValueError(
            f"IS level {level!r} supports only mode 'mask': a sequence-level ratio is one number for the "
            f"whole sequence, so clipping or truncating it would rescale every token by a sequence-wide "
            f"factor instead of correcting each token; it can only accept or reject the sequence"
        )
    check_band(low, high)
    if low < 0:
        raise ValueError(f"low must be >= 0 (ratios are positive), got {low}")


def is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    level: ISLevel,
    mode: ISMode,
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token IS weights, detached, 0 off the mask. Inputs ``[B, T]``; returns ``([B, T], stats)``.

    ``log rho_t = clamp(old_logprobs_t - rollout_logprobs_t, -30, 30)`` on loss tokens. For
    ``token``: ``mask`` -> ``rho_t * [low <= rho_t <= high]``, ``clip`` -> ``clamp(rho_t, low,
    high)``, ``trunc`` -> ``min(rho_t, high)`` (``low`` unused). For ``seq``/``geo`` (``mask``
    only): ``rho_t * [low <= U_i <= high]`` with ``U_i`` the sequence unit (module docstring).
    stats: ``is_ratio_mean`` (mean rho_t), ``is_weight_mean``, ``is_filter_ratio`` (fraction of
    units rejected: tokens at token level, sequences with a loss token otherwise; ~1 means no
    gradient), ``is_clip_ratio`` (tokens changed by clip/trunc), and
    ``vllm_kl = mean(rollout_logprobs - old_logprobs)`` (k1 estimate of KL(rollout || old)).
    """
    _check_level_mode(level, mode, low, high)
    check_ndim(2, old_logprobs=old_logprobs)
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, loss_mask=loss_mask)
    check_float(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    check_finite(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    m = mask_as_float(loss_mask, old_logprobs.dtype)
    log_ratio = (old_logprobs.detach() - rollout_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    ratio = log_ratio.exp()
    rejected = torch.zeros((), dtype=m.dtype, device=m.device)
    if level == "off":
        weights = m
    elif level == "token" and mode == "clip":
        weights = ratio.clamp(low, high) * m
    elif level == "token" and mode == "trunc":
        weights = ratio.clamp(max=high) * m
    elif level == "token":
        keep = ((ratio >= low) & (ratio <= high)).to(m.dtype)
        weights = ratio * keep * m
        rejected = masked_mean(1.0 - keep, m)
    else:
        unit_log = masked_sum(log_ratio, m, dim=1) if level == "seq" else masked_mean(log_ratio, m, dim=1)
        unit = unit_log.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
        keep = ((unit >= low) & (unit <= high)).to(m.dtype)
        weights = ratio * keep[:, None] * m
        rejected = masked_mean(1.0 - keep, (m.sum(1) > 0).to(m.dtype))
    changed = (weights != ratio).to(m.dtype) if level == "token" and mode != "mask" else torch.zeros_like(m)
    stats = {
        "is_ratio_mean": masked_mean(ratio, m),
        "is_weight_mean": masked_mean(weights, m),
        "is_filter_ratio": rejected,
        "is_clip_ratio": masked_mean(changed, m),
        "vllm_kl": masked_mean(-log_ratio, m),
    }
    return weights, stats
