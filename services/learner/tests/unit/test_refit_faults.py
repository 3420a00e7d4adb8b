"""The refit's fault-injection seam: what a corrupt or dropped tensor does to the manifest and the bytes sent."""

from __future__ import annotations

import pytest
import torch

from molt.core.weightsync import TensorMeta, tensor_checksum
from molt.learner.refit_faults import RefitFault, with_faults


def refit() -> tuple[list[TensorMeta], dict[str, torch.Tensor]]:
    state = {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3)}
    return [TensorMeta.of(name, tensor) for name, tensor in state.items()], state


def test_a_corrupt_tensor_is_sent_under_its_honest_checksum() -> None:
    metas, state = refit()
    sent_metas, sent = with_faults([RefitFault("b", "corrupt", version=6)], 6, metas, state)
    assert sent_metas == metas
    assert tensor_checksum(sent["b"]) != metas[1].checksum
    assert torch.equal(sent["a"], state["a"])
    assert torch.equal(state["b"], torch.ones(2, 3))  # the caller's tensor is left alone


def test_a_dropped_tensor_leaves_the_manifest_and_the_buckets() -> None:
    metas, state = refit()
    sent_metas, sent = with_faults([RefitFault("a", "drop", version=5)], 5, metas, state)
    assert [m.name for m in sent_metas] == ["b"] and list(sent) == ["b"]
    assert list(state) == ["a", "b"]


def test_a_fault_applies_to_its_version_only_and_must_name_a_tensor() -> None:
    metas, state = refit()
    assert with_faults([RefitFault("a", "drop", version=5)], 6, metas, state) == (metas, state)
    with pytest.raises(ValueError, match="no such tensor"):
        with_faults([RefitFault("c", "corrupt", version=1)], 1, metas, state)
