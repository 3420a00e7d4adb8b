"""Entry point of ``molt-router``: settings -> objects -> serve."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from molt.core.cli import start_service
from molt.router.config import RouterSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(RouterSettings, "router", "molt-router", argv)
    if settings is None:
        return
    logging.getLogger(__name__).error(
        "the router's serving loop is not implemented yet (issue #3); only --dry-run works"
    )
    sys.exit(2)


if __name__ == "__main__":
    main()
