"""KL estimators against float64 references, and the KL coefficient controller."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algos.kl import KLController, kl_penalty

SETTINGS = settings(max_examples=50, deadline=None, database=None)
F64 = torch.float64


def reference(d: float, estimator: str) -> float:
    """d = log pi - log pi_ref; k2 and k3 capped at 10."""
    if estimator == "k1":
        return d
    if estimator == "k2":
        return min(d * d / 2, 10.0)
    return min(math.exp(-d) - 1 + d, 10.0)


@SETTINGS
@given(
    logprobs=st.lists(st.floats(-8, 0, allow_subnormal=False), min_size=1, max_size=8),
    ref=st.lists(st.floats(-8, 0, allow_subnormal=False), min_size=8, max_size=8),
    mask=st.lists(st.booleans(), min_size=8, max_size=8),
    estimator=st.sampled_from(["k1", "k2", "k3"]),
)
def test_estimators_match_reference(logprobs: list, ref: list, mask: list, estimator: str) -> None:
    n = len(logprobs)
    expected = [
        reference(lp - r, estimator) if m else 0.0 for lp, r, m in zip(logprobs, ref[:n], mask[:n], strict=True)
    ]
    got = kl_penalty(
        torch.tensor([logprobs], dtype=F64), torch.tensor([ref[:n]], dtype=F64), torch.tensor([mask[:n]]), estimator
    )  # type: ignore[arg-type]
    torch.testing.assert_close(got, torch.tensor([expected], dtype=F64), rtol=1e-9, atol=1e-12)


def test_k3_is_unbiased_and_k1_matches_on_average() -> None:
    """Sampling y ~ pi over a 4-token vocabulary: E[k1] and E[k3] approach the exact KL(pi || ref)."""
    pi, ref = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64), torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    exact = (pi * (pi / ref).log()).sum().item()
    y = torch.multinomial(pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, lr = pi.log()[y][None], ref.log()[y][None]
    mask = torch.ones_like(lp, dtype=torch.bool)
    for estimator in ("k1", "k3"):
        assert kl_penalty(lp, lr, mask, estimator).mean().item() == pytest.approx(exact, abs=3e-3)  # type: ignore[arg-type]


def test_gradient_flows_through_logprobs_only() -> None:
    """d k3 / d logpi = 1 - exp(-d); ref gets none."""
    lp, ref = torch.tensor([[-1.0]], requires_grad=True), torch.tensor([[-1.5]], requires_grad=True)
    kl_penalty(lp, ref, torch.ones(1, 1), "k3").sum().backward()
    assert lp.grad is not None and ref.grad is None
    assert lp.grad.item() == pytest.approx(1 - math.exp(-0.5))


def test_kl_input_errors() -> None:
    ok = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(ok, ok, ok, "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ref_logprobs contains NaN at index \(0, 1\)"):
        kl_penalty(ok, torch.tensor([[0.0, math.nan]]), ok, "k1")


def test_fixed_controller_never_moves() -> None:
    controller = KLController(coef=0.01)
    assert controller.update(kl=5.0, n_samples=1000) == 0.01


def test_adaptive_controller() -> None:
    """e = clip(kl / target - 1, +-0.2); coef *= 1 + e n / horizon."""
    up = KLController(coef=0.1, target=0.01, horizon=1000)
    assert up.update(kl=0.011, n_samples=100) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert KLController(coef=0.1, target=0.01, horizon=1000).update(kl=0.5, n_samples=100) == pytest.approx(0.1 * 1.02)
    assert KLController(coef=0.1, target=0.01, horizon=1000).update(kl=0.0, n_samples=100) == pytest.approx(0.1 * 0.98)
    assert KLController(coef=0.1, target=0.01, horizon=1000).update(kl=0.01, n_samples=100) == pytest.approx(0.1)
    assert KLController(coef=0.1, target=0.01, horizon=500).update(kl=0.5, n_samples=100) == pytest.approx(0.1 * 1.04)


def test_controller_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="target must be finite and > 0"):
        KLController(coef=0.1, target=0.0)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        KLController(coef=0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="kl must be finite"):
        KLController(coef=0.1).update(kl=math.nan, n_samples=1)
