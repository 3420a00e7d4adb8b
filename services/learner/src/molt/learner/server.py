"""LearnerService over gRPC: protobuf in, calls on the ``LearnerLoop``, protobuf out (nothing else lives here).

The loop runs in its own thread; SaveCheckpoint and StopLearner hand it a request
and await the future it resolves between steps.
"""

from __future__ import annotations

import asyncio

import grpc
import redis
from google.protobuf.timestamp_pb2 import Timestamp

from molt.core.queue import QueueKeys
from molt.core.serve import grpc_errors
from molt.learner.config import LearnerSettings
from molt.learner.loop import LearnerLoop
from molt.v1 import learner_pb2, learner_pb2_grpc

DOMAIN = "learner"


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """Maps LearnerService calls onto the loop."""

    def __init__(self, loop: LearnerLoop, settings: LearnerSettings) -> None:
        self.loop = loop
        self.settings = settings

    @grpc_errors(DOMAIN)
    async def GetLearnerStatus(
        self, request: learner_pb2.GetLearnerStatusRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.GetLearnerStatusResponse:
        status = self.loop.status()
        response = learner_pb2.GetLearnerStatusResponse(
            step=status.step,
            policy_version=status.policy_version,
            consumed_trajectory_count=status.consumed_count,
            dropped_trajectory_counts=status.dropped,
            last_step_metrics=status.last_metrics,
            last_checkpoint_step=status.last_checkpoint_step,
            skipped_group_counts=status.skipped,
            dead_letter_count=await asyncio.to_thread(self._dead_letters),
        )
        if status.last_step_time is not None:
            stamp = Timestamp()
            stamp.FromNanoseconds(int(status.last_step_time * 1e9))
            response.last_step_time.CopyFrom(stamp)
        return response

    def _dead_letters(self) -> int:
        """The run's dead-letter stream's length now; -1 when Redis does not answer (status still served)."""
        if self.loop.queue is None:
            return 0
        try:
            return self.loop.queue.stats().dead_letters
        except redis.RedisError:
            return -1

    @grpc_errors(DOMAIN)
    async def GetRunSettings(
        self, request: learner_pb2.GetRunSettingsRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.GetRunSettingsResponse:
        keys = QueueKeys(self.settings.run.run_id)
        return learner_pb2.GetRunSettingsResponse(
            run_id=self.settings.run.run_id,
            redis_url=self.settings.run.redis_url,
            trajectory_stream_key=keys.stream,
            seen_set_key=keys.seen_ids,
            rollout=self.settings.rollout.to_proto(),
        )

    @grpc_errors(DOMAIN)
    async def SaveCheckpoint(
        self, request: learner_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.SaveCheckpointResponse:
        info = await asyncio.wrap_future(self.loop.request_checkpoint(request.request_id))
        return learner_pb2.SaveCheckpointResponse(step=info.step, path=str(info.path))

    @grpc_errors(DOMAIN)
    async def StopLearner(
        self, request: learner_pb2.StopLearnerRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.StopLearnerResponse:
        step = await asyncio.wrap_future(self.loop.request_stop(request.save_checkpoint))
        return learner_pb2.StopLearnerResponse(step=step)
