"""Data parallelism: the learner with two FSDP2 ranks (gloo, CPU) takes the same step as one rank.

Both runs go through ``launch`` (the ``molt-learner`` path): rank 0 reads the same
group from a real Redis queue, broadcasts the global batch, each rank trains its
length-balanced share, gradients are reduce-scattered, and the checkpoint
gathers the full weights. The checkpoints of step 1 must agree within float
tolerance, and so must the logged gradient norm and loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from molt.core.queue import TrajectoryQueue
from molt.core.testing import RedisServer
from molt.learner.config import LearnerSettings
from molt.learner.metrics import read_history
from molt.learner.service import launch
from molt.learner.synthetic import named_group

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def run_one_step(
    world: int, model: Path, redis_url: str, run_dir: Path, estimator: str
) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor] | None]:
    run_id = f"fsdp-{world}-{estimator}"
    producer = TrajectoryQueue(redis.Redis.from_url(redis_url), run_id)
    producer.put(named_group("only", [1.0, 0.0, 0.5], run_id=run_id))
    settings = LearnerSettings(
        model_path=model,
        run={"run_id": run_id, "redis_url": redis_url, "run_dir": run_dir},
        listen="127.0.0.1:0",
        metrics_port=0,
        data_parallel_size=world,
        group_size=3,
        groups_per_step=1,
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
    single, single_metrics, single_critic = run_one_step(1, tiny_model, redis_server.url, tmp_path / "one", estimator)
    sharded, sharded_metrics, sharded_critic = run_one_step(
        2, tiny_model, redis_server.url, tmp_path / "two", estimator
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    assert single.keys() == sharded.keys()
    for name, value in single.items():
        # Compare the updates (~1e-6), not the weights (~1e-2, ulp ~2e-9, hence atol).
        update, sharded_update = value - initial[name], sharded[name] - initial[name]
        assert update.abs().max() > 0, name
        torch.testing.assert_close(sharded_update, update, rtol=1e-3, atol=1e-8, msg=name)
    assert sharded_metrics["grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
    assert sharded_metrics["loss/objective"] == pytest.approx(single_metrics["loss/objective"], abs=1e-6)
    assert sharded_metrics["samples"] == single_metrics["samples"] == 3
    if estimator == "gae":
        assert single_critic is not None and sharded_critic is not None
        assert single_critic["head.weight"].abs().max() > 0  # the zero-initialised head moved
        for name, value in single_critic.items():
            torch.testing.assert_close(sharded_critic[name], value, rtol=1e-3, atol=1e-8, msg=name)
        for key in ("critic/value_error", "critic/grad_norm"):
            assert sharded_metrics[key] == pytest.approx(single_metrics[key], rel=1e-5), key
