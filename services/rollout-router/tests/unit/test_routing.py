"""Engine choice: rendezvous-hash affinity for sessions, least load otherwise."""

from __future__ import annotations

from collections import Counter

import pytest

from molt.router.routing import pick_engine

ENGINES = [f"engine-{i}" for i in range(4)]


def test_session_affinity_is_stable_and_ignores_load() -> None:
    choice = pick_engine(ENGINES, "episode-42", {})
    heavy = dict.fromkeys(ENGINES, 0) | {choice: 10**9}
    assert pick_engine(ENGINES, "episode-42", heavy) == choice
    assert pick_engine(list(reversed(ENGINES)), "episode-42", {}) == choice  # order of engines does not matter


def test_sessions_spread_and_only_a_removed_engines_sessions_move() -> None:
    sessions = [f"s{i}" for i in range(2000)]
    before = {s: pick_engine(ENGINES, s, {}) for s in sessions}
    spread = Counter(before.values())
    assert set(spread) == set(ENGINES) and min(spread.values()) > 350  # ~500 each
    after = {s: pick_engine(ENGINES[:3], s, {}) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert moved and all(before[s] == "engine-3" for s in moved)


def test_without_session_least_loaded_wins_ties_by_order() -> None:
    assert pick_engine(ENGINES, "", {"engine-0": 5, "engine-1": 2, "engine-2": 2, "engine-3": 9}) == "engine-1"
    assert pick_engine(ENGINES, "", {}) == "engine-0"


def test_no_engines() -> None:
    with pytest.raises(ValueError, match="no engines"):
        pick_engine([], "s", {})
