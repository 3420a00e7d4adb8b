"""Entry point of ``molt-learner``: settings -> soundness check -> RL loop + LearnerService, or SFT."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from molt.core.cli import start_service
from molt.core.errors import ConfigError
from molt.learner.config import LearnerSettings, check_sound


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(LearnerSettings, "learner", "molt-learner", argv)
    if settings is None:
        return
    try:
        check_sound(settings)
    except ConfigError as exc:
        sys.stderr.write(f"molt-learner: {exc.message}\n")
        raise SystemExit(2) from exc
    if settings.mode == "sft":
        from molt.learner.sft import run_sft

        run_sft(settings)
        return
    from molt.learner.service import launch

    launch(settings)


if __name__ == "__main__":
    main()
