"""The router's engines as one pool: routing, the request lifecycle, admission, pause and resume.

``EnginePool`` starts one engine actor per configured engine, or attaches to a
running one of the same name (``molt.router.engine_launch``), routes each request
(``routing.pick_engine``) and sends it over the engine's data channel
(``molt.router.data_channel``). It gates admission while paused: requests
arriving during a pause wait (up to ``pause.paused_wait_timeout_s``) instead of
failing. Ray carries only the control calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import ray

from molt.core.errors import Aborted, ConfigError, InvalidInput, TimedOut, Unavailable, WrongState
from molt.router import metrics
from molt.router.config import RouterSettings
from molt.router.data_channel import Chunk, EngineLinks, Failure, Submission
from molt.router.engine_launch import check_engine_args, check_engine_nodes, start_or_attach, stop_engines
from molt.router.engine_replacement import Replacements, unless_died
from molt.router.engine_spec import EngineInfo
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
        self.keys = itertools.count()
        self.key_prefix = secrets.token_hex(4)  # this router's: a restarted one never reuses a detached engine's ids
        # Requests waiting at admission: per request_id, one event per waiter (set: aborted).
        self.held: dict[str, set[asyncio.Event]] = {}
        self.links = EngineLinks()  # the router's ends of the engines' data channels
        self.replacements = Replacements(self)  # of engines that die (molt.router.engine_replacement)
        self.use_gpu = False
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
        use_gpu = self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        check_engine_args(self.settings, use_gpu)
        if engine.nodes:
            check_engine_nodes(self.settings, use_gpu)
        for index in range(engine.engine_count):
            version = self.policy_version
            self.actors[f"engine-{index}"] = start_or_attach(self.settings, self.namespace, index, use_gpu, version)
        infos = await asyncio.gather(*(actor.start.remote() for actor in self.actors.values()))
        self.infos = {info.engine_id: info for info in infos}
        limits = {(i.vocab_size, i.max_model_len) for i in infos}
        if len(limits) != 1:
            raise ConfigError(f"engines serve different models (vocab size, context): {sorted(limits)}")
        self._take_over(infos)
        addresses = await asyncio.gather(*(actor.channel.remote() for actor in self.actors.values()))
        for engine_id, address in zip(self.actors, addresses, strict=True):
            await self.links.connect(engine_id, address)
        metrics.ENGINES_UP.set(len(infos))
        if self.settings.replace_dead_engines:
            self.replacements.start()
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

    async def shutdown(self) -> None:
        """Stops the engines and frees their placement groups, unless they are detached (then a later
        router attaches to them); an engine this router attached to goes too unless it is detached."""
        self.replacements.stop()
        self.links.close()
        if self.settings.engine.detached:
            return
        await stop_engines(self.actors, self.namespace)
        metrics.ENGINES_UP.set(0)

    # -- requests --------------------------------------------------------------------------

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
        live = self.replacements.serving([engine_id for engine_id in self.actors if self.links.is_live(engine_id)])
        engine_id = pick_engine(live or list(self.actors), session_id, load)  # none live: it fails at once
        key = f"{request_id}#{self.key_prefix}-{next(self.keys)}"
        queue = self.links.open_queue(key, engine_id)
        self.in_flight[request_id] = InFlight(engine_id, len(prompt_token_ids) + sampling.max_tokens, key)
        self._idle.clear()
        metrics.REQUESTS_IN_FLIGHT.inc()
        started, outcome, finished, refused = time.monotonic(), "aborted", 0, False
        try:
            submission = Submission(
                request_id=key, prompt_token_ids=prompt_token_ids, sampling=sampling, final_only=final_only
            )
            self.links.send(engine_id, ("submit", submission))
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
                self.links.send(engine_id, ("abort", key))
            del self.in_flight[request_id]
            self.links.close_queue(key)
            if not self.in_flight:
                self._idle.set()
            metrics.REQUESTS_IN_FLIGHT.dec()
            metrics.REQUESTS.labels(outcome).inc()
            metrics.REQUEST_SECONDS.observe(time.monotonic() - started)

    def _refuse_duplicate(self, request_id: str) -> None:
        if request_id in self.in_flight:
            raise InvalidInput(f"request_id {request_id!r} is already in flight", reason="DUPLICATE_REQUEST_ID")

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
            self.links.send(flight.engine_id, ("abort", flight.key))
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
        engines = asyncio.gather(
            *(unless_died(e, actor.pause.remote(engine_mode, clear_cache)) for e, actor in self._live_actors())
        )
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
            engines = asyncio.gather(*(unless_died(e, self._resume_engine(e, a)) for e, a in self._live_actors()))
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

    async def _resume_engine(self, engine_id: str, actor: Any) -> None:
        version = await self.replacements.resume_version(engine_id, actor, self.policy_version)
        self.infos[engine_id] = dataclasses.replace(self.infos[engine_id], policy_version=version)
        await actor.resume.remote(version)

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

    def _live_actors(self) -> list[tuple[str, Any]]:
        """The engines whose data channel is open (pausing or resuming a dead one would fail every refit)."""
        return [(engine_id, actor) for engine_id, actor in self.actors.items() if self.links.is_live(engine_id)]

    def load(self) -> dict[str, tuple[int, int]]:
        """Per engine: (outstanding requests, outstanding tokens)."""
        result = dict.fromkeys(self.actors, (0, 0))
        for flight in self.in_flight.values():
            count, tokens = result[flight.engine_id]
            result[flight.engine_id] = (count + 1, tokens + flight.load)
        return result
