"""A learner killed mid-run resumes from its last checkpoint and trains every trajectory exactly once.

Real Redis, the real ``python -m molt.learner`` process on the tiny model. The run:
six groups (three steps, checkpoint every two) -> SIGKILL once step 3 is trained
but not committed -> restart: it resumes at step 2, re-reads step 3's pending
entries and trains them again, then two more groups give step 4 -> SaveCheckpoint
(deduplicated by request id) -> StopLearner. Checked: the final checkpoint holds
every produced id once, the last record of each step sums to the produced count,
and nothing is left pending in the queue.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from molt.core.queue import TrajectoryQueue
from molt.core.testing import RedisServer, ServiceProcess, free_port
from molt.learner.metrics import read_history
from molt.learner.synthetic import named_group
from molt.v1 import learner_pb2, learner_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RUN_ID = "kill-test"
REWARDS = [1.0, 0.0, 0.5, 0.25]


def recipe(tmp_path: Path, model: Path, redis_url: str, port: int) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(f"""
[run]
run_id = "{RUN_ID}"
redis_url = "{redis_url}"
run_dir = "{tmp_path / "run"}"

[rollout]
group_size = 4
groups_per_step = 2
max_staleness = 100

[learner]
model_path = "{model}"
listen = "127.0.0.1:{port}"
metrics_port = 0
checkpoint_every = 2
micro_batch_tokens = 64
poll_s = 0.1
status_every_s = 1.0

[learner.optimizer]
lr = 1e-3
""")
    return path


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def status(address: str) -> learner_pb2.GetLearnerStatusResponse:
    with grpc.insecure_channel(address) as channel:
        return learner_pb2_grpc.LearnerServiceStub(channel).GetLearnerStatus(
            learner_pb2.GetLearnerStatusRequest(), timeout=10
        )


def test_killed_learner_resumes_without_training_anything_twice(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = recipe(tmp_path, tiny_model, redis_server.url, port)
    args = [sys.executable, "-m", "molt.learner", "--config", str(config)]
    producer = TrajectoryQueue(redis_client, RUN_ID)
    groups = [named_group(f"g{i}", REWARDS, run_id=RUN_ID) for i in range(8)]
    produced = {t.trajectory_id for g in groups for t in g.trajectories}
    producer.put_many(groups[:6])

    first = ServiceProcess(args, address, tmp_path / "learner-1.log")
    first.start(timeout_s=180)
    try:
        wait_for(lambda: status(address).step == 3, "step 3")
        assert status(address).last_checkpoint_step == 2
        assert producer.stats().pending == 2  # step 3's groups: trained, not committed
    finally:
        assert first.process is not None
        first.process.kill()  # SIGKILL: no shutdown path runs
        first.process.wait()

    second = ServiceProcess(args, address, tmp_path / "learner-2.log")
    second.start(timeout_s=180)
    try:
        resumed = status(address)
        assert resumed.last_checkpoint_step == 2 and resumed.step >= 2
        wait_for(lambda: status(address).step == 3, "step 3 again")
        producer.put_many(groups[6:])
        wait_for(lambda: status(address).last_checkpoint_step == 4, "the checkpoint of step 4")
        with grpc.insecure_channel(address) as channel:
            stub = learner_pb2_grpc.LearnerServiceStub(channel)
            saved = stub.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(request_id="r1"), timeout=60)
            again = stub.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(request_id="r1"), timeout=60)
            assert (saved.step, saved.path) == (again.step, again.path) == (4, saved.path)
            final = status(address)
            assert final.consumed_trajectory_count == 32 and dict(final.dropped_trajectory_counts) == {}
            assert final.last_step_metrics["samples"] == 8
            stopped = stub.StopLearner(learner_pb2.StopLearnerRequest(save_checkpoint=True), timeout=60)
            assert stopped.step == 4
        assert second.process is not None
        assert second.process.wait(timeout=60) == 0
    finally:
        second.stop()

    state = json.loads((Path(saved.path) / "state.json").read_text())
    assert set(state["consumed"]) == produced
    assert sorted(set(state["consumed"].values())) == [1, 2, 3, 4]
    history = read_history(tmp_path / "run" / "metrics.jsonl")  # last line per step: the committed lineage
    assert sorted(history) == [1, 2, 3, 4]
    assert sum(record["samples"] for record in history.values()) == len(produced)
    lines = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 3, 4]  # step 3 was lost with the kill and trained again
    stats = producer.stats()
    assert (stats.depth, stats.pending) == (0, 0)
