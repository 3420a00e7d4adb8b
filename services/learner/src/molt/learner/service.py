"""Running the learner: one process per data-parallel rank; rank 0 serves LearnerService and reads
the queue, the other ranks follow its steps.

``launch`` starts ``data_parallel_size`` ranks as local processes (torch
multiprocessing, ``placement = "local"``) or as Ray actors in a placement group
(``placement = "ray"``, ``molt.learner.placement``), and ``run_rank`` builds one
rank's objects: trainer, checkpoints (resuming from the newest),
and on rank 0 the queue consumer, the metrics sinks, the gRPC server with
health, reflection and ``/metrics``, and the loop thread. SIGTERM/SIGINT stop
the loop after its current step, with a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from molt.core import rollout
from molt.core.auth import Access
from molt.core.errors import ConsumerNameTaken
from molt.core.log import setup_logging
from molt.core.ports import free_port
from molt.core.queue import TrajectoryQueue
from molt.core.serve import Registration, ServiceHost
from molt.learner.checkpoint import Checkpoints
from molt.learner.config import LearnerSettings
from molt.learner.loop import LearnerLoop, OnStep
from molt.learner.metrics import MetricsLog
from molt.learner.ranks import RankInfo, finish_together, init_group, leave_group
from molt.learner.refit import WeightPublisher
from molt.learner.server import LearnerServicer
from molt.learner.trainer import Trainer
from molt.learner.wandb_sink import WandbSink
from molt.v1 import learner_pb2, learner_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name


def launch(settings: LearnerSettings, on_step: OnStep | None = None) -> None:
    """Runs the learner until it stops: Ray actors (``placement = "ray"``), else in this process for
    one rank and one local process per rank for more."""
    run_dir = settings.run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "learner-settings.json").write_text(settings.model_dump_json(indent=2))
    with Access.of(settings.run).redis(settings.run.redis_url) as client:  # ConfigError: a service of the run disagrees
        rollout.register(client, settings.run.run_id, "learner", settings.rollout)
    if settings.placement == "ray":
        from molt.learner.placement import launch_on_ray

        launch_on_ray(settings)
        return
    world = settings.data_parallel_size
    if world == 1:
        run_rank(0, 1, settings, ("127.0.0.1", 0), on_step)
        return
    rendezvous = ("127.0.0.1", settings.master_port or free_port())
    ranks = mp.start_processes(
        _spawned_rank, args=(world, settings, rendezvous), nprocs=world, join=False, start_method="spawn"
    )
    # SIGTERM reaches this parent only: hand it to rank 0, whose loop stops after its step with a
    # checkpoint and tells the followers to stop.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(ranks.pids()[0], signal.SIGTERM))
    try:
        while not ranks.join():
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _spawned_rank(rank: int, world: int, settings: LearnerSettings, rendezvous: tuple[str, int]) -> None:
    setup_logging(f"molt-learner[{rank}]", settings.run.run_id)  # a spawned process starts without handlers
    run_rank(rank, world, settings, rendezvous, None)


def run_rank(
    rank: int,
    world: int,
    settings: LearnerSettings,
    rendezvous: tuple[str, int],
    on_step: OnStep | None,
    on_loop: Callable[[LearnerLoop], None] | None = None,
) -> None:
    """One rank's life: join the group at ``rendezvous`` (host, port), build, resume, then lead (rank 0)
    or follow. ``on_loop`` receives rank 0's loop before it runs; a caller that passes it stops the loop
    itself (a Ray actor runs this off the main thread, where no signal handler can be installed)."""
    info = RankInfo(rank, world)
    if settings.cpu_threads and not torch.cuda.is_available():
        # Beside an engine on the same few cores, torch's default (one thread per core) oversubscribes them.
        torch.set_num_threads(settings.cpu_threads)
    init_group(info, *rendezvous)
    try:
        trainer = Trainer(settings, info)
        checkpoints = Checkpoints(
            settings.run.run_dir / "checkpoints", settings.keep_checkpoints, is_writer=info.is_main
        )
        if not info.is_main:
            follower = LearnerLoop(settings, trainer, checkpoints, rank=info)
            follower.resume()
            follower.follow()
            finish_together(info)
            return
        client = Access.of(settings.run).redis(settings.run.redis_url)
        # Waits for a dead predecessor's claim on the name to lapse; closed, frees it for the next one.
        with contextlib.closing(TrajectoryQueue(client, settings.run.run_id, consumer=f"learner-{rank}")) as queue:
            if on_step is None and settings.refit_every > 0:
                on_step = WeightPublisher(settings, trainer.model.config.vocab_size)
                on_step.register()
            loop = LearnerLoop(settings, trainer, checkpoints, queue=queue, rank=info, on_step=on_step)
            resumed = loop.resume()
            sink = None
            if settings.metrics.wandb_project:
                config = settings.model_dump(mode="json")
                sink = WandbSink(settings.metrics, settings.run.run_id, settings.run.run_dir, config)
            loop.metrics = MetricsLog(
                settings.run.run_dir, plot_every=settings.plot_every, resumed_step=resumed, sink=sink
            )
            if on_loop is not None:
                on_loop(loop)
            asyncio.run(serve(settings, loop, handle_signals=on_loop is None))
        finish_together(info)
    except ConsumerNameTaken as exc:
        # Another learner process reads under this name (it took over while this one stalled, or runs
        # beside it): end without a traceback and without acknowledging anything, non-zero, so that a
        # supervisor restarts this one, which resumes from the newest checkpoint.
        log.error("learner rank %d stops: %s", rank, exc.message, extra={"reason": exc.reason})
        raise SystemExit(1) from exc
    except Exception:
        log.exception("learner rank %d failed", rank)  # one error line with the cause, for logs and `molt up`
        raise
    finally:
        leave_group()


async def serve(settings: LearnerSettings, loop: LearnerLoop, handle_signals: bool = True) -> None:
    """Serves LearnerService while the loop trains in a worker thread; returns when the loop ends.
    SIGTERM/SIGINT stop the loop after its step when ``handle_signals`` (only possible on the main thread)."""
    host = ServiceHost(
        name="learner",
        listen=settings.listen,
        registrations=[
            Registration(
                learner_pb2_grpc.add_LearnerServiceServicer_to_server, LearnerServicer(loop, settings), SERVICE_NAME
            )
        ],
        metrics_port=settings.metrics_port,
        access=Access.of(settings.run),
    )
    await host.start()
    if handle_signals:
        events = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            events.add_signal_handler(sig, lambda: loop.request_stop(save_checkpoint=True))
    try:
        await asyncio.to_thread(loop.run)
    finally:
        await host.stop()
