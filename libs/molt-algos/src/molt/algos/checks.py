"""Input checks shared by every estimator and loss in ``molt.algos``.

The original system silently replaced NaN with 0 and inf with +-30 inside the loss,
which hid broken logprobs and rewards for whole runs. Here a bad input is a
``ValueError`` naming the argument and the first bad index, raised before any
arithmetic; padding is checked too (callers pad with finite values). On a GPU each
``check_finite`` call costs one host sync for all the tensors it is given. Inside
``deferred_checks()`` the value checks (finiteness, 0/1 masks) record a device-side flag
instead, settled with one sync when the block ends and raising the same ``ValueError``:
a training step wraps its forwards and backwards in it, so a bad value still stops the
step before the optimizer, without a sync per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

# (all-good flag on the tensors' device, what raises the precise error) per deferred check.
_Pending = list[tuple[Tensor, Callable[[], None]]]
_DEFERRED: ContextVar[_Pending | None] = ContextVar("molt_algos_deferred_checks", default=None)


@contextmanager
def deferred_checks() -> Iterator[None]:
    """Value checks inside the block are settled together when it ends without an exception: one host
    sync, then the first failed check's own ``ValueError``."""
    pending: _Pending = []
    token = _DEFERRED.set(pending)
    try:
        yield
    finally:
        _DEFERRED.reset(token)
    if pending and not bool(torch.stack([flag.to(pending[0][0].device) for flag, _ in pending]).all().item()):
        for flag, raise_error in pending:
            if not bool(flag.item()):
                raise_error()


@contextmanager
def immediate_checks() -> Iterator[None]:
    """Inside ``deferred_checks()``: value checks in this block raise at once again (host-side work whose
    error must surface where it happens, on every rank alike, not after the step's collectives)."""
    token = _DEFERRED.set(None)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def _check_or_defer(flag: Tensor, raise_error: Callable[[], None]) -> None:
    pending = _DEFERRED.get()
    if pending is None:
        if not bool(flag.item()):
            raise_error()
    else:
        pending.append((flag, raise_error))


def _index(flat: int, shape: torch.Size) -> str:
    """A flat index as the caller would write it: ``3`` for 1-D, ``(1, 7)`` otherwise."""
    if len(shape) <= 1:
        return str(flat)
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return str(tuple(reversed(coords)))


def check_finite(**tensors: Tensor) -> None:
    """Raises ``ValueError("<name> contains NaN at index 3")`` for the first non-finite entry.

    Integer and bool tensors are always finite and skipped.
    """
    floats = {name: t.detach() for name, t in tensors.items() if t.is_floating_point()}
    if not floats:
        return
    all_finite = torch.stack([torch.isfinite(t).all() for t in floats.values()]).all()
    _check_or_defer(all_finite, lambda: _raise_first_non_finite(floats))


def _raise_first_non_finite(floats: dict[str, Tensor]) -> None:
    for name, t in floats.items():
        bad = (~torch.isfinite(t)).flatten().nonzero()
        if bad.numel():
            flat = int(bad[0].item())
            value = float(t.flatten()[flat].item())
            kind = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            raise ValueError(f"{name} contains {kind} at index {_index(flat, t.shape)}")


def check_same_shape(**tensors: Tensor) -> None:
    """Raises ``ValueError`` naming the first tensor whose shape differs from the first one's."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, {first_name} has shape {tuple(first.shape)}")


def check_ndim(ndim: int, **tensors: Tensor) -> None:
    """Raises ``ValueError`` for a tensor that is not ``ndim``-dimensional."""
    for name, t in tensors.items():
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_float(**tensors: Tensor) -> None:
    """Raises ``ValueError`` for a tensor that is not floating point (rewards, logprobs, values)."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_ids(**tensors: Tensor) -> None:
    """Raises ``ValueError`` for an id tensor that is not 1-D integer (map string ids to ints first)."""
    for name, t in tensors.items():
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} of shape {tuple(t.shape)}")


def mask_as_float(loss_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``loss_mask`` (bool, or numbers that are all 0/1) as ``dtype``; anything else is a ``ValueError``."""
    if loss_mask.dtype != torch.bool:
        check_finite(loss_mask=loss_mask)
        _check_or_defer(((loss_mask == 0) | (loss_mask == 1)).all(), _raise_bad_mask)
    return loss_mask.detach().to(dtype)


def _raise_bad_mask() -> None:
    raise ValueError("loss_mask must be bool or hold only 0 and 1")


def check_band(low: float, high: float, low_name: str = "low", high_name: str = "high") -> None:
    """Raises ``ValueError`` unless ``low <= high`` and both are finite numbers."""
    if not (float("-inf") < low <= high < float("inf")):
        raise ValueError(f"need finite {low_name} <= {high_name}, got {low_name}={low}, {high_name}={high}")
