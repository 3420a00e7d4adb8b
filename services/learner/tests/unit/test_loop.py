"""The learner loop against a real Redis queue: steps, acknowledgement only after a checkpoint,
re-delivery after a restart, control requests, idle warning, metrics sinks."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch
from prometheus_client import REGISTRY
from torch import nn

from molt.core.errors import ConsumerNameTaken, WrongState
from molt.core.queue import TrajectoryQueue
from molt.learner.checkpoint import Checkpoints
from molt.learner.config import LearnerSettings
from molt.learner.loop import LearnerLoop
from molt.learner.metrics import MetricsLog, read_history
from molt.learner.progress import StatusClock
from molt.learner.synthetic import named_group
from molt.learner.trainer import Trainer

SettingsFactory = Callable[..., LearnerSettings]
REWARDS = [1.0, 0.0, 0.5, 0.0]
pytestmark = pytest.mark.timeout(60)  # a loop waiting for data it will never get must fail, not hang


def make_loop(settings: LearnerSettings, client: redis.Redis, on_step=None) -> LearnerLoop:
    run_dir = settings.run.run_dir
    trainer = Trainer(settings)
    checkpoints = Checkpoints(run_dir / "checkpoints", settings.keep_checkpoints)
    queue = TrajectoryQueue(client, settings.run.run_id, consumer="learner-0")
    loop = LearnerLoop(settings, trainer, checkpoints, queue=queue, on_step=on_step)
    resumed = loop.resume()
    loop.metrics = MetricsLog(run_dir, plot_every=2, resumed_step=resumed)
    return loop


def test_entries_are_acknowledged_only_once_their_step_is_checkpointed(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """groups_per_step 2, checkpoint_every 2, 3 steps: at the hook of step 1 two entries are pending,
    at step 2 four (its checkpoint comes after the hook), at step 3 two again; the stop checkpoints
    step 3 and the queue ends empty."""
    settings = learner_settings(checkpoint_every=2, max_steps=3, poll_s=0.1, max_staleness=3)
    producer = TrajectoryQueue(redis_client, "molt")
    producer.put_many([named_group(f"g{i}", REWARDS) for i in range(6)])
    seen: list[tuple[int, int]] = []

    def on_step(step: int, model: nn.Module) -> None:
        assert isinstance(model, nn.Module)
        seen.append((step, producer.stats().pending))

    loop = make_loop(settings, redis_client, on_step)
    assert loop.run() == 3
    assert seen == [(1, 2), (2, 4), (3, 2)]
    stats = producer.stats()
    assert (stats.depth, stats.pending) == (0, 0)
    assert len(loop.state.consumed) == 24 and set(loop.state.consumed.values()) == {1, 2, 3}

    run_dir = settings.run.run_dir
    assert [p.name for p in loop.checkpoints.complete()] == ["step-00000002", "step-00000003"]
    history = read_history(run_dir / "metrics.jsonl")
    assert sorted(history) == [1, 2, 3] and all(r["samples"] == 8 for r in history.values())
    assert (run_dir / "reward.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert REGISTRY.get_sample_value("molt_learner_step") == 3
    assert REGISTRY.get_sample_value("molt_learner_reward_mean") == history[3]["reward/mean"]


def test_redelivered_trajectories_are_not_trained_twice(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """A producer that writes around the queue's dedupe re-sends a trained group: the resumed learner
    drops its 4 trajectories as duplicates, trains the two new groups, and acknowledges all three."""
    settings = learner_settings(checkpoint_every=1, max_steps=1, poll_s=0.1)
    producer = TrajectoryQueue(redis_client, "molt")
    first = [named_group("a", REWARDS), named_group("b", REWARDS)]
    producer.put_many(first)
    first_run = make_loop(settings, redis_client)
    assert first_run.run() == 1
    assert first_run.queue is not None
    first_run.queue.close()  # as the process that ran it would on its way out: the next takes the name

    redis_client.xadd(producer.keys.stream, {"group": first[0].SerializeToString()})
    producer.put_many([named_group("c", REWARDS), named_group("d", REWARDS)])
    loop = make_loop(settings.model_copy(update={"max_steps": 2}), redis_client)
    assert loop.state.step == 1
    assert loop.run() == 2
    assert loop.state.dropped == {"duplicate": 4}
    assert sorted({tid.split("-")[0] for tid in loop.state.consumed}) == ["a", "b", "c", "d"]
    assert {step for tid, step in loop.state.consumed.items() if tid.startswith(("c", "d"))} == {2}
    assert producer.stats().depth == 0


def test_control_requests_and_the_idle_warning(
    learner_settings: SettingsFactory, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle learner warns; SaveCheckpoint is deduplicated by request id; StopLearner ends run()."""
    settings = learner_settings(poll_s=0.05, idle_warning_s=0.2)
    loop = make_loop(settings, redis_client)
    caplog.set_level(logging.WARNING, logger="molt.learner.progress")
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        first = loop.request_checkpoint("req-1")
        assert loop.request_checkpoint("req-1") is first
        info = first.result(timeout=30)
        assert info.step == 0 and info.path.name == "step-00000000"
        assert loop.request_checkpoint("req-2").result(timeout=30) == info  # no step since: the same one
        threading.Event().wait(0.5)
    finally:
        stopped = loop.request_stop(save_checkpoint=True)
        thread.join(timeout=30)
    assert stopped.result(timeout=1) == 0
    assert any("no trajectories for" in r.getMessage() for r in caplog.records)
    status = loop.status()
    assert (status.step, status.last_checkpoint_step, status.consumed_count) == (0, 0, 0)
    assert json.loads((settings.run.run_dir / "checkpoints" / "step-00000000" / "state.json").read_text())["step"] == 0


