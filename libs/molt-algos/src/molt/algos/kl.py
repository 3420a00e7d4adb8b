"""KL divergence to a reference policy: per-token estimators and the coefficient controller.

The tokens were sampled from the policy pi, so with ``d = log pi(y_t) - log pi_ref(y_t)``
each estimator below has expectation (k1, k3) or approximates (k2) KL(pi || pi_ref)
(Schulman, "Approximating KL divergence", 2020). The KL is used either as a loss term
(``loss += coef * aggregate(kl)``, gradient through ``logprobs``) or as a per-token reward
(``advantages.token_rewards(kl=..., kl_coef=...)``, used by reinforce and gae; the group
estimators take no KL reward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from torch import Tensor

from molt.algos.checks import check_finite, check_float, check_ndim, check_same_shape, mask_as_float

KLEstimator = Literal["k1", "k2", "k3"]
MAX_LOG_RATIO = 30.0
# k2 and k3 grow like d^2 and e^-d: one token whose reference logprob collapsed would
# otherwise dominate the step, so they are capped (the original system's bound, too).
MAX_KL = 10.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL estimate, 0 off the mask. ``[B, T] -> [B, T]``.

    ``d = clamp(logprobs - ref_logprobs, -30, 30)``; ``k1 = d`` (unbiased, can be negative),
    ``k2 = d^2 / 2`` (biased, low variance), ``k3 = exp(-d) - 1 + d`` (unbiased, >= 0).
    k2 and k3 are capped at 10. ``ref_logprobs`` are detached; the gradient flows through
    ``logprobs`` when the KL is a loss term (detach ``logprobs`` to use it as a reward).
    """
    if estimator not in get_args(KLEstimator):
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {get_args(KLEstimator)}")
    check_ndim(2, logprobs=logprobs)
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask)
    check_float(logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_finite(logprobs=logprobs, ref_logprobs=ref_logprobs)
    m = mask_as_float(loss_mask, logprobs.dtype)
    d = (logprobs - ref_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = (0.5 * d**2).clamp(max=MAX_KL)
    else:
        kl = ((-d).exp() - 1.0 + d).clamp(max=MAX_KL)
    return kl * m


@dataclass
class KLController:
    """The KL coefficient: fixed (``target=None``) or adaptive toward a target KL.

    Adaptive (Ziegler et al. 2019): after a step with measured ``kl`` over ``n_samples``
    samples, ``e = clip(kl / target - 1, -0.2, 0.2)`` and ``coef *= 1 + e * n_samples / horizon``:
    the coefficient rises when the policy drifts past the target and falls below it.
    The original system passed n = rollout batch size * samples per prompt, horizon 10000.
    """

    coef: float
    target: float | None = None
    horizon: int = 10_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"coef must be finite and >= 0, got {self.coef}")
        if self.target is not None and not (math.isfinite(self.target) and self.target > 0):
            raise ValueError(f"target must be finite and > 0 (or None for a fixed coefficient), got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {self.horizon}")

    def update(self, kl: float, n_samples: int) -> float:
        """Applies one step's measured KL; returns the new coefficient (unchanged when fixed)."""
        if not math.isfinite(kl):
            raise ValueError(f"kl must be finite, got {kl}")
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n_samples / self.horizon
        return self.coef
