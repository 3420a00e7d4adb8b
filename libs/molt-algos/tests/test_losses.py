"""Policy surrogates and value loss against float64 per-token references (value and gradient)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algos import losses

SETTINGS = settings(max_examples=50, deadline=None, database=None)
F64 = torch.float64


@st.composite
def policy_batch(draw: st.DrawFn) -> dict[str, list]:
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))

    def rows(strategy: st.SearchStrategy) -> list[list]:
        return [draw(st.lists(strategy, min_size=t, max_size=t)) for _ in range(b)]

    logprobs = rows(st.floats(-6, 0, allow_subnormal=False))
    drift = rows(st.floats(-1, 1, allow_subnormal=False))
    return {
        "logprobs": logprobs,
        "old_logprobs": [[lp - d for lp, d in zip(r, dr, strict=True)] for r, dr in zip(logprobs, drift, strict=True)],
        "advantages": rows(st.floats(-2, 2, allow_subnormal=False)),
        "mask": rows(st.booleans()),
    }


def run(fn, batch: dict[str, list], **kwargs: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (loss, d sum(loss) / d logprobs, stats)."""
    logprobs = torch.tensor(batch["logprobs"], dtype=F64, requires_grad=True)
    loss, stats = fn(
        logprobs,
        torch.tensor(batch["old_logprobs"], dtype=F64),
        torch.tensor(batch["advantages"], dtype=F64),
        torch.tensor(batch["mask"]),
        **kwargs,
    )
    loss.sum().backward()
    assert logprobs.grad is not None
    return loss.detach(), logprobs.grad, stats


def per_token(batch: dict[str, list]):
    for b, row in enumerate(batch["mask"]):
        for t, on in enumerate(row):
            yield b, t, on, batch["logprobs"][b][t], batch["old_logprobs"][b][t], batch["advantages"][b][t]


def clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def reference_ppo(batch: dict[str, list], lo: float, hi: float, dual: float | None) -> tuple[list, list, float]:
    """loss = max(-A r, -A clip(r)), capped at -c A for A < 0; d/d logpi = -A r where the unclipped term is live."""
    shape = [[0.0] * len(row) for row in batch["mask"]]
    loss, grad, clipped, n = [r[:] for r in shape], [r[:] for r in shape], 0, 0
    for b, t, on, lp, old, a in per_token(batch):
        if not on:
            continue
        r = math.exp(lp - old)
        unclipped, clipped_term = -a * r, -a * clip(r, 1 - lo, 1 + hi)
        value, g = max(unclipped, clipped_term), (-a * r if unclipped >= clipped_term else 0.0)
        clipped, n = clipped + (clipped_term > unclipped), n + 1
        if dual is not None and a < 0 and value > -dual * a:
            value, g = -dual * a, 0.0
        loss[b][t], grad[b][t] = value, g
    return loss, grad, clipped / max(n, 1)


@SETTINGS
@given(batch=policy_batch(), lo=st.floats(0, 0.5), hi=st.floats(0, 0.5), dual=st.none() | st.floats(1.5, 5))
def test_ppo_matches_reference(batch: dict[str, list], lo: float, hi: float, dual: float | None) -> None:
    loss, grad, stats = run(losses.ppo_loss, batch, clip_low=lo, clip_high=hi, dual_clip=dual)
    ref_loss, ref_grad, ref_clip = reference_ppo(batch, lo, hi, dual)
    torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=F64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=F64), rtol=1e-9, atol=1e-9)
    assert stats["clip_fraction"].item() == pytest.approx(ref_clip)


@SETTINGS
@given(batch=policy_batch(), lo=st.floats(0, 0.05), hi=st.floats(0, 0.05))
def test_gspo_matches_reference(batch: dict[str, list], lo: float, hi: float) -> None:
    """s_i = exp(mean of log ratios over row i's loss tokens); per token max(-A s, -A clip(s)); grad -A s."""
    loss, grad, _ = run(losses.gspo_loss, batch, clip_low=lo, clip_high=hi)
    ref_loss = [[0.0] * len(row) for row in batch["mask"]]
    ref_grad = [[0.0] * len(row) for row in batch["mask"]]
    for b, row in enumerate(batch["mask"]):
        diffs = [batch["logprobs"][b][t] - batch["old_logprobs"][b][t] for t, on in enumerate(row) if on]
        s = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        for t, on in enumerate(row):
            a = batch["advantages"][b][t]
            if on:
                unclipped, clipped_term = -a * s, -a * clip(s, 1 - lo, 1 + hi)
                ref_loss[b][t] = max(unclipped, clipped_term)
                ref_grad[b][t] = -a * s if unclipped >= clipped_term else 0.0
    torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=F64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=F64), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(batch=policy_batch(), lo=st.floats(0, 1), hi=st.floats(0, 0.5))
def test_cispo_matches_reference(batch: dict[str, list], lo: float, hi: float) -> None:
    """loss = -w A log pi with w = clip(r) detached, so every loss token's gradient is -w A."""
    loss, grad, _ = run(losses.cispo_loss, batch, clip_low=lo, clip_high=hi)
    ref_loss = [[0.0] * len(row) for row in batch["mask"]]
    ref_grad = [[0.0] * len(row) for row in batch["mask"]]
    for b, t, on, lp, old, a in per_token(batch):
        if on:
            w = clip(math.exp(lp - old), 1 - lo, 1 + hi)
            ref_loss[b][t], ref_grad[b][t] = -w * a * lp, -w * a
    torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=F64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=F64), rtol=1e-9, atol=1e-9)


