"""One reader per consumer name, against a real redis-server on loopback: a live holder keeps its name,
a frozen one's claim lapses and is taken over, and from then on the frozen reader's acknowledgements,
skips, dead letters and reads are refused without changing anything in Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import redis

from molt.core.errors import ConsumerNameTaken
from molt.core.queue import CONSUMER_GROUP, QueueKeys, TrajectoryQueue
from molt.core.testing import RedisServer
from molt.core.testing import trajectory_group as make_group

pytestmark = pytest.mark.integration
RUN = "test-run"
TTL_S = 1.0
CLAIM = f"molt:{RUN}:consumer:learner-0"

# A reader that takes learner-0, reads three entries, then tries each call named on its stdin and
# prints the reason it was refused, or "done".
FROZEN_READER = """
import sys, redis
from molt.core.errors import ConsumerNameTaken
from molt.core.queue import TrajectoryQueue
client = redis.Redis.from_url(sys.argv[1])
queue = TrajectoryQueue(client, sys.argv[2], consumer="learner-0", claim_ttl_s=float(sys.argv[3]))
entries = queue.read(count=3)
ids = [e.entry_id for e in entries]
print(" ".join(ids), flush=True)
calls = {"ack": lambda: queue.ack(ids), "skip": lambda: queue.skip(ids), "read": lambda: queue.read(count=10),
         "dead_letter": lambda: queue.dead_letter(entries, "refused step")}
for line in sys.stdin:
    try:
        calls[line.strip()]()
        print("done", flush=True)
    except ConsumerNameTaken as exc:
        print(exc.reason, flush=True)
"""


def redis_state(client: redis.Redis) -> tuple[Any, ...]:
    """Everything a settlement could change: the stream, who holds which entry (and how often it was
    delivered), the skipped set and the dead letters."""
    keys = QueueKeys(RUN)
    pending = client.xpending_range(keys.stream, CONSUMER_GROUP, min="-", max="+", count=100)
    return (
        [eid for eid, _ in client.xrange(keys.stream)],
        [(p["message_id"], p["consumer"], p["times_delivered"]) for p in pending],
        sorted(client.smembers(keys.skipped_groups)),
        client.xlen(keys.dead_letters),
    )


def test_a_name_held_by_a_live_reader_is_refused_to_a_second(redis_client: redis.Redis) -> None:
    """The holder renews its claim (every third of the TTL): the second waits the TTL and a quarter, then
    gives up; the holder goes on settling, and another name is free."""
    first = TrajectoryQueue(redis_client, RUN, consumer="learner-0", claim_ttl_s=TTL_S)
    first.put(make_group())
    started = time.monotonic()
    with pytest.raises(ConsumerNameTaken, match="held by another live reader"):
        TrajectoryQueue(redis_client, RUN, consumer="learner-0", claim_ttl_s=TTL_S)
    assert time.monotonic() - started >= TTL_S  # it waited for a lapse that never came
    (entry,) = first.read(count=10)
    assert first.ack([entry.entry_id]) == 1
    TrajectoryQueue(redis_client, RUN, consumer="learner-1", claim_ttl_s=TTL_S).close()
    first.close()


def test_a_frozen_readers_name_is_taken_over_and_its_settlements_refused(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A reader holding three entries is frozen (SIGSTOP: its renewal thread too). A new reader of the
    name takes it once the claim lapses and re-reads the three. Thawed, the old reader's ack, skip, dead
    letter and read are each refused, and Redis is exactly as before; the new holder's ack goes through."""
    producer = TrajectoryQueue(redis_client, RUN)
    producer.put_many([make_group(prompt_id=f"p{i}") for i in range(4)])
    frozen = subprocess.Popen(
        [sys.executable, "-c", FROZEN_READER, redis_server.url, RUN, str(TTL_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert frozen.stdin is not None and frozen.stdout is not None
    try:
        held = frozen.stdout.readline().split()
        assert len(held) == 3
        os.kill(frozen.pid, signal.SIGSTOP)
        successor = TrajectoryQueue(redis_client, RUN, consumer="learner-0", claim_ttl_s=TTL_S)
        assert [e.entry_id for e in successor.read(count=3)] == held  # the name's pending entries, again
        before = redis_state(redis_client)
        assert len(before[0]) == 4 and [p[0].decode() for p in before[1]] == held

        os.kill(frozen.pid, signal.SIGCONT)
        for call in ("ack", "skip", "dead_letter", "read"):
            frozen.stdin.write(call + "\n")
            frozen.stdin.flush()
            assert frozen.stdout.readline().strip() == "CONSUMER_NAME_TAKEN", call
        assert redis_state(redis_client) == before
        assert successor.ack(held) == 3
        assert producer.stats().depth == 1
        successor.close()
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        frozen.kill()
        frozen.wait()
        frozen.stdin.close()
        frozen.stdout.close()


def test_close_frees_the_name_at_once_and_for_good(redis_client: redis.Redis) -> None:
    """A closed reader's name is taken at once (not after its 30 s TTL), and the closed reader cannot take
    it back through a settlement."""
    first = TrajectoryQueue(redis_client, RUN, consumer="learner-0", claim_ttl_s=30.0)
    first.put(make_group())
    (entry,) = first.read(count=1)
    first.close()
    started = time.monotonic()
    second = TrajectoryQueue(redis_client, RUN, consumer="learner-0", claim_ttl_s=30.0)
    assert time.monotonic() - started < 5.0
    second.close()
    with pytest.raises(ConsumerNameTaken):
        first.ack([entry.entry_id])
    assert first.stats().pending == 1


def test_a_lapsed_claim_nobody_took_is_taken_back_by_its_reader(redis_client: redis.Redis) -> None:
    """A claim that lapsed with no other reader taking the name (a Redis outage longer than the TTL, a
    starved renewal): nobody else can have read or settled under it, so the reader's next call sets it
    again and goes through."""
    queue = TrajectoryQueue(redis_client, RUN, consumer="learner-0", claim_ttl_s=30.0)
    queue.put(make_group())
    (entry,) = queue.read(count=1)
    redis_client.delete(CLAIM)  # as it lapses
    assert queue.ack([entry.entry_id]) == 1
    assert redis_client.pttl(CLAIM) > 29_000
    queue.close()
    assert not redis_client.exists(CLAIM)
