"""What ``molt up`` does when one of its processes dies: restart it, within a budget, after a backoff.

One budget (``[launcher] restarts``) is shared by every service and the embedded redis-server, so a
run whose pieces keep dying ends instead of restarting forever. The wait before a restart doubles with
each restart of the same piece (``restart_backoff_s``, 2x, 4x, ... up to ``MAX_BACKOFF_S``): a service
that dies at once again (a bad config, a port still taken) does not spin. What rejoins how:

- learner: resumes from its newest checkpoint and publishes those weights before it reads;
- agent-pool: continues the dataset where it was (its position is in Redis);
- broadcaster: opens the weight group's store again; the learner re-registers at its next refit;
- router: attaches to detached engines, or starts new ones that the broadcaster finds at its next refit;
- redis-server: started again on its port and data directory; with AOF nothing acknowledged is lost,
  and the services wait out the gap.

The Ray head is not restarted: the engines (and a Ray-placed learner) live in it, so its death ends
the run.
"""

from __future__ import annotations

import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from molt.core.service_logs import failure_cause

MAX_BACKOFF_S = 60.0
NOT_RESTARTED = ("ray",)  # the engines live in it: a new head would have none (module docstring)


@dataclass
class Restarts:
    """The run's restart budget and each piece's count."""

    budget: int
    backoff_s: float
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def left(self) -> int:
        return self.budget - sum(self.counts.values())

    def take(self, name: str) -> float | None:
        """Spends one restart of ``name``; returns the wait before it, or None when the budget is spent
        or ``name`` is never restarted."""
        if name in NOT_RESTARTED or self.left <= 0:
            return None
        delay = min(self.backoff_s * 2 ** self.counts[name], MAX_BACKOFF_S)
        self.counts[name] += 1
        return delay

    def describe(self) -> str:
        """``learner 1, agent_pool 2`` in the order they first restarted; "" when none did."""
        return ", ".join(f"{name} {count}" for name, count in self.counts.items())


def cause_of(log_path: Path, code: int | None = None) -> str:
    """``: <the line of the log that says why>``, or "" when the log says nothing (for a process killed by
    a signal, only an error record or a traceback: its last line is whatever it was doing)."""
    cause = failure_cause(log_path, last_line=code is None or code >= 0)
    return f": {cause}" if cause else ""


def how_it_ended(code: int | None) -> str:
    """How a child process ended, in words: ``exited with 1``, ``was killed by SIGKILL (...)``."""
    if code is None or code >= 0:
        return f"exited with {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (killed from outside, or by the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
    return f"was killed by {name}{hint}"
