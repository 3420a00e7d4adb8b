"""Entry point of ``molt-agent-pool``: settings -> objects -> serve."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from molt.agent_pool.config import AgentPoolSettings
from molt.core.cli import start_service


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(AgentPoolSettings, "agent_pool", "molt-agent-pool", argv)
    if settings is None:
        return
    logging.getLogger(__name__).error(
        "the agent-pool's serving loop is not implemented yet (issue #4); only --dry-run works"
    )
    sys.exit(2)


if __name__ == "__main__":
    main()
