"""Notices engines that serve older weights than the learner's, and says when to publish them again.

A router restarted without detached engines (or an engine replaced) serves the weights it loaded at
start, at version 0, while the learner is at version N. Every rollout then arrives too old to train on
(dropped as ``stale``), so no step is made, and since refits follow steps, none would ever bring the
engines up to date: the run stalls while counting drops. The sign is a step's worth of stale samples
with no step between them; the cure is the learner's current weights published again (the same refit
a restarted learner makes first). In an ordinary run stale drops come between steps, which resets the
count, so this does not fire there.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

REPUBLISH_EVERY_S = 30.0  # at most one such refit this often: a refit in flight has rollouts to drain first


class StaleWatch:
    """``due`` once ``samples_per_step`` samples were dropped as stale since the last step or republish."""

    def __init__(self, samples_per_step: int, every_s: float = REPUBLISH_EVERY_S) -> None:
        self.samples_per_step = samples_per_step
        self.every_s = every_s
        self.step: int | None = None
        self.stale_at_mark = 0
        self.last_publish = float("-inf")

    def due(self, stale: int, step: int, now: float | None = None) -> bool:
        """Whether to publish again, given the run's stale-drop count and step now; a True is taken to be
        acted on (the count starts again from here)."""
        now = time.monotonic() if now is None else now
        if step != self.step:
            self.step, self.stale_at_mark = step, stale
            return False
        if stale - self.stale_at_mark < self.samples_per_step or now - self.last_publish < self.every_s:
            return False
        log.warning(
            "a step's worth of rollouts arrived too old to train on and no step was made: the engines serve "
            "older weights than this learner's; publishing them again",
            extra={"step": step, "stale": stale},
        )
        self.stale_at_mark, self.last_publish = stale, now
        return True

    def mark(self, stale: int, step: int, now: float | None = None) -> None:
        """A publish of the current weights just happened (at the start, or for ``due``): count from here."""
        self.step, self.stale_at_mark = step, stale
        self.last_publish = time.monotonic() if now is None else now
