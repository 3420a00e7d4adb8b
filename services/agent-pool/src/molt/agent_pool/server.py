"""AgentPoolService over gRPC: protobuf in, pool calls, protobuf out."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from molt.agent_pool.pool import RolloutPool
from molt.core.errors import InvalidInput
from molt.core.serve import grpc_errors
from molt.v1 import agent_pool_pb2, agent_pool_pb2_grpc

DOMAIN = "agent-pool"


class AgentPoolServicer(agent_pool_pb2_grpc.AgentPoolServiceServicer):
    """Maps AgentPoolService calls onto the RolloutPool."""

    def __init__(self, pool: RolloutPool, policy_version: Callable[[], int]) -> None:
        self.pool = pool
        self.policy_version = policy_version

    @grpc_errors(DOMAIN)
    async def StartRollouts(
        self, request: agent_pool_pb2.StartRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> agent_pool_pb2.StartRolloutsResponse:
        if request.max_group_count < 0:
            raise InvalidInput(f"max_group_count must be >= 0 (0: until stopped), got {request.max_group_count}")
        return agent_pool_pb2.StartRolloutsResponse(started=self.pool.start(request.max_group_count))

    @grpc_errors(DOMAIN)
    async def StopRollouts(
        self, request: agent_pool_pb2.StopRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> agent_pool_pb2.StopRolloutsResponse:
        abandoned = await self.pool.stop(drain=request.drain)
        return agent_pool_pb2.StopRolloutsResponse(abandoned_episode_count=abandoned)

    @grpc_errors(DOMAIN)
    async def GetAgentPoolStatus(
        self, request: agent_pool_pb2.GetAgentPoolStatusRequest, context: grpc.aio.ServicerContext
    ) -> agent_pool_pb2.GetAgentPoolStatusResponse:
        stats = self.pool.stats
        rewards = list(stats.recent_rewards)
        return agent_pool_pb2.GetAgentPoolStatusResponse(
            running=self.pool.running,
            in_flight_episode_count=stats.in_flight_episodes,
            in_flight_group_count=stats.in_flight_groups,
            completed_episode_count=stats.completed_episodes,
            failed_episode_counts=dict(stats.failed_episodes),
            queued_group_count=stats.queued_groups,
            filtered_group_counts=dict(stats.filtered_groups),
            queued_trajectory_count=stats.queued_trajectories,
            recent_mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            backpressured=stats.backpressured,
            policy_version=self.policy_version(),
        )
