"""The refit: pause the router, move the learner's weights into every engine worker, validate, publish.

Members of the weight group: rank 0 is the learner (it sends), ranks 1.. are
the engine workers (they receive, through the router's worker extension, which
this process reaches as Ray actors named ``molt-<engine_id>`` in the router's
namespace). The broadcaster itself holds no tensors: it hosts the group's
TCPStore and drives the steps.

One refit, for request id R (the learner's):

1. Pause the router (drain or keep).
2. Tell the engine workers to join the group when its membership changed (a new
   *generation*), then to receive the manifest; write ``refit/R`` into the
   store with the group's generation, world size and bucket size: the learner
   waits for it, joins when needed, and broadcasts.
3. Each worker stages every bucket, checks coverage and checksums, and loads
   only when both hold. A refused refit leaves the old weights everywhere: the
   router resumes at the old version and the call fails with the reasons.
4. Optional teacher-forced probe: every engine scores the learner's probe
   tokens; a difference above the tolerance keeps the router paused (the weights
   are complete but disagree with the learner: serving them would be wrong).
   So does a refit that loaded on some engines only. The way out is the next
   refit (a restarted learner resumes from its checkpoint and sends one): it
   rewrites every weight, and only when it validates does the router resume;
   a refused one leaves the router paused, since the old weights are gone.
5. Resume the router at the version: the request's ``policy_version``
   (default: the learner's step). Only once the router accepts is the version
   published (GetPolicyVersion, WatchPolicyVersion streams, then the Redis
   key): a published version is one the router serves. A resume the router
   refuses leaves the engines paused and the version unpublished.

Versions only grow. The newest one is the published one or, before this
process has published any, the router's (a restarted broadcaster in front of
engines that kept theirs; the version it restores from Redis at start is only
reported). A version not newer is refused, except in a
learner's first refit after it starts (``continue_versions``): a learner
restarted from the checkpoint of the newest version publishes it again, and one
restarted from a checkpoint behind the engines publishes its weights as the
version after the newest and numbers on from there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis.asyncio as aioredis
import torch.distributed as dist
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from molt.broadcaster import metrics
from molt.broadcaster.config import BroadcasterSettings
from molt.core.errors import InvalidInput, MoltError, TimedOut, Unavailable, WrongState
from molt.core.serve import KEEPALIVE
from molt.core.weightsync import ABANDONED, TensorMeta, check_manifest, manifest_to_json, plan_buckets, refit_keys
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2

log = logging.getLogger(__name__)
REDIS_TIMEOUT_S = 5.0  # the published version's key: read at start, written after each refit


def version_key(run_id: str) -> str:
    """The Redis key holding the newest published policy version (JSON)."""
    return f"molt:{run_id}:policy_version"


def unfinished(request_id: str) -> str:
    """What holds the engines after refit ``request_id`` ended unfinished, until ``refit`` says why."""
    return f"refit {request_id} did not finish"


def seconds(duration: Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def duration_of(value: float) -> Duration:
    out = Duration()
    out.FromNanoseconds(int(value * 1e9))
    return out


class PhaseClock:
    """Seconds since it was made, split into named phases (each ``lap`` ends one)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def lap(self, name: str) -> None:
        self.phases[name] = self.elapsed() - sum(self.phases.values())


@dataclass
class Engine:
    """A registered engine: its Ray actor and its workers' first rank in the current generation."""

    engine_id: str
    actor: Any
    worker_count: int
    first_rank: int = 0


@dataclass
class Attempt:
    """How far one refit got, which decides what a failure counts as in ``molt_broadcaster_refits_total``."""

    paused: bool = False
    resumed: bool = False

    def failed(self) -> str:
        if not self.paused:
            return "rejected"  # nothing was paused: bad input, no engine, the router out of reach
        return "refused" if self.resumed else "failed_paused"


@dataclass
class GroupState:
    """The weight group's current membership."""

    generation: int = 0
    members: tuple[tuple[str, int], ...] = ()  # (engine id, worker count), in rank order
    learner_joined: bool = False


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


