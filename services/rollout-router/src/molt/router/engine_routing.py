"""The engine actor's side of routed-expert capture: start it in the workers, take a finished sample's.

``[rollout] routing_replay`` starts the capture of ``molt.router.expert_capture`` in every worker of
the engine when it is built. When a sample finishes, its routing over the prompt and every token
it sampled is taken from the workers (which then forget it) and packed as a ``molt.v1.ExpertRouting``
for the sample's last chunk. vLLM runs the samples of a request with ``n > 1`` as child requests
``<index>_<request id>``; a request with one sample keeps its id.
"""

from __future__ import annotations

import logging
from typing import Any

from molt.core import expert_routing
from molt.router.expert_capture import routing_array

log = logging.getLogger(__name__)


class EngineRouting:
    """Capture bookkeeping of one engine: the model's routing shape, from ``start``."""

    def __init__(self, shape: dict[str, int]) -> None:
        self.layers = shape["layers"]
        self.top_k = shape["top_k"]
        self.experts = shape["experts"]

    @classmethod
    async def start(cls, llm: Any, engine_id: str) -> EngineRouting:
        """Binds the capture in every worker (the first worker's answer gives the shape)."""
        shape = (await llm.collective_rpc("start_routing_capture"))[0]
        log.info("routed-expert capture on", extra={"engine": engine_id, **shape})
        return cls(shape)

    async def take(self, llm: Any, request_id: str, index: int, sample_count: int, token_count: int) -> bytes:
        """The serialized ``ExpertRouting`` of sample ``index`` of ``request_id`` over ``token_count``
        tokens (prompt + sampled), taken from every worker (tensor-parallel workers each hold a copy;
        the first is used); ``b""`` when nothing was captured for it (a request aborted before its
        first step)."""
        key = f"{index}_{request_id}" if sample_count > 1 else request_id
        answers = await llm.collective_rpc("take_routing", args=({key: token_count},))
        entry = answers[0].get(key)
        if entry is None:
            return b""
        return expert_routing.pack(routing_array(entry), self.experts or None).SerializeToString()
