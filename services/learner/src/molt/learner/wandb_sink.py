"""Weights & Biases as one more sink of the learner's step metrics (``[learner.metrics] wandb_project``).

The run is named after the run id and keeps one W&B id per run directory, so a learner restarted
from a checkpoint goes on logging into the same W&B run; W&B refuses a step at or below one it has
(the steps redone after a crash), which it says in its own log. The API key comes from the
environment or ``wandb login``; no setting holds it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from molt.core.errors import ConfigError
from molt.learner.config import MetricsSettings

log = logging.getLogger(__name__)


class WandbSink:
    """One W&B run for the learner of ``run_dir``."""

    def __init__(self, settings: MetricsSettings, run_id: str, run_dir: Path, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                "[learner.metrics] wandb_project is set but wandb is not installed: install the learner's "
                "wandb extra (pip install 'molt-learner[wandb]', or `uv sync` in this project)"
            ) from exc
        run_dir.mkdir(parents=True, exist_ok=True)
        ident = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=settings.wandb_project,
            entity=settings.wandb_entity,
            name=run_id,
            id=f"{run_id}-{ident}"[:64],
            dir=str(run_dir),
            mode=settings.wandb_mode,
            config=dict(config),
            resume="allow",
        )
        log.info("logging to Weights & Biases", extra={"project": settings.wandb_project, "mode": settings.wandb_mode})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
