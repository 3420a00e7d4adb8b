"""Data parallelism: the learner with two FSDP2 ranks (gloo, CPU) takes the same step as one rank,
whether the ranks are local processes or Ray actors placed by a real Ray cluster.

Every run goes through ``launch`` (the ``molt-learner`` path): rank 0 reads the same
group from a real Redis queue, broadcasts the global batch, each rank trains its
length-balanced share, gradients are reduce-scattered, and the checkpoint
gathers the full weights. The checkpoints of step 1 must agree within float
tolerance, and so must the logged gradient norm and loss.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from molt.core.queue import TrajectoryQueue
from molt.core.testing import RAY_ENV, RedisServer, ServiceProcess, free_port
from molt.core.tiny_model import build
from molt.learner.config import LearnerSettings
from molt.learner.metrics import read_history
from molt.learner.service import launch
from molt.learner.synthetic import named_group
from molt.v1 import learner_pb2, learner_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def run_one_step(
    world: int,
    model: Path,
    redis_url: str,
    run_dir: Path,
    estimator: str,
    ray_address: str | None = None,
    mini_batches: int = 1,
    lora: int = 0,
) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor] | None]:
    run_id = f"fsdp-{world}-{estimator}-{'ray' if ray_address else 'local'}-{mini_batches}-{lora}"
    producer = TrajectoryQueue(redis.Redis.from_url(redis_url), run_id)
    for index in range(mini_batches):  # one group per mini-batch
        producer.put(named_group(f"group-{index}", [1.0, 0.0, 0.5][index:] + [1.0, 0.0, 0.5][:index], run_id=run_id))
    settings = LearnerSettings(
        model_path=model,
        run={"run_id": run_id, "redis_url": redis_url, "run_dir": run_dir},
        listen="127.0.0.1:0",
        metrics_port=0,
        data_parallel_size=world,
        placement="ray" if ray_address else "local",
        ray_address=ray_address,
        cpu_threads=1,
        rollout={"group_size": 3, "groups_per_step": mini_batches},
        mini_batches=mini_batches,
        lora={"rank": lora},
        # One sample per micro-batch: rank 0 trains two, rank 1 one plus an empty micro-batch, in which
        # it must still join FSDP's collectives (Trainer._idle_backward).
        micro_batch_tokens=16,
        max_steps=1,
        # eps = 1 makes Adam's first update ~lr * g instead of ~lr * sign(g), so float noise in g ~ 0
        # cannot flip an update and a wrongly scaled gradient shows in the weights
        # (and no clipping, which would hide a wrong gradient scale: both norms clip to the same 1.0).
        optimizer={"lr": 1e-3, "eps": 1.0, "max_grad_norm": 1e6},
        algorithm={"estimator": estimator},
        critic={"lr": 1e-3, "max_grad_norm": 1e6},  # gae: the critic's replicas sum their gradients by hand
    )
    launch(settings)
    checkpoint = run_dir / "checkpoints" / "step-00000001"
    state = torch.load(checkpoint / "model.pt", weights_only=True)
    critic = torch.load(checkpoint / "extra_state.pt", weights_only=True).get("critic")
    return state, read_history(run_dir / "metrics.jsonl")[1], critic["model"] if critic else None


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_two_ranks_take_the_same_step_as_one(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, estimator: str
) -> None:
    single = run_one_step(1, tiny_model, redis_server.url, tmp_path / "one", estimator)
    sharded = run_one_step(2, tiny_model, redis_server.url, tmp_path / "two", estimator)
    assert_same_step(tiny_model, single, sharded, estimator)


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen3", False)])
def test_two_ranks_shard_other_architectures_as_one(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, arch: str, tied: bool
) -> None:
    """A tied Llama and an untied Qwen3 model, sharded over two ranks, take the same step as on one."""
    model = build(tmp_path / arch, arch=arch, tied=tied)
    single = run_one_step(1, model, redis_server.url, tmp_path / "one", "grpo")
    sharded = run_one_step(2, model, redis_server.url, tmp_path / "two", "grpo")
    assert_same_step(model, single, sharded, "grpo")


def test_two_ranks_take_the_same_mini_batch_steps_as_one(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two PPO mini-batches (two AdamW steps on one batch, the second one's ratio against the proximal
    policy): each mini-batch spread over the ranks, the proximal logprobs gathered from both."""
    single = run_one_step(1, tiny_model, redis_server.url, tmp_path / "one", "grpo", mini_batches=2)
    sharded = run_one_step(2, tiny_model, redis_server.url, tmp_path / "two", "grpo", mini_batches=2)
    assert single[1]["optimizer_steps"] == sharded[1]["optimizer_steps"] == 2
    assert_same_step(tiny_model, single, sharded, "grpo", samples=6)


