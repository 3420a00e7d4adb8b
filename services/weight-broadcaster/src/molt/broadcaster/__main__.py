"""Entry point of ``molt-broadcaster``: settings -> objects -> serve."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from molt.broadcaster.config import BroadcasterSettings
from molt.core.cli import start_service


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(BroadcasterSettings, "broadcaster", "molt-broadcaster", argv)
    if settings is None:
        return
    logging.getLogger(__name__).error(
        "the weight-broadcaster's serving loop is not implemented yet (issue #6); only --dry-run works"
    )
    sys.exit(2)


if __name__ == "__main__":
    main()
