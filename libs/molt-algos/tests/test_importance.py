"""IS correction (train vs rollout logprobs) against a per-token float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algos.importance import is_weights

SETTINGS = settings(max_examples=50, deadline=None, database=None)
F64 = torch.float64
COMBINATIONS = [
    ("off", "mask"),
    ("token", "mask"),
    ("token", "clip"),
    ("token", "trunc"),
    ("seq", "mask"),
    ("geo", "mask"),
]


@st.composite
def is_batch(draw: st.DrawFn) -> dict[str, list]:
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))

    def rows(strategy: st.SearchStrategy) -> list[list]:
        return [draw(st.lists(strategy, min_size=t, max_size=t)) for _ in range(b)]

    return {
        "old": rows(st.floats(-5, 0, allow_subnormal=False)),
        "drift": rows(st.floats(-1, 1, allow_subnormal=False)),
        "mask": rows(st.booleans()),
    }


def reference(batch: dict[str, list], level: str, mode: str, low: float, high: float) -> tuple[list, float]:
    """Weights and is_filter_ratio, token by token."""
    weights, rejected, units = [], 0, 0
    for old_row, drift_row, mask_row in zip(batch["old"], batch["drift"], batch["mask"], strict=True):
        # rollout = old - drift, so log rho = drift exactly as the implementation sees it (old - rollout).
        logs = [o - (o - d) for o, d in zip(old_row, drift_row, strict=True)]
        on = [x for x, m in zip(logs, mask_row, strict=True) if m]
        if level in ("seq", "geo"):
            unit = math.exp(sum(on) if level == "seq" else (sum(on) / len(on) if on else 0.0))
            keep_row = low <= unit <= high
            rejected, units = rejected + (bool(on) and not keep_row), units + bool(on)
        row = []
        for x, m in zip(logs, mask_row, strict=True):
            rho = math.exp(x)
            if not m:
                w = 0.0
            elif level == "off":
                w = 1.0
            elif level in ("seq", "geo"):
                w = rho if keep_row else 0.0
            elif mode == "clip":
                w = min(max(rho, low), high)
            elif mode == "trunc":
                w = min(rho, high)
            else:
                keep = low <= rho <= high
                w, rejected, units = (rho if keep else 0.0), rejected + (not keep), units + 1
            row.append(w)
        weights.append(row)
    return weights, rejected / max(units, 1)


@SETTINGS
@given(
    batch=is_batch(),
    combination=st.sampled_from(COMBINATIONS),
    low=st.floats(0.3, 1.0),
    high=st.floats(1.0, 3.0),
)
def test_is_weights_match_reference(
    batch: dict[str, list], combination: tuple[str, str], low: float, high: float
) -> None:
    level, mode = combination
    old = torch.tensor(batch["old"], dtype=F64)
    rollout = old - torch.tensor(batch["drift"], dtype=F64)
    weights, stats = is_weights(old, rollout, torch.tensor(batch["mask"]), level=level, mode=mode, low=low, high=high)  # type: ignore[arg-type]
    expected, filter_ratio = reference(batch, level, mode, low, high)
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=F64), rtol=1e-9, atol=1e-12)
    assert stats["is_filter_ratio"].item() == pytest.approx(filter_ratio)
    assert not weights.requires_grad


def test_seq_mask_keeps_per_token_ratios() -> None:
    """geo mean of rho = (2, 0.5) is 1 -> inside [0.9, 1.1], and the tokens keep 2 and 0.5 (not 1)."""
    old = torch.tensor([[math.log(2.0), math.log(0.5)]])
    weights, stats = is_weights(old, torch.zeros(1, 2), torch.ones(1, 2), level="geo", mode="mask", low=0.9, high=1.1)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5]]))
    assert stats["is_filter_ratio"].item() == 0.0
    # The product (seq) is also 1; token level rejects both tokens.
    weights, stats = is_weights(old, torch.zeros(1, 2), torch.ones(1, 2), level="token", mode="mask", low=0.9, high=1.1)
    assert torch.equal(weights, torch.zeros(1, 2)) and stats["is_filter_ratio"].item() == 1.0


def test_seq_is_the_product_and_geo_the_geometric_mean() -> None:
    """rho = (2, 2): the product 4 is outside [0.5, 3] (rejected), the geometric mean 2 is inside."""
    old, rollout, mask = torch.full((1, 2), math.log(2.0)), torch.zeros(1, 2), torch.ones(1, 2)
    seq, seq_stats = is_weights(old, rollout, mask, level="seq", mode="mask", low=0.5, high=3.0)
    geo, geo_stats = is_weights(old, rollout, mask, level="geo", mode="mask", low=0.5, high=3.0)
    assert torch.equal(seq, torch.zeros(1, 2)) and seq_stats["is_filter_ratio"].item() == 1.0
    torch.testing.assert_close(geo, torch.full((1, 2), 2.0))
    assert geo_stats["is_filter_ratio"].item() == 0.0


def test_trunc_caps_without_raising_small_weights_and_clip_does_not_drop() -> None:
    old = torch.tensor([[math.log(0.1), math.log(10.0)]])
    trunc, _ = is_weights(old, torch.zeros(1, 2), torch.ones(1, 2), level="token", mode="trunc", low=0.5, high=2.0)
    torch.testing.assert_close(trunc, torch.tensor([[0.1, 2.0]]))
    clipped, stats = is_weights(old, torch.zeros(1, 2), torch.ones(1, 2), level="token", mode="clip", low=0.5, high=2.0)
    torch.testing.assert_close(clipped, torch.tensor([[0.5, 2.0]]))
    assert stats["is_clip_ratio"].item() == 1.0 and stats["is_filter_ratio"].item() == 0.0


def test_stats_and_masked_rows() -> None:
    """vllm_kl = mean(rollout - old) over loss tokens; an empty row gets 0 weight and is not a rejected unit."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    rollout = torch.tensor([[-1.2, -0.8], [-50.0, 3.0]])
    mask = torch.tensor([[True, True], [False, False]])
    weights, stats = is_weights(old, rollout, mask, level="seq", mode="mask", low=0.99, high=1.01)
    torch.testing.assert_close(weights, torch.tensor([[math.exp(0.2), math.exp(-0.2)], [0.0, 0.0]]))
    assert stats["is_filter_ratio"].item() == 0.0
    assert stats["vllm_kl"].item() == pytest.approx(0.0, abs=1e-7)
    off, off_stats = is_weights(old, rollout, mask, level="off", mode="mask")
    assert torch.equal(off, mask.float()) and off_stats["is_weight_mean"].item() == 1.0


@pytest.mark.parametrize("level", ["seq", "geo"])
@pytest.mark.parametrize("mode", ["clip", "trunc"])
def test_sequence_levels_accept_only_mask(level: str, mode: str) -> None:
    with pytest.raises(ValueError, match=f"IS level '{level}' supports only mode 'mask'"):
        is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), level=level, mode=mode)  # type: ignore[arg-type]


def test_is_input_errors() -> None:
    ok = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown IS level"):
        is_weights(ok, ok, ok, level="sequence", mode="mask")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low <= high"):
        is_weights(ok, ok, ok, level="token", mode="mask", low=2.0, high=1.0)
    with pytest.raises(ValueError, match=r"rollout_logprobs contains -inf at index \(0, 0\)"):
        is_weights(ok, torch.tensor([[-math.inf, 0.0]]), ok, level="token", mode="mask")
