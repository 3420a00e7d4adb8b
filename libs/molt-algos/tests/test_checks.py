"""Input checks, and the package's promise to import nothing but torch and the standard library."""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import pytest
import torch

from molt.algos.checks import (
    check_finite,
    check_ids,
    check_same_shape,
    deferred_checks,
    immediate_checks,
    mask_as_float,
)

SOURCE = Path(__file__).resolve().parents[1] / "src" / "molt" / "algos"


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.tensor([0.0, 1.0, 2.0, math.nan]), "rewards contains NaN at index 3"),
        (torch.tensor([0.0, math.inf]), "rewards contains inf at index 1"),
        (torch.tensor([[0.0, 0.0], [0.0, -math.inf]]), r"rewards contains -inf at index \(1, 1\)"),
        (torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[0.0, math.nan], [math.nan, 0.0]]]), r"index \(1, 0, 1\)"),
    ],
)
def test_check_finite_names_argument_and_first_index(tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_finite(values=torch.zeros(3), rewards=tensor)


def test_check_finite_accepts_finite_ints_and_grad_tensors() -> None:
    check_finite(a=torch.zeros(2, requires_grad=True), b=torch.tensor([1, 2]), c=torch.tensor([True]))


def test_shape_and_id_checks() -> None:
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 4\), logprobs has shape \(2, 3\)"):
        check_same_shape(logprobs=torch.zeros(2, 3), loss_mask=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="group_ids must be a 1-D integer tensor"):
        check_ids(group_ids=torch.tensor([True]))
    assert torch.equal(mask_as_float(torch.tensor([0, 1]), torch.float32), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="loss_mask must be bool"):
        mask_as_float(torch.tensor([2]), torch.float32)


def test_only_torch_and_stdlib_are_imported() -> None:
    """molt.algos is pure math: no grpc, redis, ray, numpy or any other service dependency."""
    allowed = set(sys.stdlib_module_names) | {"torch", "molt"}
    for path in SOURCE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                if name.startswith("molt."):
                    assert name.startswith("molt.algos"), f"{path.name} imports {name}"
    assert not (SOURCE / "__init__.py").exists() and not (SOURCE.parent / "__init__.py").exists()


def test_deferred_checks_raise_the_same_error_once_the_block_ends() -> None:
    """Inside the block nothing syncs or raises; on leaving, the first failed check's own message."""
    good = torch.zeros(2, 3)
    bad = torch.zeros(2, 3)
    bad[1, 2] = float("nan")
    reached_the_end = False
    with pytest.raises(ValueError, match=r"logprobs contains NaN at index \(1, 2\)"), deferred_checks():
        check_finite(rewards=good)
        check_finite(logprobs=bad)
        mask_as_float(torch.tensor([0.0, 2.0]), torch.float32)  # also bad, but checked later
        reached_the_end = True
    assert reached_the_end
    with pytest.raises(ValueError, match="loss_mask must be bool or hold only 0 and 1"), deferred_checks():
        mask_as_float(torch.tensor([0.0, 2.0]), torch.float32)
    with deferred_checks():  # all good: nothing raised
        check_finite(rewards=good)
        mask_as_float(torch.tensor([0.0, 1.0]), torch.float32)
    with pytest.raises(KeyError), deferred_checks():  # an error inside the block propagates as it is
        check_finite(logprobs=bad)
        raise KeyError("first")
    with pytest.raises(ValueError, match="logprobs contains NaN"):  # outside a block: immediate again
        check_finite(logprobs=bad)
    reached_the_end = False
    with pytest.raises(ValueError, match="rewards contains NaN"), deferred_checks():
        with immediate_checks():  # raises here, inside the deferred block, not when it ends
            check_finite(rewards=bad)
        reached_the_end = True
    assert not reached_the_end
