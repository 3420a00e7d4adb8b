"""The trajectory queue's recovery against a real redis-server on loopback: a killed consumer's entries
reclaimed, a restarted consumer's own re-read, an acknowledgement cut off half-way, a Redis restart."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from molt.core.queue import CONSUMER_GROUP, QueueKeys, QueueStats, TrajectoryQueue
from molt.core.testing import RedisServer
from molt.core.testing import trajectory_group as make_group

pytestmark = pytest.mark.integration
RUN = "test-run"


CONSUMER_SCRIPT = """
import sys, time, redis
from molt.core.queue import TrajectoryQueue
queue = TrajectoryQueue(redis.Redis.from_url(sys.argv[1]), sys.argv[2], consumer="doomed")
entries = queue.read(count=3)
print(" ".join(e.entry_id for e in entries), flush=True)
time.sleep(600)
"""


def test_entries_of_a_killed_consumer_are_reclaimed_once(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    queue = TrajectoryQueue(redis_client, RUN, consumer="survivor", reclaim_after_s=0.5)
    for i in range(5):
        queue.put(make_group(prompt_id=f"p{i}"))
    doomed = subprocess.Popen(
        [sys.executable, "-c", CONSUMER_SCRIPT, redis_server.url, RUN], stdout=subprocess.PIPE, text=True
    )
    try:
        assert doomed.stdout is not None
        taken = doomed.stdout.readline().split()
    finally:
        doomed.kill()
        doomed.wait()
        if doomed.stdout is not None:
            doomed.stdout.close()
    assert len(taken) == 3

    # Before the idle timeout only the two untouched entries are delivered.
    fresh = queue.read(count=10)
    assert len(fresh) == 2 and not {e.entry_id for e in fresh} & set(taken)
    time.sleep(0.6)
    reclaimed = queue.read(count=10)
    assert sorted(e.entry_id for e in reclaimed) == sorted(taken)
    time.sleep(0.6)  # our own held entries are never re-delivered to us, however long we hold them
    assert queue.read(count=10) == []
    queue.ack([e.entry_id for e in fresh + reclaimed])
    assert queue.stats().pending == 0 and queue.stats().depth == 0
    seen = [e.group.prompt_id for e in fresh + reclaimed]
    assert sorted(seen) == [f"p{i}" for i in range(5)]


def test_an_ack_cut_off_after_its_xdel_is_completed_by_the_next_reclaim(redis_client: redis.Redis) -> None:
    """A reader that pipelines XDEL, then XACK, without a transaction (as another client may; this one
    settles in one script) leaves, when its connection is lost between the two, entries deleted from the
    stream and still pending for their consumer. Made here with those two commands' first half: the
    next reclaim must acknowledge them and deliver nothing."""
    queue = TrajectoryQueue(redis_client, RUN, consumer="survivor", reclaim_after_s=0.2)
    for i in range(3):
        queue.put(make_group(prompt_id=f"p{i}"))
    cut_off = TrajectoryQueue(redis_client, RUN, consumer="cut-off")
    taken = [e.entry_id for e in cut_off.read(count=2)]
    redis_client.xdel(QueueKeys(RUN).stream, *taken)  # the ack's XDEL arrived, its XACK did not
    assert queue.stats().pending == 2 and queue.stats().depth == 1
    time.sleep(0.3)
    delivered = queue.read(count=10)
    assert [e.group.prompt_id for e in delivered] == ["p2"]
    assert queue.stats().pending == 1  # only the entry just delivered to the survivor
    queue.ack([e.entry_id for e in delivered])
    assert queue.stats() == QueueStats(depth=0, pending=0, lag=0, dead_letters=0)


def test_restarted_consumer_gets_its_own_pending_entries_first(redis_client: redis.Redis) -> None:
    first = TrajectoryQueue(redis_client, RUN, consumer="learner-0")
    for i in range(4):
        first.put(make_group(prompt_id=f"p{i}"))
    held = first.read(count=2)
    first.close()  # its process ends
    restarted = TrajectoryQueue(redis_client, RUN, consumer="learner-0")  # same name, new process
    again = restarted.read(count=2)
    assert [e.entry_id for e in again] == [e.entry_id for e in held]
    assert [e.group.prompt_id for e in restarted.read(count=10)] == ["p2", "p3"]


def test_redis_restart_with_aof_loses_nothing(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "aof", appendonly=True)
    server.start()
    try:
        queue = TrajectoryQueue(server.client(), RUN, consumer="c0")
        sent = [make_group(prompt_id=f"p{i}") for i in range(6)]
        for group in sent:
            queue.put(group)
        delivered = queue.read(count=3)
        queue.ack([delivered[0].entry_id])  # acknowledged: must stay gone
        port = server.port
        server.kill()  # a crash, not a clean shutdown
        server.start(port=port)

        client = server.client()
        queue.close()  # the name's claim lived through the restart (AOF): free it for the next reader
        restarted = TrajectoryQueue(client, RUN, consumer="c0")
        assert restarted.stats().pending == 2
        recovered = restarted.read(count=10) + restarted.read(count=10)
        assert [e.group for e in recovered] == sent[1:]
        assert restarted.put(sent[0]).entry_id is None  # the dedupe set survived too
        pending = client.xpending(QueueKeys(RUN).stream, CONSUMER_GROUP)
        assert pending["pending"] == 5
    finally:
        server.stop()


def test_a_restarted_consumer_gets_back_every_entry_it_held(redis_client: redis.Redis) -> None:
    """A consumer killed holding 7 entries (one of them deleted by an ack cut off after its XDEL) comes
    back under its name and reads 3 at a time: the 6 left come back in order, before the new entry and
    without waiting for the 60 s reclaim timeout; the deleted one is acknowledged, not delivered."""
    first = TrajectoryQueue(redis_client, RUN, consumer="learner-0")
    first.put_many([make_group(prompt_id=f"p{i}") for i in range(8)])
    held = [e.entry_id for e in first.read(count=7)]
    redis_client.xdel(QueueKeys(RUN).stream, held[2])
    first.close()
    restarted = TrajectoryQueue(redis_client, RUN, consumer="learner-0")
    delivered = [e for _ in range(5) for e in restarted.read(count=3)]
    assert [e.entry_id for e in delivered[:6]] == held[:2] + held[3:]
    assert [e.group.prompt_id for e in delivered[6:]] == ["p7"]
    assert restarted.stats() == QueueStats(depth=7, pending=7, lag=0, dead_letters=0)


def test_a_reclaim_reaches_past_the_entries_this_consumer_holds(redis_client: redis.Redis) -> None:
    """The survivor holds 30 entries past the idle timeout, ahead of 2 a dead consumer left: XAUTOCLAIM
    scans at most ten entries per one asked for, so a reclaim that always started from the front of the
    pending list, finding only the survivor's own, would never reach the dead consumer's."""
    queue = TrajectoryQueue(redis_client, RUN, consumer="survivor", reclaim_after_s=0.2)
    queue.put_many([make_group(prompt_id=f"p{i}") for i in range(32)])
    assert len(queue.read(count=30)) == 30
    taken = [e.entry_id for e in TrajectoryQueue(redis_client, RUN, consumer="dead").read(count=2)]
    time.sleep(0.3)
    reclaimed: list[str] = []
    for _ in range(3):  # a reclaim is looked for at most every quarter of the timeout
        reclaimed += [e.entry_id for e in queue.read(count=1)]
        time.sleep(0.06)
    assert reclaimed == taken
