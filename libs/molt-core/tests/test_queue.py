"""The trajectory queue against a real redis-server on loopback."""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
import redis

from molt.core import expert_routing
from molt.core.errors import Backpressure, InvalidInput
from molt.core.queue import DEAD_PAYLOAD_BYTES, PutResult, QueueKeys, QueueStats, TrajectoryQueue
from molt.core.testing import trajectory_group as make_group
from molt.core.trajectory import group_problems
from molt.v1 import common_pb2

pytestmark = pytest.mark.integration
RUN = "test-run"


def test_order_is_kept_and_ack_deletes(redis_client: redis.Redis) -> None:
    producer = TrajectoryQueue(redis_client, RUN)
    consumer = TrajectoryQueue(redis_client, RUN, consumer="c0")
    sent = [make_group(prompt_id=f"p{i}") for i in range(10)]
    for group in sent:
        assert producer.put(group).entry_id is not None
    received = consumer.read(count=4) + consumer.read(count=100)
    assert [e.group.prompt_id for e in received] == [g.prompt_id for g in sent]
    assert [e.group for e in received] == sent
    assert consumer.stats().pending == 10
    assert consumer.ack([e.entry_id for e in received]) == 10
    stats = consumer.stats()
    assert (stats.depth, stats.pending, stats.lag) == (0, 0, 0)
    assert consumer.read(count=10) == []


def test_stats_report_depth_pending_and_lag(redis_client: redis.Redis) -> None:
    queue = TrajectoryQueue(redis_client, RUN, consumer="c0")
    for _ in range(5):
        queue.put(make_group())
    queue.read(count=2)
    stats = queue.stats()
    assert (stats.depth, stats.pending, stats.lag, stats.dead_letters) == (5, 2, 3, 0)


def test_duplicate_trajectory_ids_are_dropped(redis_client: redis.Redis) -> None:
    queue = TrajectoryQueue(redis_client, RUN, consumer="c0")
    group = make_group(samples=3)
    first = queue.put(group)
    again = queue.put(group)
    assert first.entry_id is not None and first.duplicate_ids == ()
    assert again.entry_id is None
    assert set(again.duplicate_ids) == {t.trajectory_id for t in group.trajectories}

    partial = make_group(samples=2)
    partial.trajectories.append(group.trajectories[0])
    result = queue.put(partial)
    assert result.entry_id is not None and result.duplicate_ids == (group.trajectories[0].trajectory_id,)
    entries = queue.read(count=10)
    assert [len(e.group.trajectories) for e in entries] == [3, 2]
    assert queue.stats().depth == 2


def test_put_many_batches_keep_the_dedupe_and_the_bound(redis_client: redis.Redis) -> None:
    """The transaction path (no Lua) and the script fallback agree: an id repeated inside one batch,
    an id seen before, and a batch that does not fit are handled exactly as single puts are."""
    queue = TrajectoryQueue(redis_client, RUN, max_length=4, consumer="c0")
    a, b = make_group(samples=2), make_group(samples=2)
    b.trajectories.append(a.trajectories[0])  # repeated inside the batch
    results = queue.put_many([a, b])
    assert results[0].duplicate_ids == () and results[1].duplicate_ids == (a.trajectories[0].trajectory_id,)
    seen = queue.put_many([a], timeout=0)[0]
    assert seen.entry_id is None and len(seen.duplicate_ids) == 2
    clean = queue.put_many([make_group(), make_group()])  # the transaction path
    assert all(r.entry_id is not None and r.duplicate_ids == () for r in clean)
    with pytest.raises(Backpressure):  # 4 queued: a fifth does not fit
        queue.put_many([make_group()], timeout=0)
    assert queue.put_many([]) == []  # nothing to put: no round trip (Redis refuses an empty SMISMEMBER)
    entries = queue.read(count=10)
    assert [len(e.group.trajectories) for e in entries] == [2, 2, 2, 2]
    ids = [t.trajectory_id for e in entries for t in e.group.trajectories]
    assert len(ids) == len(set(ids)) == redis_client.scard(QueueKeys(RUN).seen_ids)


