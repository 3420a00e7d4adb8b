"""Loss aggregation: references for each mode and micro-batch / full-batch equivalence."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algos import aggregation as agg
from molt.algos.importance import is_weights
from molt.algos.losses import ppo_loss

SETTINGS = settings(max_examples=50, deadline=None, database=None)
F64 = torch.float64
MODES = ["token_mean", "seq_mean_token_mean", "prompt_mean_token_mean"]


@st.composite
def step_batch(draw: st.DrawFn) -> dict[str, list]:
    """One optimizer step's rows: per-token losses, mask (rows may be empty), a prompt id per row."""
    b, t = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    return {
        "loss": [draw(st.lists(st.floats(-3, 3, allow_subnormal=False), min_size=t, max_size=t)) for _ in range(b)],
        "mask": [draw(st.lists(st.booleans(), min_size=t, max_size=t)) for _ in range(b)],
        "groups": draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)),
    }


def reference(batch: dict[str, list], mode: str) -> float:
    """The three means written out: over tokens; over non-empty rows of their token mean;
    over non-empty prompts of the token mean of all their rows' tokens."""
    rows = [[x for x, on in zip(r, m, strict=True) if on] for r, m in zip(batch["loss"], batch["mask"], strict=True)]
    if mode == "token_mean":
        tokens = [x for r in rows for x in r]
        return sum(tokens) / max(len(tokens), 1)
    if mode == "seq_mean_token_mean":
        means = [sum(r) / len(r) for r in rows if r]
        return sum(means) / max(len(means), 1)
    by_prompt: dict[int, list[float]] = {}
    for r, g in zip(rows, batch["groups"], strict=True):
        by_prompt.setdefault(g, []).extend(r)
    means = [sum(xs) / len(xs) for xs in by_prompt.values() if xs]
    return sum(means) / max(len(means), 1)


@SETTINGS
@given(batch=step_batch(), mode=st.sampled_from(MODES))
def test_modes_match_reference(batch: dict[str, list], mode: str) -> None:
    loss, mask = torch.tensor(batch["loss"], dtype=F64), torch.tensor(batch["mask"])
    weights = agg.row_weights(mask, mode, torch.tensor(batch["groups"]))  # type: ignore[arg-type]
    assert agg.aggregate(loss, mask, weights).item() == pytest.approx(reference(batch, mode), rel=1e-9, abs=1e-12)


@SETTINGS
@given(batch=step_batch())
def test_token_mean_with_global_count_equals_weights(batch: dict[str, list]) -> None:
    loss, mask = torch.tensor(batch["loss"], dtype=F64), torch.tensor(batch["mask"])
    by_count = agg.token_mean(loss, mask, int(mask.sum()))
    by_weights = agg.aggregate(loss, mask, agg.row_weights(mask, "token_mean"))
    assert by_count.item() == pytest.approx(by_weights.item(), rel=1e-12, abs=1e-15)
    assert by_count.item() == pytest.approx(agg.masked_mean(loss, mask).item(), rel=1e-12, abs=1e-15)


@SETTINGS
@given(
    b=st.integers(2, 8),
    t=st.integers(1, 6),
    cuts=st.lists(st.integers(1, 7), max_size=4),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_micro_batches_sum_to_the_full_batch(b: int, t: int, cuts: list[int], mode: str, seed: int) -> None:
    """Split one step into micro-batches (as two 'ranks' with gradient accumulation would): the
    sum of their aggregated PPO+IS losses and gradients equals the full batch's, in every mode."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=gen, dtype=F64) * 3
    old = logprobs + 0.3 * torch.randn(b, t, generator=gen, dtype=F64)
    rollout = old + 0.05 * torch.randn(b, t, generator=gen, dtype=F64)
    advantages = torch.randn(b, t, generator=gen, dtype=F64)
    mask = torch.rand(b, t, generator=gen) < 0.7
    groups = torch.randint(0, 3, (b,), generator=gen)
    weights = agg.row_weights(mask, mode, groups)  # type: ignore[arg-type]

    def step_loss(leaf: torch.Tensor, rows: slice) -> torch.Tensor:
        loss, _ = ppo_loss(leaf[rows], old[rows], advantages[rows], mask[rows], clip_high=0.28, dual_clip=3.0)
        w, _ = is_weights(old[rows], rollout[rows], mask[rows], level="geo", mode="mask", low=0.9, high=1.1)
        return agg.aggregate(loss * w, mask[rows], weights[rows])

    full_leaf = logprobs.clone().requires_grad_()
    full = step_loss(full_leaf, slice(None))
    full.backward()

    micro_leaf = logprobs.clone().requires_grad_()
    bounds = sorted({0, b, *(c for c in cuts if c < b)})
    total = torch.zeros((), dtype=F64)
    for start, stop in itertools.pairwise(bounds):
        part = step_loss(micro_leaf, slice(start, stop))
        part.backward()  # gradient accumulation: no division by the number of micro-batches
        total += part.detach()
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-14)
    assert full_leaf.grad is not None and micro_leaf.grad is not None
    torch.testing.assert_close(micro_leaf.grad, full_leaf.grad, rtol=1e-12, atol=1e-14)


def test_unequal_micro_batches_differ_from_mean_of_means() -> None:
    """Why the global count matters: rows of 1 and 3 tokens, losses 1 and 3 per token. Token mean
    is (1 + 9) / 4 = 2.5; averaging the two micro-batch means would give (1 + 3) / 2 = 2."""
    loss = torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    parts = [agg.token_mean(loss[i : i + 1], mask[i : i + 1], 4) for i in range(2)]
    assert sum(p.item() for p in parts) == 2.5
    assert agg.aggregate(loss, mask, agg.row_weights(mask, "seq_mean_token_mean")).item() == 2.0


def test_empty_step_gives_zero() -> None:
    loss, mask = torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        weights = agg.row_weights(mask, mode, torch.tensor([0, 1]))  # type: ignore[arg-type]
        assert agg.aggregate(loss, mask, weights).item() == 0.0
    assert agg.token_mean(loss, mask, 0).item() == 0.0
    assert agg.token_mean(loss, mask, torch.tensor(0)).item() == 0.0
    assert agg.masked_mean(loss, mask).item() == 0.0


def test_aggregation_errors() -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs group_ids"):
        agg.row_weights(mask, "prompt_mean_token_mean")
    with pytest.raises(ValueError, match="unknown aggregation mode 'seq_mean'"):
        agg.row_weights(mask, "seq_mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights has 1 entries"):
        agg.aggregate(torch.ones(2, 3), mask, torch.ones(1))
    with pytest.raises(ValueError, match="global_token_count must be >= 0"):
        agg.token_mean(torch.ones(2, 3), mask, -1)
