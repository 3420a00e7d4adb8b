"""Wires the agent-pool together: tokenizer, router client, queue, episode runner, pool, gRPC + HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import redis
import uvicorn
from transformers import AutoTokenizer

from molt.agent_pool import metrics
from molt.agent_pool.agents import ChatAgent, Env, Prompt, load_agent
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.episodes import Episode, TurnLimits, run_chat_episode, run_env_episode
from molt.agent_pool.evaluation import Evaluator
from molt.agent_pool.front import ChatFront
from molt.agent_pool.pool import VERSION_POLL_S, EpisodeRunner, PromptSource, RolloutPool
from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.server import AgentPoolServicer
from molt.agent_pool.transcript import Transcript
from molt.core import rollout
from molt.core.errors import Unavailable
from molt.core.queue import TrajectoryQueue
from molt.core.serve import KEEPALIVE, Registration, ServiceHost
from molt.v1 import agent_pool_pb2, agent_pool_pb2_grpc, weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)


class VersionWatch:
    """The policy version the engines sample with, as the pool paces on it.

    The router is asked once a second (``run``). With the weight-broadcaster's address, ``follow``
    also listens to its WatchPolicyVersion stream, which announces each validated version just
    before the router resumes generation: a pool held back by staleness then starts its next groups
    at once (their requests wait at the router until the resume releases them together) instead of
    on its next question to the router. Versions only go up within a run (the broadcaster refuses
    an older version), so the watch keeps the highest it has heard of.
    """

    def __init__(self, router: RouterClient) -> None:
        self.router = router
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
                async with grpc.aio.insecure_channel(address, options=KEEPALIVE) as channel:
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


def env_runner(env_cls: type[Env], tokenizer: object, router: RouterClient, limits: TurnLimits) -> EpisodeRunner:
    async def run(prompt: Prompt) -> Episode:
        return await run_env_episode(env_cls, prompt, Transcript(tokenizer), router, limits)

    return run


def chat_runner(agent_cls: type[ChatAgent], front: ChatFront, base_url: str) -> EpisodeRunner:
    async def run(prompt: Prompt) -> Episode:
        return await run_chat_episode(agent_cls, prompt, front, base_url)

    return run


class FrontServer(uvicorn.Server):
    """uvicorn inside the service's event loop; signals stay with the gRPC host's graceful shutdown."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


async def start_front(front: ChatFront, listen: str) -> tuple[FrontServer, asyncio.Task[None], str]:
    host, port = listen.rsplit(":", 1)
    server = FrontServer(uvicorn.Config(front.app, host=host, port=int(port), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # raises the bind error
            raise OSError(f"the HTTP front could not start on {listen}")
        await asyncio.sleep(0.05)
    return server, task, f"http://{listen}"


async def serve(settings: AgentPoolSettings) -> None:
    router = RouterClient(settings.router_address)
    info = await router.info()  # fails fast, with the address, when the router is not there
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
    agent_cls = load_agent(settings.agent)
    limits = TurnLimits(settings.max_tokens, info.max_model_len, info.max_tokens_cap)
    front = ChatFront(tokenizer, router, limits, max_body_bytes=settings.http_max_body_bytes)
    server, front_task, base_url = await start_front(front, settings.http_listen)
    if issubclass(agent_cls, Env):
        runner = env_runner(agent_cls, tokenizer, router, limits)
    else:
        runner = chat_runner(agent_cls, front, base_url)
    client = redis.Redis.from_url(settings.run.redis_url)
    if info.rollout is not None:  # the router has no Redis: its clients record what it reports
        rollout.register(client, settings.run.run_id, "rollout-router", info.rollout)
    rollout.register(client, settings.run.run_id, "agent-pool", settings.rollout)
    queue = TrajectoryQueue(client, settings.run.run_id, max_length=settings.rollout.queue_max_length)
    watch = VersionWatch(router)
    watch.version = info.policy_version
    watch.start(settings.broadcaster_address)
    pool = RolloutPool(
        settings, runner, PromptSource(settings.prompts_path, settings.seed), queue, watch, watch.wait_newer
    )
    evaluator = None
    if settings.eval.enabled:
        evaluator = Evaluator(
            settings.eval,
            runner,
            watch,
            settings.run.run_dir / "eval.jsonl",
            settings.episode_timeout_s,
            settings.max_concurrent_episodes,
        )
    host = ServiceHost(
        name="agent-pool",
        listen=settings.listen,
        registrations=[
            Registration(
                agent_pool_pb2_grpc.add_AgentPoolServiceServicer_to_server,
                AgentPoolServicer(pool, watch),
                agent_pool_pb2.DESCRIPTOR.services_by_name["AgentPoolService"].full_name,
            )
        ],
        metrics_port=settings.metrics_port,
    )
    await host.start()
    if evaluator is not None:
        evaluator.start()
    if settings.autostart:
        pool.start()

    async def stop() -> None:
        await pool.stop(drain=False)
        if evaluator is not None:
            await watch.refresh()
            await evaluator.close(final=True)  # the latest policy version gets its evaluation
        watch.stop()
        server.should_exit = True
        await front_task
        await front.aclose()
        await router.close()

    await host.serve_until_signal(on_stop=stop)
