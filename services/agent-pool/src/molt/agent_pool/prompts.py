"""The order of the training prompts, epoch after epoch, and where the pool is in it, kept in Redis.

Prompts are numbered as they are taken: number k is row ``order(e)[p]`` of the n rows, with
``(e, p) = divmod(k, n)`` (epoch, position) and epoch e's order a shuffle seeded with (seed, e), or
file order, so ``k`` alone says where the pool is. A prompt is consumed when its group ends (queued,
filtered, or every episode failed), not when it is taken; a group cancelled by a stop gives its
prompt back, to be taken first again. Groups end out of order, so the position kept is the first
prompt not yet consumed: a restarted pool serves again the prompts in flight when it went, and the
fewer than ``groups_in_flight`` consumed after the first of them (at least once, never skipped).
Redis: the hash ``molt:<run>:data-position``, one field per dataset (``path@split``), a JSON value.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import redis
from redis import RedisError

from molt.agent_pool import metrics
from molt.agent_pool.agents import Prompt
from molt.agent_pool.dataset import PromptRows

log = logging.getLogger(__name__)


def position_key(run_id: str) -> str:
    """The Redis hash where a run's pools keep their place in each training dataset."""
    return f"molt:{run_id}:data-position"


class PositionStore:
    """One dataset's place in the run's Redis, with what it was counted over: a place recorded for a
    different number of rows, seed or shuffle means nothing in this order and is not used."""

    def __init__(
        self, client: redis.Redis, run_id: str, path: str, split: str, rows: int, shuffle: bool, seed: int
    ) -> None:
        self.client = client
        self.key = position_key(run_id)
        self.field = f"{path}@{split}"
        self.rows = rows
        self.order: dict[str, object] = {"rows": rows, "shuffle": shuffle, "seed": seed}

    def load(self) -> int:
        """The number of the first prompt not yet consumed (0 when nothing, or something else, was kept)."""
        raw = self.client.hget(self.key, self.field)
        if raw is None:
            return 0
        kept = json.loads(raw)
        if any(kept.get(name) != value for name, value in self.order.items()):
            log.warning(
                "the dataset's kept position was counted over another order; starting from its beginning",
                extra={"dataset": self.field, "kept": kept, "now": self.order},
            )
            return 0
        return int(kept["next"])

    def save(self, next_prompt: int) -> None:
        epoch, position = divmod(next_prompt, self.rows)
        value = {"next": next_prompt, "epoch": epoch, "position": position, **self.order}
        self.client.hset(self.key, self.field, json.dumps(value))


class PromptSource:
    """Takes prompts in order, epoch after epoch; ``consumed`` and ``give_back`` settle each one."""

    def __init__(
        self, rows: PromptRows, shuffle: bool = True, seed: int = 0, store: PositionStore | None = None
    ) -> None:
        self.rows = rows
        self.shuffle = shuffle
        self.seed = seed
        self.store = store
        self.resume_at = store.load() if store is not None else 0  # first prompt not yet consumed
        self.next_number = self.resume_at  # next prompt never taken yet
        self.given_back: list[int] = []  # taken, then abandoned: taken again first
        self.finished: set[int] = set()  # consumed, past resume_at
        self.orders: dict[int, list[int]] = {}
        self.saved_at = self.resume_at
        self.save_lock = asyncio.Lock()
        if self.resume_at:
            epoch, position = divmod(self.resume_at, len(rows))
            log.info("continuing the dataset", extra={"epoch": epoch, "position": position, "dataset": rows.name})

    def take(self) -> tuple[int, Prompt]:
        """The next prompt and its number (what ``consumed`` and ``give_back`` take)."""
        if self.given_back:
            number = self.given_back.pop(0)
        else:
            number, self.next_number = self.next_number, self.next_number + 1
        epoch, position = divmod(number, len(self.rows))
        return number, self.rows[self._order(epoch)[position]]

    def give_back(self, number: int) -> None:
        """A prompt whose group was cancelled: it is taken again before any new one (unless it was
        consumed before the cancellation landed)."""
        if number < self.resume_at or number in self.finished or number in self.given_back:
            return
        self.given_back.append(number)
        self.given_back.sort()

    def consumed(self, number: int) -> bool:
        """Marks prompt ``number`` consumed; True when the first prompt not yet consumed moved on."""
        self.finished.add(number)
        moved = False
        while self.resume_at in self.finished:
            self.finished.remove(self.resume_at)
            self.resume_at += 1
            moved = True
        return moved

    async def save(self) -> None:
        """Writes ``resume_at`` to Redis when it moved since the last write; a Redis that does not answer
        is logged and the next save carries the place (the pool goes on)."""
        if self.store is None:
            return
        async with self.save_lock:  # one write at a time, so a later place is never overwritten by an earlier
            at = self.resume_at
            if at == self.saved_at:
                return
            try:
                await asyncio.to_thread(self.store.save, at)
            except RedisError as exc:
                log.warning("cannot keep the dataset position in Redis", extra={"error": str(exc), "next": at})
                return
            self.saved_at = at

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self.orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self.orders = {e: o for e, o in self.orders.items() if e >= epoch - 1}  # a given-back prompt's epoch
            self.orders[epoch] = order
            if epoch == max(self.orders):
                log.info("dataset epoch started", extra={"epoch": epoch, "dataset": self.rows.name})
                metrics.DATA_EPOCH.set(epoch)
        return self.orders[epoch]
