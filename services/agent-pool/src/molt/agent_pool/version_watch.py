"""The policy version the engines sample with: asked of the router, or heard from the broadcaster.

The pool paces its groups on it (staleness backpressure) and the evaluator times its passes by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from molt.agent_pool import metrics
from molt.agent_pool.router_client import RouterClient
from molt.core.auth import Access
from molt.core.errors import Unavailable
from molt.core.serve import KEEPALIVE
from molt.v1 import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)

VERSION_POLL_S = 0.05  # how often a pool held back by staleness asks for the policy version


class VersionWatch:
    """The policy version the engines sample with, as the pool paces on it.

    The router is asked once a second (``run``). With the weight-broadcaster's address, ``follow``
    also listens to its WatchPolicyVersion stream, which announces each validated version just
    before the router resumes generation: a pool held back by staleness then starts its next groups
    at once (their requests wait at the router until the resume releases them together) instead of
    on its next question to the router. Versions only go up within a run (the broadcaster refuses
    an older version), so the watch keeps the highest it has heard of.
    """

    def __init__(self, router: RouterClient, access: Access | None = None) -> None:
        self.router = router
        self.access = access or Access()  # to the broadcaster: the run's token and TLS
        self.version = 0
        self.streaming = False  # the broadcaster's stream is up: news arrives without asking
        self.tasks: list[asyncio.Task[None]] = []
        self._newer = asyncio.Event()
        self._asked = 0.0  # monotonic time of the last question to the router

    def _heard(self, version: int) -> None:
        if version > self.version:
            self.version = version
            metrics.POLICY_VERSION.set(version)
            self._newer.set()
            self._newer = asyncio.Event()

    async def refresh(self) -> int:
        """Asks the router now; keeps the last known version when it cannot be reached."""
        self._asked = time.monotonic()
        try:
            self._heard((await self.router.info()).policy_version)
        except Unavailable as exc:
            log.error("cannot reach the rollout-router", extra={"error": exc.message})
        return self.version

    async def wait_newer(self) -> None:
        """Waits up to ``VERSION_POLL_S`` for a newer version: told by the broadcaster's stream when it
        is up (the router is then asked at most once a second, as a safety net), else asking the router."""
        if self.streaming:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._newer.wait(), VERSION_POLL_S)
                return
            if time.monotonic() - self._asked < 1.0:
                return
        else:
            await asyncio.sleep(VERSION_POLL_S)
        await self.refresh()

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(1.0)

    async def follow(self, address: str) -> None:
        """Listens to the broadcaster's WatchPolicyVersion; reconnects every second while it is away."""
        while True:
            try:
                async with self.access.aio_channel(address, KEEPALIVE) as channel:
                    stub = weights_pb2_grpc.WeightServiceStub(channel)
                    async for message in stub.WatchPolicyVersion(weights_pb2.WatchPolicyVersionRequest()):
                        if not self.streaming:
                            log.info("following the weight-broadcaster's policy versions", extra={"address": address})
                        self.streaming = True
                        self._heard(message.policy_version.version)
            except grpc.aio.AioRpcError as exc:
                if self.streaming:
                    log.warning(
                        "lost the weight-broadcaster's version stream; asking the router meanwhile",
                        extra={"address": address, "code": exc.code().name},
                    )
            except Exception:
                log.exception("the weight-broadcaster's version stream failed; asking the router meanwhile")
            finally:
                self.streaming = False
            await asyncio.sleep(1.0)

    def start(self, broadcaster_address: str = "") -> None:
        self.tasks.append(asyncio.create_task(self.run()))
        if broadcaster_address:
            self.tasks.append(asyncio.create_task(self.follow(broadcaster_address)))

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()

    def __call__(self) -> int:
        return self.version
