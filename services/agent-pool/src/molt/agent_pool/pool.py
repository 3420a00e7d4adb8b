"""The streaming pool: keeps prompt groups in flight and queues each group once all its episodes end.

- ``groups_in_flight`` groups run at once, ``max_concurrent_episodes`` episodes in all; a slow
  group never blocks the others. A failed episode (``episodes.attempt``) is counted, never queued.
- Dynamic filtering drops groups whose mean reward is not strictly inside the band.
- Staleness backpressure: group k starts only once the policy version is at least
  ``k // groups_per_step - max_staleness``, so a group the learner trains in its slot is at most
  ``max_staleness`` versions old (partial rollout aside: docs/queue.md). k counts only the groups
  the learner can still train: not those filtered, left unqueued or skipped by the learner, since
  it takes others in their place (docs/queue.md, "Pacing a producer").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from google.protobuf import duration_pb2, timestamp_pb2
from redis import RedisError

from molt.agent_pool import metrics
from molt.agent_pool.agents import Prompt
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.episodes import Episode, EpisodeRunner, attempt
from molt.agent_pool.prompts import PromptSource
from molt.agent_pool.version_watch import VERSION_POLL_S
from molt.core import expert_routing
from molt.core.errors import Backpressure, InvalidInput
from molt.core.queue import PutResult, TrajectoryQueue
from molt.v1 import common_pb2

log = logging.getLogger(__name__)

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "aborted": common_pb2.FINISH_REASON_ABORTED,
}


@dataclass
class PoolStats:
    """Counters since start (reported by GetAgentPoolStatus and the metrics)."""

    started_groups: int = 0
    in_flight_groups: int = 0
    in_flight_episodes: int = 0
    completed_episodes: int = 0
    failed_episodes: Counter[str] = field(default_factory=Counter)
    filtered_groups: Counter[str] = field(default_factory=Counter)
    queued_groups: int = 0
    unqueued_groups: int = 0  # finished but not queued: filtered, no episode, or every trajectory a duplicate
    learner_skipped_groups: int = 0  # queued, then settled by the learner without training (since this pool began)
    backlog_groups: int = 0  # queued before this pool began and not yet read by the learner (at its start)
    start_version: int = 0  # the policy version when this pool began producing
    queued_trajectories: int = 0
    recent_rewards: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    backpressured: bool = False


PUT_WAIT_S = 1.0  # one try of a put into a full queue (the pool says it is waiting, and can stop, between tries)
RETRY_MAX_S = 10.0  # longest wait between tries when Redis does not answer
FAILING_BACKOFF_MAX_S = 30.0  # longest pause before a group when every episode of the last ones failed
WAITING_LOG_EVERY_S = 30.0  # a pool held back says why this often, with the staleness gate's parts
REDIS_WARN_EVERY_S = 30.0  # a pacing read Redis does not answer is logged at most this often


class RolloutPool:
    """Produces TrajectoryGroups from an episode runner into the queue."""

    def __init__(
        self,
        settings: AgentPoolSettings,
        runner: EpisodeRunner,
        prompts: PromptSource,
        queue: TrajectoryQueue,
        policy_version: Callable[[], int],
        wait_version: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.prompts = prompts
        self.queue = queue
        self.policy_version = policy_version
        self.wait_version = wait_version  # waits a little for news of the version: used while held back
        self.stats = PoolStats()
        self.episodes = asyncio.Semaphore(settings.max_concurrent_episodes)
        self.groups: set[asyncio.Task[None]] = set()
        self.producer: asyncio.Task[None] | None = None
        self.skipped_before: int | None = None  # the learner's skipped groups when this pool began
        self.failing = 0  # groups in a row in which every episode failed (the producer backs off)
        self.redis_warned_at = -REDIS_WARN_EVERY_S  # when a failed pacing read was last logged
        self.redis_failures = 0  # failed pacing reads since then
        self.counted_from = (0, 0)  # (started, unqueued) groups when the current production began

    @property
    def running(self) -> bool:
        return self.producer is not None and not self.producer.done()

    def start(self, max_groups: int = 0) -> bool:
        """Starts producing (``max_groups`` = 0: until stopped); False if already running."""
        if self.running:
            return False
        self.producer = asyncio.create_task(self._produce(max_groups))
        return True

    @property
    def trainable_index(self) -> int:
        """The next group's place among the groups the learner can still train on, counted from this
        pool's start: the backlog it found in the queue comes first."""
        s = self.stats
        started, unqueued = s.started_groups - self.counted_from[0], s.unqueued_groups - self.counted_from[1]
        return s.backlog_groups + started - unqueued - s.learner_skipped_groups

    async def stop(self, drain: bool) -> int:
        """Stops starting groups; waits for in-flight ones (drain) or cancels them. Returns abandoned episodes."""
        if self.producer is not None:
            self.producer.cancel()
        abandoned = 0 if drain else self.stats.in_flight_episodes
        if not drain:
            for task in self.groups:
                task.cancel()
        await asyncio.gather(*self.groups, return_exceptions=True)
        return abandoned

    async def wait_idle(self) -> None:
        """Waits until the producer has finished and every group ended."""
        if self.producer is not None:
            await asyncio.gather(self.producer, return_exceptions=True)
        await asyncio.gather(*self.groups, return_exceptions=True)

    async def _produce(self, max_groups: int) -> None:
        slots = asyncio.Semaphore(self.settings.groups_in_flight)
        # A pool started mid-run (a restart, another pool) counts from here: from the version now and behind
        # the groups already waiting for the learner. Counted from 0 at version 0 instead, a pool started at
        # version 100 would start 100 steps' worth of groups unpaced, most of them stale when trained.
        self.skipped_before = await self._learner_skipped()
        self.stats.start_version = self.policy_version()
        self.stats.backlog_groups = await self._backlog()  # this pool's earlier groups not yet read included
        self.stats.learner_skipped_groups = 0
        self.counted_from = (self.stats.started_groups, self.stats.unqueued_groups)
        if self.stats.start_version or self.stats.backlog_groups:
            log.info(
                "pacing from the run's current state",
                extra={"policy_version": self.stats.start_version, "backlog_groups": self.stats.backlog_groups},
            )
        while max_groups == 0 or self.stats.started_groups - self.counted_from[0] < max_groups:  # its own groups
            await slots.acquire()
            await self._wait_for_learner()
            await self._back_off()
            self.stats.started_groups += 1
            number, prompt = self.prompts.take()
            task = asyncio.create_task(self._group(number, prompt))
            self.groups.add(task)
            task.add_done_callback(functools.partial(self._group_ended, number, slots))

    def _group_ended(self, number: int, slots: asyncio.Semaphore, task: asyncio.Task[None]) -> None:
        self.groups.discard(task)
        slots.release()
        if task.cancelled():  # a stop, perhaps before the group even began: a later start takes its prompt again
            self.prompts.give_back(number)

    def _needed_version(self) -> int:
        return (
            self.stats.start_version
            + self.trainable_index // (self.settings.groups_per_step_share or self.settings.rollout.groups_per_step)
            - self.settings.rollout.max_staleness
        )

    def _pacing(self) -> dict[str, int | None]:
        """The parts of the staleness gate, for the log: what a stuck pool was waiting on."""
        s = self.stats
        return {
            "policy_version": self.policy_version(),
            "needed_version": self._needed_version(),
            "index": self.trainable_index,
            "start_version": s.start_version,
            "backlog_groups": s.backlog_groups,
            "started_groups": s.started_groups - self.counted_from[0],
            "unqueued_groups": s.unqueued_groups - self.counted_from[1],
            "learner_skipped_groups": s.learner_skipped_groups,
            "skipped_before": self.skipped_before,
            "queued_groups": s.queued_groups,
            "in_flight_groups": s.in_flight_groups,
        }

    async def _wait_for_learner(self) -> None:
        said = time.monotonic()
        while self.policy_version() < self._needed_version():
            if not self.stats.backpressured:
                log.info("waiting for the learner", extra=self._pacing())
            elif time.monotonic() - said >= WAITING_LOG_EVERY_S:
                said = time.monotonic()
                log.info("still waiting for the learner", extra=self._pacing())
            self.stats.backpressured = True
            metrics.BACKPRESSURED.set(1)
            # Held back, the engines may idle: learn of a new version at once, not at the next tick of
            # a slow background poll, which would leave each new version unused meanwhile.
            if self.wait_version is not None:
                await self.wait_version()
            else:
                await asyncio.sleep(VERSION_POLL_S)
            if (skipped := await self._learner_skipped()) is not None:
                if self.skipped_before is None:  # Redis could not say at the start
                    self.skipped_before = skipped
                self.stats.learner_skipped_groups = skipped - self.skipped_before
        self.stats.backpressured = False
        metrics.BACKPRESSURED.set(0)

    async def _back_off(self) -> None:
        """When every episode of the last groups failed (a router down, an agent that always raises), waits
        before the next group, doubling up to FAILING_BACKOFF_MAX_S: failing fast is counted and logged,
        but thousands of failures a second would fill the logs and the CPU and say nothing new."""
        if self.failing < self.settings.groups_in_flight:
            return
        delay = min(0.25 * 2 ** (self.failing // self.settings.groups_in_flight - 1), FAILING_BACKOFF_MAX_S)
        log.warning(
            "every episode of the last %d groups failed; waiting %.1f s before the next group",
            self.failing,
            delay,
            extra={"failedEpisodes": dict(self.stats.failed_episodes)},
        )
        await asyncio.sleep(delay)

    async def _backlog(self) -> int:
        """Groups in the queue that no consumer has read yet (0 when Redis cannot say now)."""
        try:
            return (await asyncio.to_thread(self.queue.stats)).lag
        except RedisError as exc:
            await self._redis_failed("cannot read the queue's backlog", exc)
            return 0

    async def _learner_skipped(self) -> int | None:
        """The queue's count of groups the learner skipped (None when Redis cannot say now)."""
        try:
            return await asyncio.to_thread(self.queue.skipped)
        except RedisError as exc:
            await self._redis_failed("cannot read the learner's skipped groups", exc)
            return None

    async def _redis_failed(self, what: str, exc: RedisError) -> None:
        """A pacing read Redis did not answer: logged at most every REDIS_WARN_EVERY_S (with how many
        failed since), and the caller slowed to one try a second, so that a Redis gone does not flood
        the log from the staleness gate's poll."""
        self.redis_failures += 1
        now = time.monotonic()
        if now - self.redis_warned_at >= REDIS_WARN_EVERY_S:
            log.warning(what, extra={"error": str(exc), "failuresSinceLastLine": self.redis_failures})
            self.redis_warned_at, self.redis_failures = now, 0
        await asyncio.sleep(1.0)

    async def _group(self, number: int, prompt: Prompt) -> None:
        self.stats.in_flight_groups += 1
        metrics.GROUPS_IN_FLIGHT.inc()
        queued = False
        try:
            results = await asyncio.gather(*(self._episode(prompt) for _ in range(self.settings.rollout.group_size)))
            episodes = [e for e in results if e is not None]
            self.failing = 0 if episodes else self.failing + 1
            queued = await self._queue_group(prompt, episodes, failed=len(results) - len(episodes))
            # Queued, filtered or failed: the prompt is used up, and a restart goes on after it.
            if self.prompts.consumed(number):
                await self.prompts.save()
        finally:
            self.stats.unqueued_groups += not queued  # filtered, all duplicates, or failed: another starts
            self.stats.in_flight_groups -= 1
            metrics.GROUPS_IN_FLIGHT.dec()

    async def _episode(self, prompt: Prompt) -> Episode | None:
        async with self.episodes:
            self.stats.in_flight_episodes += 1
            metrics.EPISODES_IN_FLIGHT.inc()
            try:
                episode, reason = await attempt(self.runner, prompt, self.settings.episode_timeout_s, "train")
            except asyncio.CancelledError:
                self.stats.failed_episodes["stopped"] += 1
                raise
            finally:
                self.stats.in_flight_episodes -= 1
                metrics.EPISODES_IN_FLIGHT.dec()
        if episode is None:
            self.stats.failed_episodes[reason or "exception"] += 1
            return None
        self.stats.completed_episodes += 1
        self.stats.recent_rewards.append(episode.reward)
        return episode

    def _filtered(self, reason: str, prompt: Prompt) -> None:
        self.stats.filtered_groups[reason] += 1
        metrics.GROUPS_FILTERED.labels(reason).inc()
        log.info("group not queued", extra={"reason": reason, "prompt_id": prompt.get("id")})

    async def _queue_group(self, prompt: Prompt, episodes: list[Episode], failed: int) -> bool:
        """Queues the group unless it is filtered; True when an entry was written."""
        if not episodes:
            self._filtered("no_episodes", prompt)
            return False
        band = self.settings.filter
        mean = sum(e.reward for e in episodes) / len(episodes)
        if band.enabled and not band.low < mean < band.high:
            self._filtered("all_fail" if mean <= band.low else "all_pass", prompt)
            return False
        group = build_group(self.settings.run.run_id, str(prompt["id"]), episodes, self.settings, failed)
        try:
            result = await self._put(group)
        except InvalidInput as exc:  # a bug of the pool's or the agent's: counted, logged, never silent
            log.error("the queue refused a group: %s", exc.message, extra={"prompt_id": prompt.get("id")})
            self._filtered("refused_by_queue", prompt)
            return False
        return self._count_queued(group, result)

    def _count_queued(self, group: common_pb2.TrajectoryGroup, result: PutResult) -> bool:
        queued = len(group.trajectories) - len(result.duplicate_ids)
        self.stats.queued_groups += result.entry_id is not None
        self.stats.queued_trajectories += queued
        metrics.GROUPS_QUEUED.inc(result.entry_id is not None)
        metrics.TRAJECTORIES_QUEUED.inc(queued)
        return result.entry_id is not None

    async def _put(self, group: common_pb2.TrajectoryGroup) -> PutResult:
        """Queues ``group``, however long the queue stays full or Redis away (said in the log, and the
        pool can be stopped meanwhile): a finished group is never dropped for want of room or a
        connection. A stop that lands during a try waits for that try (at most PUT_WAIT_S), so a
        group written after all is counted as queued."""
        retry_s, waiting = 0.1, False
        while True:
            put = asyncio.ensure_future(asyncio.to_thread(self.queue.put, group, PUT_WAIT_S))
            try:
                return await asyncio.shield(put)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    self._count_queued(group, await put)
                raise
            except Backpressure:
                if not waiting:
                    log.warning("the trajectory queue is full: waiting for the learner to read")
                    waiting = True
            except RedisError as exc:
                log.warning("cannot queue a group; trying again", extra={"error": str(exc), "retryS": retry_s})
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, RETRY_MAX_S)


def build_group(
    run_id: str, prompt_id: str, episodes: list[Episode], settings: AgentPoolSettings, failed: int
) -> common_pb2.TrajectoryGroup:
    """The queue payload for one prompt's episodes (every segment of an episode shares its rollout id)."""
    group = common_pb2.TrajectoryGroup(
        group_id=uuid.uuid4().hex,
        prompt_id=prompt_id,
        run_id=run_id,
        agent_name=settings.agent,
        sample_count=settings.rollout.group_size,
        failed_sample_count=failed,
    )
    group.create_time.FromSeconds(int(time.time()))
    for episode in episodes:
        for index, segment in enumerate(episode.segments):
            trajectory = group.trajectories.add(
                trajectory_id=uuid.uuid4().hex,
                rollout_id=episode.rollout_id,
                segment_index=index,
                prompt_token_ids=segment.prompt_ids,
                response_token_ids=segment.response_ids,
                rollout_logprobs=segment.logprobs,
                loss_mask=segment.loss_mask,
                policy_versions=segment.versions,
                reward=episode.reward,
                reward_components=episode.reward_components,
                finish_reason=FINISH.get(episode.finish_reason, common_pb2.FINISH_REASON_STOP),
                turn_count=segment.turns,
                routed_experts=None if segment.full_routing is None else expert_routing.pack(segment.full_routing),
            )
            trajectory.create_time.CopyFrom(timestamp_pb2.Timestamp(seconds=int(episode.started)))
            trajectory.duration.CopyFrom(duration_pb2.Duration(nanos=0, seconds=int(episode.duration_s)))
    return group