def test_two_ranks_train_the_same_lora_adapters_as_one(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """LoRA (rank 4) under FSDP2: the adapters of two ranks after a step equal one rank's; the base
    weights, frozen and sharded beside them, are not in the checkpoint (adapters only)."""
    single = run_one_step(1, tiny_model, redis_server.url, tmp_path / "one", "grpo", lora=4)
    sharded = run_one_step(2, tiny_model, redis_server.url, tmp_path / "two", "grpo", lora=4)
    assert single[0].keys() == sharded[0].keys() and all(".lora_" in name for name in single[0])
    for name, value in single[0].items():
        torch.testing.assert_close(sharded[0][name], value, rtol=1e-3, atol=1e-8, msg=name)
    assert any(value.abs().max() > 0 for name, value in single[0].items() if "lora_B" in name)
    assert sharded[1]["grad_norm"] == pytest.approx(single[1]["grad_norm"], rel=1e-5)


def test_two_ranks_placed_by_ray_take_the_same_step_as_one(
    tiny_model: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    ray_head: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in RAY_ENV.items():
        monkeypatch.setenv(key, value)
    single = run_one_step(1, tiny_model, redis_server.url, tmp_path / "one", "grpo")
    placed = run_one_step(2, tiny_model, redis_server.url, tmp_path / "ray", "grpo", ray_address=ray_head)
    assert_same_step(tiny_model, single, placed, "grpo")
    # The ranks ran in a placement group of that cluster, which the learner removed when it ended.
    import ray

    ray.init(address=ray_head, log_to_driver=False)
    try:
        from ray.util import placement_group_table

        states = {entry["name"]: entry["state"] for entry in placement_group_table().values()}
        assert states.get("molt-fsdp-2-grpo-ray-1-0-learner") == "REMOVED", states
    finally:
        ray.shutdown()


Step = tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor] | None]