def test_concurrent_producers_queue_every_group_once(redis_client: redis.Redis) -> None:
    """Writers racing on one queue (each transaction WATCHes the stream and the id set, so a
    collision aborts EXEC and the check runs again): every group lands exactly once, and of the
    groups that share trajectory ids across writers exactly one is queued per shared id."""
    TrajectoryQueue(redis_client, RUN, consumer="c0").close()  # creates the consumer group, frees the name
    writers, batches, per_batch = 4, 15, 3
    contested = [uuid.uuid4().hex for _ in range(batches)]
    outcomes: list[list[PutResult]] = [[] for _ in range(writers)]
    together = threading.Barrier(writers)  # every writer offers batch b at the same moment

    def produce(w: int) -> None:
        queue = TrajectoryQueue(redis_client, RUN, max_length=10_000)
        for b in range(batches):
            batch = [make_group(samples=2) for _ in range(per_batch)]
            rival = make_group(samples=1)
            rival.trajectories[0].trajectory_id = contested[b]
            batch.append(rival)  # every writer also offers the same contested id, each in its own group
            together.wait(timeout=30)
            outcomes[w].append(queue.put_many(batch))

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reader = TrajectoryQueue(redis_client, RUN, consumer="c0")
    entries = reader.read(count=10_000)
    ids = [t.trajectory_id for e in entries for t in e.group.trajectories]
    assert len(entries) == writers * batches * per_batch + batches
    assert len(ids) == len(set(ids)) == redis_client.scard(QueueKeys(RUN).seen_ids)
    assert all(r.entry_id is not None for outcome in outcomes for put in outcome for r in put[:per_batch])
    winners = [sum(outcome[b][per_batch].entry_id is not None for outcome in outcomes) for b in range(batches)]
    assert winners == [1] * batches


def test_backpressure_engages_at_the_bound_and_never_drops(redis_client: redis.Redis) -> None:
    queue = TrajectoryQueue(redis_client, RUN, max_length=3, consumer="c0")
    for _ in range(3):
        queue.put(make_group())
    with pytest.raises(Backpressure, match="full"):
        queue.put(make_group(), timeout=0)
    with pytest.raises(Backpressure):
        queue.put(make_group(), timeout=0.2)
    assert queue.stats().depth == 3

    first = queue.read(count=1)

    def ack_later() -> None:
        time.sleep(0.3)
        queue.ack([first[0].entry_id])

    thread = threading.Thread(target=ack_later)
    thread.start()
    started = time.monotonic()
    waiting = make_group(prompt_id="waited")
    assert queue.put(waiting, timeout=10).entry_id is not None
    thread.join()
    assert time.monotonic() - started >= 0.25  # it waited for the ack instead of dropping or failing
    assert [e.group.prompt_id for e in queue.read(count=10)][-1] == "waited"


def test_malformed_group_is_refused_at_put(redis_client: redis.Redis) -> None:
    queue = TrajectoryQueue(redis_client, RUN)
    bad = make_group()
    del bad.trajectories[0].loss_mask[:]
    with pytest.raises(InvalidInput, match="loss_mask has 0 entries"):
        queue.put(bad)
    with pytest.raises(InvalidInput, match="run_id"):
        queue.put(make_group(run_id="other-run"))
    assert queue.stats().depth == 0


def _break(field: str) -> Callable[[common_pb2.Trajectory], None]:
    def apply(t: common_pb2.Trajectory) -> None:
        if field in ("trajectory_id", "rollout_id"):
            setattr(t, field, "")
        elif field == "segment_index":
            t.segment_index = -1
        elif field == "reward":
            t.reward = math.nan

        elif field == "routed_experts":  # 3 prompt + 4 response tokens x 2 layers x top 1, one row short
            t.routed_experts.CopyFrom(expert_routing.pack(np.zeros((6, 2, 1), dtype=np.int16)))
        else:
            getattr(t, field).pop()  # repeated fields: one entry short

    return apply


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("trajectory_id", "trajectory_id is empty"),
        ("rollout_id", "rollout_id is empty"),
        ("segment_index", "segment_index -1 < 0"),
        ("prompt_token_ids", "prompt_token_ids is empty"),
        ("rollout_logprobs", "rollout_logprobs has 3 entries"),
        ("loss_mask", "loss_mask has 3 entries"),
        ("policy_versions", "policy_versions has 3 entries"),
        ("routed_experts", "routed_experts covers 6 tokens; the trajectory has 7"),
        ("reward", "reward nan is not finite"),
    ],
)
def test_every_structural_check_refuses(field: str, message: str) -> None:
    group = make_group(samples=2, tokens=4)
    assert group_problems(group, RUN) == []
    if field == "prompt_token_ids":
        del group.trajectories[1].prompt_token_ids[:]
    else:
        _break(field)(group.trajectories[1])
    problems = group_problems(group, RUN)
    assert len(problems) == 1 and message in problems[0], problems
    valid = make_group(samples=1, tokens=4)
    valid.trajectories[0].routed_experts.CopyFrom(expert_routing.pack(np.full((7, 2, 1), 3, dtype=np.int16)))
    assert group_problems(valid, RUN) == []


