"""Advantage estimators against float64 references written from the formulas in plain Python."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algos import advantages as adv

SETTINGS = settings(max_examples=50, deadline=None, database=None)
F64 = torch.float64

# Dyadic rewards (k / 4) keep the references' sums exact, so equal rewards give exact ties there too.
grid_rewards = st.integers(-40, 40).map(lambda k: k / 4)


@st.composite
def segmented_batch(draw: st.DrawFn, rewards: st.SearchStrategy[float] = grid_rewards) -> dict[str, list]:
    """Episodes (group, reward, 1-3 segments each) flattened to shuffled per-segment lists."""
    n_episodes = draw(st.integers(1, 12))
    rows = []
    for rollout in range(n_episodes):
        group = draw(st.integers(0, 3))
        reward = draw(rewards)
        rows += [(reward, group, rollout * 7 + 3)] * draw(st.integers(1, 3))
    random.Random(draw(st.integers(0, 2**16))).shuffle(rows)
    return {"rewards": [r[0] for r in rows], "group_ids": [r[1] for r in rows], "rollout_ids": [r[2] for r in rows]}


def reference_group(batch: dict[str, list], kind: str, eps: float = 1e-6) -> list[float]:
    """One reward per rollout id, grouped by group id, straight from the formula table."""
    episodes: dict[int, tuple[float, int]] = {}
    for r, g, rid in zip(batch["rewards"], batch["group_ids"], batch["rollout_ids"], strict=True):
        episodes.setdefault(rid, (r, g))
    members: dict[int, list[float]] = defaultdict(list)
    for r, g in episodes.values():
        members[g].append(r)
    out: dict[int, float] = {}
    for rid, (r, g) in episodes.items():
        rs = members[g]
        n = len(rs)
        mean = sum(rs) / n
        if kind in ("reinforce_baseline", "dr_grpo"):
            out[rid] = r - mean
        elif kind == "rloo":
            out[rid] = r - (sum(rs) - r) / (n - 1) if n > 1 else r
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (n - 1)) if n > 1 else 0.0
            out[rid] = (r - mean) / (std + eps)
    return [out[rid] for rid in batch["rollout_ids"]]


def run_group(batch: dict[str, list], kind: str) -> torch.Tensor:
    fn = getattr(adv, kind)
    return fn(
        torch.tensor(batch["rewards"], dtype=F64),
        torch.tensor(batch["group_ids"]),
        torch.tensor(batch["rollout_ids"]),
    )


@SETTINGS
@given(batch=segmented_batch(), kind=st.sampled_from(["reinforce_baseline", "dr_grpo", "rloo", "grpo"]))
def test_group_estimators_match_reference(batch: dict[str, list], kind: str) -> None:
    got = run_group(batch, kind)
    assert got.dtype == F64
    torch.testing.assert_close(got, torch.tensor(reference_group(batch, kind), dtype=F64), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(batch=segmented_batch(st.floats(-10, 10, allow_subnormal=False)), kind=st.sampled_from(["dr_grpo", "rloo"]))
def test_std_free_estimators_match_reference_on_any_floats(batch: dict[str, list], kind: str) -> None:
    got = run_group(batch, kind)
    torch.testing.assert_close(got, torch.tensor(reference_group(batch, kind), dtype=F64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["reinforce_baseline", "dr_grpo", "rloo", "grpo"])
@pytest.mark.parametrize("value", [0.1, 1.0, -3.7, 1e-7])
def test_constant_group_gives_exact_zero(kind: str, value: float) -> None:
    """0.1 * 3 / 3 != 0.1 in floats: the naive mean leaves an ulp that grpo would blow up."""
    for dtype in (torch.float32, F64):
        got = getattr(adv, kind)(
            torch.full((3,), value, dtype=dtype), torch.zeros(3, dtype=torch.long), torch.arange(3)
        )
        assert torch.equal(got, torch.zeros(3, dtype=dtype)), (kind, dtype, got)


def test_single_sample_groups() -> None:
    """A group of one: grpo, dr_grpo and reinforce_baseline give 0; rloo keeps the raw reward."""
    rewards, groups, rollouts = torch.tensor([2.5, -1.0]), torch.tensor([0, 1]), torch.tensor([0, 1])
    for kind in ("grpo", "dr_grpo", "reinforce_baseline"):
        assert torch.equal(getattr(adv, kind)(rewards, groups, rollouts), torch.zeros(2))
    assert torch.equal(adv.rloo(rewards, groups, rollouts), rewards)


def test_split_episode_counts_once() -> None:
    """Rollout 0 (reward 1) has three segments, rollout 1 (reward 0) one: the mean is 0.5, not 0.75."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    got = adv.dr_grpo(rewards, torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 0, 1]))
    assert torch.equal(got, torch.tensor([0.5, 0.5, 0.5, -0.5]))
    # grpo: std of {1, 0} with n - 1 is sqrt(0.5); every segment of rollout 0 gets the same value.
    got = adv.grpo(rewards, torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 0, 1]), eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0, 1.0, -1.0]) * 0.5 / math.sqrt(0.5))


