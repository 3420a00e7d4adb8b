"""What the learner loop logs while it runs: a status line, and warnings when it starves or drops.

``StatusClock.maybe_report`` runs once per loop turn: every ``status_every_s`` a
status line (step, version, samples trained, groups ready, reward) and a
warning when many samples were dropped as stale; every ``idle_warning_s``
without trajectories a warning that asks whether the agent-pool is producing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from molt.learner import metrics as prom

if TYPE_CHECKING:
    from molt.learner.loop import LearnerLoop

log = logging.getLogger(__name__)

STALE_WARNING_SHARE = 0.05  # of the samples between two status lines


class StatusClock:
    """When trajectories last arrived, and when the status line and the idle warning are due."""

    def __init__(self, now: float, stale: int = 0, trained: int = 0) -> None:
        self.last_arrival = now
        self.last_report = now
        self.last_idle_warning = now
        self.stale_seen = stale  # samples dropped as stale / trained so far, at the last status line (or the
        self.trained_seen = trained  # loop's start: after a restart they hold the run's history)

    def arrived(self) -> None:
        self.last_arrival = time.monotonic()

    def maybe_report(self, loop: LearnerLoop) -> None:
        now = time.monotonic()
        idle = now - self.last_arrival
        prom.IDLE_SECONDS.set(idle)
        settings = loop.settings
        if idle >= settings.idle_warning_s and now - self.last_idle_warning >= settings.idle_warning_s:
            self.last_idle_warning = now
            try:
                stats = loop.queue.stats() if loop.queue is not None else None
            except redis.RedisError:  # the warning goes out without the queue's numbers
                stats = None
            log.warning(
                "no trajectories for %.0f s: is the agent-pool running and producing to run %r?",
                idle,
                settings.run.run_id,
                extra={"idleSeconds": round(idle, 1), "queue": stats.__dict__ if stats else None},
            )
        if now - self.last_report >= settings.status_every_s:
            self.last_report = now
            status = loop.status()
            log.info(
                "step %d, version %d, %d trained, %d groups ready, reward %.3f",
                status.step,
                status.policy_version,
                status.consumed_count,
                len(loop.ready),
                status.last_metrics.get("reward/mean", float("nan")),
                extra={"dropped": status.dropped, "lastCheckpointStep": status.last_checkpoint_step},
            )
            self._warn_stale(loop, status.dropped.get("stale", 0), status.consumed_count)

    def _warn_stale(self, loop: LearnerLoop, stale: int, trained: int) -> None:
        """Warns when more than STALE_WARNING_SHARE of the samples trained or dropped as stale since the last
        status line were dropped: on a long-tailed workload those are the long responses (docs/queue.md)."""
        new_stale, new_trained = stale - self.stale_seen, trained - self.trained_seen
        self.stale_seen, self.trained_seen = stale, trained
        if new_stale > STALE_WARNING_SHARE * (new_stale + new_trained):
            log.warning(
                "%d samples were dropped as stale since the last status line, against %d trained (oldest loss "
                "token more than %d versions behind): long responses are cut out of training; a larger "
                "[learner] drop_after_versions keeps them",
                new_stale,
                new_trained,
                loop.drop_after,
                extra={"stale": new_stale, "trained": new_trained},
            )