def test_malformed_entries_go_to_dead_letters(redis_client: redis.Redis) -> None:
    keys = QueueKeys(RUN)
    queue = TrajectoryQueue(redis_client, RUN, consumer="c0")
    queue.put(make_group(prompt_id="before"))
    redis_client.xadd(keys.stream, {"group": b"\xff\xff not a protobuf"})
    redis_client.xadd(keys.stream, {"other": b"x"})
    wrong_lengths = make_group()
    wrong_lengths.trajectories[0].rollout_logprobs.append(0.0)
    redis_client.xadd(keys.stream, {"group": wrong_lengths.SerializeToString()})
    queue.put(make_group(prompt_id="after"))

    entries = queue.read(count=10)
    assert [e.group.prompt_id for e in entries] == ["before", "after"]
    dead = redis_client.xrange(keys.dead_letters)
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert len(reasons) == 3
    assert "no 'group' field" in reasons[1]
    assert "rollout_logprobs has 5 entries" in reasons[2]
    assert dead[0][1][b"group"] == b"\xff\xff not a protobuf"  # the original bytes are kept for inspection
    stats = queue.stats()
    assert (stats.depth, stats.pending, stats.dead_letters) == (2, 2, 3)
    assert queue.skipped() == 3  # groups that will never be trained: a pacing producer starts others


def test_oversize_groups_are_refused_and_dead_lettered_in_part(redis_client: redis.Redis) -> None:
    """A group over ``max_entry_bytes`` is refused at put (GROUP_TOO_LARGE) and dead-lettered when written
    around the check; the dead letter keeps the size and only the first DEAD_PAYLOAD_BYTES of it."""
    keys = QueueKeys(RUN)
    queue = TrajectoryQueue(redis_client, RUN, consumer="c0", max_entry_bytes=2 << 20)
    big = make_group(samples=2, tokens=400_000)  # ~3.2 MB serialized
    with pytest.raises(InvalidInput, match="over the queue's bound") as refused:
        queue.put(big)
    assert refused.value.reason == "GROUP_TOO_LARGE"
    payload = big.SerializeToString()
    redis_client.xadd(keys.stream, {"group": payload})
    queue.put(make_group(prompt_id="after"))
    assert [e.group.prompt_id for e in queue.read(count=10)] == ["after"]
    ((_, letter),) = redis_client.xrange(keys.dead_letters)
    assert b"over the bound" in letter[b"reason"] and int(letter[b"bytes"]) == len(payload)
    assert letter[b"group"] == payload[:DEAD_PAYLOAD_BYTES]


def test_segments_of_one_episode_must_agree_on_its_reward() -> None:
    group = make_group(samples=2)
    group.trajectories[1].rollout_id = group.trajectories[0].rollout_id  # rewards 0.0 and 1.0
    (problem,) = group_problems(group, RUN)
    assert "disagree on the episode's reward (0.0 and 1.0)" in problem
    group.trajectories[1].reward = 0.0
    assert group_problems(group, RUN) == []


def test_skipped_groups_are_counted_for_producers_and_acknowledged(redis_client: redis.Redis) -> None:
    consumer = TrajectoryQueue(redis_client, RUN, consumer="c0")
    producer = TrajectoryQueue(redis_client, RUN)
    assert producer.skipped() == 0  # no key yet
    producer.put_many([make_group(prompt_id=f"p{i}") for i in range(3)])
    read = [e.entry_id for e in consumer.read(count=3)]
    consumer.skip(read[:2], {"stale": 3, "too_long": 1})
    consumer.skip([])
    consumer.skip([read[0]], {"stale": 2})  # again (a retry whose first try ran): counted once
    assert producer.skipped() == 2
    assert producer.skipped_trajectories() == {"stale": 3, "too_long": 1}
    assert consumer.stats() == QueueStats(depth=1, pending=1, lag=0, dead_letters=0)  # skipping settles
    assert TrajectoryQueue(redis_client, "another-run").skipped() == 0
