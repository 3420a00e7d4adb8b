"""The fault-injection seam of a refit: corrupt or drop one tensor on purpose.

``WeightPublisher(..., faults=[RefitFault(tensor, kind, version)])`` applies each
fault to the refit that publishes ``version``, after the manifest and its
checksums are computed: ``corrupt`` flips a bit of the tensor's bytes (the
checksum announced is the honest one), ``drop`` leaves the tensor out of the
manifest and the buckets. The weight-broadcaster's validation must then refuse
the refit (checksum mismatch; missing tensor). Used by the refit tests and the
consistency gates; nothing else passes faults (docs/refit.md, "Injecting a fault").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from molt.core.weightsync import TensorMeta


@dataclass(frozen=True)
class RefitFault:
    """Corrupt or drop the tensor named ``tensor`` (an HF checkpoint name) in the refit of ``version``."""

    tensor: str
    kind: Literal["corrupt", "drop"]
    version: int

    def apply(self, metas: list[TensorMeta], state: dict[str, Tensor]) -> tuple[list[TensorMeta], dict[str, Tensor]]:
        """The manifest and tensors this refit sends instead; ``state``'s own tensors are not modified."""
        if self.tensor not in state:
            raise ValueError(f"refit fault on {self.tensor!r}: the refit has no such tensor")
        if self.kind == "drop":
            return [m for m in metas if m.name != self.tensor], {n: t for n, t in state.items() if n != self.tensor}
        corrupt = state[self.tensor].clone()
        corrupt.view(-1).view(torch.uint8)[0] ^= 1  # one bit: the announced checksum no longer matches
        return metas, {**state, self.tensor: corrupt}


def with_faults(
    faults: Sequence[RefitFault], version: int, metas: list[TensorMeta], state: dict[str, Tensor]
) -> tuple[list[TensorMeta], dict[str, Tensor]]:
    """The refit of ``version`` with every fault meant for it applied, in order."""
    for fault in faults:
        if fault.version == version:
            metas, state = fault.apply(metas, state)
    return metas, state
