"""The learner loop: queue -> samples -> optimizer step -> hook -> checkpoint -> acknowledgement.

Rank 0 is the only queue consumer (``learner-0``): it turns groups into samples
as it reads them (``batch.build_group`` drops and counts bad ones) and trains on
``groups_per_step`` groups at a time, broadcasting each step, checkpoint and the
stop to the followers (``follow``). An entry trained on is acknowledged only
once its step is in a complete checkpoint, so a restarted learner re-reads what
was not; one skipped is acknowledged at once (``_skip``, docs/queue.md). After
every step ``on_step(step, model)`` runs on rank 0; with the ``WeightPublisher``
as that hook the loop first refits the weights it starts with (``_publish_first``).
Control requests: ``control.py``; the status line and warnings: ``progress.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from molt.core.errors import WrongState
from molt.core.queue import QueueEntry, TrajectoryQueue
from molt.core.redis_outage import RedisOutage
from molt.learner import metrics as prom
from molt.learner.batch import Sample, assemble, build_group, first_reason
from molt.learner.checkpoint import Checkpoints, RunState
from molt.learner.config import GROUP_ESTIMATORS, LearnerSettings
from molt.learner.control import CheckpointInfo, ControlRequests, LearnerStatus
from molt.learner.metrics import MetricsLog
from molt.learner.progress import StatusClock
from molt.learner.ranks import SINGLE, RankInfo
from molt.learner.refit import WeightPublisher, gather_for_refit
from molt.learner.stale_watch import StaleWatch
from molt.learner.trainer import StepRefused, Trainer

log = logging.getLogger(__name__)

OnStep = Callable[[int, nn.Module], None]
MAX_REFUSED_IN_A_ROW = 3  # refused steps in a row that stop the learner (a fault of the learner, not of data)


@dataclass
class ReadyGroup:
    """A group read from the queue whose samples wait for the next step."""

    entry: QueueEntry
    samples: list[Sample]
    dropped: Counter[str]  # samples of the entry dropped as it was read

    @property
    def entry_id(self) -> str:
        return self.entry.entry_id


class LearnerLoop:
    """Rank 0's loop (``run``) and the followers' (``follow``) over one trainer."""

    def __init__(
        self,
        settings: LearnerSettings,
        trainer: Trainer,
        checkpoints: Checkpoints,
        *,
        queue: TrajectoryQueue | None = None,
        metrics: MetricsLog | None = None,
        rank: RankInfo = SINGLE,
        on_step: OnStep | None = None,
    ) -> None:
        self.settings = settings
        self.trainer = trainer
        self.checkpoints = checkpoints
        self.queue = queue
        self.redis = RedisOutage(settings.redis_outage_s)  # every queue call waits out a Redis outage
        self.metrics = metrics
        self.rank = rank
        self.on_step = on_step
        # Samples whose oldest loss token is more versions behind than this are dropped as stale.
        self.drop_after = (
            settings.rollout.max_staleness if settings.drop_after_versions is None else settings.drop_after_versions
        )

        self.state = RunState()
        self.ready: list[ReadyGroup] = []
        self.settled: list[str] = []  # entry ids trained on, acknowledged at the next checkpoint
        self.skipped: Counter[str] = Counter()  # groups skipped whole since this process started, by reason
        self.waited_s = 0.0  # time blocked on the queue since the last step: > 0 means the rollouts are behind
        self.last_metrics: dict[str, float] = {}
        self.last_checkpoint_step = -1
        self.last_step_time: float | None = None
        self._lock = threading.Lock()
        self._requests = ControlRequests(self._lock)
        self.refused_in_a_row = 0  # steps the trainer refused since the last one it took
        rollout = settings.rollout
        self.stale_watch = StaleWatch(rollout.groups_per_step * rollout.group_size)

    # -- start-up ---------------------------------------------------------------------------------

    def resume(self) -> int:
        """Loads the newest complete checkpoint, if any (every rank); returns the step to continue from."""
        newest = self.checkpoints.newest()
        if newest is not None:
            self.state = self.checkpoints.load(self.trainer, newest)
            self.last_checkpoint_step = self.state.step
            prom.LAST_CHECKPOINT_STEP.set(self.state.step)
        return self.state.step

    # -- control (called from other threads) ------------------------------------------------------

    def request_checkpoint(self, request_id: str) -> Future[CheckpointInfo]:
        """A checkpoint after the current step; a repeated ``request_id`` gets the same result."""
        return self._requests.checkpoint(request_id)

    def request_stop(self, save_checkpoint: bool = True) -> Future[int]:
        """Stops after the current step (checkpointing first when asked); resolves to the last committed step."""
        return self._requests.stop_after_step(save_checkpoint)

    def status(self) -> LearnerStatus:
        with self._lock:
            return LearnerStatus(
                step=self.state.step,
                policy_version=self.state.policy_version,
                consumed_count=len(self.state.consumed),
                dropped=dict(self.state.dropped),
                skipped=dict(self.skipped),
                last_metrics=dict(self.last_metrics),
                last_checkpoint_step=self.last_checkpoint_step,
                last_step_time=self.last_step_time,
            )

    # -- rank 0 -----------------------------------------------------------------------------------

    def run(self) -> int:
        """Trains until stopped (``request_stop``) or ``max_steps``; returns the last committed step."""
        if self.queue is None:
            raise ValueError("rank 0 needs the trajectory queue")
        start = self.status()
        clock = StatusClock(time.monotonic(), start.dropped.get("stale", 0), start.consumed_count)
        try:
            publishes = isinstance(self.on_step, WeightPublisher) and self.settings.refit_every > 0
            if publishes and not self._should_stop():
                # Before reading: the engines may be paused by a refit the previous learner left failed,
                # and then no new trajectory comes until this one restores them.
                self._publish_first()
            while not self._should_stop():
                self._serve_checkpoint_requests()
                if len(self.ready) >= self.settings.rollout.groups_per_step:
                    self._train_one_step()
                else:
                    self._read(clock)
                clock.maybe_report(self)
                if publishes and self.stale_watch.due(self.state.dropped.get("stale", 0), self.state.step):
                    self._publish_first()  # the engines serve older weights than these (StaleWatch)
            self._finish()
        except BaseException as exc:
            self._requests.fail(exc)
            raise
        return self.last_checkpoint_step

    def _should_stop(self) -> bool:
        max_steps = self.settings.max_steps
        with self._lock:
            return self._requests.stop is not None or bool(max_steps and self.state.step >= max_steps)

    def _read(self, clock: StatusClock) -> None:
        assert self.queue is not None
        need = self.settings.rollout.groups_per_step - len(self.ready)
        started = time.monotonic()
        entries = self.redis.call("reading the queue", self.queue.read, count=need, block_s=self.settings.poll_s)
        self.waited_s += time.monotonic() - started
        if entries:
            clock.arrived()
        needs_groups = self.settings.algorithm.estimator in GROUP_ESTIMATORS
        for entry in entries:
            outcome = build_group(
                entry.group,
                vocab_size=self.trainer.vocab_size,
                current_version=self.state.policy_version,
                max_staleness=self.drop_after,
                consumed=self.state.consumed,
                needs_groups=needs_groups,
                key=entry.entry_id,
                max_length=self.trainer.max_length,
                routing_shape=self.trainer.routing_shape,
            )
            if outcome.samples:  # its drops count when it is trained: a checkpoint before then holds none
                self.ready.append(ReadyGroup(entry, outcome.samples, outcome.dropped))
            else:
                self._count_drops(outcome.dropped)
                self._skip([entry.entry_id], outcome.dropped)
        prom.READY_GROUPS.set(len(self.ready))

    def _count_drops(self, dropped: Counter[str]) -> None:
        with self._lock:
            for reason, count in dropped.items():
                self.state.dropped[reason] = self.state.dropped.get(reason, 0) + count
                prom.DROPPED.labels(reason).inc(count)

    def _skip(self, entry_ids: list[str], dropped: Counter[str]) -> None:
        """Settles groups none of whose samples is trained on: the producer starts others in their place
        (docs/queue.md); counted by the reason that dropped them (GetLearnerStatus). Acknowledged now, not
        at a checkpoint (``TrajectoryQueue.skip``): nothing of them is in the weights to make durable, and
        a run whose samples all go stale makes no step, so it would never checkpoint, and the skipped
        entries would fill the queue's bound. Exactly once still holds: the skip is final (one skipped as
        stale before a crash stays skipped, though the older weights resumed might have trained it), and
        one skipped as a duplicate of an uncommitted step's trajectories is a second copy, the first
        staying pending until that step's checkpoint and so trained again after a crash."""
        assert self.queue is not None
        self.redis.call("recording skipped groups", self.queue.skip, entry_ids, dropped)
        with self._lock:
            self.skipped[first_reason(dropped)] += len(entry_ids)
            for reason, count in dropped.items():
                self.state.skipped[reason] = self.state.skipped.get(reason, 0) + count

    def _trainable(self, groups: list[ReadyGroup]) -> tuple[list[Sample], Counter[str]]:
        """The groups' samples, re-checked, and what was dropped: a group carried over a step may have gone
        stale, and one id may have arrived twice (a producer writing around the queue's dedupe)."""
        oldest_allowed = self.state.policy_version - self.drop_after
        seen: set[str] = set()
        kept: list[Sample] = []
        dropped: Counter[str] = sum((g.dropped for g in groups), Counter())  # as read, and below
        for sample in (s for g in groups for s in g.samples):
            if sample.trajectory_id in self.state.consumed or sample.trajectory_id in seen:
                dropped["duplicate"] += 1
            elif int(sample.policy_versions[sample.loss_mask].min()) < oldest_allowed:
                dropped["stale"] += 1
            else:
                seen.add(sample.trajectory_id)
                kept.append(sample)
        self._count_drops(dropped)
        return kept, dropped

    def _train_one_step(self) -> None:
        groups, self.ready = (
            self.ready[: self.settings.rollout.groups_per_step],
            self.ready[self.settings.rollout.groups_per_step :],
        )
        samples, dropped = self._trainable(groups)
        if not samples:
            self._skip([g.entry_id for g in groups], dropped)
            return
        batch = assemble(samples)
        self._broadcast(("step", batch))
        try:
            step_metrics = {**self.trainer.train_step(batch), "wait_seconds": self.waited_s}
        except StepRefused as exc:
            self._refuse(groups, len(samples), exc)
            return
        self.settled.extend(g.entry_id for g in groups)
        self.refused_in_a_row = 0
        self.waited_s = 0.0
        step = self.trainer.step
        with self._lock:
            for tid in batch.trajectory_ids:
                self.state.consumed[tid] = step
            self.state.step = step
            self.state.policy_version = self.trainer.policy_version
            self.last_metrics = step_metrics
            self.last_step_time = time.time()
        prom.CONSUMED.inc(len(samples))
        prom.POLICY_VERSION.set(self.state.policy_version)
        if self.metrics is not None:
            dropped = {f"dropped/{reason}": float(n) for reason, n in self.state.dropped.items()}
            self.metrics.record(step, {**step_metrics, **dropped})
        if self.on_step is not None:
            if not isinstance(self.on_step, WeightPublisher):
                self.on_step(step, self.trainer.model)
            elif self.on_step.wants(step):
                # The publisher's gather (and probe forward) is a collective of every rank.
                self._broadcast(("refit", self.on_step.next_probe()))
                self.on_step(step, self.trainer.model, version=self.trainer.policy_version)
        if step % self.settings.checkpoint_every == 0 or self._settled_crowd_the_queue():
            self._checkpoint()

    def _settled_crowd_the_queue(self) -> bool:
        """Whether the entries trained on since the checkpoint leave less room than one step's groups under
        the run's queue bound: they stay in the stream until their checkpoint, so with ``checkpoint_every
        * groups_per_step`` above ``queue_max_length`` the producers could not put the next step and the
        loop would wait for ever. Then the checkpoint comes early: a whole one, acknowledging as any does."""
        rollout = self.settings.rollout
        return len(self.settled) + rollout.groups_per_step > rollout.queue_max_length

    def _refuse(self, groups: list[ReadyGroup], count: int, exc: StepRefused) -> None:
        """A step the trainer refused (a non-finite value; nothing applied): its groups go to the dead
        letters with the reason, and the loop goes on, unless steps keep being refused."""
        assert self.queue is not None
        self.refused_in_a_row += 1
        log.error(
            "step refused, its groups moved to the dead letters: %s",
            exc,
            extra={"groupIds": [g.entry.group.group_id for g in groups], "entries": [g.entry_id for g in groups]},
        )
        entries = [g.entry for g in groups]
        self.redis.call("dead-lettering", self.queue.dead_letter, entries, f"the learner refused the step: {exc}")
        self._count_drops(Counter({"refused_step": count}))
        if self.refused_in_a_row >= MAX_REFUSED_IN_A_ROW:
            raise WrongState(
                f"{self.refused_in_a_row} steps in a row were refused (the last: {exc}); stopping rather than "
                "dead-lettering every group",
                reason="STEPS_REFUSED",
            )

    def _publish_first(self) -> None:
        """The first refit after the start, before the first read: the engines may hold other weights (a
        restarted learner behind them) or be paused by a refit its predecessor left failed. Its version is
        the learner's (``step + version_offset``) if newer than the engines', else the one after theirs,
        and the learner numbers on from there (the offset is checkpointed)."""
        assert isinstance(self.on_step, WeightPublisher)
        self._broadcast(("refit", self.on_step.next_probe()))
        version = self.on_step.publish_first(self.state.step, self.trainer.policy_version, self.trainer.model)
        offset = version - self.state.step
        if offset != self.trainer.version_offset:
            log.warning(
                "the engines were ahead of this learner: its weights are published as version %d, and the "
                "versions of its steps go on from there",
                version,
                extra={"step": self.state.step, "version": version, "previousVersion": self.trainer.policy_version},
            )
        self.trainer.version_offset = offset
        self.stale_watch.mark(self.state.dropped.get("stale", 0), self.state.step)
        self._broadcast(("version_offset", offset))
        with self._lock:
            self.state.policy_version = version
        prom.POLICY_VERSION.set(version)

    def _checkpoint(self) -> CheckpointInfo:
        """Writes a checkpoint of the current step (unless there is one), then acknowledges the settled
        entries: only now is their use durable. So with ``checkpoint_every = N`` up to N steps of entries
        stay pending; after a crash those of a committed step are dropped as duplicates (the consumed ids
        are checkpointed), the others trained again on the restored weights."""
        assert self.queue is not None
        newest = self.checkpoints.newest()
        if self.last_checkpoint_step == self.state.step and newest is not None:
            # No step since: nothing new to save (and nothing settled, skipped entries being acknowledged).
            path = newest
        else:
            # Only the holder of the queue's consumer name writes the run's checkpoints: a learner that lost it
            # would write over its successor's steps (a stall between this check and the save still races).
            self.redis.call("confirming the consumer name", self.queue.confirm_consumer)
            self._broadcast(("checkpoint", self.state))
            path = self.checkpoints.save(self.trainer, self.state)
        acked = self.redis.call("acknowledging entries", self.queue.ack, self.settled)
        log.info("checkpoint committed", extra={"step": self.state.step, "acked": acked})
        self.settled = []
        with self._lock:
            self.last_checkpoint_step = self.state.step
        prom.LAST_CHECKPOINT_STEP.set(self.state.step)
        return CheckpointInfo(self.state.step, path)

    def _serve_checkpoint_requests(self) -> None:
        waiting = self._requests.take_waiting()
        if waiting:
            info = self._checkpoint()
            for future in waiting:
                future.set_result(info)

    def _finish(self) -> None:
        stop, save = self._requests.finish()
        if isinstance(self.on_step, WeightPublisher):
            self.on_step.wait()  # the last step's refit: published, or its failure raised here
        if save:
            self._checkpoint()
        self._serve_checkpoint_requests()
        self._broadcast(("stop", None))
        if self.metrics is not None:
            self.metrics.close()
        log.info("learner stopped", extra={"step": self.state.step, "lastCheckpointStep": self.last_checkpoint_step})
        if stop is not None:
            stop.set_result(self.last_checkpoint_step)

    def _broadcast(self, command: tuple[str, Any]) -> None:
        if self.rank.distributed:
            dist.broadcast_object_list([command], src=0)

    # -- ranks > 0 --------------------------------------------------------------------------------

    def follow(self) -> None:
        """A follower rank: runs rank 0's steps and checkpoints on its shard until rank 0 stops."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            command, payload = box[0]
            if command == "step":
                with contextlib.suppress(StepRefused):  # refused on every rank alike; rank 0 reports it
                    self.trainer.train_step(payload)
            elif command == "checkpoint":
                self.checkpoints.save(self.trainer, payload)
            elif command == "refit":
                gather_for_refit(self.trainer.model, payload)
            elif command == "version_offset":
                self.trainer.version_offset = payload
            else:
                return
