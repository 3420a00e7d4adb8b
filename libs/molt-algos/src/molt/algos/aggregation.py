"""Loss aggregation: per-token losses ``[B, T]`` to the scalar one optimizer step differentiates.

Every mode is a weighted token sum, ``L = sum_i w_i * sum_t loss_it * mask_it``, whose row
weights ``w_i`` depend only on the loss-mask lengths (and prompt ids) of the **whole
optimizer step**, every micro-batch of every data-parallel rank: each micro-batch's
aggregate is its share of the sum, and the micro-batch losses (and gradients) add up to the
full-batch value with no division by the number of accumulation steps. DDP/FSDP average
gradients over ranks: multiply each rank's loss by the data-parallel world size (or reduce
with SUM); context-parallel ranks share a sample and must not count it twice. The number
to *report* is a plain ``masked_mean`` of the per-token loss, however the step was split.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from molt.algos.checks import check_finite, check_ids, check_ndim, check_same_shape, mask_as_float

AggregationMode = Literal["token_mean", "seq_mean_token_mean", "prompt_mean_token_mean"]


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x * mask)`` over ``dim`` (all dims when None). ``mask``: bool or 0/1, same shape as ``x``.

    Not validated (it runs on every stat of every loss call); the public losses check their masks.
    """
    m = mask.detach().to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x * mask) / max(sum(mask), 1)`` over ``dim``: 0 (not NaN) where the mask is empty."""
    m = mask.detach().to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def row_weights(loss_mask: Tensor, mode: AggregationMode, group_ids: Tensor | None = None) -> Tensor:
    """Per-row weights ``w_i`` of ``mode`` for the WHOLE optimizer step. ``[B, T] -> [B]`` float64.

    With ``n_i`` the loss tokens of row i (one row = one segment):

    * ``token_mean``: ``w_i = 1 / N``, N = sum of n_i over the step (a global token mean).
    * ``seq_mean_token_mean``: ``w_i = 1 / (n_i * S)``, S = rows with n_i > 0 (mean over rows
      of each row's token mean).
    * ``prompt_mean_token_mean``: ``w_i = 1 / (N_g * P)``, N_g = loss tokens of all rows of
      row i's group (prompt) g, P = groups with N_g > 0; needs ``group_ids`` ``[B]``.

    Rows (groups) without a loss token get weight 0 and are not counted in S (P). Compute
    the weights once on the step's rows (the metadata is tiny: all-gather it across
    ranks), split them alongside the rows, and pass each micro-batch's slice to ``aggregate``.
    """
    check_ndim(2, loss_mask=loss_mask)
    n = mask_as_float(loss_mask, torch.float64).sum(1)
    if mode == "token_mean":
        return torch.full_like(n, 1.0) / n.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        rows = (n > 0).sum().clamp(min=1)
        return torch.where(n > 0, 1.0 / (n.clamp(min=1) * rows), 0.0)
    if mode == "prompt_mean_token_mean":
        if group_ids is None:
            raise ValueError("prompt_mean_token_mean needs group_ids: one prompt (group) id per row")
        check_ids(group_ids=group_ids)
        if group_ids.shape[0] != n.shape[0]:
            raise ValueError(f"group_ids has {group_ids.shape[0]} entries, loss_mask has {n.shape[0]} rows")
        _, group = torch.unique(group_ids, return_inverse=True)
        n_groups = int(group.max().item()) + 1 if group.numel() else 0
        per_group = torch.zeros(n_groups, dtype=n.dtype, device=n.device).index_add(0, group, n)
        prompts = (per_group > 0).sum().clamp(min=1)
        tokens = per_group[group]
        return torch.where(tokens > 0, 1.0 / (tokens.clamp(min=1) * prompts), 0.0)
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {get_args(AggregationMode)}")


def aggregate(loss: Tensor, loss_mask: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i * sum_t loss_it * mask_it``: this micro-batch's share of the step loss. 0-d.

    loss, loss_mask: ``[B, T]``; weights: ``[B]``, this micro-batch's slice of ``row_weights``.
    """
    check_ndim(2, loss=loss)
    check_same_shape(loss=loss, loss_mask=loss_mask)
    check_ndim(1, weights=weights)
    if weights.shape[0] != loss.shape[0]:
        raise ValueError(f"weights has {weights.shape[0]} entries, loss has {loss.shape[0]} rows")
    check_finite(weights=weights)
    m = mask_as_float(loss_mask, loss.dtype)
    return ((loss * m).sum(1) * weights.detach().to(loss.dtype)).sum()


def token_mean(loss: Tensor, loss_mask: Tensor, global_token_count: float | Tensor) -> Tensor:
    """``sum(loss * mask) / global_token_count``: the ``token_mean`` share of one micro-batch. 0-d.

    ``global_token_count`` is the number of loss tokens of the whole optimizer step, summed
    over every micro-batch and data-parallel rank (all-reduce the local ``loss_mask.sum()``).
    A count of 0 (no loss token anywhere) gives 0. This equals ``aggregate`` with
    ``row_weights(..., "token_mean")`` without gathering any metadata.
    """
    check_same_shape(loss=loss, loss_mask=loss_mask)
    if isinstance(global_token_count, Tensor):
        count = global_token_count.detach().to(loss.dtype).clamp(min=1)
    else:
        if not global_token_count >= 0:
            raise ValueError(f"global_token_count must be >= 0, got {global_token_count}")
        count = max(float(global_token_count), 1.0)
    return (loss * mask_as_float(loss_mask, loss.dtype)).sum() / count
