"""The Redis keys of one run's trajectory queue (docs/queue.md).

Keys of run ``<run>``: ``molt:<run>:trajectories``, the stream
(field ``group``, consumer group ``learner``); ``molt:<run>:trajectory-ids``, every
trajectory id ever queued (dedupe); ``molt:<run>:trajectories:dead``, the dead
letters (reason, entry id, size, the payload's first ``DEAD_PAYLOAD_BYTES``; about
the newest ``DEAD_LETTERS_KEPT``); ``molt:<run>:groups-skipped``, the entries settled
without training, which a producer pacing itself on the policy version starts again;
``molt:<run>:trajectories-skipped``, how many trajectories those entries held, by drop reason;
``molt:<run>:consumer:<name>``, the claim of the one reader of that name (``consumer_claim.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueKeys:
    """The Redis keys of one run's queue."""

    run_id: str

    @property
    def stream(self) -> str:
        return f"molt:{self.run_id}:trajectories"

    @property
    def seen_ids(self) -> str:
        return f"molt:{self.run_id}:trajectory-ids"

    @property
    def dead_letters(self) -> str:
        return f"molt:{self.run_id}:trajectories:dead"

    @property
    def skipped_groups(self) -> str:
        return f"molt:{self.run_id}:groups-skipped"

    @property
    def skipped_trajectories(self) -> str:
        return f"molt:{self.run_id}:trajectories-skipped"
