"""The refit sequence: pause the router, move the learner's weights into every engine worker, validate, publish.

``Broadcaster.refit`` runs one refit at a time, deduplicated by the learner's
request id; ``_refit`` gives the steps and what each failure leaves behind. The
weight group's members live in ``molt.broadcaster.membership``, the published
version in ``molt.broadcaster.publication``. A published version is one the
router serves, and versions only grow (``Publisher.version_for``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf.duration_pb2 import Duration

from molt.broadcaster import metrics
from molt.broadcaster.config import BroadcasterSettings
from molt.broadcaster.membership import Membership, retryable
from molt.broadcaster.publication import Publisher
from molt.core.auth import Access
from molt.core.errors import InvalidInput, MoltError, TimedOut, Unavailable, WrongState
from molt.core.serve import KEEPALIVE
from molt.core.weightsync import ABANDONED, TensorMeta, check_manifest, manifest_to_json, plan_buckets, refit_keys
from molt.v1 import rollout_pb2, rollout_pb2_grpc, weights_pb2

log = logging.getLogger(__name__)


def unfinished(request_id: str) -> str:
    """What holds the engines after refit ``request_id`` ended unfinished, until ``refit`` says why."""
    return f"refit {request_id} did not finish"


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
class Attempt:
    """How far one refit got, which decides what a failure counts as in ``molt_broadcaster_refits_total``."""

    paused: bool = False
    resumed: bool = False

    def failed(self) -> str:
        if not self.paused:
            return "rejected"  # nothing was paused: bad input, no engine, the router out of reach
        return "refused" if self.resumed else "failed_paused"


class Broadcaster:
    """Runs refits one at a time over the weight group's members, and publishes their versions."""

    def __init__(self, settings: BroadcasterSettings) -> None:
        self.settings = settings
        self.lock = asyncio.Lock()
        self.responses: dict[str, weights_pb2.RefitWeightsResponse] = {}
        self.channel = Access.of(settings.run).aio_channel(settings.router_address, KEEPALIVE)
        self.router = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.membership = Membership(settings, self.router)
        self.publisher = Publisher(settings)
        self.paused_by_failure: str | None = None
        self.router_version = -1  # the router's version when this process first refits; -1: not asked yet

    async def close(self) -> None:
        await self.channel.close()
        await self.publisher.close()

    async def learner_registered(self) -> None:
        """A (new or restarted) learner: its rank 0 is a new process, so the next refit builds a new
        group generation (waits for a refit in progress to end)."""
        async with self.lock:
            self.membership.group.learner_joined = False
        log.info("learner registered", extra={"generation": self.membership.group.generation})

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
                self.membership.group.learner_joined = False  # the group may be mid-collective: rebuild it next time
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
                if (again := retryable(exc, request.request_id, self.settings.router_address)) is not None:
                    raise again from exc
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
        """The version ``request``'s weights will be published as (``Publisher.version_for``)."""
        if self.router_version < 0:
            self.router_version = (await self.membership.router_status()).policy_version
        asked = request.policy_version or request.learner_step
        return self.publisher.version_for(asked, request.learner_step, request.continue_versions, self.router_version)

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
        """One refit, for request id R (the learner's):

        1. Pause the router (drain or keep).
        2. Tell the engine workers to join the group when its membership changed (a new generation),
           then to receive the manifest; write ``refit/R`` into the store with the group's generation,
           world size and bucket size: the learner waits for it, joins when needed, and broadcasts.
        3. Each worker stages every bucket, checks coverage and checksums, and loads only when both
           hold (``_validate``).
        4. Optional teacher-forced probe: every engine scores the learner's probe tokens; a difference
           above the tolerance keeps the router paused (the weights are complete but disagree with the
           learner: serving them would be wrong). The way out is the next refit: it rewrites every
           weight, and only when it validates does the router resume.
        5. Resume the router at the version, and only once the router accepts, publish it. A resume
           the router refuses leaves the engines paused and the version unpublished.
        """
        assert self.membership.store is not None
        clock = PhaseClock()
        vocab_size = await self.membership.discover_engines()
        if not self.membership.engines:
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
            report = await self._validate(request, metas, reports, attempt)
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
            return self._publish(version_number, request.learner_step, report, clock, probed)
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
                self.membership.group.learner_joined = False
                self.paused_by_failure = unfinished(request.request_id)
            raise

    async def _validate(
        self,
        request: weights_pb2.RefitWeightsRequest,
        metas: list[TensorMeta],
        reports: list[dict[str, Any]],
        attempt: Attempt,
    ) -> weights_pb2.RefitReport:
        """The refit's report, once every worker loaded weights that validated. A refused refit leaves the
        old weights everywhere: the router resumes at the old version and the call fails with the reasons
        (unless an earlier failure already replaced them). A refit that loaded on some engines only keeps
        the router paused."""
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
        return report

    def _publish(
        self, number: int, learner_step: int, report: weights_pb2.RefitReport, clock: PhaseClock, probed: bool
    ) -> weights_pb2.RefitWeightsResponse:
        """Publishes the version the router now serves, and counts and logs the refit."""
        version = self.publisher.publish(number, learner_step)
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

    def _bucket_bytes(self, request: weights_pb2.RefitWeightsRequest) -> int:
        return request.bucket_bytes or self.settings.bucket_bytes

    async def _move(self, request: weights_pb2.RefitWeightsRequest, metas: list[TensorMeta]) -> list[dict[str, Any]]:
        membership = self.membership
        store = membership.store
        assert store is not None
        world, changed = membership.assign_ranks()
        timeout = self.settings.refit_timeout_s
        # The engine workers wait for the learner's ready key before they block on the group: a learner
        # that died after asking (its call is then cancelled here) must not leave them waiting for its
        # bytes until the group's timeout, unable to take the next refit. On any failure the key is
        # written ABANDONED (unless the learner wrote it first), which releases them.
        go_key, ready_key = refit_keys(request.request_id)
        try:
            joins = []
            if changed:
                for engine in membership.engines.values():
                    args = (
                        self.settings.store_host,
                        membership.store_port,
                        engine.first_rank,
                        world,
                        membership.backend(),
                        membership.group.generation,
                        timeout,
                        ready_key,
                        self.settings.join_timeout_s,
                        membership.namespace,
                    )
                    joins.append(engine.actor.collective_rpc.remote("join_weight_group", args))
            bucket_bytes = self._bucket_bytes(request)
            go = {
                "generation": membership.group.generation,
                "world_size": world,
                "backend": membership.backend(),
                "bucket_bytes": bucket_bytes,
                "join_timeout_s": self.settings.join_timeout_s,
            }
            store.set(go_key, json.dumps(go))
            if joins:
                await asyncio.gather(*joins)
                membership.group.learner_joined = True
            manifest = manifest_to_json(metas)
            receives = [
                e.actor.collective_rpc.remote("receive_weights", (manifest, bucket_bytes, ready_key))
                for e in membership.engines.values()
            ]
            results = await asyncio.gather(*receives)
        except BaseException:
            store.compare_set(ready_key, "", ABANDONED)
            membership.group.learner_joined = False
            raise
        return [report for per_engine in results for report in per_engine]

    async def _probe(self, request: weights_pb2.RefitWeightsRequest, version: int) -> float:
        """The largest |engine - learner| probe logprob; the engines resume for it and stay running."""
        tokens = list(request.probe_token_ids)
        expected = list(request.probe_logprobs)
        engines = self.membership.engines.values()
        results = await asyncio.gather(*(e.actor.probe.remote(tokens, version) for e in engines))
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

    async def _resume(self, version: int | None) -> None:
        request = rollout_pb2.ResumeGenerationRequest()
        if version is not None:
            request.policy_version = version
        await self.router.ResumeGeneration(request, timeout=60)
