"""The event-loop stall watch names what blocked the loop, reports the stall's length, and stays
quiet while the loop runs."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import REGISTRY

from molt.core.stallwatch import StallWatch


def block_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call inside a coroutine: what the watch exists to catch


async def watched(threshold_s: float, body_s: float, blocking_s: float) -> StallWatch:
    watch = StallWatch("test", threshold_s=threshold_s, beat_s=0.02)
    watch.start()
    try:
        await asyncio.sleep(body_s)  # the loop runs: no stall
        if blocking_s:
            block_the_loop_for(blocking_s)
            await asyncio.sleep(0.3)  # the loop runs again: the watch reports the stall's end
    finally:
        watch.stop()
    return watch


def stalls_counted() -> float:
    return REGISTRY.get_sample_value("molt_event_loop_stalls_total") or 0.0


def test_a_blocked_loop_is_reported_with_the_blocking_stack(caplog: pytest.LogCaptureFixture) -> None:
    before = stalls_counted()
    with caplog.at_level(logging.WARNING, logger="molt.core.stallwatch"):
        watch = asyncio.run(watched(threshold_s=0.3, body_s=0.2, blocking_s=0.8))
    assert watch.stalls == 1
    assert stalls_counted() == before + 1
    silent = [r for r in caplog.records if "event loop silent" in r.getMessage()]
    assert len(silent) == 1
    assert "block_the_loop_for" in silent[0].getMessage()  # the stack points at the blocking call
    back = [r for r in caplog.records if "event loop ran again" in r.getMessage()]
    assert len(back) == 1
    assert 0.6 <= back[0].stall_s <= 5.0  # type: ignore[attr-defined]


def test_a_running_loop_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="molt.core.stallwatch"):
        watch = asyncio.run(watched(threshold_s=1.0, body_s=1.5, blocking_s=0.0))
    assert watch.stalls == 0
    assert not [r for r in caplog.records if "silent" in r.getMessage()]
