"""RolloutService over gRPC: protobuf in, domain calls, protobuf out (nothing else lives here)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf import duration_pb2

from molt.core.errors import InvalidInput
from molt.core.serve import grpc_errors
from molt.router import metrics
from molt.router.config import RouterSettings
from molt.router.data_channel import Chunk
from molt.router.engine_pool import EnginePool
from molt.router.sampling import ModelLimits, RequestedSampling, Sampling, check_prompt, resolve
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

DOMAIN = "rollout-router"
FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORTED,
}
PAUSE_MODES = {rollout_pb2.PAUSE_MODE_DRAIN: "drain", rollout_pb2.PAUSE_MODE_KEEP: "keep"}
MAX_DURATION_S = 315_576_000_000  # google.protobuf.Duration's range: about 10,000 years


def _seconds(duration: duration_pb2.Duration) -> float:
    """A Duration in seconds; InvalidInput for one outside the type's range (which ``ToTimedelta`` turns
    into an OverflowError) or whose nanos disagree with its seconds."""
    seconds, nanos = duration.seconds, duration.nanos
    if abs(seconds) > MAX_DURATION_S or abs(nanos) > 999_999_999 or seconds * nanos < 0:
        raise InvalidInput(
            f"drain_timeout ({seconds} s, {nanos} ns) is not a valid Duration", reason="INVALID_DRAIN_TIMEOUT"
        )
    return seconds + nanos / 1e9


def requested_sampling(params: common_pb2.SamplingParams) -> RequestedSampling:
    """The request's sampling fields, with unset optional fields as None."""

    def optional(name: str) -> float | int | None:
        return getattr(params, name) if params.HasField(name) else None

    return RequestedSampling(
        max_tokens=params.max_tokens,
        temperature=optional("temperature"),
        top_p=optional("top_p"),
        top_k=optional("top_k"),  # type: ignore[arg-type]
        min_p=optional("min_p"),
        repetition_penalty=optional("repetition_penalty"),
        stop_token_ids=tuple(params.stop_token_ids),
        stop_strings=tuple(params.stop_strings),
        seed=optional("seed"),  # type: ignore[arg-type]
        sample_count=params.sample_count,
        top_logprob_count=params.top_logprob_count,
    )


def _top_logprobs(chunk: Chunk) -> list[rollout_pb2.TopLogprobs]:
    return [rollout_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in chunk.top_logprobs]


