"""Running the router: Ray, then the engine pool behind RolloutService until SIGTERM.

``launch`` joins (or starts) Ray and runs ``serve``, which starts or attaches to
the engines (``EnginePool``), then serves RolloutService with health, reflection
and ``/metrics``; on SIGTERM it stops serving and shuts the pool down.
"""

from __future__ import annotations

import asyncio

import ray

from molt.core.auth import Access
from molt.core.serve import Registration, ServiceHost
from molt.router.config import RouterSettings
from molt.router.engine_pool import EnginePool
from molt.router.server import RolloutServicer
from molt.v1 import rollout_pb2, rollout_pb2_grpc

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


def launch(settings: RouterSettings) -> None:
    """Serves until SIGTERM inside Ray, which is shut down on the way out."""
    # Unset: a Ray instance of its own ("local"), never whatever `ray start` cluster (live or stale)
    # this machine recorded last.
    ray.init(address=settings.ray_address or "local", namespace=f"molt-{settings.run.run_id}", log_to_driver=True)
    try:
        asyncio.run(serve(settings))
    finally:
        ray.shutdown()


async def serve(settings: RouterSettings) -> None:
    pool = EnginePool(settings)
    limits = await pool.start()
    host = ServiceHost(
        name="rollout-router",
        listen=settings.listen,
        registrations=[
            Registration(
                rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                RolloutServicer(pool, settings, limits),
                SERVICE_NAME,
            )
        ],
        max_message_bytes=settings.max_message_bytes,
        metrics_port=settings.metrics_port,
        access=Access.of(settings.run),
    )
    await host.start()
    await host.serve_until_signal(on_stop=pool.shutdown)