def test_groups_are_independent() -> None:
    got = adv.reinforce_baseline(torch.tensor([1.0, 3.0, 10.0, 20.0]), torch.tensor([5, 5, 9, 9]), torch.arange(4))
    assert torch.equal(got, torch.tensor([-1.0, 1.0, -5.0, 5.0]))


def test_segments_disagreeing_on_reward_or_group_raise() -> None:
    with pytest.raises(ValueError, match="rollout_ids=7 disagree on rewards"):
        adv.grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([7, 7]))
    with pytest.raises(ValueError, match="disagree on group_ids"):
        adv.grpo(torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), torch.tensor([7, 7]))


def test_group_input_errors() -> None:
    with pytest.raises(ValueError, match="rewards contains NaN at index 1"):
        adv.rloo(torch.tensor([0.0, math.nan]), torch.tensor([0, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rewards contains inf at index 0"):
        adv.grpo(torch.tensor([math.inf, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rollout_ids has shape"):
        adv.grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="group_ids must be a 1-D integer tensor"):
        adv.grpo(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([0, 1]))


def test_empty_batch() -> None:
    empty = torch.zeros(0, dtype=torch.long)
    for kind in ("reinforce_baseline", "dr_grpo", "rloo", "grpo"):
        assert getattr(adv, kind)(torch.zeros(0), empty, empty).shape == (0,)


def test_clip_rewards() -> None:
    assert torch.equal(adv.clip_rewards(torch.tensor([-20.0, 0.5, 11.0]), -10, 10), torch.tensor([-10.0, 0.5, 10.0]))
    with pytest.raises(ValueError, match="low <= high"):
        adv.clip_rewards(torch.zeros(1), 1.0, -1.0)
    with pytest.raises(ValueError, match="rewards contains NaN"):
        adv.clip_rewards(torch.tensor([math.nan]), -1.0, 1.0)


# ---- token estimators -------------------------------------------------------------------


@st.composite
def token_batch(draw: st.DrawFn) -> dict[str, list]:
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    floats = st.floats(-3, 3, allow_subnormal=False)
    return {
        "rewards": draw(st.lists(floats, min_size=b, max_size=b)),
        "mask": [draw(st.lists(st.booleans(), min_size=t, max_size=t)) for _ in range(b)],
        "values": [draw(st.lists(floats, min_size=t, max_size=t)) for _ in range(b)],
        "kl": [draw(st.lists(floats, min_size=t, max_size=t)) for _ in range(b)],
    }


def reference_token_rewards(batch: dict[str, list], kl_coef: float) -> list[list[float]]:
    out = []
    for reward, mask, kl in zip(batch["rewards"], batch["mask"], batch["kl"], strict=True):
        row = [-kl_coef * k if on else 0.0 for on, k in zip(mask, kl, strict=True)]
        on_positions = [t for t, on in enumerate(mask) if on]
        if on_positions:
            row[on_positions[-1]] += reward
        out.append(row)
    return out


def reference_gae(batch: dict[str, list], gamma: float, lam: float, kl_coef: float) -> list[list[float]]:
    """Reverse recursion over loss tokens only; V_next = A_next = 0 after the last one."""
    out = []
    for r, mask, values in zip(reference_token_rewards(batch, kl_coef), batch["mask"], batch["values"], strict=True):
        row, next_v, next_a = [0.0] * len(mask), 0.0, 0.0
        for t in reversed(range(len(mask))):
            if mask[t]:
                next_a = r[t] + gamma * next_v - values[t] + gamma * lam * next_a
                next_v = values[t]
                row[t] = next_a
        out.append(row)
    return out


def tensors(batch: dict[str, list]) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(batch["rewards"], dtype=F64),
        torch.tensor(batch["mask"]),
        torch.tensor(batch["values"], dtype=F64),
        torch.tensor(batch["kl"], dtype=F64),
    )


@SETTINGS
@given(batch=token_batch(), gamma=st.floats(0, 1), kl_coef=st.floats(0, 0.5))
def test_reinforce_matches_reference(batch: dict[str, list], gamma: float, kl_coef: float) -> None:
    """G_t = r_t + gamma G_next over loss tokens, i.e. GAE with V = 0 and lambda = 1."""
    rewards, mask, _, kl = tensors(batch)
    expected = reference_gae({**batch, "values": [[0.0] * len(m) for m in batch["mask"]]}, gamma, 1.0, kl_coef)
    got = adv.reinforce(rewards, mask, gamma=gamma, kl=kl, kl_coef=kl_coef)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(batch=token_batch(), gamma=st.floats(0, 1), lam=st.floats(0, 1), kl_coef=st.floats(0, 0.5))
def test_gae_matches_reference(batch: dict[str, list], gamma: float, lam: float, kl_coef: float) -> None:
    rewards, mask, values, kl = tensors(batch)
    advantages, returns = adv.gae(rewards, values, mask, gamma=gamma, lam=lam, kl=kl, kl_coef=kl_coef)
    expected = torch.tensor(reference_gae(batch, gamma, lam, kl_coef), dtype=F64)
    torch.testing.assert_close(advantages, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(returns, (expected + values) * mask, rtol=1e-9, atol=1e-9)


def test_gae_lambda_one_is_monte_carlo() -> None:
    """gamma = lambda = 1: A_t = (sum of rewards from t on) - V_t = R - V_t with no KL."""
    values = torch.tensor([[0.5, 9.0, 0.25, 0.0]])
    mask = torch.tensor([[True, False, True, False]])
    a, ret = adv.gae(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0)
    assert torch.equal(a, torch.tensor([[0.5, 0.0, 0.75, 0.0]]))
    assert torch.equal(ret, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))


def test_gae_bootstraps_across_an_observation_gap_but_not_past_the_end() -> None:
    """lambda = 0: A_t = r_t + gamma V_next - V_t. Token 0's next loss token is 2 (skipping the tool
    token 1, whose value 100 is ignored); token 2 is the last, so its V_next is 0 despite padding."""
    values = torch.tensor([[1.0, 100.0, 2.0, 50.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    a, _ = adv.gae(torch.tensor([3.0]), values, mask, gamma=0.5, lam=0.0)
    assert torch.equal(a, torch.tensor([[0.5 * 2.0 - 1.0, 0.0, 3.0 - 2.0, 0.0]]))


def test_reinforce_discount_skips_tool_tokens() -> None:
    """Two loss tokens around two tool tokens: the first is one policy step from the reward."""
    got = adv.reinforce(torch.tensor([1.0]), torch.tensor([[True, False, False, True]]), gamma=0.5)
    assert torch.equal(got, torch.tensor([[0.5, 0.0, 0.0, 1.0]]))


def test_fully_masked_rows_get_zero_and_no_nan() -> None:
    mask = torch.tensor([[False, False], [True, True]])
    rewards, values = torch.tensor([5.0, 1.0]), torch.ones(2, 2)
    assert torch.equal(adv.reinforce(rewards, mask), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    a, ret = adv.gae(rewards, values, mask, lam=1.0)
    assert torch.equal(a[0], torch.zeros(2)) and torch.equal(ret[0], torch.zeros(2))
    assert torch.isfinite(adv.whiten(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool))).all()


@SETTINGS
@given(batch=token_batch())
def test_whiten_matches_reference(batch: dict[str, list]) -> None:
    """Population mean/var over loss tokens only, var clamped at 1e-8, 0 off the mask."""
    values, mask = batch["values"], batch["mask"]
    xs = [v for row, m in zip(values, mask, strict=True) for v, on in zip(row, m, strict=True) if on]
    mean = sum(xs) / len(xs) if xs else 0.0
    var = sum((x - mean) ** 2 for x in xs) / len(xs) if xs else 0.0
    rstd = 1 / math.sqrt(max(var, 1e-8))
    expected = [
        [(v - mean) * rstd if on else 0.0 for v, on in zip(r, m, strict=True)]
        for r, m in zip(values, mask, strict=True)
    ]
    got = adv.whiten(torch.tensor(values, dtype=F64), torch.tensor(mask))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(batch=token_batch(), coef=st.floats(0, 2))
def test_on_policy_distill_is_negative_log_ratio(batch: dict[str, list], coef: float) -> None:
    student, teacher = batch["values"], batch["kl"]
    expected = [
        [-coef * (s - t) if on else 0.0 for s, t, on in zip(rs, rt, m, strict=True)]
        for rs, rt, m in zip(student, teacher, batch["mask"], strict=True)
    ]
    got = adv.on_policy_distill(
        torch.tensor(student, dtype=F64, requires_grad=True),
        torch.tensor(teacher, dtype=F64),
        torch.tensor(batch["mask"]),
        coef=coef,
    )
    assert not got.requires_grad
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-9, atol=1e-9)


def test_token_estimator_input_errors() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"values contains NaN at index \(0, 1\)"):
        adv.gae(torch.zeros(1), torch.tensor([[0.0, math.nan]]), mask)
    with pytest.raises(ValueError, match="values has shape"):
        adv.gae(torch.zeros(1), torch.zeros(1, 3), mask)
    with pytest.raises(ValueError, match="rewards has 2 rows"):
        adv.reinforce(torch.zeros(2), mask)
    with pytest.raises(ValueError, match="teacher_logprobs contains -inf"):
        adv.on_policy_distill(torch.zeros(1, 2), torch.tensor([[0.0, -math.inf]]), mask)
    with pytest.raises(ValueError, match="loss_mask must be bool or hold only 0 and 1"):
        adv.reinforce(torch.zeros(1), torch.tensor([[0.5, 1.0]]))
