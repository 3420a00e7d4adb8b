"""Publication of policy versions: what GetPolicyVersion and WatchPolicyVersion report, and the Redis key.

A refit publishes its version only once the router serves it. The version is
announced at once (GetPolicyVersion, the WatchPolicyVersion streams), then
written to the Redis key ``molt:<run>:policy_version`` in the background, where
a restarted broadcaster finds it and reports it until it publishes its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.timestamp_pb2 import Timestamp

from molt.broadcaster import metrics
from molt.broadcaster.config import BroadcasterSettings
from molt.core.auth import Access
from molt.core.errors import InvalidInput
from molt.v1 import common_pb2

log = logging.getLogger(__name__)
REDIS_TIMEOUT_S = 5.0  # the published version's key: read at start, written after each refit


def version_key(run_id: str) -> str:
    """The Redis key holding the newest published policy version (JSON)."""
    return f"molt:{run_id}:policy_version"


@dataclass
class Published:
    """The published version; ``set`` never waits, so a refit cannot be cancelled half-published."""

    version: common_pb2.PolicyVersion = field(default_factory=common_pb2.PolicyVersion)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def set(self, version: common_pb2.PolicyVersion) -> None:
        self.version = version
        self._changed.set()  # wakes every waiter; later ones wait on a fresh event
        self._changed = asyncio.Event()

    async def newer_than(self, seen: int) -> common_pb2.PolicyVersion:
        """The published version once it is not ``seen``."""
        while self.version.version == seen:
            await self._changed.wait()
        return self.version


class Publisher:
    """Publishes versions to the watchers and to Redis, and restores the one a previous broadcaster wrote."""

    def __init__(self, settings: BroadcasterSettings) -> None:
        self.run_id = settings.run.run_id
        self.published = Published()
        self.published_here = 0  # the newest version this process published (a restored one does not count)
        self.redis = Access.of(settings.run).aio_redis(settings.run.redis_url) if settings.publish_redis else None
        self._redis_write: asyncio.Task[None] | None = None  # the latest write of the published version

    async def restore(self) -> None:
        """Reports the version a previous broadcaster of this run published (the Redis key) on
        GetPolicyVersion and WatchPolicyVersion until this one publishes. It does not count as the newest
        version (see ``version_for``): a run restarted whole from a checkpoint keeps its
        numbering. Without Redis, or when the key cannot be read (logged), nothing is reported as published."""
        if self.redis is None:
            return
        key = version_key(self.run_id)
        try:
            raw = await asyncio.wait_for(self.redis.get(key), REDIS_TIMEOUT_S)
            if raw is None:
                return
            record = json.loads(raw)
            version = common_pb2.PolicyVersion(version=int(record["version"]), learner_step=int(record["learner_step"]))
            version.publish_time.FromJsonString(record["publish_time"])
        except (aioredis.RedisError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.warning("could not restore the published policy version", extra={"key": key, "error": repr(exc)})
            return
        self.published.set(version)
        metrics.POLICY_VERSION.set(version.version)
        log.info("published version restored from Redis", extra={"version": version.version})

    def version_for(self, asked: int, learner_step: int, continue_versions: bool, router_version: int) -> int:
        """The version a refit that asks for ``asked`` publishes as.

        Versions only grow. The newest one is the published one or, before this process has published
        any, the router's (a restarted broadcaster in front of engines that kept theirs; the version it
        restores from Redis at start is only reported). A version not newer is refused, except in a
        learner's first refit after it starts (``continue_versions``): a learner restarted from the
        checkpoint of the newest version publishes it again, and one restarted from a checkpoint behind
        the engines publishes its weights as the version after the newest and numbers on from there. The
        router's version itself, never published by this process, is taken again too: a broadcaster that
        died between resuming the engines at it and publishing it left the learner to send it again."""
        newest = max(self.published_here, router_version)
        if asked > newest or newest == 0:
            return asked
        if asked == newest and (continue_versions or self.published_here < newest):
            return asked  # the weights the engines serve, from a learner restarted at them or a cut-short refit
        if continue_versions:
            log.info(
                "a learner's first refit continues after the newest version",
                extra={"learner_step": learner_step, "asked": asked, "newest": newest},
            )
            return newest + 1
        raise InvalidInput(
            f"policy version {asked} (learner_step {learner_step}) is not newer than the newest version {newest}",
            reason="VERSION_NOT_NEWER",
        )

    def publish(self, number: int, learner_step: int) -> common_pb2.PolicyVersion:
        """Announces a version the router serves (GetPolicyVersion, the watchers), then writes it to Redis in
        the background, where a restarted broadcaster finds it to report: a failed or slow write there is
        logged, and holds nothing (the engines already serve the version)."""
        now = Timestamp()
        now.GetCurrentTime()
        version = common_pb2.PolicyVersion(version=number, learner_step=learner_step, publish_time=now)
        self.published.set(version)
        self.published_here = number
        metrics.POLICY_VERSION.set(version.version)
        if self.redis is not None:
            record = {"version": number, "learner_step": learner_step, "publish_time": now.ToJsonString()}
            self._redis_write = asyncio.create_task(self._write_version(record, self._redis_write))
        return version

    async def _write_version(self, record: dict[str, Any], before: asyncio.Task[None] | None) -> None:
        """Writes ``record`` to the version key after the write ``before`` it (so the newest lands last)."""
        assert self.redis is not None
        if before is not None:
            await asyncio.wait({before})
        key = version_key(self.run_id)
        try:
            await asyncio.wait_for(self.redis.set(key, json.dumps(record)), REDIS_TIMEOUT_S)
        except (aioredis.RedisError, TimeoutError) as exc:
            log.error(
                "published version not written to Redis (a restarted broadcaster will report an older one)",
                extra={"key": key, "version": record["version"], "error": repr(exc)},
            )

    async def close(self) -> None:
        """Waits (bounded) for the last write to Redis, then closes the connection."""
        if self._redis_write is not None:
            await asyncio.wait({self._redis_write}, timeout=REDIS_TIMEOUT_S)
        if self.redis is not None:
            await self.redis.aclose()
