"""The learner's metrics sinks: the reward curve is redrawn off the training loop's path."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from molt.learner.config import MetricsSettings
from molt.learner.metrics import MetricsLog
from molt.learner.wandb_sink import WandbSink


def test_the_reward_curve_is_drawn_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = MetricsLog(tmp_path, plot_every=2)
    release = threading.Event()
    drawn_by: list[str] = []
    draw = log._draw

    def slow_draw(series: tuple[list[int], list[float], list[float]]) -> None:
        release.wait(timeout=30)
        drawn_by.append(threading.current_thread().name)
        draw(series)

    monkeypatch.setattr(log, "_draw", slow_draw)
    log.record(1, {"reward/mean": 0.1, "reward/std": 0.0})
    log.record(2, {"reward/mean": 0.2, "reward/std": 0.1})  # starts a drawing, which now waits
    log.record(3, {"reward/mean": 0.3, "reward/std": 0.1})
    log.record(4, {"reward/mean": 0.4, "reward/std": 0.1})  # the drawer is busy: skipped, not queued
    assert not (tmp_path / "reward.png").exists()  # record() returned without drawing
    release.set()
    log.plot()  # waits for the drawing in progress, then draws all four steps
    assert drawn_by[0].startswith("reward-plot") and len(drawn_by) == 2
    assert (tmp_path / "reward.png").stat().st_size > 0
    log.close()


def test_a_failed_background_drawing_is_logged_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = MetricsLog(tmp_path, plot_every=1)

    def broken(series: object) -> None:
        raise RuntimeError("no fonts")

    monkeypatch.setattr(log, "_draw", broken)
    log.record(1, {"reward/mean": 0.1})
    assert log.drawing is not None
    log.drawing.result()  # the failure does not propagate out of the background drawing
    assert "could not redraw the reward curve" in caplog.text
    with pytest.raises(RuntimeError, match="no fonts"):
        log.plot()  # an explicit drawing still raises
    log.close()  # the end of a run logs it and still flushes and stops the rest
    assert "could not draw the final reward curve" in caplog.text


def test_steps_go_to_weights_and_biases_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[learner.metrics] wandb_project in offline mode: one W&B run under <run_dir>/wandb, named by the run
    id, whose record file holds every step's metrics (read back as bytes: wandb's reader is not Python)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    settings = MetricsSettings(wandb_project="molt-test", wandb_mode="offline")
    metrics = MetricsLog(run_dir, plot_every=100, sink=WandbSink(settings, "wb-run", run_dir, {"lr": 1e-4}))
    for step in range(1, 4):
        metrics.record(step, {"reward/mean": 0.25 * step, "loss/policy": 1.0 / step})
    metrics.close()
    (record,) = (run_dir / "wandb").glob("offline-run-*-wb-run-*/run-wb-run-*.wandb")
    data = record.read_bytes()
    assert data.count(b"reward/mean") >= 3 and b"0.75" in data  # the third step's reward