def test_on_policy_ppo_is_reinforce() -> None:
    """old = sg(new): ratio 1, nothing clipped, gradient -A on every loss token."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0, 3.0]])
    loss, stats = losses.ppo_loss(logprobs, logprobs.detach(), advantages, torch.ones(1, 3), dual_clip=3.0)
    loss.sum().backward()
    assert logprobs.grad is not None
    assert torch.equal(logprobs.grad, -advantages)
    assert stats["clip_fraction"].item() == 0.0 and stats["ratio_mean"].item() == 1.0


def test_dual_clip_caps_negative_advantages() -> None:
    """r = e^3 ~ 20 with A = -1: PPO gives 20, the dual clip c = 3 caps it at 3 (and cuts the gradient)."""
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    loss, stats = losses.ppo_loss(
        logprobs, torch.tensor([[-4.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1), dual_clip=3.0
    )
    assert loss.item() == 3.0 and stats["dual_clip_fraction"].item() == 1.0
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        losses.ppo_loss(logprobs, logprobs.detach(), torch.ones(1, 1), torch.ones(1, 1), dual_clip=0.5)


def test_gspo_ignores_padding_and_does_not_clip_a_single_token() -> None:
    """One token moved by log 1.5 among four: s = 1.5^(1/4) ~ 1.107 < 1.2, so nothing is clipped;
    the padding token's huge log ratio does not enter the mean."""
    logprobs = torch.tensor([[math.log(1.5) - 1, -1.0, -1.0, -1.0, 5.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -20.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = losses.gspo_loss(logprobs, old, torch.ones(1, 5), mask, clip_low=0.2, clip_high=0.2)
    assert stats["clip_fraction"].item() == 0.0
    assert stats["seq_ratio_mean"].item() == pytest.approx(1.5**0.25)
    loss.sum().backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-(1.5**0.25)] * 4 + [0.0]]))


@pytest.mark.parametrize("name", ["ppo_loss", "gspo_loss", "cispo_loss"])
def test_fully_masked_and_extreme_inputs_give_zero_and_no_nan(name: str) -> None:
    """A masked row contributes exactly 0 (and 0 gradient), even with a log ratio of 1000 there."""
    logprobs = torch.tensor([[-1000.0, 0.0], [-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1000.0], [-1.0, -2.0]])
    mask = torch.tensor([[False, False], [True, True]])
    loss, stats = getattr(losses, name)(logprobs, old, torch.ones(2, 2), mask, clip_high=0.2, clip_low=0.2)
    loss.sum().backward()
    assert logprobs.grad is not None
    assert torch.equal(loss[0], torch.zeros(2)) and torch.equal(logprobs.grad[0], torch.zeros(2))
    assert all(torch.isfinite(v) for v in stats.values())
    empty, empty_stats = getattr(losses, name)(
        logprobs, old, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool), clip_high=0.2, clip_low=0.2
    )
    assert torch.equal(empty, torch.zeros(2, 2)) and all(v.item() == 0.0 for v in empty_stats.values())


@pytest.mark.parametrize("name", ["ppo_loss", "gspo_loss", "cispo_loss"])
def test_policy_losses_reject_bad_inputs(name: str) -> None:
    fn, ok, mask = getattr(losses, name), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"old_logprobs contains NaN at index \(0, 1\)"):
        fn(ok, torch.tensor([[0.0, math.nan]]), ok, mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="advantages contains inf"):
        fn(ok, ok, torch.tensor([[math.inf, 0.0]]), mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="advantages has shape"):
        fn(ok, ok, torch.zeros(1, 3), mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_low"):
        fn(ok, ok, ok, mask, clip_low=1.5, clip_high=0.2)


@SETTINGS
@given(
    values=st.lists(st.floats(-3, 3, allow_subnormal=False), min_size=1, max_size=8),
    old=st.lists(st.floats(-3, 3, allow_subnormal=False), min_size=8, max_size=8),
    returns=st.lists(st.floats(-3, 3, allow_subnormal=False), min_size=8, max_size=8),
    clip_range=st.floats(0, 1),
)
def test_value_loss_matches_reference(values: list, old: list, returns: list, clip_range: float) -> None:
    n = len(values)
    expected = [
        0.5 * max((v - r) ** 2, (o + clip(v - o, -clip_range, clip_range) - r) ** 2)
        for v, o, r in zip(values, old[:n], returns[:n], strict=True)
    ]
    mask = torch.tensor([[i % 3 != 2 for i in range(n)]])
    loss, _ = losses.value_loss(
        torch.tensor([values], dtype=F64),
        torch.tensor([old[:n]], dtype=F64),
        torch.tensor([returns[:n]], dtype=F64),
        mask,
        clip=clip_range,
    )
    torch.testing.assert_close(loss, torch.tensor([expected], dtype=F64) * mask, rtol=1e-9, atol=1e-9)


def test_value_loss_without_clip_is_half_squared_error() -> None:
    loss, stats = losses.value_loss(
        torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), clip=math.inf
    )
    assert loss.item() == 2.0 and stats["value_clip_fraction"].item() == 0.0
