"""Running the weight-broadcaster: Ray, the weight group's store, then WeightService until SIGTERM.

``launch`` joins the engines' Ray cluster and runs ``serve``, which opens the
weight group's TCPStore, records the run's [rollout] values (its own and the
router's), restores the version a previous broadcaster published, and serves WeightService
with health, reflection and ``/metrics``.
"""

from __future__ import annotations

import asyncio

import ray

from molt.broadcaster.agreement import record_rollout
from molt.broadcaster.config import BroadcasterSettings
from molt.broadcaster.refit import Broadcaster
from molt.broadcaster.server import WeightServicer
from molt.core.auth import Access
from molt.core.serve import Registration, ServiceHost
from molt.v1 import weights_pb2, weights_pb2_grpc

SERVICE_NAME = weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name


def launch(settings: BroadcasterSettings) -> None:
    """Serves until SIGTERM inside the engines' Ray cluster, disconnecting from it on the way out."""
    ray.init(address=settings.ray_address or "auto", namespace=f"molt-{settings.run.run_id}", log_to_driver=False)
    try:
        asyncio.run(serve(settings))
    finally:
        ray.shutdown()


async def serve(settings: BroadcasterSettings) -> None:
    broadcaster = Broadcaster(settings)
    broadcaster.membership.open_store()
    await record_rollout(settings, broadcaster.router)
    await broadcaster.publisher.restore()
    host = ServiceHost(
        name="weight-broadcaster",
        listen=settings.listen,
        registrations=[
            Registration(
                weights_pb2_grpc.add_WeightServiceServicer_to_server, WeightServicer(broadcaster), SERVICE_NAME
            )
        ],
        metrics_port=settings.metrics_port,
        access=Access.of(settings.run),
    )
    await host.start()
    await host.serve_until_signal(on_stop=broadcaster.close)
