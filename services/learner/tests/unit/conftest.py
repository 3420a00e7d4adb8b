"""Fixtures of the learner's unit tests: settings on the tiny model, the run in ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from molt.core.testing import nest_rollout
from molt.learner.config import LearnerSettings

SettingsFactory = Callable[..., LearnerSettings]


@pytest.fixture
def learner_settings(tiny_model: Path, tmp_path: Path) -> SettingsFactory:
    """``learner_settings(**overrides)``: settings on the tiny model with the run in ``tmp_path / "run"``."""

    def build(**overrides: Any) -> LearnerSettings:
        values: dict[str, Any] = {
            "model_path": tiny_model,
            "run": {"run_dir": tmp_path / "run"},
            "metrics_port": 0,
            "optimizer": {"lr": 1e-3},
            "group_size": 4,
            "groups_per_step": 2,
        }
        values.update(overrides)
        return LearnerSettings(**nest_rollout(values))

    return build
