"""The agent-pool's client of RolloutService: protobuf stays here, samples come out as dataclasses."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from molt.core import expert_routing
from molt.core.auth import Access
from molt.core.errors import InvalidInput, MoltError, Unavailable
from molt.core.rollout import RolloutSettings
from molt.core.serve import KEEPALIVE, error_info
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORTED: "aborted",
}


@dataclass
class Sample:
    """One sampled reply, token-exact. ``finish_reason``: "stop" | "length" | "aborted"."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    routing: np.ndarray | None = None  # [prompt + sampled tokens, layers, top_k] (``[rollout] routing_replay``)

    def extend(self, chunk: rollout_pb2.GenerateStreamResponse | rollout_pb2.Completion) -> None:
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.versions += chunk.policy_versions
        self.top_logprobs += [(list(t.token_ids), list(t.logprobs)) for t in chunk.top_logprobs]
        if chunk.finish_reason:
            self.finish_reason = FINISH_NAMES.get(chunk.finish_reason, "stop")
            self.stop_reason = chunk.stop_reason
        if chunk.HasField("routed_experts"):
            self.routing = expert_routing.unpack(chunk.routed_experts)


@dataclass(frozen=True)
class GenerationRequest:
    """What the pool asks of the router; protected sampling values are left to the router unless set."""

    request_id: str
    session_id: str
    prompt_ids: list[int]
    max_tokens: int = 0
    sample_count: int = 1
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    top_logprob_count: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


@dataclass(frozen=True)
class RouterInfo:
    policy_version: int
    max_model_len: int
    vocab_size: int
    max_tokens_cap: int = 0  # the most max_tokens a request may ask for (0: not reported)
    rollout: RolloutSettings | None = None  # the router's [rollout] table (None: not reported)


# A router that restarts must be reached again within seconds: gRPC's default reconnect backoff grows to
# 120 s, which would keep a pool that failed a few calls failing long after the router is back.
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


def _to_error(exc: grpc.aio.AioRpcError) -> MoltError:
    info = error_info(exc)
    reason = info.reason if info else exc.code().name
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidInput(exc.details() or "invalid request", reason=reason)
    return Unavailable(f"rollout-router: {exc.code().name}: {exc.details()}", reason="ROUTER_UNAVAILABLE")


class RouterClient:
    """Calls one rollout-router; every call has a deadline."""

    def __init__(self, address: str, timeout_s: float = 600.0, access: Access | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = (access or Access()).aio_channel(address, [*RECONNECT, *KEEPALIVE])
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    def _request(self, req: GenerationRequest) -> dict[str, Any]:
        """The fields a GenerateRequest and a GenerateStreamRequest share."""
        params = common_pb2.SamplingParams(
            max_tokens=req.max_tokens,
            sample_count=req.sample_count,
            stop_strings=req.stop_strings,
            top_logprob_count=req.top_logprob_count,
        )
        for name in ("seed", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(req, name) is not None:
                setattr(params, name, getattr(req, name))
        return {
            "request_id": req.request_id,
            "session_id": req.session_id,
            "prompt_token_ids": req.prompt_ids,
            "sampling_params": params,
        }

    async def stream(
        self, req: GenerationRequest
    ) -> AsyncGenerator[tuple[int, rollout_pb2.GenerateStreamResponse], None]:
        """Yields ``(sample_index, chunk)`` as the router streams them."""
        call = self.stub.GenerateStream(rollout_pb2.GenerateStreamRequest(**self._request(req)), timeout=self.timeout_s)
        try:
            async for chunk in call:
                yield chunk.sample_index, chunk
        except grpc.aio.AioRpcError as exc:
            raise _to_error(exc) from exc
        finally:
            call.cancel()  # closed early (the reader gave up): the router aborts the request; no-op once done

    async def generate(self, req: GenerationRequest) -> list[Sample]:
        """All samples of the request, once finished: one unary call (the router then carries each
        sample once, not one message per ``stream_interval`` tokens)."""
        try:
            reply = await self.stub.Generate(rollout_pb2.GenerateRequest(**self._request(req)), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _to_error(exc) from exc
        samples = [Sample() for _ in range(max(1, req.sample_count))]
        for completion in reply.completions:
            samples[completion.sample_index].extend(completion)
        return samples

    async def info(self) -> RouterInfo:
        try:
            status = await self.stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise _to_error(exc) from exc
        rollout = RolloutSettings.from_proto(status.rollout) if status.HasField("rollout") else None
        return RouterInfo(
            status.policy_version, status.max_model_len, status.vocab_size, status.max_tokens_cap, rollout
        )
