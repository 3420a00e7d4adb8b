"""Control requests from the gRPC thread, served by the learner loop between steps.

SaveCheckpoint and StopLearner (``server.py``) become futures here that the
loop resolves once the checkpoint is committed or the loop has stopped; a
repeated ``request_id`` gets the same checkpoint. ``LearnerStatus`` is the
snapshot GetLearnerStatus reads. All of it is guarded by the loop's lock.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from molt.core.errors import Unavailable, WrongState


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


@dataclass
class LearnerStatus:
    """A snapshot for GetLearnerStatus (copied under the loop's lock)."""

    step: int
    policy_version: int
    consumed_count: int
    dropped: dict[str, int]
    skipped: dict[str, int]  # groups skipped whole since this process started, by reason
    last_metrics: dict[str, float]
    last_checkpoint_step: int
    last_step_time: float | None


class ControlRequests:
    """The checkpoint and stop requests not yet served, under the loop's ``lock``."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.checkpoints: dict[str, Future[CheckpointInfo]] = {}
        self.waiting: list[Future[CheckpointInfo]] = []
        self.stop: Future[int] | None = None
        self.stop_with_checkpoint = True
        self.finished = False  # set once the loop can no longer serve requests

    def checkpoint(self, request_id: str) -> Future[CheckpointInfo]:
        """A checkpoint after the current step; a repeated ``request_id`` gets the same result."""
        with self.lock:
            if request_id and request_id in self.checkpoints:
                return self.checkpoints[request_id]
            if self.finished:
                raise WrongState("the learner has stopped; it writes no more checkpoints", reason="LEARNER_STOPPED")
            future: Future[CheckpointInfo] = Future()
            if request_id:
                self.checkpoints[request_id] = future
            self.waiting.append(future)
            return future

    def stop_after_step(self, save_checkpoint: bool = True) -> Future[int]:
        """A stop after the current step (checkpointing first when asked); resolves to the last committed step."""
        with self.lock:
            if self.stop is None:
                self.stop = Future()
                self.stop_with_checkpoint = save_checkpoint
            return self.stop

    def take_waiting(self) -> list[Future[CheckpointInfo]]:
        """The checkpoint requests to serve now (each is served once)."""
        with self.lock:
            waiting, self.waiting = self.waiting, []
        return waiting

    def finish(self) -> tuple[Future[int] | None, bool]:
        """Marks the loop finished; returns the stop request (None: ``max_steps`` ended it) and whether
        the loop checkpoints before it stops."""
        with self.lock:
            self.finished = True
            return self.stop, self.stop is None or self.stop_with_checkpoint

    def fail(self, exc: BaseException) -> None:
        """The loop failed: every request still open fails with ``Unavailable``."""
        with self.lock:
            self.finished = True
            futures = [*self.waiting, *([self.stop] if self.stop else [])]
        for future in futures:
            if not future.done():
                future.set_exception(Unavailable(f"the learner loop failed: {exc!r}", reason="LEARNER_FAILED"))
