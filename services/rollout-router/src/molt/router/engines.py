"""The router's engines: Ray actors placed with placement groups, routing, pause/resume.

``EnginePool`` starts one ``EngineActor`` per configured engine (or attaches to
a running one of the same name), routes each request (``routing.pick_engine``),
and gates admission while paused: requests arriving during a pause wait (up to
``pause.paused_wait_timeout_s``) instead of failing. Requests and aborts go to an
engine over its data channel (``molt.router.engine``), everything one pass of the
event loop gathered in one frame and in order (so an abort never overtakes its
request); one pump task per engine reads the channel and hands each chunk to its
request's queue. Ray carries only the control calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from molt.core.errors import Aborted, ConfigError, InvalidInput, TimedOut, Unavailable, WrongState
from molt.router import metrics
from molt.router.config import RouterSettings
from molt.router.engine import (
    RESERVED_ENGINE_ARGS,
    Chunk,
    EngineActor,
    EngineInfo,
    EngineSpec,
    Failure,
    Operation,
    Output,
    Submission,
    frame,
    keep_alive,
    read_frame,
)
from molt.router.routing import pick_engine
from molt.router.sampling import ModelLimits, Sampling

log = logging.getLogger(__name__)


ENGINE_CALL_TIMEOUT_S = 120.0  # an engine's pause or resume; one that never answers must not hold the router


def _overtaken() -> WrongState:
    return WrongState("a resume came before this pause reached the engines; not paused", reason="RESUMED_WHILE_PAUSING")


@dataclass
class InFlight:
    """A request routed to an engine."""

    engine_id: str
    load: int  # prompt + max generated tokens: the work it may still cost the engine
    key: str  # its id in the engine: unique per submission (see ``EnginePool.generate``)


class EnginePool:
    """Owns the engine actors and the request lifecycle across them."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.namespace = f"molt-{settings.run.run_id}"
        self.actors: dict[str, Any] = {}
        self.infos: dict[str, EngineInfo] = {}
        self.in_flight: dict[str, InFlight] = {}  # by the caller's request_id
        self.queues: dict[str, asyncio.Queue[Chunk | Failure]] = {}  # by the submission's key in the engine
        self.keys = itertools.count()
        self.key_prefix = secrets.token_hex(4)  # this router's: a restarted one never reuses a detached engine's ids
        # Requests waiting at admission: per request_id, one event per waiter (set: aborted).
        self.held: dict[str, set[asyncio.Event]] = {}
        self.pumps: list[asyncio.Task[None]] = []
        # Per live engine, the router's end of its data channel (an engine whose channel closed is dropped).
        self.links: dict[str, asyncio.StreamWriter] = {}
        self.outgoing: dict[str, list[Operation]] = {}  # per engine: what this pass of the loop gathered
        self.policy_version = 0
        self.versions_differ = False  # attached engines hold different weights: only a refit may resume them
        self.paused = False
        self.waiting = 0  # requests held at admission by a pause
        self.closing = 0  # pause calls under way: admission stays closed while any is
        self.overtaken: set[asyncio.Event] = set()  # one per pause under way: set by a resume meanwhile
        self._switch = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> ModelLimits:
        """Starts (or attaches to) every engine and waits until they serve."""
        engine = self.settings.engine
        reserved = sorted(set(engine.engine_args) & set(RESERVED_ENGINE_ARGS))
        if reserved:
            raise ConfigError(
                f"router.engine.engine_args may not set {reserved}: molt sets them itself or they have "
                "their own [router.engine] setting"
            )
        if self.settings.pause.kv_cache == "keep" and engine.engine_args.get("enable_prefix_caching"):
            raise ConfigError(
                'router.pause.kv_cache = "keep" needs prefix caching off (new requests would reuse blocks the old '
                "weights wrote); remove router.engine.engine_args.enable_prefix_caching"
            )
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if not use_gpu and engine.engine_args.get("enable_chunked_prefill"):
            raise ConfigError(
                "router.engine.engine_args.enable_chunked_prefill is not safe on CPU engines: vLLM rewinds a seeded "
                "request's random generator after a partial prefill, which CPU generators cannot do, and the "
                "engine dies; remove it"
            )
        for index in range(engine.engine_count):
            engine_id = f"engine-{index}"
            self.actors[engine_id] = self._actor(engine_id, use_gpu)
        infos = await asyncio.gather(*(actor.start.remote() for actor in self.actors.values()))
        self.infos = {info.engine_id: info for info in infos}
        limits = {(i.vocab_size, i.max_model_len) for i in infos}
        if len(limits) != 1:
            raise ConfigError(f"engines serve different models (vocab size, context): {sorted(limits)}")
        self._take_over(infos)
        addresses = await asyncio.gather(*(actor.channel.remote() for actor in self.actors.values()))
        for engine_id, address in zip(self.actors, addresses, strict=True):
            try:
                reader, writer = await asyncio.open_connection(address.host, address.port)
            except OSError as exc:
                raise Unavailable(
                    f"cannot reach the data channel of {engine_id} at {address.host}:{address.port}: {exc}",
                    reason="ENGINE_UNAVAILABLE",
                ) from exc
            keep_alive(writer)
            writer.write(frame(address.token))
            self.links[engine_id] = writer
            self.pumps.append(asyncio.create_task(self._pump(engine_id, reader)))
        metrics.ENGINES_UP.set(len(infos))
        vocab_size, max_model_len = limits.pop()
        channels = {engine_id: f"{a.host}:{a.port}" for engine_id, a in zip(self.actors, addresses, strict=True)}
        log.info(
            "engines ready",
            extra={
                "engines": list(self.infos),
                "gpu": use_gpu,
                "data_channels": channels,
                "policy_version": self.policy_version,
                "paused": self.paused,
            },
        )
        return ModelLimits(vocab_size, max_model_len)

    def _take_over(self, infos: list[EngineInfo]) -> None:
        """Takes the policy version and the pause over from engines this router attached to (they outlived
        an earlier router): the highest version, and paused when any engine is paused or the versions
        differ (a refit cut short, or fresh engines beside attached ones), so that nothing is served
        before a ResumeGeneration; engines that differ resume only with a new version (a refit).
        Fresh engines are at version 0, running."""
        versions = {info.policy_version for info in infos}
        self.policy_version = max(versions)
        self.versions_differ = len(versions) > 1
        metrics.POLICY_VERSION.set(self.policy_version)
        if any(info.paused for info in infos) or self.versions_differ:
            self.paused = True
            self._open.clear()
            metrics.PAUSED.set(1)
            log.warning(
                "attached to paused engines (or engines at different versions): requests wait for a ResumeGeneration",
                extra={"versions": {info.engine_id: info.policy_version for info in infos}},
            )

    def _actor(self, engine_id: str, use_gpu: bool) -> Any:
        name = f"molt-{engine_id}"
        try:
            actor = ray.get_actor(name, namespace=self.namespace)
            log.info("attached to running engine", extra={"engine": engine_id})
            return actor
        except ValueError:
            pass
        try:  # a detached group whose engine died (crash, ray.kill) would block creating it again
            remove_placement_group(get_placement_group(self._group_name(engine_id)))
            log.warning("removed the placement group of a dead engine", extra={"engine": engine_id})
        except ValueError:
            pass
        engine = self.settings.engine
        tp = engine.tensor_parallel_size
        # CPU: one bundle for the actor (vLLM's worker runs in a child process). GPU: one GPU per
        # tensor-parallel worker; with tp > 1 vLLM's Ray executor places its workers in this group.
        bundles = [{"CPU": 1.0, "GPU": 1.0}] + [{"GPU": 1.0}] * (tp - 1) if use_gpu else [{"CPU": 1.0}]
        # A detached engine's group is detached too: Ray removes a job's groups, and the actors in them,
        # when the job (this router) ends.
        lifetime = "detached" if engine.detached else None
        group = placement_group(bundles, strategy="PACK", name=self._group_name(engine_id), lifetime=lifetime)
        extra: dict[str, Any] = {"distributed_executor_backend": "ray"} if use_gpu and tp > 1 else {}
        if self.settings.pause.kv_cache == "keep":
            extra["enable_prefix_caching"] = False
        if not use_gpu:
            # vLLM rewinds a seeded request's generator (set_offset) when a step only prefilled part of it,
            # which a CPU generator refuses: the engine died once seeded prompts overran a step's token
            # budget (concurrent long prompts; requests re-prefilling after a pause). Whole prefills only.
            extra["enable_chunked_prefill"] = False
        spec = EngineSpec(
            engine_id=engine_id,
            model_path=engine.model_path,
            tensor_parallel_size=tp,
            max_model_len=engine.max_model_len,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            seed=engine.seed,
            dtype=engine.dtype,
            stream_interval=engine.stream_interval,
            engine_args={**extra, **engine.engine_args},
            wait=engine.wait if engine.wait != "auto" else ("spin" if use_gpu else "sleep"),
        )
        remote_cls = ray.remote(EngineActor)
        return remote_cls.options(  # type: ignore[attr-defined]
            name=name,
            namespace=self.namespace,
            lifetime="detached" if engine.detached else None,
            num_cpus=1,
            num_gpus=1 if use_gpu and tp == 1 else 0,
            max_concurrency=10_000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(spec, self.policy_version)

    def _group_name(self, engine_id: str) -> str:
        return f"{self.namespace}-{engine_id}"

    async def shutdown(self) -> None:
        """Stops the engines and frees their placement groups, unless they are detached (then a later
        router attaches to them); an engine this router attached to goes too unless it is detached."""
        for task in self.pumps:
            task.cancel()
        for writer in self.links.values():
            writer.close()
        if self.settings.engine.detached:
            return
        await asyncio.gather(*(actor.shutdown.remote() for actor in self.actors.values()), return_exceptions=True)
        for engine_id, actor in self.actors.items():
            ray.kill(actor)
            try:
                remove_placement_group(get_placement_group(self._group_name(engine_id)))
            except Exception as exc:  # already gone (with an earlier router's job): nothing to free
                log.debug("no placement group to remove", extra={"engine": engine_id, "error": repr(exc)})
        metrics.ENGINES_UP.set(0)

    # -- requests --------------------------------------------------------------------------

    async def _pump(self, engine_id: str, reader: asyncio.StreamReader) -> None:
        """Moves an engine's outputs to the requests' queues until its channel closes (the engine died)."""
        try:
            while True:
                outputs: list[Output] = pickle.loads(await read_frame(reader))
                for key, item in outputs:
                    queue = self.queues.get(key)
                    if queue is not None:  # else the caller has left; its abort is on the way
                        queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # closed (the engine died), keep-alive timed out, or a frame we cannot read
            log.error("engine died: its data channel closed", extra={"engine": engine_id, "error": repr(exc)})
            if (writer := self.links.pop(engine_id, None)) is not None:
                writer.close()
            metrics.ENGINES_UP.dec()
            for flight in self.in_flight.values():
                if flight.engine_id == engine_id:
                    self.queues[flight.key].put_nowait(Failure(f"{engine_id} died"))

    async def generate(
        self,
        request_id: str,
        session_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        final_only: bool = False,
    ) -> AsyncIterator[tuple[str, Chunk]]:
        """Yields ``(engine_id, chunk)`` for the request (with ``final_only``, each sample's chunks only
        once it finished); leaving early aborts it in the engine.

        The engine knows the request by a key unique to this submission (``<request_id>#<router>-<n>``):
        an id the caller reuses at once after giving up on a request must not receive that request's
        late outputs (its abort's last chunk), nor be refused while the engine still winds it down."""
        self._refuse_duplicate(request_id)
        await self._admit(request_id)
        self._refuse_duplicate(request_id)  # one with the same id may have been admitted while this one waited
        load = {engine_id: tokens for engine_id, (_, tokens) in self.load().items()}
        live = [engine_id for engine_id in self.actors if engine_id in self.links]
        engine_id = pick_engine(live or list(self.actors), session_id, load)  # none live: it fails at once
        key = f"{request_id}#{self.key_prefix}-{next(self.keys)}"
        queue: asyncio.Queue[Chunk | Failure] = asyncio.Queue()
        self.queues[key] = queue
        self.in_flight[request_id] = InFlight(engine_id, len(prompt_token_ids) + sampling.max_tokens, key)
        self._idle.clear()
        metrics.REQUESTS_IN_FLIGHT.inc()
        started, outcome, finished, refused = time.monotonic(), "aborted", 0, False
        try:
            self._enqueue(
                engine_id,
                (
                    "submit",
                    Submission(
                        request_id=key,
                        prompt_token_ids=prompt_token_ids,
                        sampling=sampling,
                        final_only=final_only,
                    ),
                ),
            )
            while finished < sampling.sample_count:
                item = await queue.get()
                if isinstance(item, Failure):
                    if item.refused:
                        refused = True
                        raise InvalidInput(item.message, reason="DUPLICATE_REQUEST_ID")
                    outcome = "error"
                    raise Unavailable(f"{engine_id} failed {request_id}: {item.message}", reason="ENGINE_FAILED")
                if finished == 0 and item.token_ids:
                    metrics.FIRST_TOKEN_SECONDS.observe(time.monotonic() - started)
                metrics.GENERATED_TOKENS.inc(len(item.token_ids))
                finished += item.finish_reason is not None
                yield engine_id, item
            outcome = "ok"
        finally:
            if finished < sampling.sample_count and not refused:  # the caller is gone or failed
                self._enqueue(engine_id, ("abort", key))
            del self.in_flight[request_id], self.queues[key]
            if not self.in_flight:
                self._idle.set()
            metrics.REQUESTS_IN_FLIGHT.dec()
            metrics.REQUESTS.labels(outcome).inc()
            metrics.REQUEST_SECONDS.observe(time.monotonic() - started)

    def _refuse_duplicate(self, request_id: str) -> None:
        if request_id in self.in_flight:
            raise InvalidInput(f"request_id {request_id!r} is already in flight", reason="DUPLICATE_REQUEST_ID")

    def _enqueue(self, engine_id: str, operation: Operation) -> None:
        """Queues a submission or an abort for ``engine_id``; what this pass of the event loop gathers
        goes out together, in order, once the pass is over."""
        operations = self.outgoing.get(engine_id)
        if operations is None:
            operations = self.outgoing[engine_id] = []
            asyncio.get_running_loop().call_soon(self._send, engine_id)
        operations.append(operation)

    def _send(self, engine_id: str) -> None:
        operations = self.outgoing.pop(engine_id)
        writer = self.links.get(engine_id)
        if writer is None or writer.is_closing():
            self._fail_submissions(operations, Failure(f"{engine_id} is gone"))
            return
        try:
            payload = pickle.dumps(operations, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # cannot happen with molt's own dataclasses; fail the callers, never lose them
            log.exception("cannot encode a frame for the engine", extra={"engine": engine_id})
            self._fail_submissions(operations, Failure(f"the router could not send the request: {exc!r}"))
            return
        submissions = sum(operation[0] == "submit" for operation in operations)
        if submissions:
            metrics.SUBMIT_BATCH.observe(submissions)
        writer.write(frame(payload))

    def _fail_submissions(self, operations: list[Operation], failure: Failure) -> None:
        for operation in operations:
            if operation[0] == "submit" and (queue := self.queues.get(operation[1].request_id)) is not None:
                queue.put_nowait(failure)

    async def _admit(self, request_id: str) -> None:
        """Waits while generation is paused (bounded); an abort meanwhile ends the wait."""
        if self._open.is_set():
            return
        self.waiting += 1
        metrics.REQUESTS_WAITING.inc()
        aborted = asyncio.Event()
        self.held.setdefault(request_id, set()).add(aborted)
        opened = asyncio.ensure_future(self._open.wait())
        abort = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait(
                {opened, abort}, timeout=self.settings.pause.paused_wait_timeout_s, return_when="FIRST_COMPLETED"
            )
            if aborted.is_set():
                raise Aborted(f"request {request_id!r} was aborted while generation was paused", reason="ABORTED")
            if not opened.done():
                raise Unavailable(
                    f"generation has been paused for more than {self.settings.pause.paused_wait_timeout_s} s",
                    reason="PAUSED_TOO_LONG",
                )
        finally:
            opened.cancel()
            abort.cancel()
            waiters = self.held.get(request_id, set())
            waiters.discard(aborted)
            if not waiters:
                self.held.pop(request_id, None)
            self.waiting -= 1
            metrics.REQUESTS_WAITING.dec()

    async def abort(self, request_id: str) -> bool:
        """Aborts a request in flight or waiting at admission; False when it is unknown or already finished."""
        flight = self.in_flight.get(request_id)
        if flight is not None:
            self._enqueue(flight.engine_id, ("abort", flight.key))
            return True
        if (waiters := self.held.pop(request_id, None)) is not None:  # a newcomer with this id waits anew
            for aborted in waiters:
                aborted.set()
            return True
        return False

    # -- pause / resume --------------------------------------------------------------------

    async def pause(self, mode: Literal["drain", "keep"], drain_timeout_s: float) -> int:
        """Closes admission and pauses the engines; returns the requests in flight at the pause.

        ``drain`` waits for in-flight requests first (and gives up, raising TimedOut, if they do
        not finish in time); ``keep`` suspends them inside the engines. Admission stays closed
        while any pause is under way or in force. A resume that comes before this pause reaches
        the engines overtakes it (WrongState, nothing paused); one that comes later runs after it.
        """
        overtaken = asyncio.Event()
        self.overtaken.add(overtaken)
        self.closing += 1
        self._open.clear()
        try:
            if mode == "drain":
                await self._drain(drain_timeout_s, overtaken)
            async with self._switch:  # the engines' pause and resume, one at a time
                if overtaken.is_set():
                    raise _overtaken()
                return await self._pause_engines(mode)
        finally:  # done, timed out, overtaken, or its caller gave up: admission reopens unless paused
            self.overtaken.discard(overtaken)
            self.closing -= 1
            self._settle_admission()

    async def _drain(self, timeout_s: float, overtaken: asyncio.Event) -> None:
        """Waits until nothing is in flight, or a resume overtakes the pause, or ``timeout_s`` passes."""
        idle = asyncio.ensure_future(self._idle.wait())
        resumed = asyncio.ensure_future(overtaken.wait())
        try:
            done, _ = await asyncio.wait({idle, resumed}, timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            idle.cancel()
            resumed.cancel()
        if overtaken.is_set():
            raise _overtaken()
        if not done:
            raise TimedOut(
                f"{len(self.in_flight)} requests still in flight after {timeout_s} s of draining",
                reason="DRAIN_TIMEOUT",
            )

    async def _pause_engines(self, mode: Literal["drain", "keep"]) -> int:
        suspended = len(self.in_flight)
        engine_mode: Literal["wait", "keep"] = "wait" if mode == "drain" else "keep"
        clear_cache = mode == "drain" or self.settings.pause.kv_cache == "recompute"
        started = time.monotonic()
        engines = asyncio.gather(*(actor.pause.remote(engine_mode, clear_cache) for actor in self._live_actors()))
        # Shielded: once the engines are told to pause they pause, so the router counts itself paused
        # whatever the outcome (a caller that gives up, an engine that fails): it reports what it may be,
        # keeps admission closed, and a resume recovers it.
        try:
            await asyncio.wait_for(asyncio.shield(engines), ENGINE_CALL_TIMEOUT_S)
        except TimeoutError as exc:
            raise TimedOut(
                f"the engines did not pause within {ENGINE_CALL_TIMEOUT_S} s", reason="ENGINE_PAUSE_TIMEOUT"
            ) from exc
        except asyncio.CancelledError:
            await asyncio.wait({engines}, timeout=ENGINE_CALL_TIMEOUT_S)
            raise
        finally:
            self.paused = True
            metrics.PAUSED.set(1)
        log.info(
            "paused",
            extra={
                "mode": mode,
                "suspended": suspended,
                "kv_cache": "cleared" if clear_cache else "kept",
                "policy_version": self.policy_version,
                "engines_s": round(time.monotonic() - started, 4),  # the engines' part of the pause (after any drain)
            },
        )
        return suspended

    async def resume(self, policy_version: int | None) -> int:
        """Resumes the engines (under ``policy_version`` if given) and reopens admission; overtakes any
        pause that has not reached the engines yet."""
        self._check_resume(policy_version)
        async with self._switch:
            self._check_resume(policy_version)  # again: another resume may have run meanwhile
            for overtaken in self.overtaken:  # only now: a resume refused or cancelled overtakes nothing
                overtaken.set()
            if policy_version is not None:
                self.policy_version = policy_version
            started = time.monotonic()
            engines = asyncio.gather(*(actor.resume.remote(self.policy_version) for actor in self._live_actors()))
            try:
                await asyncio.wait_for(engines, ENGINE_CALL_TIMEOUT_S)
            except TimeoutError as exc:
                raise TimedOut(
                    f"the engines did not resume within {ENGINE_CALL_TIMEOUT_S} s", reason="ENGINE_RESUME_TIMEOUT"
                ) from exc
            self.paused = False
            self.versions_differ = False
        self._settle_admission()
        metrics.PAUSED.set(0)
        metrics.POLICY_VERSION.set(self.policy_version)
        log.info(
            "resumed",
            extra={"policy_version": self.policy_version, "engines_s": round(time.monotonic() - started, 4)},
        )
        return self.policy_version

    def _check_resume(self, policy_version: int | None) -> None:
        if policy_version is None and self.versions_differ:
            raise WrongState(
                "the engines hold different weights (attached engines at different versions, or beside fresh "
                "ones); only a refit can resume them: ResumeGeneration with the new policy_version",
                reason="ENGINES_DIFFER",
            )
        if policy_version is not None and policy_version < self.policy_version:
            raise InvalidInput(
                f"policy_version {policy_version} is older than the current {self.policy_version}",
                reason="VERSION_REGRESSION",
            )

    def _settle_admission(self) -> None:
        """Opens admission when no pause is under way or in force."""
        if not self.paused and self.closing == 0:
            self._open.set()

    def _live_actors(self) -> list[Any]:
        """The engines whose data channel is open (pausing or resuming a dead one would fail every refit)."""
        return [actor for engine_id, actor in self.actors.items() if engine_id in self.links]

    def load(self) -> dict[str, tuple[int, int]]:
        """Per engine: (outstanding requests, outstanding tokens)."""
        result = dict.fromkeys(self.actors, (0, 0))
        for flight in self.in_flight.values():
            count, tokens = result[flight.engine_id]
            result[flight.engine_id] = (count + 1, tokens + flight.load)
        return result