def assert_same_step(model: Path, one: Step, two: Step, estimator: str, samples: int = 3) -> None:
    """The two-rank run's update equals the one-rank run's (weights, norm, loss; the critic's for gae)."""
    single, single_metrics, single_critic = one
    sharded, sharded_metrics, sharded_critic = two
    initial = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    assert single.keys() == sharded.keys()
    for name, value in single.items():
        # Compare the updates (~1e-6), not the weights (~1e-2, ulp ~2e-9, hence atol).
        update, sharded_update = value - initial[name], sharded[name] - initial[name]
        assert update.abs().max() > 0, name
        torch.testing.assert_close(sharded_update, update, rtol=1e-3, atol=1e-8, msg=name)
    assert sharded_metrics["grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
    assert sharded_metrics["loss/objective"] == pytest.approx(single_metrics["loss/objective"], abs=1e-6)
    assert sharded_metrics["samples"] == single_metrics["samples"] == samples
    if estimator == "gae":
        assert single_critic is not None and sharded_critic is not None
        assert single_critic["head.weight"].abs().max() > 0  # the zero-initialised head moved
        for name, value in single_critic.items():
            torch.testing.assert_close(sharded_critic[name], value, rtol=1e-3, atol=1e-8, msg=name)
        for key in ("critic/value_error", "critic/grad_norm"):
            assert sharded_metrics[key] == pytest.approx(single_metrics[key], rel=1e-5), key


def start_ray_learner(
    run_id: str, tiny_model: Path, redis_url: str, ray_head: str, tmp_path: Path
) -> tuple[ServiceProcess, str]:
    """``molt-learner`` as its own process, two ranks placed by Ray; returns it (serving) and its address."""
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "recipe.toml"
    config.write_text(f"""
[run]
run_id = "{run_id}"
redis_url = "{redis_url}"
run_dir = "{tmp_path / "run"}"

[rollout]
group_size = 3
groups_per_step = 1

[learner]
model_path = "{tiny_model}"
listen = "{address}"
metrics_port = 0
data_parallel_size = 2
placement = "ray"
ray_address = "{ray_head}"
cpu_threads = 1
micro_batch_tokens = 64
checkpoint_every = 100
poll_s = 0.1
""")
    learner = ServiceProcess(
        [sys.executable, "-m", "molt.learner", "--config", str(config)], address, tmp_path / "learner.log", RAY_ENV
    )
    learner.start(timeout_s=240)
    return learner, address


def test_ray_placed_learner_serves_steps_and_stops_on_sigterm(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, ray_head: str, tmp_path: Path
) -> None:
    """Rank 0 (an actor) serves LearnerService at the configured address and trains; SIGTERM to the
    driver reaches rank 0, which checkpoints its step and ends, and the driver exits 0."""
    run_id = "ray-sigterm"
    TrajectoryQueue(redis_client, run_id).put(named_group("only", [1.0, 0.0, 0.5], run_id=run_id))
    learner, address = start_ray_learner(run_id, tiny_model, redis_server.url, ray_head, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while learner_step(address) < 1:
            assert time.monotonic() < deadline, "no step within 120 s"
            time.sleep(0.2)
        assert learner.process is not None
        learner.process.send_signal(signal.SIGTERM)
        assert learner.process.wait(timeout=120) == 0
    finally:
        learner.stop()
    saved = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert (saved / "model.pt").exists(), "SIGTERM did not checkpoint the step"
    assert "learner ranks placed by Ray" in (tmp_path / "learner.log").read_text()


def test_ray_placed_learner_fails_fast_when_a_rank_dies(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, ray_head: str, tmp_path: Path
) -> None:
    """SIGKILL of rank 1's actor process (a real fault): the driver stops rank 0, which would otherwise
    wait in a collective forever, and exits non-zero naming the dead actor."""
    learner, address = start_ray_learner("ray-rank-dies", tiny_model, redis_server.url, ray_head, tmp_path)
    try:
        log = tmp_path / "learner.log"
        deadline = time.monotonic() + 60
        while not (placed := re.search(r'"ranks": \["[^"]*", "[^:]*:(\d+)"\]', log.read_text())):
            assert time.monotonic() < deadline, "the ranks' placement was never logged"
            time.sleep(0.2)
        os.kill(int(placed.group(1)), signal.SIGKILL)  # rank 1's actor process
        assert learner.process is not None
        assert learner.process.wait(timeout=120) != 0
        with pytest.raises(grpc.RpcError):
            learner_step(address)  # rank 0 is gone with it
    finally:
        learner.stop()
    text = log.read_text()
    assert "learner rank failed; stopping the other ranks" in text and "ActorDiedError" in text


def learner_step(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        return stub.GetLearnerStatus(learner_pb2.GetLearnerStatusRequest(), timeout=10).step


def test_a_step_refused_on_one_rank_is_refused_on_every_rank(tiny_model: Path, tmp_path: Path) -> None:
    """A NaN in rank 1's share only: both ranks refuse the step (rank 0 with rank 1's word for it), clear
    their gradients, and then take the same good step (equal weights on both)."""
    out = tmp_path / "ranks.json"
    script = Path(__file__).with_name("refused_step_ranks.py")
    subprocess.run([sys.executable, str(script), str(tiny_model), str(out)], check=True, timeout=280)
    first, second = json.loads(out.read_text())
    assert "rollout_logprobs contains NaN" in second["refused"], second
    assert first["refused"] == "another rank refused a value of this step", first
    assert first["cleared"] and second["cleared"]
    assert first["step"] == second["step"] == 1
    assert first["weights"] == second["weights"] and math.isfinite(first["weights"])
