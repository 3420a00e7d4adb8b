"""Entry point of ``molt-learner``: settings -> soundness check -> RL loop + LearnerService, or SFT."""

from __future__ import annotations

from collections.abc import Sequence

from molt.core.cli import refuse_on_config_error, start_service
from molt.learner.config import LearnerSettings, check_sound


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(LearnerSettings, "learner", "molt-learner", argv)
    if settings is None:
        return
    with refuse_on_config_error("molt-learner"):
        check_sound(settings)
    if settings.mode == "sft":
        from molt.learner.sft import run_sft

        run_sft(settings)
        return
    from molt.learner.service import launch

    with refuse_on_config_error("molt-learner"):
        launch(settings)


if __name__ == "__main__":
    main()
