"""Entry point of ``molt-agent-pool``: settings -> router client, queue, agents -> serve until SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from molt.agent_pool.config import AgentPoolSettings
from molt.core.cli import refuse_on_config_error, start_service


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(AgentPoolSettings, "agent_pool", "molt-agent-pool", argv)
    if settings is None:
        return
    from molt.agent_pool.service import serve

    with refuse_on_config_error("molt-agent-pool"):
        asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
