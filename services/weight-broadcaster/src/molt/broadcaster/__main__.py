"""Entry point of ``molt-broadcaster``: settings -> Ray + weight-group store -> WeightService until SIGTERM."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from molt.broadcaster.config import BroadcasterSettings
from molt.core.cli import start_service


async def serve(settings: BroadcasterSettings) -> None:
    from molt.broadcaster.refit import Broadcaster
    from molt.broadcaster.server import WeightServicer
    from molt.core.serve import Registration, ServiceHost
    from molt.v1 import weights_pb2, weights_pb2_grpc

    broadcaster = Broadcaster(settings)
    broadcaster.membership.open_store()
    await broadcaster.publisher.restore()
    service = weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name
    host = ServiceHost(
        name="weight-broadcaster",
        listen=settings.listen,
        registrations=[
            Registration(weights_pb2_grpc.add_WeightServiceServicer_to_server, WeightServicer(broadcaster), service)
        ],
        metrics_port=settings.metrics_port,
    )
    await host.start()
    await host.serve_until_signal(on_stop=broadcaster.close)


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(BroadcasterSettings, "broadcaster", "molt-broadcaster", argv)
    if settings is None:
        return
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # see molt.router.__main__
    import ray

    ray.init(address=settings.ray_address or "auto", namespace=f"molt-{settings.run.run_id}", log_to_driver=False)
    try:
        asyncio.run(serve(settings))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
