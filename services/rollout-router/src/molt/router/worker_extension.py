"""Code vLLM injects into every engine worker (``worker_extension_cls``).

Reached with ``collective_rpc``; it runs beside the model in the worker
process. The weight-broadcaster builds weight receiving on it (issue #6);
for now it reports what the worker holds, which refit validation compares.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


class WeightReceiver:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the served model."""

    model_runner: Any

    def parameter_checksums(self) -> dict[str, str]:
        """Per parameter: blake2b of its bytes as the worker holds them (dtype and layout included)."""
        sums: dict[str, str] = {}
        for name, tensor in self.model_runner.model.state_dict().items():
            data = tensor.detach().contiguous().cpu().view(-1).view(dtype=torch.uint8)
            sums[name] = hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()
        return sums
