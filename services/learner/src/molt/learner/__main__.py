"""Entry point of ``molt-learner``: settings -> objects -> serve."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from molt.core.cli import start_service
from molt.learner.config import LearnerSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(LearnerSettings, "learner", "molt-learner", argv)
    if settings is None:
        return
    logging.getLogger(__name__).error(
        "the learner's training loop is not implemented yet (issue #5); only --dry-run works"
    )
    sys.exit(2)


if __name__ == "__main__":
    main()