class Broadcaster:
    """Owns the weight group's store and membership, and runs refits one at a time."""

    def __init__(self, settings: BroadcasterSettings) -> None:
        self.settings = settings
        self.backend = settings.backend
        self.store: dist.TCPStore | None = None
        self.store_port = settings.store_port
        self.engines: dict[str, Engine] = {}
        self.group = GroupState()
        self.published = Published()
        self._redis_write: asyncio.Task[None] | None = None  # the latest write of the published version
        self.lock = asyncio.Lock()
        self.responses: dict[str, weights_pb2.RefitWeightsResponse] = {}
        self.channel = grpc.aio.insecure_channel(settings.router_address, options=KEEPALIVE)
        self.router = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.redis = aioredis.Redis.from_url(settings.run.redis_url) if settings.publish_redis else None
        self.paused_by_failure: str | None = None
        self.router_version = -1  # the router's version when this process first refits; -1: not asked yet
        self.published_here = 0  # the newest version this process published (a restored one does not count)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Opens the TCPStore the group rendezvous on."""
        self.store = dist.TCPStore("0.0.0.0", self.store_port, is_master=True, wait_for_workers=False, use_libuv=True)
        self.store_port = self.store.port
        log.info("weight-group store open", extra={"port": self.store_port})

    async def restore(self) -> None:
        """Reports the version a previous broadcaster of this run published (the Redis key) on
        GetPolicyVersion and WatchPolicyVersion until this one publishes. It does not count as the newest
        version (see the module docstring): a run restarted whole from a checkpoint keeps its numbering.
        Without Redis, or when the key cannot be read (logged), nothing is reported as published."""
        if self.redis is None:
            return
        key = version_key(self.settings.run.run_id)
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

    async def close(self) -> None:
        await self.channel.close()
        if self._redis_write is not None:
            await asyncio.wait({self._redis_write}, timeout=REDIS_TIMEOUT_S)
        if self.redis is not None:
            await self.redis.aclose()

    @property
    def rendezvous_address(self) -> str:
        return f"{self.settings.store_host}:{self.store_port}"

    # -- membership -------------------------------------------------------------------------------

    async def register_engine(self, engine_id: str, actor_name: str) -> Engine:
        """Finds the engine's Ray actor and counts its workers."""
        import ray

        namespace = f"molt-{self.settings.run.run_id}"
        try:
            actor = await asyncio.to_thread(ray.get_actor, actor_name or f"molt-{engine_id}", namespace)
        except ValueError as exc:
            raise InvalidInput(
                f"no engine actor {actor_name or 'molt-' + engine_id!r} in namespace {namespace}"
            ) from exc
        ranks = await actor.collective_rpc.remote("weight_worker_rank")
        for other in self.engines.values():  # checked after the await: another registration may have run
            if other.engine_id != engine_id and other.actor._actor_id == actor._actor_id:
                raise InvalidInput(
                    f"engine actor {actor_name or 'molt-' + engine_id!r} is already registered as {other.engine_id!r}",
                    reason="ENGINE_REGISTERED_TWICE",
                )
        engine = Engine(engine_id, actor, len(ranks))
        self.engines[engine_id] = engine
        log.info("engine registered", extra={"engine": engine_id, "workers": engine.worker_count})
        return engine

    async def learner_registered(self) -> None:
        """A (new or restarted) learner: its rank 0 is a new process, so the next refit builds a new
        group generation (waits for a refit in progress to end)."""
        async with self.lock:
            self.group.learner_joined = False
        log.info("learner registered", extra={"generation": self.group.generation})

    async def register_endpoint(self, engine_id: str, actor_name: str) -> Engine:
        """RegisterWeightEndpoint for an engine: one the router reports, and an actor not registered yet
        under another id (twice in the group, it would double the world size: every join times out)."""
        status = await self._router_status()
        reported = sorted(engine.engine_id for engine in status.engines)
        if engine_id not in reported:
            raise InvalidInput(
                f"the router reports no engine {engine_id!r} (it has {reported})", reason="UNKNOWN_ENGINE"
            )
        if actor_name not in ("", f"molt-{engine_id}"):
            raise InvalidInput(
                f"engine {engine_id!r} is the actor 'molt-{engine_id}', not {actor_name!r}", reason="WRONG_ENGINE_ACTOR"
            )
        return await self.register_engine(engine_id, actor_name)

    async def discover_engines(self) -> int:
        """Registers every engine the router reports that is not registered yet; returns the router's
        vocabulary size."""
        status = await self._router_status()
        for engine in status.engines:
            if engine.engine_id not in self.engines:
                await self.register_engine(engine.engine_id, "")
        return int(status.vocab_size)

    async def _router_status(self) -> rollout_pb2.GetRouterStatusResponse:
        try:
            return await self.router.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"router at {self.settings.router_address}: {exc.details()}") from exc

    def _assign_ranks(self) -> tuple[int, bool]:
        """Ranks in engine-id order; returns the world size and whether the membership changed."""
        members = tuple((e.engine_id, e.worker_count) for e in sorted(self.engines.values(), key=lambda e: e.engine_id))
        rank = 1
        for engine_id, count in members:
            self.engines[engine_id].first_rank = rank
            rank += count
        changed = members != self.group.members or not self.group.learner_joined
        if changed:
            self.group = GroupState(self.group.generation + 1, members)
        return rank, changed

    # -- the refit --------------------------------------------------------------------------------

    async def refit(self, request: weights_pb2.RefitWeightsRequest) -> weights_pb2.RefitWeightsResponse:
        if not request.request_id:
            raise InvalidInput("request_id is required (retries are recognised by it)")
        cached = self.responses.get(request.request_id)
        if cached is not None:
            return cached
        async with self.lock:
            cached = self.responses.get(request.request_id)
            if cached is not None:
                return cached
            attempt = Attempt()
            try:
                metas = self._manifest(request)
                if self.paused_by_failure:
                    # A full refit rewrites every weight: if it validates, the engines are consistent again.
                    log.warning(
                        "refit over a failed one: the engines stay paused unless it validates",
                        extra={"earlier_failure": self.paused_by_failure, "request_id": request.request_id},
                    )
                version = await self._version_of(request)
                response = await asyncio.wait_for(
                    self._refit(request, metas, version, attempt), self.settings.refit_timeout_s
                )
            except TimeoutError as exc:
                metrics.REFITS.labels(outcome="timeout").inc()
                self.group.learner_joined = False  # the group may be mid-collective: rebuild it next time
                message = f"refit {request.request_id} did not finish in {self.settings.refit_timeout_s} s"
                self._unfinished(request.request_id, message)
                raise TimedOut(message) from exc
            except asyncio.CancelledError:
                # The call ended mid-refit: the learner died, or its deadline passed (or this process is
                # stopping). Nothing was loaded unless every bucket had arrived and validated.
                metrics.REFITS.labels(outcome="abandoned").inc()
                self._unfinished(
                    request.request_id,
                    f"refit {request.request_id} abandoned: its call ended mid-refit (the learner died, its "
                    "deadline passed, or this broadcaster is stopping)",
                )
                raise
            except MoltError as exc:
                metrics.REFITS.labels(outcome=attempt.failed()).inc()
                if not attempt.paused:  # the others are logged where they were raised
                    log.warning("refit rejected before anything paused", extra={"reason": exc.message})
                raise
            except Exception as exc:  # Ray, a worker, the router's RPCs
                metrics.REFITS.labels(outcome="error").inc()
                self._unfinished(request.request_id, f"refit {request.request_id} failed: {type(exc).__name__}: {exc}")
                raise
            self.responses[request.request_id] = response
            return response

    def _unfinished(self, request_id: str, message: str) -> None:
        """A refit that did not finish: logged, and reported (GetPolicyVersion) when it left the engines
        paused (an earlier failure that holds them is kept: this refit may have ended before it paused)."""
        if self.paused_by_failure == unfinished(request_id):
            self.paused_by_failure = message
        log.error(message, extra={"engines_paused_by": self.paused_by_failure})

    async def _version_of(self, request: weights_pb2.RefitWeightsRequest) -> int:
        """The version ``request``'s weights will be published as (see the module docstring)."""
        if self.router_version < 0:
            self.router_version = (await self._router_status()).policy_version
        newest = max(self.published_here, self.router_version)
        asked = request.policy_version or request.learner_step
        if asked > newest or newest == 0:
            return asked
        if request.continue_versions and asked == newest:
            return asked  # a learner restarted from the checkpoint of the weights the engines serve
        if request.continue_versions:
            log.info(
                "a learner's first refit continues after the newest version",
                extra={"learner_step": request.learner_step, "asked": asked, "newest": newest},
            )
            return newest + 1
        raise InvalidInput(
            f"policy version {asked} (learner_step {request.learner_step}) is not newer than the newest "
            f"version {newest}",
            reason="VERSION_NOT_NEWER",
        )

    @staticmethod
    def _check_probe(request: weights_pb2.RefitWeightsRequest, vocab_size: int) -> None:
        """Probe tokens the engines can score (checked before anything is paused or moved)."""
        if request.run_probe and vocab_size and any(not 0 <= t < vocab_size for t in request.probe_token_ids):
            raise InvalidInput(f"probe_token_ids must lie in [0, {vocab_size}) (the router's vocabulary)")

    def _manifest(self, request: weights_pb2.RefitWeightsRequest) -> list[TensorMeta]:
        if not request.tensors:
            raise InvalidInput("the manifest is empty")
        if request.bucket_bytes < 0:
            raise InvalidInput(f"bucket_bytes must be >= 0, got {request.bucket_bytes}")
        if request.learner_step < 0 or request.policy_version < 0:
            raise InvalidInput(
                f"learner_step ({request.learner_step}) and policy_version ({request.policy_version}) must be >= 0"
            )
        metas = [TensorMeta(t.name, t.dtype, tuple(t.shape), t.checksum) for t in request.tensors]
        try:
            check_manifest(metas)
        except ValueError as exc:
            raise InvalidInput(f"bad manifest: {exc}") from exc
        if request.run_probe and (
            len(request.probe_token_ids) < 2 or len(request.probe_logprobs) != len(request.probe_token_ids) - 1
        ):
            raise InvalidInput("run_probe needs >= 2 probe_token_ids and one probe_logprob per token after the first")
        return metas

    async def _refit(
        self,
        request: weights_pb2.RefitWeightsRequest,
        metas: list[TensorMeta],
        version_number: int,
        attempt: Attempt,
    ) -> weights_pb2.RefitWeightsResponse:
        assert self.store is not None
        clock = PhaseClock()
        vocab_size = await self.discover_engines()
        if not self.engines:
            raise Unavailable("no engine is registered")
        self._check_probe(request, vocab_size)  # against the vocabulary the router serves now, before any pause
        mode = request.pause_mode or (
            rollout_pb2.PAUSE_MODE_KEEP if self.settings.rollout.partial_rollout else rollout_pb2.PAUSE_MODE_DRAIN
        )
        await self.router.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=mode), timeout=600)
        attempt.paused = True
        clock.lap("pause")
        running = False  # the probe resumes the engines; the router admits nothing new until its resume
        try:
            reports = await self._move(request, metas)
            clock.lap("move")
            report = weights_pb2.RefitReport(
                byte_count=sum(m.nbytes for m in metas),
                tensor_count=len(metas),
                bucket_count=len(plan_buckets(metas, self._bucket_bytes(request))),
                coverage_ok=all(r["coverage_ok"] for r in reports),
                checksums_ok=all(r["checksums_ok"] for r in reports),
                transfer_duration=duration_of(max(r["receive_s"] for r in reports)),
                load_duration=duration_of(max(r.get("load_s", 0.0) for r in reports)),
            )
            problems = [f"rank {r['rank']}: {p}" for r in reports for p in r["problems"]]
            if not all(r["loaded"] for r in reports):
                # Nothing was loaded anywhere it was refused; ranks that loaded hold the new weights,
                # which the others do not: only when none loaded is resuming at the old version consistent.
                if not any(r["loaded"] for r in reports):
                    if self.paused_by_failure:  # the previous weights are already gone
                        raise WrongState("refit refused, the engines stay paused: " + "; ".join(problems))
                    await self._resume(None)
                    attempt.resumed = True
                    raise WrongState("refit refused, the engines keep the previous weights: " + "; ".join(problems))
                raise WrongState("refit loaded on some engines only: " + "; ".join(problems))
            if problems:
                raise WrongState("refit loaded but did not validate: " + "; ".join(problems))
            probed = request.run_probe and self.settings.probe
            if probed:
                running = True
                worst = await self._probe(request, version_number)
                clock.lap("probe")
                report.probe_max_abs_logprob_diff = worst
                if worst > self.settings.probe_tolerance:
                    raise WrongState(
                        f"probe: engine and learner logprobs differ by up to {worst:.3g} "
                        f"(> tolerance {self.settings.probe_tolerance})"
                    )
            await self._resume(version_number)
            # From here on nothing waits: a refit the router serves cannot be cancelled half-published.
            attempt.resumed = True
            clock.lap("resume")
            version = self._publish(version_number, request.learner_step)
            clock.lap("publish")
            if self.paused_by_failure:
                log.info("engines consistent again after a failed refit", extra={"version": version.version})
                self.paused_by_failure = None
            report.duration.CopyFrom(duration_of(clock.elapsed()))
            metrics.REFITS.labels(outcome="ok").inc()
            metrics.REFIT_SECONDS.observe(clock.elapsed())
            metrics.REFIT_BYTES.inc(report.byte_count)
            log.info(
                "refit published",
                extra={
                    "version": version.version,
                    "bytes": report.byte_count,
                    "buckets": report.bucket_count,
                    "seconds": round(clock.elapsed(), 3),
                    "phase_seconds": {name: round(value, 4) for name, value in clock.phases.items()},
                    "probe_max_abs_diff": report.probe_max_abs_logprob_diff if probed else None,
                },
            )
            return weights_pb2.RefitWeightsResponse(policy_version=version, report=report)
        except MoltError as exc:
            if running and not attempt.resumed:
                await self._pause_again()
            if not attempt.resumed:
                self.paused_by_failure = exc.message
                log.error("refit failed, engines stay paused", extra={"reason": exc.message})
            raise
        except BaseException:  # cancelled (the learner's call ended, or the refit timed out), or the router's RPCs
            if running and not attempt.resumed:
                await self._pause_again()
            if not attempt.resumed:
                self.group.learner_joined = False
                self.paused_by_failure = unfinished(request.request_id)
            raise

    def _bucket_bytes(self, request: weights_pb2.RefitWeightsRequest) -> int:
        return request.bucket_bytes or self.settings.bucket_bytes

    async def _move(self, request: weights_pb2.RefitWeightsRequest, metas: list[TensorMeta]) -> list[dict[str, Any]]:
        assert self.store is not None
        world, changed = self._assign_ranks()
        timeout = self.settings.refit_timeout_s
        # The engine workers wait for the learner's ready key before they block on the group: a learner
        # that died after asking (its call is then cancelled here) must not leave them waiting for its
        # bytes until the group's timeout, unable to take the next refit. On any failure the key is
        # written ABANDONED (unless the learner wrote it first), which releases them.
        go_key, ready_key = refit_keys(request.request_id)
        try:
            joins = []
            if changed:
                for engine in self.engines.values():
                    args = (
                        self.settings.store_host,
                        self.store_port,
                        engine.first_rank,
                        world,
                        self._backend(),
                        self.group.generation,
                        timeout,
                        ready_key,
                        self.settings.join_timeout_s,
                    )
                    joins.append(engine.actor.collective_rpc.remote("join_weight_group", args))
            bucket_bytes = self._bucket_bytes(request)
            go = {
                "generation": self.group.generation,
                "world_size": world,
                "backend": self._backend(),
                "bucket_bytes": bucket_bytes,
                "join_timeout_s": self.settings.join_timeout_s,
            }
            self.store.set(go_key, json.dumps(go))
            if joins:
                await asyncio.gather(*joins)
                self.group.learner_joined = True
            manifest = manifest_to_json(metas)
            receives = [
                e.actor.collective_rpc.remote("receive_weights", (manifest, bucket_bytes, ready_key))
                for e in self.engines.values()
            ]
            results = await asyncio.gather(*receives)
        except BaseException:
            self.store.compare_set(ready_key, "", ABANDONED)
            self.group.learner_joined = False
            raise
        return [report for per_engine in results for report in per_engine]

    def _backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        import ray

        return "nccl" if ray.cluster_resources().get("GPU", 0) > 0 else "gloo"

    async def _probe(self, request: weights_pb2.RefitWeightsRequest, version: int) -> float:
        """The largest |engine - learner| probe logprob; the engines resume for it and stay running."""
        tokens = list(request.probe_token_ids)
        expected = list(request.probe_logprobs)
        results = await asyncio.gather(*(e.actor.probe.remote(tokens, version) for e in self.engines.values()))
        return max(abs(a - b) for got in results for a, b in zip(got, expected, strict=True))

    async def _pause_again(self) -> None:
        """After a probe, on a failure path: pauses the router, and with it the engines, again. Its own
        error is logged; the refit's failure is what is raised."""
        try:
            await self.router.PauseGeneration(
                rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=600
            )
        except Exception:
            log.exception("could not pause the engines again after a failed refit")

    def _publish(self, number: int, learner_step: int) -> common_pb2.PolicyVersion:
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
        key = version_key(self.settings.run.run_id)
        try:
            await asyncio.wait_for(self.redis.set(key, json.dumps(record)), REDIS_TIMEOUT_S)
        except (aioredis.RedisError, TimeoutError) as exc:
            log.error(
                "published version not written to Redis (a restarted broadcaster will report an older one)",
                extra={"key": key, "version": record["version"], "error": repr(exc)},
            )

    async def _resume(self, version: int | None) -> None:
        request = rollout_pb2.ResumeGenerationRequest()
        if version is not None:
            request.policy_version = version
        await self.router.ResumeGeneration(request, timeout=60)
