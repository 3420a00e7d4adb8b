"""Waiting out a Redis outage: a call retried with backoff until Redis answers again or a budget runs out.

A service whose work is durable in Redis (the learner's reads, acknowledgements and skips) should not
die with the connection: Redis restarted with its append-only file holds everything it held, and
redis-py reconnects on the next command. ``RedisOutage.call`` retries connection failures (refused,
reset, timed out, still loading its data) with exponential backoff, logs the outage once when it
starts and once when it ends, and raises ``Unavailable`` when Redis stayed away past the budget.
Errors Redis itself answered (a wrong key type, a missing consumer group) are not retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from molt.core.errors import Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRIED = (redis.ConnectionError, redis.TimeoutError)  # BusyLoadingError (AOF being read) is a ConnectionError


class RedisOutage:
    """Retries Redis calls through outages of up to ``budget_s`` seconds each."""

    def __init__(
        self,
        budget_s: float,
        *,
        first_delay_s: float = 0.25,
        max_delay_s: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_s = budget_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.sleep = sleep
        self.clock = clock
        self.outages = 0  # outages waited out so far

    def call(self, what: str, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)``, retried while Redis cannot be reached; ``what`` names it in the log."""
        started: float | None = None
        delay = self.first_delay_s
        while True:
            try:
                result = fn(*args, **kwargs)
            except RETRIED as exc:
                now = self.clock()
                if started is None:
                    started = now
                    log.warning("Redis unreachable; waiting for it", extra={"while": what, "error": str(exc)})
                if now - started >= self.budget_s:
                    raise Unavailable(
                        f"Redis stayed unreachable for {now - started:.1f} s (budget {self.budget_s:g} s) while "
                        f"{what}: {exc}",
                        reason="REDIS_UNAVAILABLE",
                    ) from exc
                self.sleep(delay)
                delay = min(delay * 2, self.max_delay_s)
                continue
            if started is not None:
                self.outages += 1
                log.warning("Redis is back", extra={"while": what, "outage_s": round(self.clock() - started, 3)})
            return result
