"""The loop's progress reports: the warning when many samples are dropped as stale."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import cast

import pytest

from molt.learner.loop import LearnerLoop
from molt.learner.progress import StatusClock


def test_many_samples_dropped_as_stale_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """More than 5% of the samples since the last status line (or the loop's start, whose counts hold a
    restarted run's history) dropped as stale is a warning that names the setting."""
    clock = StatusClock(0.0, stale=50, trained=100)
    loop = cast(LearnerLoop, SimpleNamespace(drop_after=4))
    with caplog.at_level(logging.WARNING, logger="molt.learner.progress"):
        clock._warn_stale(loop, stale=52, trained=200)  # 2 of 102
        clock._warn_stale(loop, stale=70, trained=250)  # 18 of 68
    warnings = [r.getMessage() for r in caplog.records if "dropped as stale" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("18 samples were dropped as stale since the last")
    assert "against 50 trained" in warnings[0] and "more than 4 versions" in warnings[0]
    assert "drop_after_versions" in warnings[0]