def test_resume_without_checkpoints_starts_at_zero(learner_settings: SettingsFactory, tmp_path: Path) -> None:
    settings = learner_settings()
    loop = LearnerLoop(settings, Trainer(settings), Checkpoints(tmp_path / "empty", 1))
    assert loop.resume() == 0 and loop.last_checkpoint_step == -1


def test_drop_after_versions_keeps_groups_the_pacing_bound_would_drop(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """The six groups of the test below, with ``drop_after_versions = 2`` beside ``max_staleness = 1``: all
    of them are trained, in three steps, the last on samples two versions behind (the staleness metric
    says so); none is dropped."""
    settings = learner_settings(checkpoint_every=5, poll_s=0.05, max_staleness=1, drop_after_versions=2, max_steps=3)
    TrajectoryQueue(redis_client, "molt").put_many([named_group(f"g{i}", REWARDS) for i in range(6)])
    loop = make_loop(settings, redis_client)
    thread = threading.Thread(target=loop.run)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():  # a third step never came: its groups were dropped
        loop.request_stop(save_checkpoint=False).result(timeout=30)
        thread.join(timeout=30)
    assert loop.state.step == 3 and not loop.status().dropped
    assert loop.last_metrics["staleness/max"] == 2.0


def test_groups_that_went_stale_are_dropped_and_acknowledged(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """Six groups sampled at version 0, max_staleness 1: steps 1 and 2 train four of them; at version 2
    the last two are 2 versions behind, so their 8 trajectories are dropped as stale, and the stop's
    checkpoint acknowledges them with the rest."""
    settings = learner_settings(checkpoint_every=5, poll_s=0.05, max_staleness=1)
    producer = TrajectoryQueue(redis_client, "molt")
    producer.put_many([named_group(f"g{i}", REWARDS) for i in range(6)])
    loop = make_loop(settings, redis_client)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        for _ in range(600):
            if loop.status().dropped.get("stale") == 8:
                break
            threading.Event().wait(0.05)
    finally:
        loop.request_stop(save_checkpoint=True).result(timeout=30)
        thread.join(timeout=30)
    assert loop.status().dropped == {"stale": 8}
    assert loop.state.step == 2 and loop.last_checkpoint_step == 2
    assert producer.stats().depth == 0
    assert producer.skipped() == 2  # two whole groups settled untrained: the agent-pool starts two more
    # Counted where they were settled too, for an account of the run that outlives this learner's memory.
    assert producer.skipped_trajectories() == loop.state.skipped == {"stale": 8}


def test_a_refused_step_dead_letters_its_groups_and_leaves_no_gradient_behind(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """Fault injected (the queue refuses a NaN logprob, so it is written into a sample already read): the
    step is refused, its two groups go to the dead letters with the reason, no gradient is left, and the
    next step, on good groups, trains to finite weights. Three refusals in a row stop the learner."""
    settings = learner_settings(checkpoint_every=1, poll_s=0.05)
    producer = TrajectoryQueue(redis_client, "molt")
    producer.put_many([named_group(f"g{i}", REWARDS) for i in range(4)])
    loop = make_loop(settings, redis_client)
    clock = StatusClock(0.0)
    loop._read(clock)
    assert len(loop.ready) >= 2
    loop.ready[0].samples[1].rollout_logprobs[-1] = float("nan")
    loop._train_one_step()
    assert loop.state.step == 0 and loop.state.dropped == {"refused_step": 8}
    assert all(p.grad is None for p in loop.trainer.model.parameters())
    letters = redis_client.xrange(producer.keys.dead_letters)
    assert len(letters) == 2 and all(
        b"refused the step: rollout_logprobs contains NaN" in f[b"reason"] for _, f in letters
    )
    while len(loop.ready) < 2:
        loop._read(clock)
    loop._train_one_step()
    assert loop.state.step == 1 and loop.refused_in_a_row == 0
    assert all(torch.isfinite(p).all() for p in loop.trainer.model.parameters())
    producer.put_many([named_group(f"h{i}", REWARDS) for i in range(6)])
    with pytest.raises(WrongState, match="3 steps in a row were refused"):
        for _ in range(3):
            while len(loop.ready) < 2:
                loop._read(clock)
            loop.ready[0].samples[0].rollout_logprobs[-1] = float("inf")
            loop._train_one_step()
    assert producer.stats().dead_letters == 8


def test_groups_skipped_whole_are_counted_by_their_first_reason(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """Two good groups train step 1; a third with a token id outside the vocabulary (and of a future
    version too) is skipped whole as invalid_token, the reason checked first, not future_version."""
    settings = learner_settings(checkpoint_every=5, poll_s=0.05, max_steps=1)
    bad = named_group("bad", REWARDS, version=7)
    bad.trajectories[0].response_token_ids[0] = 10**6
    producer = TrajectoryQueue(redis_client, "molt")
    producer.put_many([named_group("g0", REWARDS), bad, named_group("g1", REWARDS)])
    loop = make_loop(settings, redis_client)
    loop.run()
    assert loop.state.step == 1
    assert loop.status().skipped == {"invalid_token": 1}
    assert loop.status().dropped == {"invalid_token": len(REWARDS)}


def run_in_thread(loop: LearnerLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.run, daemon=True)  # daemon: a loop that hangs must not hang the test
    thread.start()
    return thread


def test_a_learner_that_skips_every_group_keeps_the_queue_moving(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """The queue's bound (4) filled with groups of a future version, all skipped whole: held until a
    checkpoint that no step ever brings, they would keep the producer's next put out for good. Skipped
    entries are acknowledged as they are skipped, so the two good groups put behind them make step 1."""
    settings = learner_settings(poll_s=0.05, queue_max_length=4, max_steps=1)
    producer = TrajectoryQueue(redis_client, "molt", max_length=4)
    producer.put_many([named_group(f"f{i}", REWARDS, version=50) for i in range(4)])
    loop = make_loop(settings, redis_client)
    thread = run_in_thread(loop)
    try:
        for name in ("g0", "g1"):
            producer.put(named_group(name, REWARDS), timeout=20)  # Backpressure: the learner holds the bound
        thread.join(timeout=30)
    finally:
        if thread.is_alive():
            loop.request_stop(save_checkpoint=False)
    assert loop.state.step == 1 and loop.status().skipped == {"future_version": 4}
    assert producer.skipped() == 4 and producer.stats().depth == 0
    assert producer.skipped_trajectories() == loop.state.skipped == {"future_version": 4 * len(REWARDS)}


def test_a_checkpoint_comes_early_when_trained_entries_would_fill_the_queue(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """Bound 4, two groups a step, checkpoint_every 100: after step 2 its four trained entries fill the
    bound until their checkpoint, and the producer's fifth group could never be put. The loop commits
    them early instead, at steps 2 and 4 (then 5, the stop's), and trains all ten groups."""
    settings = learner_settings(poll_s=0.05, queue_max_length=4, checkpoint_every=100, max_steps=5, max_staleness=5)
    producer = TrajectoryQueue(redis_client, "molt", max_length=4)
    loop = make_loop(settings, redis_client)
    thread = run_in_thread(loop)
    try:
        for i in range(10):
            producer.put(named_group(f"g{i}", REWARDS), timeout=20)
        thread.join(timeout=30)
    finally:
        if thread.is_alive():
            loop.request_stop(save_checkpoint=False)
    assert loop.state.step == 5 and len(loop.state.consumed) == 40
    assert [p.name for p in loop.checkpoints.complete()] == ["step-00000002", "step-00000004", "step-00000005"]
    assert producer.stats().depth == 0


def test_a_learner_that_lost_its_consumer_name_stops_before_its_checkpoint(
    learner_settings: SettingsFactory, redis_client: redis.Redis
) -> None:
    """Another reader takes learner-0 during step 1 (as after this learner stalled past its claim's TTL):
    the loop stops with ConsumerNameTaken at the checkpoint that follows, writing none and acknowledging
    nothing, so the step's two entries stay pending for the new holder."""
    settings = learner_settings(checkpoint_every=1, max_steps=1, poll_s=0.1)
    producer = TrajectoryQueue(redis_client, "molt")
    producer.put_many([named_group(f"g{i}", REWARDS) for i in range(2)])
    claim = "molt:molt:consumer:learner-0"

    def on_step(step: int, model: nn.Module) -> None:
        redis_client.set(claim, "successor", px=30_000)  # what the successor's take writes
        redis_client.set(f"{claim}:taker", "successor")

    loop = make_loop(settings, redis_client, on_step)
    with pytest.raises(ConsumerNameTaken):
        loop.run()
    assert loop.checkpoints.complete() == []
    stats = producer.stats()
    assert (stats.depth, stats.pending) == (2, 2)
