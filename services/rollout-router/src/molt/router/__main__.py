"""Entry point of ``molt-router``: settings -> Ray + engines -> RolloutService until SIGTERM."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from molt.core.cli import start_service
from molt.router.config import RouterSettings


async def serve(settings: RouterSettings) -> None:
    from molt.core.serve import Registration, ServiceHost
    from molt.router.engine_pool import EnginePool
    from molt.router.server import RolloutServicer
    from molt.v1 import rollout_pb2, rollout_pb2_grpc

    pool = EnginePool(settings)
    limits = await pool.start()
    service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
    host = ServiceHost(
        name="rollout-router",
        listen=settings.listen,
        registrations=[
            Registration(
                rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                RolloutServicer(pool, settings, limits),
                service,
            )
        ],
        max_message_bytes=settings.max_message_bytes,
        metrics_port=settings.metrics_port,
    )
    await host.start()
    await host.serve_until_signal(on_stop=pool.shutdown)


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(RouterSettings, "router", "molt-router", argv)
    if settings is None:
        return
    # Ray's `uv run` hook would start every worker through `uv run` and upload the working
    # directory; molt's workers share this interpreter, so turn it off before Ray is imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    # Unset: a Ray instance of its own ("local"), never whatever `ray start` cluster (live or stale)
    # this machine recorded last.
    ray.init(address=settings.ray_address or "local", namespace=f"molt-{settings.run.run_id}", log_to_driver=True)
    try:
        asyncio.run(serve(settings))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
