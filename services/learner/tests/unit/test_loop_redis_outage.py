"""The learner loop waits out a Redis restart mid-run (a redis-server of this test's own, append-only
file on) and trains on: nothing it read is lost, every entry is acknowledged at the end."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from torch import nn

from molt.core.processes import RedisServer
from molt.core.queue import TrajectoryQueue
from molt.learner.checkpoint import Checkpoints
from molt.learner.config import LearnerSettings
from molt.learner.loop import LearnerLoop
from molt.learner.synthetic import named_group
from molt.learner.trainer import Trainer

pytestmark = pytest.mark.timeout(120)
REWARDS = [1.0, 0.0, 0.5, 0.0]


def test_the_loop_waits_out_a_redis_restart(learner_settings: Callable[..., LearnerSettings], tmp_path: Path) -> None:
    """Redis stops right after step 1 (its entries still pending, checkpoint_every 2) and comes back 2 s
    later on the same port; the loop's reads and acknowledgements wait for it, and all three steps train."""
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    port = server.port
    # No retries of redis-py's own, which would ride out a short outage before the loop saw it.
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    settings = learner_settings(checkpoint_every=2, max_steps=3, poll_s=0.1, max_staleness=3, redis_outage_s=60)
    producer = TrajectoryQueue(client, "molt")
    producer.put_many([named_group(f"g{i}", REWARDS) for i in range(6)])
    restart = threading.Timer(2.0, server.start, kwargs={"port": port})

    def on_step(step: int, model: nn.Module) -> None:
        if step == 1:
            server.stop()
            restart.start()

    queue = TrajectoryQueue(client, settings.run.run_id, consumer="learner-0")
    loop = LearnerLoop(
        settings, Trainer(settings), Checkpoints(settings.run.run_dir / "checkpoints", 2), queue=queue, on_step=on_step
    )
    loop.resume()
    try:
        assert loop.run() == 3
        assert loop.redis.outages >= 1
        stats = producer.stats()
        assert (stats.depth, stats.pending) == (0, 0)  # every entry trained and acknowledged
        assert len(loop.state.consumed) == 24
    finally:
        restart.join()
        server.stop()
