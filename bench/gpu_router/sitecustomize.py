"""A shim for one measurement only: ``bench/router.py`` on the GPU machine (``bench/gpu_router/run.sh``
puts this directory first on ``PYTHONPATH``), whose image holds torch 2.11.

vLLM 0.26.0 is the newest release built for torch 2.11 (later ones pin torch 2.13+, which cannot be
carried there), and it predates the engine core's weight-version labels (``set_weight_version_async``
and ``CompletionOutput.weight_versions``) that molt's engine actor reads each token's policy version
from. This file, imported at start by every Python process of that run, replaces the two methods of
``EngineActor`` that use them: every token is stamped with the actor's current version, which is exact
while no refit happens (the router bench runs none). Nothing else changes: requests, the data channel,
the router and gRPC run as in the product. Never put this on the path of a real run: under refits it
would misstate the versions of tokens sampled around a pause.
"""

from __future__ import annotations

from typing import Any

try:
    from molt.router import engine_actor as _engine
except Exception:  # a process that has no molt on its path (a Ray or vLLM helper): nothing to patch
    _engine = None  # type: ignore[assignment]

if _engine is not None:

    async def _label(self: Any, policy_version: int) -> None:
        self.policy_version = policy_version

    def _versions(self: Any, request_id: str, completion: Any, start: int) -> list[int]:
        return [self.policy_version] * len(completion.token_ids)

    _engine.EngineActor._label = _label  # type: ignore[method-assign]
    _engine.EngineActor._versions = _versions  # type: ignore[method-assign]
