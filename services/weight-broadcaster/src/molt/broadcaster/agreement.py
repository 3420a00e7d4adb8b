"""The broadcaster's part in the run's [rollout] agreement (``molt.core.rollout.register``).

It records its own values (it acts on ``partial_rollout``: how it pauses the router for a refit) and
the router's, which has no Redis of its own, so that a learner started with another sampling
temperature than the engines' is refused before it trains on wrongly weighted logprobs.
"""

from __future__ import annotations

import logging

import grpc

from molt.broadcaster.config import BroadcasterSettings
from molt.core import rollout
from molt.core.auth import Access
from molt.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


async def record_rollout(settings: BroadcasterSettings, router: rollout_pb2_grpc.RolloutServiceStub) -> None:
    """Registers the router's [rollout] values (when it answers) and the broadcaster's in the run's
    Redis hash; raises ``ConfigError`` when a service of the run disagrees. Without ``publish_redis``
    the broadcaster uses no Redis, and records nothing."""
    if not settings.publish_redis:
        return
    run_id = settings.run.run_id
    with Access.of(settings.run).redis(settings.run.redis_url) as client:
        try:
            status = await router.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:  # the router may start later; its other clients record it then
            log.warning("the rollout-router did not answer: its [rollout] values are not recorded", exc_info=exc)
        else:
            if status.HasField("rollout"):
                rollout.register(client, run_id, "rollout-router", rollout.RolloutSettings.from_proto(status.rollout))
        rollout.register(client, run_id, "weight-broadcaster", settings.rollout)
