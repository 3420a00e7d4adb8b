"""A learner killed mid-run resumes from its last checkpoint and trains every trajectory exactly once.

Real Redis, the real ``python -m molt.learner`` process on the tiny model. The first run:
six groups (three steps, checkpoint every two) -> SIGKILL once step 3 is trained
but not committed -> restart: it resumes at step 2, re-reads step 3's pending
entries and trains them again, then two more groups give step 4 -> SaveCheckpoint
(deduplicated by request id) -> StopLearner. Checked: the final checkpoint holds
every produced id once, the last record of each step sums to the produced count,
and nothing is left pending in the queue. The second: a learner killed while the
queue is at its bound and it holds entries, behind which wait more groups than the
bound that it skips whole (``test_a_learner_killed_at_the_queue_bound``). The third: a learner
frozen while a second one starts and takes its consumer name over; thawed, the first exits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from molt.core.queue import QueueStats, TrajectoryQueue
from molt.core.testing import RedisServer, ServiceProcess, free_port
from molt.learner.metrics import read_history
from molt.learner.synthetic import named_group
from molt.v1 import common_pb2, learner_pb2, learner_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RUN_ID = "kill-test"
REWARDS = [1.0, 0.0, 0.5, 0.25]


def recipe(
    tmp_path: Path,
    model: Path,
    redis_url: str,
    port: int,
    checkpoint_every: int = 2,
    queue_max_length: int = 1024,
    mini_batches: int = 1,
) -> Path:
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
queue_max_length = {queue_max_length}

[learner]
model_path = "{model}"
listen = "127.0.0.1:{port}"
metrics_port = 0
checkpoint_every = {checkpoint_every}
mini_batches = {mini_batches}
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


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_killed_learner_resumes_without_training_anything_twice(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, mini_batches: int
) -> None:
    """SIGKILL after step 3, whose checkpoint never came; with two PPO mini-batches a step too (two
    AdamW updates per consumed batch, none of which may count a sample twice)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = recipe(tmp_path, tiny_model, redis_server.url, port, mini_batches=mini_batches)
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


def run_until_it_holds(pid: int, producer: TrajectoryQueue, more_than: int) -> QueueStats:
    """Lets the stopped learner run in slices of 10 ms (SIGCONT, SIGSTOP: it trains faster than it could
    be watched) until, stopped, it holds more than ``more_than`` entries with the queue at its bound."""
    for _ in range(500):
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.1)  # the producer fills whatever room the slice made
        stats = producer.stats()
        if stats.depth == producer.max_length and stats.pending > more_than:
            return stats
    raise AssertionError("the learner never held enough entries at the queue's bound")


def put_all(producer: TrajectoryQueue, groups: list[common_pb2.TrajectoryGroup], entry_ids: list[str]) -> None:
    for group in groups:  # each put blocks while the queue is full; Backpressure after 240 s ends the thread
        entry_id = producer.put(group, timeout=240).entry_id
        assert entry_id is not None
        entry_ids.append(entry_id)


