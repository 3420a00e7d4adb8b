"""Wires the agent-pool together: tokenizer, router client, queue, episode runner, pool, gRPC + HTTP.

Only wiring: what runs lives in the modules it builds (``front``, ``episodes``, ``pool``,
``evaluation``, ``version_watch``, ``server``).
"""

from __future__ import annotations

from transformers import AutoTokenizer

from molt.agent_pool.agents import Env, load_agent
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.dataset import load_prompts
from molt.agent_pool.episodes import TurnLimits, chat_runner, env_runner
from molt.agent_pool.evaluation import Evaluator
from molt.agent_pool.front import ChatFront, start_front
from molt.agent_pool.pool import RolloutPool
from molt.agent_pool.prompts import PositionStore, PromptSource
from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.server import AgentPoolServicer
from molt.agent_pool.version_watch import VersionWatch
from molt.core import rollout
from molt.core.auth import Access
from molt.core.queue import TrajectoryQueue
from molt.core.serve import Registration, ServiceHost
from molt.v1 import agent_pool_pb2, agent_pool_pb2_grpc


async def serve(settings: AgentPoolSettings) -> None:
    access = Access.of(settings.run)
    router = RouterClient(settings.router_address, access=access)
    info = await router.info()  # fails fast, with the address, when the router is not there
    client = access.redis(settings.run.redis_url)
    if info.rollout is not None:  # the router has no Redis: its clients record what it reports
        rollout.register(client, settings.run.run_id, "rollout-router", info.rollout)
    rollout.register(client, settings.run.run_id, "agent-pool", settings.rollout)
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
    agent_cls = load_agent(settings.agent)
    limits = TurnLimits(settings.max_tokens, info.max_model_len, info.max_tokens_cap)
    front = ChatFront(tokenizer, router, limits, max_body_bytes=settings.http_max_body_bytes)
    server, front_task, base_url = await start_front(front, settings.http_listen)
    if issubclass(agent_cls, Env):
        runner = env_runner(agent_cls, tokenizer, router, limits)
    else:
        runner = chat_runner(agent_cls, front, base_url)
    queue = TrajectoryQueue(client, settings.run.run_id, max_length=settings.rollout.queue_max_length)
    watch = VersionWatch(router, access)
    watch.version = info.policy_version
    watch.start(settings.broadcaster_address)
    data = settings.data
    rows = load_prompts(data.path, data.split, data.prompt_key, data.answer_key)
    position = PositionStore(client, settings.run.run_id, data.path, data.split, len(rows), data.shuffle, data.seed)
    prompts = PromptSource(rows, data.shuffle, data.seed, position)
    pool = RolloutPool(settings, runner, prompts, queue, watch, watch.wait_newer)
    evaluator = None
    if settings.eval.enabled and settings.eval.path is not None:
        held_out = load_prompts(settings.eval.path, settings.eval.split, data.prompt_key, data.answer_key)
        evaluator = Evaluator(
            settings.eval,
            held_out.all(),
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
        access=access,
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
