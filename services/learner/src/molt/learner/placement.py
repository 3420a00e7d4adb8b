"""Ray placement of the learner's ranks (``placement = "ray"``).

``molt-learner`` becomes a Ray driver: it asks the cluster for one placement group of
``data_parallel_size`` bundles (a GPU and a CPU each where the cluster has GPUs, else
``max(cpu_threads, 1)`` CPUs each), ``STRICT_PACK`` on one node so that FSDP's collectives
stay inside it, preferring the driver's own node so that rank 0's gRPC and ``/metrics``
listen addresses are where they were configured. Each rank is a ``RankActor`` on its bundle
(Ray sets its ``CUDA_VISIBLE_DEVICES``); rank 0 picks the rendezvous (its node address and a
free port) and then runs exactly what a local rank runs (``run_rank``). The driver forwards
SIGTERM/SIGINT to rank 0 (stop after the step, with a checkpoint), and when any rank fails it
kills the others, which would otherwise wait in a collective forever, and raises its error.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from molt.core.log import setup_logging
from molt.core.ports import free_port
from molt.learner.config import LearnerSettings
from molt.learner.loop import LearnerLoop

log = logging.getLogger(__name__)


class RankActor:
    """One data-parallel rank inside a Ray actor (threaded: ``stop`` arrives while ``run`` runs)."""

    def __init__(self, settings: LearnerSettings, rank: int, world: int) -> None:
        setup_logging(f"molt-learner[{rank}]", settings.run.run_id)
        self.settings, self.rank, self.world = settings, rank, world
        self.loop: LearnerLoop | None = None
        self.stop_asked = False

    def where(self) -> str:
        """``<node address>:<pid>`` of this rank, for the driver's log."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{os.getpid()}"

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a free port on it, for every rank's ``init_process_group``."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, self.settings.master_port or free_port(host)

    def run(self, rendezvous: tuple[str, int]) -> None:
        from molt.learner.service import run_rank

        run_rank(self.rank, self.world, self.settings, rendezvous, None, on_loop=self._attach)

    def stop(self) -> None:
        """Rank 0: stop after the current step, with a checkpoint (also when the loop is not built yet)."""
        self.stop_asked = True
        if self.loop is not None:
            self.loop.request_stop(save_checkpoint=True)

    def _attach(self, loop: LearnerLoop) -> None:
        self.loop = loop
        if self.stop_asked:
            loop.request_stop(save_checkpoint=True)


def bundle_for(settings: LearnerSettings, use_gpu: bool) -> dict[str, float]:
    """What one rank reserves: a GPU and a CPU, or the CPUs of its torch threads."""
    return {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": float(max(settings.cpu_threads, 1))}


def launch_on_ray(settings: LearnerSettings) -> None:
    """Runs the ranks as Ray actors until rank 0's loop ends; raises the first rank failure."""
    # Ray's `uv run` hook would start every worker through `uv run`; molt's share this interpreter.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = settings.data_parallel_size
    ray.init(address=settings.ray_address or "local", namespace=f"molt-{settings.run.run_id}", log_to_driver=True)
    group = None
    actors: list[Any] = []
    try:
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        bundle = bundle_for(settings, use_gpu)
        group = placement_group(
            [bundle] * world,
            strategy="STRICT_PACK",
            name=f"molt-{settings.run.run_id}-learner",
            _soft_target_node_id=ray.get_runtime_context().get_node_id(),
        )
        ready, _ = ray.wait([group.ready()], timeout=settings.placement_timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray did not grant {world} x {bundle} on one node within {settings.placement_timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()} free"
            )
        remote = ray.remote(RankActor)
        actors = [
            remote.options(  # type: ignore[attr-defined]
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0.0),
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote(settings, rank, world)
            for rank in range(world)
        ]
        rendezvous = ray.get(actors[0].rendezvous.remote())
        log.info(
            "learner ranks placed by Ray",
            extra={
                "bundle": bundle,
                "rendezvous": f"{rendezvous[0]}:{rendezvous[1]}",
                "ranks": ray.get([actor.where.remote() for actor in actors]),  # node:pid per rank
            },
        )
        _wait(ray, actors, [actor.run.remote(rendezvous) for actor in actors])
    finally:
        for actor in actors:
            ray.kill(actor)
        if group is not None:
            remove_placement_group(group)
        ray.shutdown()


def _wait(ray: Any, actors: list[Any], runs: list[Any]) -> None:
    """Waits for every rank; forwards SIGTERM/SIGINT to rank 0 and fails fast when a rank fails."""
    stop_asked = False

    def ask_stop(signum: int, frame: object) -> None:
        nonlocal stop_asked
        stop_asked = True

    previous = {sig: signal.signal(sig, ask_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    forwarded = False
    rank_of = {ref: rank for rank, ref in enumerate(runs)}
    pending = list(runs)
    try:
        while pending:
            if stop_asked and not forwarded:
                log.info("stop asked: rank 0 stops after its step, with a checkpoint")
                actors[0].stop.remote()
                forwarded = True
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception:
                    # The caller's finally kills the others, which would wait in a collective forever.
                    log.error("learner rank failed; stopping the other ranks", extra={"rank": rank_of[ref]})
                    raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
