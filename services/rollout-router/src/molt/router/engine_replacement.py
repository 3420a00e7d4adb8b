"""Dead engines replaced while the others serve (``[router] replace_dead_engines``).

An engine whose data channel closed has died (``molt.router.data_channel.EngineLinks``). Its requests
already failed with UNAVAILABLE, Generate and GenerateStream alike: the router does not retry them on
another engine, because the tokens a stream already delivered were sampled by the dead one, and a
retry is a new sample that only the caller can decide to want. New requests go to the live engines.

The watch looks every ``POLL_S`` seconds. For each dead engine it ends what is left of the actor,
frees its placement group and starts a new actor under the same name, at version 0 (the initial
weights). The replacement is live but *fresh*: while another engine serves the current version, no
request is routed to it, because its weights are not the policy's. The broadcaster's next refit finds
the new actor under the old name (``discover_engines``), builds a new generation of the weight group
with it, and loads and validates the current weights into it. The engine actor counts the refits it
loaded (``loaded_refits``); on the router's resume after such a refit the replacement is labelled with
the new version and routed to again. A fresh engine that a refit did not cover (it came up after the
refit began) keeps its own version on that resume and stays out until the next refit.

When every live engine is fresh (a run with one engine), requests go to them: their samples carry
version 0, the learner drops them as stale and publishes its weights again (``molt.learner.stale_watch``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from molt.router import metrics
from molt.router.engine_launch import group_name, start_or_attach
from molt.router.engine_spec import EngineInfo

log = logging.getLogger(__name__)

POLL_S = 2.0
GONE_TIMEOUT_S = 60.0  # for Ray to free a killed actor's name
RETRY_S = (5.0, 60.0)  # the wait before another try after a replacement failed: first, most


class Replacements:
    """Which engines are being replaced, which replacements await their first refit, and the counts."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool  # molt.router.engine_pool.EnginePool (its actors, infos, links, settings)
        self.replacing: set[str] = set()
        self.fresh: dict[str, int] = {}  # engine id -> refits it had loaded when it came up (0)
        self.counts: dict[str, int] = {}  # engine id -> replacements that came up
        self.failures: dict[str, int] = {}  # engine id -> tries in a row that did not
        self.not_before: dict[str, float] = {}  # after a failed try: monotonic time of the next one
        self.task: asyncio.Task[None] | None = None
        self.tries: set[asyncio.Task[None]] = set()  # replacements under way (kept: the loop holds tasks weakly)

    def start(self) -> None:
        self.task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        for task in (self.task, *self.tries):
            if task is not None:
                task.cancel()

    def serving(self, live: list[str]) -> list[str]:
        """The live engines requests go to: the ones at the current version, or all when none is."""
        current = [engine_id for engine_id in live if engine_id not in self.fresh]
        return current or live

    async def resume_version(self, engine_id: str, actor: Any, version: int) -> int:
        """The version ``engine_id`` resumes under: ``version`` unless it is a replacement no refit has
        loaded the current weights into yet (then its own, and it stays out of routing)."""
        if engine_id not in self.fresh:
            return version
        if await actor.loaded_refits.remote() > self.fresh[engine_id]:
            del self.fresh[engine_id]
            log.info("replaced engine holds the current weights; serving", extra={"engine": engine_id})
            return version
        return self.pool.infos[engine_id].policy_version

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            now = time.monotonic()
            for engine_id in list(self.pool.actors):
                dead = not self.pool.links.is_live(engine_id) and engine_id not in self.replacing
                if dead and now >= self.not_before.get(engine_id, 0.0):
                    self.replacing.add(engine_id)
                    task = asyncio.create_task(self._replace(engine_id))
                    self.tries.add(task)
                    task.add_done_callback(self.tries.discard)

    async def _replace(self, engine_id: str) -> None:
        started = time.monotonic()
        log.warning("replacing a dead engine", extra={"engine": engine_id})
        try:
            info = await self._start_new(engine_id)
        except Exception as exc:  # logged; tried again later while the engine stays dead
            tries = self.failures[engine_id] = self.failures.get(engine_id, 0) + 1
            wait = min(RETRY_S[0] * 2 ** (tries - 1), RETRY_S[1])
            self.not_before[engine_id] = time.monotonic() + wait
            log.error("could not replace a dead engine; trying again", extra={"engine": engine_id, "error": repr(exc)})
            return
        finally:
            self.replacing.discard(engine_id)
        self.counts[engine_id] = self.counts.get(engine_id, 0) + 1
        self.failures.pop(engine_id, None)
        metrics.ENGINES_UP.inc()
        metrics.ENGINE_REPLACEMENTS.inc()
        log.warning(
            "engine replaced; it serves once a refit loads the current weights",
            extra={
                "engine": engine_id,
                "seconds": round(time.monotonic() - started, 1),
                "version": info.policy_version,
            },
        )

    async def _start_new(self, engine_id: str) -> EngineInfo:
        """Ends the dead actor, starts a new one under its name and connects its data channel."""
        pool = self.pool
        name, namespace = f"molt-{engine_id}", pool.namespace
        ray.kill(pool.actors[engine_id], no_restart=True)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while True:  # its name is free once Ray has recorded the death
            try:
                await asyncio.to_thread(ray.get_actor, name, namespace)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the dead actor {name} kept its name for {GONE_TIMEOUT_S} s")
            await asyncio.sleep(0.5)
        index = int(engine_id.rsplit("-", 1)[1])
        log.info(
            "starting a replacement engine", extra={"engine": engine_id, "group": group_name(namespace, engine_id)}
        )
        actor = start_or_attach(pool.settings, namespace, index, pool.use_gpu, 0)
        info: EngineInfo = await actor.start.remote()
        served = {(i.vocab_size, i.max_model_len) for e, i in pool.infos.items() if e != engine_id}
        if served and (info.vocab_size, info.max_model_len) not in served:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"the replacement serves another model: {info.vocab_size}, {info.max_model_len}")
        await pool.links.connect(engine_id, await actor.channel.remote())
        self.fresh[engine_id] = await actor.loaded_refits.remote()
        pool.actors[engine_id] = actor
        pool.infos[engine_id] = info
        return info


async def unless_died(engine_id: str, call: Any) -> None:
    """Awaits an engine call of a pause or resume; an engine that dies meanwhile is logged and left to
    its replacement (``Replacements``), not raised: the live engines' pause or resume stands, and the
    refit that asked for it finds the dead one gone from the router's status."""
    try:
        await call
    except ray.exceptions.RayActorError as exc:
        log.warning(
            "an engine died during a pause or resume; it will be replaced",
            extra={"engine": engine_id, "error": str(exc).splitlines()[0]},
        )
