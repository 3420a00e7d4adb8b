"""WeightService over gRPC: registration, refits, the published version and its stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from molt.broadcaster.refit import Broadcaster
from molt.core.errors import InvalidInput
from molt.core.serve import grpc_errors
from molt.v1 import weights_pb2, weights_pb2_grpc

DOMAIN = "broadcaster.molt"


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self, broadcaster: Broadcaster) -> None:
        self.broadcaster = broadcaster

    @grpc_errors(DOMAIN)
    async def RegisterWeightEndpoint(
        self, request: weights_pb2.RegisterWeightEndpointRequest, context: grpc.aio.ServicerContext
    ) -> weights_pb2.RegisterWeightEndpointResponse:
        if not request.endpoint_id:
            raise InvalidInput("endpoint_id is required")
        if request.role == weights_pb2.ENDPOINT_ROLE_LEARNER:
            await self.broadcaster.learner_registered()
            return weights_pb2.RegisterWeightEndpointResponse(
                first_rank=0, rendezvous_address=self.broadcaster.membership.rendezvous_address
            )
        if request.role == weights_pb2.ENDPOINT_ROLE_ENGINE:
            engine = await self.broadcaster.membership.register_endpoint(request.endpoint_id, request.address)
            return weights_pb2.RegisterWeightEndpointResponse(
                first_rank=engine.first_rank, rendezvous_address=self.broadcaster.membership.rendezvous_address
            )
        raise InvalidInput(f"role must be LEARNER or ENGINE, got {request.role}")

    @grpc_errors(DOMAIN)
    async def RefitWeights(
        self, request: weights_pb2.RefitWeightsRequest, context: grpc.aio.ServicerContext
    ) -> weights_pb2.RefitWeightsResponse:
        return await self.broadcaster.refit(request)

    @grpc_errors(DOMAIN)
    async def GetPolicyVersion(
        self, request: weights_pb2.GetPolicyVersionRequest, context: grpc.aio.ServicerContext
    ) -> weights_pb2.GetPolicyVersionResponse:
        return weights_pb2.GetPolicyVersionResponse(
            policy_version=self.broadcaster.publisher.published.version,
            refit_failure=self.broadcaster.paused_by_failure or "",
            rollout=self.broadcaster.settings.rollout.to_proto(),
        )

    @grpc_errors(DOMAIN)
    async def WatchPolicyVersion(
        self, request: weights_pb2.WatchPolicyVersionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[weights_pb2.WatchPolicyVersionResponse]:
        published = self.broadcaster.publisher.published
        last = published.version
        yield weights_pb2.WatchPolicyVersionResponse(policy_version=last)
        while True:
            last = await published.newer_than(last.version)
            yield weights_pb2.WatchPolicyVersionResponse(policy_version=last)
