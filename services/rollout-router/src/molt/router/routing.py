"""Which engine serves a request: session affinity first, else the least loaded.

Affinity uses rendezvous (highest-random-weight) hashing of the session id over
the engine ids: stable across router restarts (no process-random hash) and,
when an engine goes away, only that engine's sessions move.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def _weight(session_id: str, engine_id: str) -> int:
    digest = hashlib.blake2b(f"{session_id}\x00{engine_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_engine(engine_ids: Sequence[str], session_id: str, load: Mapping[str, int]) -> str:
    """The engine for a request: rendezvous hash of ``session_id``, or the smallest ``load`` without one.

    Ties on load go to the first engine in ``engine_ids`` order.
    """
    if not engine_ids:
        raise ValueError("no engines to route to")
    if session_id:
        return max(engine_ids, key=lambda engine_id: _weight(session_id, engine_id))
    return min(engine_ids, key=lambda engine_id: load.get(engine_id, 0))
