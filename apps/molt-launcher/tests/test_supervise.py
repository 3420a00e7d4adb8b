"""The restart budget: shared by every piece, a backoff that doubles per piece up to a cap, the Ray
head never restarted; the old per-learner key refused with the new one named."""

from __future__ import annotations

import pytest

from molt.launcher.recipe import LauncherSettings
from molt.launcher.supervise import MAX_BACKOFF_S, Restarts


def test_one_budget_for_every_piece_with_a_backoff_per_piece() -> None:
    restarts = Restarts(budget=4, backoff_s=2.0)
    assert restarts.take("router") == 2.0
    assert restarts.take("router") == 4.0  # doubled: the same piece again
    assert restarts.take("agent_pool") == 2.0  # another piece starts at the base wait
    assert restarts.left == 1
    assert restarts.take("learner") == 2.0
    assert restarts.take("learner") is None  # spent, whichever piece asks
    assert restarts.describe() == "router 2, agent_pool 1, learner 1"


def test_the_backoff_stops_growing_at_its_cap() -> None:
    restarts = Restarts(budget=20, backoff_s=5.0)
    waits = [restarts.take("broadcaster") for _ in range(8)]
    assert waits[:4] == [5.0, 10.0, 20.0, 40.0] and waits[4:] == [MAX_BACKOFF_S] * 4


def test_the_ray_head_is_never_restarted_and_costs_nothing() -> None:
    restarts = Restarts(budget=3, backoff_s=1.0)
    assert restarts.take("ray") is None
    assert restarts.left == 3 and restarts.describe() == ""


def test_the_old_learner_restarts_key_names_its_replacement() -> None:
    with pytest.raises(ValueError, match=r"learner_restarts was replaced by \[launcher\] restarts"):
        LauncherSettings(learner_restarts=1)
    assert LauncherSettings(restarts=0).restarts == 0