def _routing(chunk: Chunk) -> common_pb2.ExpertRouting | None:
    """The routed experts a sample's last chunk carries (``[rollout] routing_replay``), counted."""
    if not chunk.routing:
        return None
    routing = common_pb2.ExpertRouting.FromString(chunk.routing)
    metrics.ROUTING_BYTES.inc(len(routing.ids))
    metrics.ROUTING_TOKENS.inc(len(routing.ids) // (routing.layer_count * routing.top_k * routing.id_bytes))
    return routing


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Maps RolloutService calls onto the EnginePool."""

    def __init__(self, pool: EnginePool, settings: RouterSettings, limits: ModelLimits) -> None:
        self.pool = pool
        self.settings = settings
        self.limits = limits

    def _checked(self, request_id: str, prompt: list[int], params: common_pb2.SamplingParams) -> Sampling:
        check_prompt(request_id, prompt, self.limits)
        resolved = resolve(
            requested_sampling(params), self.settings.sampling, self.settings.rollout, len(prompt), self.limits
        )
        for name in resolved.ignored:
            metrics.PROTECTED_IGNORED.labels(name).inc()
        return resolved.sampling

    @grpc_errors(DOMAIN)
    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        prompt = list(request.prompt_token_ids)
        sampling = self._checked(request.request_id, prompt, request.sampling_params)
        completions = [rollout_pb2.Completion(sample_index=i) for i in range(sampling.sample_count)]
        engine = ""
        chunks = self.pool.generate(request.request_id, request.session_id, prompt, sampling, final_only=True)
        async for engine_id, chunk in chunks:
            engine = engine_id
            completion = completions[chunk.sample_index]
            completion.token_ids.extend(chunk.token_ids)
            completion.logprobs.extend(chunk.logprobs)
            completion.policy_versions.extend([chunk.policy_version] * len(chunk.token_ids))
            completion.top_logprobs.extend(_top_logprobs(chunk))
            if chunk.finish_reason is not None:
                completion.finish_reason = FINISH_REASONS.get(chunk.finish_reason, common_pb2.FINISH_REASON_STOP)
                completion.stop_reason = chunk.stop_reason
                if (routing := _routing(chunk)) is not None:
                    completion.routed_experts.CopyFrom(routing)
        return rollout_pb2.GenerateResponse(
            request_id=request.request_id, completions=completions, engine_id=engine, prompt_token_count=len(prompt)
        )

    @grpc_errors(DOMAIN)
    async def GenerateStream(
        self, request: rollout_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateStreamResponse]:
        prompt = list(request.prompt_token_ids)
        sampling = self._checked(request.request_id, prompt, request.sampling_params)
        async for engine, chunk in self.pool.generate(request.request_id, request.session_id, prompt, sampling):
            yield rollout_pb2.GenerateStreamResponse(
                request_id=request.request_id,
                sample_index=chunk.sample_index,
                token_ids=chunk.token_ids,
                logprobs=chunk.logprobs,
                policy_versions=[chunk.policy_version] * len(chunk.token_ids),
                top_logprobs=_top_logprobs(chunk),
                finish_reason=FINISH_REASONS.get(chunk.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED),
                stop_reason=chunk.stop_reason,
                engine_id=engine,
                routed_experts=_routing(chunk),
            )

    @grpc_errors(DOMAIN)
    async def AbortGeneration(
        self, request: rollout_pb2.AbortGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortGenerationResponse:
        return rollout_pb2.AbortGenerationResponse(aborted=await self.pool.abort(request.request_id))

    @grpc_errors(DOMAIN)
    async def PauseGeneration(
        self, request: rollout_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseGenerationResponse:
        if request.mode != rollout_pb2.PAUSE_MODE_UNSPECIFIED and request.mode not in PAUSE_MODES:
            raise InvalidInput(f"unknown pause mode {request.mode}", reason="UNKNOWN_PAUSE_MODE")
        mode = PAUSE_MODES.get(request.mode, self.settings.rollout.pause_mode)
        timeout = self.settings.pause.drain_timeout_s
        if request.HasField("drain_timeout"):
            timeout = _seconds(request.drain_timeout)
        if timeout < 0:
            raise InvalidInput(f"drain_timeout {timeout} s is negative", reason="NEGATIVE_DRAIN_TIMEOUT")
        suspended = await self.pool.pause(mode, timeout)  # type: ignore[arg-type]
        return rollout_pb2.PauseGenerationResponse(
            suspended_request_count=suspended, policy_version=self.pool.policy_version
        )

    @grpc_errors(DOMAIN)
    async def ResumeGeneration(
        self, request: rollout_pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeGenerationResponse:
        version = request.policy_version if request.HasField("policy_version") else None
        return rollout_pb2.ResumeGenerationResponse(policy_version=await self.pool.resume(version))

    @grpc_errors(DOMAIN)
    async def GetRouterStatus(
        self, request: rollout_pb2.GetRouterStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetRouterStatusResponse:
        pool, replacements = self.pool, self.pool.replacements
        live = [engine_id for engine_id in pool.actors if pool.links.is_live(engine_id)]
        serving = set(replacements.serving(live))
        engines = [
            rollout_pb2.EngineStatus(
                engine_id=engine_id,
                healthy=engine_id in live,  # its data channel is open (closed: it died)
                outstanding_request_count=count,
                outstanding_token_count=tokens,
                tensor_parallel_size=self.settings.engine.tensor_parallel_size,
                replacing=engine_id in replacements.replacing,
                replacement_count=replacements.counts.get(engine_id, 0),
                serving=engine_id in serving,
                policy_version=pool.infos[engine_id].policy_version if engine_id in pool.infos else 0,
            )
            for engine_id, (count, tokens) in sorted(pool.load().items())
        ]
        return rollout_pb2.GetRouterStatusResponse(
            engines=engines,
            paused=self.pool.paused,
            policy_version=self.pool.policy_version,
            in_flight_request_count=len(self.pool.in_flight),
            waiting_request_count=self.pool.waiting,
            vocab_size=self.limits.vocab_size,
            max_model_len=self.limits.max_model_len,
            max_tokens_cap=self.settings.sampling.max_tokens_cap,
            rollout=self.settings.rollout.to_proto(),
        )