def test_a_learner_killed_at_the_queue_bound_loses_nothing_and_frees_the_producer(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Bound 8, two groups a step, checkpoint every 3. The producer puts 6 good groups, 8 of a future
    version (skipped whole, like groups gone stale) and 8 more good ones, blocked at the bound all along.
    The learner, let run in slices, is SIGKILLed while it holds more entries than one read asks for (2),
    the queue at its bound; the next one re-reads every held entry, trains them first, skips and
    acknowledges the 8 (before: held until a checkpoint that their 8 places in the queue kept from ever
    coming) and trains the rest. Checked: the producer's puts all complete; every good group is trained once in the
    committed lineage, in put order; every skipped one is counted; the queue ends empty."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = recipe(tmp_path, tiny_model, redis_server.url, port, checkpoint_every=3, queue_max_length=8)
    args = [sys.executable, "-m", "molt.learner", "--config", str(config)]
    producer = TrajectoryQueue(redis_client, RUN_ID, max_length=8)
    good = [named_group(f"g{i}", REWARDS, run_id=RUN_ID) for i in range(14)]
    future = [named_group(f"f{i}", REWARDS, run_id=RUN_ID, version=1000) for i in range(8)]
    entry_ids: list[str] = []
    putting = threading.Thread(target=put_all, args=(producer, good[:6] + future + good[6:], entry_ids), daemon=True)

    first = ServiceProcess(args, address, tmp_path / "learner-1.log")
    first.start(timeout_s=180)
    try:
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGSTOP)
        putting.start()
        wait_for(lambda: len(entry_ids) == 8, "the queue at its bound")
        held = run_until_it_holds(first.process.pid, producer, more_than=2)
    finally:
        assert first.process is not None
        first.process.kill()  # SIGKILL: no shutdown path runs
        first.process.wait()
    assert held.depth == 8 and putting.is_alive()  # at the bound, the producer waiting
    assert producer.stats().pending == held.pending  # the dead learner's entries: delivered, unacknowledged

    second = ServiceProcess(args, address, tmp_path / "learner-2.log")
    second.start(timeout_s=180)
    try:
        putting.join(timeout=120)
        assert not putting.is_alive() and len(entry_ids) == 22
        wait_for(lambda: status(address).step == 7, "step 7")
        with grpc.insecure_channel(address) as channel:
            stub = learner_pb2_grpc.LearnerServiceStub(channel)
            final = status(address)
            assert final.consumed_trajectory_count == 56 and dict(final.skipped_group_counts) == {"future_version": 8}
            stopped = stub.StopLearner(learner_pb2.StopLearnerRequest(save_checkpoint=True), timeout=60)
            assert stopped.step == 7
        assert second.process is not None
        assert second.process.wait(timeout=60) == 0
    finally:
        second.stop()

    state = json.loads((tmp_path / "run" / "checkpoints" / "step-00000007" / "state.json").read_text())
    assert state["consumed"] == {f"g{i}-{k}": i // 2 + 1 for i in range(14) for k in range(len(REWARDS))}
    history = read_history(tmp_path / "run" / "metrics.jsonl")  # last line per step: the committed lineage
    assert sorted(history) == list(range(1, 8)) and all(record["samples"] == 8 for record in history.values())
    skipped = {raw.decode() for raw in redis_client.smembers(producer.keys.skipped_groups)}
    assert skipped == set(entry_ids[6:14])  # the future groups' entries, each counted once
    assert producer.stats() == QueueStats(depth=0, pending=0, lag=0, dead_letters=0)


def test_a_frozen_learner_loses_its_name_to_the_next_and_exits(
    tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The first learner trains step 1 (not yet checkpointed) and is frozen (SIGSTOP), as a supervisor may
    leave one it took for dead. A second on another port waits for the first's claim on learner-0 to
    lapse, takes the name and trains step 1 again from the pending entries. Thawed, the first exits 1,
    its log naming the cause, having acknowledged nothing; the second trains on and ends the queue empty."""
    addresses = [f"127.0.0.1:{port}" for port in (free_port(), free_port())]
    learners = []
    for i, address in enumerate(addresses):
        config = recipe(tmp_path, tiny_model, redis_server.url, int(address.split(":")[1]))
        args = [sys.executable, "-m", "molt.learner", "--config", str(config.rename(tmp_path / f"learner-{i}.toml"))]
        learners.append(ServiceProcess(args, address, tmp_path / f"learner-{i}.log"))
    first, second = learners
    producer = TrajectoryQueue(redis_client, RUN_ID)
    groups = [named_group(f"g{i}", REWARDS, run_id=RUN_ID) for i in range(4)]
    producer.put_many(groups[:2])

    first.start(timeout_s=180)
    try:
        assert first.process is not None
        wait_for(lambda: status(addresses[0]).step == 1, "step 1")
        os.kill(first.process.pid, signal.SIGSTOP)
        second.start(timeout_s=180)  # serves once it holds the name
        wait_for(lambda: status(addresses[1]).step == 1, "step 1 in the second learner")
        os.kill(first.process.pid, signal.SIGCONT)
        assert first.process.wait(timeout=60) == 1
        assert "stops: this reader no longer holds consumer name 'learner-0'" in first.log_path.read_text()
        assert producer.stats().pending == 2  # step 1's entries: the first acknowledged nothing

        producer.put_many(groups[2:])
        wait_for(lambda: status(addresses[1]).last_checkpoint_step == 2, "the checkpoint of step 2")
        with grpc.insecure_channel(addresses[1]) as channel:
            stub = learner_pb2_grpc.LearnerServiceStub(channel)
            assert stub.StopLearner(learner_pb2.StopLearnerRequest(save_checkpoint=True), timeout=60).step == 2
        assert second.process is not None
        assert second.process.wait(timeout=60) == 0
    finally:
        if first.process is not None and first.process.poll() is None:
            os.kill(first.process.pid, signal.SIGCONT)
        first.stop()
        second.stop()
    assert producer.stats() == QueueStats(depth=0, pending=0, lag=0, dead_letters=0)
