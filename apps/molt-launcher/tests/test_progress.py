"""The terminal status line's alerts."""

from __future__ import annotations

from molt.launcher.progress import Snapshot, status_line


def test_a_learner_that_stops_answering_mid_run_is_an_alert() -> None:
    snap = Snapshot(max_steps=200, router_version=205, published_step=120, unreachable=["learner"])
    assert "ALERT: learner not answering" in status_line(snap, 60.0)


def test_a_learner_that_stops_answering_after_its_last_step_is_finishing() -> None:
    snap = Snapshot(max_steps=200, router_version=204, published_step=200, unreachable=["learner"])
    line = status_line(snap, 60.0)
    assert "learner finishing" in line and "ALERT" not in line
    snap.unreachable.append("router")  # anything else still alerts
    assert "ALERT: router not answering" in status_line(snap, 60.0)


def test_a_failed_refit_holding_the_engines_is_named() -> None:
    failure = "refit tiny-cpu-1a2b-v7 abandoned: the learner's call ended mid-refit"
    line = status_line(Snapshot(max_steps=200, paused=True, refit_failure=failure), 60.0)
    assert f"ALERT: engines paused by a failed refit ({failure}) until a refit validates" in line
    assert "router paused (refit)" not in line
    plain = status_line(Snapshot(max_steps=200, paused=True), 60.0)
    assert "router paused (refit)" in plain and "ALERT" not in plain  # a refit in progress is no alarm
    # A failure the router no longer shows (it resumed meanwhile) is not an alert.
    assert "ALERT" not in status_line(Snapshot(max_steps=200, paused=False, refit_failure=failure), 60.0)


def test_failed_episodes_and_dead_letters_alert_only_while_they_grow() -> None:
    first = Snapshot(max_steps=200, failed_episodes=40, dead_letters=1)
    assert "ALERT: 40 failed episodes; 1 dead letters" in status_line(first, 60.0)  # no line before: alert
    growing = Snapshot(max_steps=200, failed_episodes=90, dead_letters=1)
    line = status_line(growing, 70.0, first)
    assert "ALERT: 90 failed episodes (+50 since the last line)" in line and "| 1 dead letters" in line
    recovered = status_line(Snapshot(max_steps=200, failed_episodes=90, dead_letters=1), 80.0, growing)
    assert "ALERT" not in recovered and "90 failed episodes" in recovered


def test_dead_engines_are_an_alert_and_a_long_refit_failure_shows_its_first_line() -> None:
    assert "ALERT: engines live 1/2" in status_line(Snapshot(max_steps=200, engines_healthy="1/2"), 60.0)
    assert "ALERT" not in status_line(Snapshot(max_steps=200, engines_healthy="2/2"), 60.0)
    failure = "ActorDiedError: The actor died unexpectedly\n\tclass_name: EngineActor\n\tpid: 7"
    line = status_line(Snapshot(max_steps=200, paused=True, refit_failure=failure), 60.0)
    assert "(ActorDiedError: The actor died unexpectedly)" in line and "\n" not in line
