"""How ``TrajectoryQueue.put_many`` writes groups: atomically, never past the bound, never an id twice.

The common case is an optimistic transaction on one connection
(``put_transaction``): WATCH the stream and the id set, check room and ids, then
SADD + XADD every group in one MULTI/EXEC. A duplicate id, a full queue or
writers that keep colliding fall back to ``PUT_SCRIPT``, a Lua script that checks
and writes one group in one step and reports the ids seen before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.connection import Connection

from molt.v1 import common_pb2

PAYLOAD_FIELD = b"group"

# Atomically: refuse when the stream is at its bound; report already-seen ids
# without writing; otherwise remember the ids and append the entry.
# KEYS: stream, seen-set. ARGV: max_length, payload, trajectory ids...
PUT_SCRIPT = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return {'full'} end
local ids = {}
for i = 3, #ARGV do ids[#ids + 1] = ARGV[i] end
local seen = redis.call('SMISMEMBER', KEYS[2], unpack(ids))
local dups = {}
for i = 1, #seen do if seen[i] == 1 then dups[#dups + 1] = ids[i] end end
if #dups > 0 then return {'dup', unpack(dups)} end
redis.call('SADD', KEYS[2], unpack(ids))
return {'ok', redis.call('XADD', KEYS[1], '*', 'group', ARGV[2])}
"""


def put_transaction(
    client: redis.Redis,
    stream: str,
    seen_ids: str,
    max_length: int,
    groups: Sequence[common_pb2.TrajectoryGroup],
    payloads: list[bytes],
) -> list[str] | None:
    """The common case without Lua, in two round trips on one connection: WATCH ``stream`` and the id
    set ``seen_ids``, XLEN and SMISMEMBER; then, when every group fits under ``max_length`` and no id
    was seen, SADD + XADD them all in one MULTI/EXEC (a concurrent writer makes EXEC fail and the check
    run again). Returns the entry ids, or None when some group is a duplicate, the queue lacks room, or
    writers keep colliding: the put script handles those. (A Lua script would copy each payload twice
    more; redis-py's own WATCH pipeline takes four round trips.)"""
    ids = [t.trajectory_id for group in groups for t in group.trajectories]
    if len(set(ids)) != len(ids):  # an id twice in this batch: the script path keeps the first only
        return None
    pool = client.connection_pool
    for _ in range(3):
        connection = pool.get_connection()
        try:
            replies = _watched_put(connection, stream, seen_ids, max_length, ids, payloads)
        except BaseException:
            connection.disconnect()  # replies may be left unread: the connection must not be reused
            raise
        finally:
            pool.release(connection)
        if replies is False:
            return None
        if replies is not None:  # None: a watched key changed before EXEC
            failed = [reply for reply in replies if isinstance(reply, Exception)]
            if failed:
                raise failed[0]
            return [entry.decode() if isinstance(entry, bytes) else str(entry) for entry in replies[1:]]
    return None


def _watched_put(
    connection: Connection, stream: str, seen_ids: str, max_length: int, ids: list[str], payloads: list[bytes]
) -> Any:
    """One optimistic attempt: False when the check fails, else EXEC's reply (None if it aborted)."""
    connection.send_packed_command(
        connection.pack_commands([("WATCH", stream, seen_ids), ("XLEN", stream), ("SMISMEMBER", seen_ids, *ids)])
    )
    connection.read_response()
    length = int(connection.read_response())
    seen = connection.read_response()
    if length + len(payloads) > max_length or any(seen):
        connection.send_command("UNWATCH")
        connection.read_response()
        return False
    commands: list[tuple[Any, ...]] = [("MULTI",), ("SADD", seen_ids, *ids)]
    commands += [("XADD", stream, "*", PAYLOAD_FIELD, payload) for payload in payloads]
    connection.send_packed_command(connection.pack_commands([*commands, ("EXEC",)]))
    for _ in commands:  # +OK for MULTI, +QUEUED for each command
        connection.read_response()
    return connection.read_response()


def with_trajectories(
    group: common_pb2.TrajectoryGroup, trajectories: Sequence[common_pb2.Trajectory]
) -> common_pb2.TrajectoryGroup:
    """A copy of ``group`` that holds only ``trajectories`` (what is left once duplicates are dropped)."""
    trimmed = common_pb2.TrajectoryGroup()
    trimmed.CopyFrom(group)
    del trimmed.trajectories[:]
    trimmed.trajectories.extend(trajectories)
    return trimmed
