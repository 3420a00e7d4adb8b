"""The trajectory queue: ``TrajectoryGroup`` protobuf bytes on a Redis stream (docs/queue.md).

The run's Redis keys: ``queue_keys.py``.
Entries are acknowledged and deleted together (XACK + XDEL) once the consumer's use
is committed, so the stream length is the work not yet done and bounds the queue.
How ``put`` writes atomically: ``queue_writes.py``; how the reader settles entries: ``queue_settle.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from google.protobuf.message import DecodeError
from redis.client import Pipeline
from redis.commands.core import Script

from molt.core.consumer_claim import ConsumerClaim
from molt.core.errors import Backpressure, InvalidInput
from molt.core.queue_keys import QueueKeys
from molt.core.queue_settle import DEAD_LETTER_SCRIPT, SETTLE_SCRIPT
from molt.core.queue_writes import PAYLOAD_FIELD, PUT_SCRIPT, put_transaction, with_trajectories
from molt.core.trajectory import group_problems
from molt.v1 import common_pb2

log = logging.getLogger(__name__)

CONSUMER_GROUP = "learner"
MAX_ENTRY_BYTES = 64 << 20  # default bound on one serialized group
DEAD_LETTERS_KEPT = 10_000  # about this many newest dead letters are kept (XADD MAXLEN ~)
DEAD_PAYLOAD_BYTES = 1 << 20  # a dead letter keeps at most this much of its payload


@dataclass(frozen=True)
class PutResult:
    """Outcome of a put: the stream entry id (None if nothing was written) and dropped duplicate ids."""

    entry_id: str | None
    duplicate_ids: tuple[str, ...]


@dataclass(frozen=True)
class QueueEntry:
    """One delivered group; ``entry_id`` is what ``ack`` takes."""

    entry_id: str
    group: common_pb2.TrajectoryGroup


@dataclass(frozen=True)
class QueueStats:
    """Depth = entries not yet acknowledged (read or not); pending = delivered, not acknowledged;
    lag = not yet delivered to any consumer; dead_letters = entries moved aside as malformed."""

    depth: int
    pending: int
    lag: int
    dead_letters: int


class TrajectoryQueue:
    """Producer and consumer side of one run's queue.

    ``max_length`` bounds the stream (entries not yet acknowledged); ``put``
    then waits up to its ``timeout`` and raises ``Backpressure`` - it never
    drops. ``max_entry_bytes`` bounds one serialized group: ``put`` refuses a
    larger one, the reader dead-letters it. A consumer reads as ``consumer``; entries another consumer left
    pending longer than ``reclaim_after_s`` are claimed (XAUTOCLAIM) on read. One instance at a time reads
    under a name (``consumer_claim.py``): its claim lapses ``claim_ttl_s`` unrenewed; ``close`` frees it.
    """

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        *,
        max_length: int = 1024,
        consumer: str | None = None,
        reclaim_after_s: float = 60.0,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        claim_ttl_s: float = 15.0,
    ) -> None:
        if max_length < 1 or claim_ttl_s <= 0:
            raise InvalidInput(f"max_length must be >= 1 and claim_ttl_s > 0, got {max_length}, {claim_ttl_s}")
        self.client = client
        self.keys = QueueKeys(run_id)
        self.max_length = max_length
        self.max_entry_bytes = max_entry_bytes
        self.consumer = consumer
        self.reclaim_after_s = reclaim_after_s
        self._put = client.register_script(PUT_SCRIPT)
        self._settle_entries = client.register_script(SETTLE_SCRIPT)
        self._dead_letter_entry = client.register_script(DEAD_LETTER_SCRIPT)
        self._claim: ConsumerClaim | None = None
        self._held: set[str] = set()  # delivered to this instance, not yet acknowledged
        self._own_pending_from: str | None = "0"  # where re-reading this name's pending entries goes on; None: done
        self._reclaim_from = "0-0"  # XAUTOCLAIM's cursor through the pending entries of every consumer
        self._next_reclaim = 0.0  # monotonic time of the next XAUTOCLAIM check
        if consumer is not None:
            self._ensure_group()
            self._claim = ConsumerClaim(client, run_id, consumer, claim_ttl_s)
            self._claim.take()

    def _ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.keys.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- producer ---------------------------------------------------------------------------

    def put(self, group: common_pb2.TrajectoryGroup, timeout: float | None = None) -> PutResult:
        """Queues ``group``; trajectories whose id was queued before are dropped (reported, not written).

        Blocks while the queue is full, up to ``timeout`` seconds (None: forever; 0: not at all),
        then raises ``Backpressure``. Raises ``InvalidInput`` for a malformed group.
        """
        return self.put_many([group], timeout)[0]

    def put_many(self, groups: Sequence[common_pb2.TrajectoryGroup], timeout: float | None = None) -> list[PutResult]:
        """``put`` for several groups in one round trip (one pipeline of atomic put scripts).

        Groups are checked first, so a malformed one queues nothing. When the
        queue fills part-way, the rest are put one by one, waiting as ``put`` does.
        """
        for group in groups:
            problems = group_problems(group, self.keys.run_id)
            if problems:
                raise InvalidInput("malformed TrajectoryGroup: " + "; ".join(problems), reason="MALFORMED_GROUP")
        if not groups:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        payloads = [group.SerializeToString() for group in groups]
        for group, payload in zip(groups, payloads, strict=True):
            if len(payload) > self.max_entry_bytes:
                raise InvalidInput(
                    f"group {group.group_id!r} is {len(payload)} bytes serialized, over the queue's bound of "
                    f"{self.max_entry_bytes}",
                    reason="GROUP_TOO_LARGE",
                )
        entry_ids = put_transaction(
            self.client, self.keys.stream, self.keys.seen_ids, self.max_length, groups, payloads
        )
        if entry_ids is not None:
            return [PutResult(entry_id, ()) for entry_id in entry_ids]
        with self.client.pipeline(transaction=False) as pipe:
            for group, payload in zip(groups, payloads, strict=True):
                self._put_script(group, pipe, payload)
            replies = pipe.execute()
        results: list[PutResult] = []
        for group, reply in zip(groups, replies, strict=True):
            done = self._settle(reply, ())
            results.append(done if done is not None else self._put_one(group, deadline))
        return results

    def _put_script(
        self, group: common_pb2.TrajectoryGroup, client: redis.Redis | Pipeline, payload: bytes | None = None
    ) -> Any:
        ids = [t.trajectory_id for t in group.trajectories]
        return self._put(
            keys=[self.keys.stream, self.keys.seen_ids],
            args=[self.max_length, payload if payload is not None else group.SerializeToString(), *ids],
            client=client,
        )

    def _settle(self, reply: list[bytes], duplicates: tuple[str, ...]) -> PutResult | None:
        """The result of a script reply, or None when the group must be retried (queue full or duplicates)."""
        if reply[0] == b"ok":
            return PutResult(reply[1].decode(), duplicates)
        return None

    def _put_one(self, group: common_pb2.TrajectoryGroup, deadline: float | None) -> PutResult:
        duplicates: tuple[str, ...] = ()
        delay = 0.005
        while True:
            reply = self._put_script(group, self.client)
            done = self._settle(reply, duplicates)
            if done is not None:
                return done
            if reply[0] == b"dup":
                seen = {raw.decode() for raw in reply[1:]}
                duplicates += tuple(sorted(seen))
                log.warning("dropping duplicate trajectory ids", extra={"ids": sorted(seen)})
                kept = [t for t in group.trajectories if t.trajectory_id not in seen]
                if not kept:
                    return PutResult(None, duplicates)
                group = with_trajectories(group, kept)
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise Backpressure(
                    f"trajectory queue {self.keys.stream} is full ({self.max_length} entries not yet "
                    f"acknowledged); the learner is behind",
                    metadata={"maxLength": str(self.max_length)},
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    # -- consumer ---------------------------------------------------------------------------

    def read(self, count: int = 16, block_s: float = 0.0) -> list[QueueEntry]:
        """Delivers up to ``count`` groups to this consumer.

        Order: first every entry this consumer name left pending before a
        restart (``count`` at a time, until none is left), then entries other
        consumers left idle past ``reclaim_after_s`` (looked for at most every
        quarter of it, so such an entry comes back within 1.25x the timeout),
        then new entries in stream order (waiting up to ``block_s`` for one).
        Malformed entries go to the dead-letter stream. Refused (``ConsumerNameTaken``) once another reader
        holds the name: checked before reading (XREADGROUP cannot block in a script), as a read racing a
        take-over only adds to the name's pending entries, which the new holder reclaims.
        """
        self.confirm_consumer()
        raw: list[tuple[bytes, dict[bytes, bytes]]] = []
        while self._own_pending_from is not None and not raw:  # a batch of deleted entries only: read on
            raw += self._own_pending(count)
        now = time.monotonic()
        if len(raw) < count and now >= self._next_reclaim:
            self._next_reclaim = now + self.reclaim_after_s / 4
            raw += self._reclaim(count - len(raw))
        if not raw:
            raw += self._read_stream(">", count, block_s)
        return self._decode(raw)

    def _read_stream(self, start: str, count: int, block_s: float | None) -> list[tuple[bytes, dict[bytes, bytes]]]:
        block = None if not block_s else max(1, int(block_s * 1000))
        reply = self.client.xreadgroup(
            CONSUMER_GROUP, self.consumer, {self.keys.stream: start}, count=count, block=block
        )
        return [(eid, fields) for _, entries in reply or [] for eid, fields in entries if fields]

    def _own_pending(self, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The next ``count`` entries this consumer name holds from before this instance, in id order.
        All of them, not only the first read's: the rest would otherwise wait for XAUTOCLAIM, which
        hands them over only once idle ``reclaim_after_s``, and then only as far as its scan reaches."""
        reply = self.client.xreadgroup(
            CONSUMER_GROUP, self.consumer, {self.keys.stream: self._own_pending_from}, count=count
        )
        entries = [(eid, fields) for _, found in reply or [] for eid, fields in found]
        self._own_pending_from = entries[-1][0].decode() if len(entries) == count else None
        deleted = [eid for eid, fields in entries if not fields]
        if deleted:  # an ack cut off after its XDEL: the entry's use is committed, finish the ack
            self.client.xack(self.keys.stream, CONSUMER_GROUP, *deleted)
        return [(eid, fields) for eid, fields in entries if fields]

    def _reclaim(self, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Up to ``count`` entries idle past the timeout, claimed from whichever consumer holds them.
        XAUTOCLAIM scans at most ten entries per one asked for and claims this consumer's own held
        entries too (dropped here): it goes on from its cursor, up to one pass over the pending list,
        so entries this consumer holds ahead of the others' cannot hide them."""
        idle_ms = int(self.reclaim_after_s * 1000)
        claimed: list[tuple[bytes, dict[bytes, bytes]]] = []
        while len(claimed) < count:
            reply = self.client.xautoclaim(
                self.keys.stream, CONSUMER_GROUP, self.consumer, idle_ms, self._reclaim_from, count=count - len(claimed)
            )
            self._reclaim_from = _text(reply[0])
            claimed += [(eid, fields) for eid, fields in reply[1] if eid.decode() not in self._held]
            deleted = reply[2] if len(reply) > 2 else []
            if deleted:  # pending but already deleted from the stream: nothing left to deliver
                self.client.xack(self.keys.stream, CONSUMER_GROUP, *deleted)
            if self._reclaim_from == "0-0":
                break  # the end of the pending list: the next look starts from its front
        if claimed:
            log.warning("reclaimed entries left pending by another consumer", extra={"count": len(claimed)})
        return claimed

    def _decode(self, raw: Iterable[tuple[bytes, dict[bytes, bytes]]]) -> list[QueueEntry]:
        entries: list[QueueEntry] = []
        for eid_bytes, fields in raw:
            eid = eid_bytes.decode()
            payload = fields.get(PAYLOAD_FIELD)
            try:
                if payload is None:
                    raise DecodeError(f"entry has no {PAYLOAD_FIELD.decode()!r} field")
                if len(payload) > self.max_entry_bytes:
                    raise DecodeError(f"payload of {len(payload)} bytes is over the bound of {self.max_entry_bytes}")
                group = common_pb2.TrajectoryGroup.FromString(payload)
                problems = group_problems(group, self.keys.run_id)
                if problems:
                    raise DecodeError("; ".join(problems))
            except DecodeError as exc:
                self._dead_letter(eid, payload or b"", str(exc))
                continue
            self._held.add(eid)
            entries.append(QueueEntry(eid, group))
        return entries

    def dead_letter(self, entries: Sequence[QueueEntry], reason: str) -> None:
        """Moves entries this consumer read, well-formed but unusable (the learner refused the step they
        made), to the dead letters: acknowledged, counted as skipped, kept there for inspection."""
        for entry in entries:
            self._dead_letter(entry.entry_id, entry.group.SerializeToString(), reason)
            self._held.discard(entry.entry_id)

    def _dead_letter(self, entry_id: str, payload: bytes, reason: str) -> None:
        letter = (reason, entry_id, len(payload), payload[:DEAD_PAYLOAD_BYTES])
        self._as_holder(self._dead_letter_entry, DEAD_LETTERS_KEPT, *letter)
        log.error("queue entry moved to dead letters", extra={"entry_id": entry_id, "reason": reason})

    def skip(self, entry_ids: Sequence[str], dropped: Mapping[str, int] | None = None) -> None:
        """Settles entries this consumer read and will not train on: records them (see ``skipped``; by
        id, so one counted again is counted once) and acknowledges them, in one script. A skip is
        final and nothing of it is in any weights, so it waits for no checkpoint; record and ack go
        together, so a crash leaves an entry either still pending (read and decided again) or counted
        and gone, never gone uncounted. Held until a checkpoint, a learner that skips everything would
        fill the queue's bound with them and then wait for entries no producer could put. ``dropped``: their
        trajectories by drop reason, added to ``skipped_trajectories`` in the same script."""
        if not entry_ids:
            return
        pairs = [str(x) for reason, count in (dropped or {}).items() for x in (reason, count)]
        self._as_holder(self._settle_entries, "1", len(pairs) // 2, *pairs, *entry_ids)
        self._held.difference_update(entry_ids)

    def skipped(self) -> int:
        """Groups the consumer settled without training on them, since the run began: a producer that
        paces itself by ``groups_per_step`` per policy version must start this many more, or it falls
        behind the consumer for good (each such group moves every later step one group further on)."""
        return int(self.client.scard(self.keys.skipped_groups))

    def skipped_trajectories(self) -> dict[str, int]:
        """Trajectories of the skipped entries, by drop reason (``skip``'s ``dropped``), since the run began."""
        return {_text(k): int(v) for k, v in self.client.hgetall(self.keys.skipped_trajectories).items()}

    def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledges and deletes entries (call only after their use is committed); returns how many were
        pending. Like ``skip`` and ``dead_letter``, one script that first checks the consumer name: once
        another reader holds it, it raises ``ConsumerNameTaken`` and changes nothing."""
        if not entry_ids:
            return 0
        acked = self._as_holder(self._settle_entries, "0", 0, *entry_ids)
        self._held.difference_update(entry_ids)
        return int(acked)

    def confirm_consumer(self) -> None:
        """Renews this reader's claim on its name; raises ``ConsumerNameTaken`` when another reader holds it
        (for a caller about to do what only the name's holder may, as the learner before a checkpoint)."""
        self._reader().confirm()

    def _as_holder(self, script: Script, *args: Any) -> Any:
        """A ``queue_settle.py`` script on this run's keys, refused unless this reader holds its name."""
        keys = [self.keys.stream, self.keys.skipped_groups, self.keys.dead_letters, self.keys.skipped_trajectories]
        return self._reader().run(script, keys, [CONSUMER_GROUP, *args])

    def _reader(self) -> ConsumerClaim:
        if self._claim is None:
            raise InvalidInput("this TrajectoryQueue has no consumer name; it can only put")
        return self._claim

    def close(self) -> None:
        """Gives up this reader's consumer name (nothing for a producer, or once another reader took it),
        so that the reader started next takes it at once rather than after the claim's TTL."""
        if self._claim is not None:
            self._claim.release()

    def stats(self) -> QueueStats:
        """Depth, pending, lag and dead letters, read from Redis now."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xlen(self.keys.stream)
            pipe.xinfo_groups(self.keys.stream)
            pipe.xlen(self.keys.dead_letters)
            depth, groups, dead = pipe.execute(raise_on_error=False)
        if isinstance(depth, Exception):  # the stream does not exist yet
            return QueueStats(0, 0, 0, 0 if isinstance(dead, Exception) else int(dead))
        info = (
            next((g for g in groups if _text(g["name"]) == CONSUMER_GROUP), None) if isinstance(groups, list) else None
        )
        pending = int(info["pending"]) if info else 0
        lag = info.get("lag") if info else None
        return QueueStats(int(depth), pending, int(lag) if lag is not None else int(depth) - pending, int(dead))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
