"""Entry point of ``molt-agent-pool``: settings -> router client, queue, agents -> serve until SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from molt.agent_pool.config import AgentPoolSettings
from molt.core.cli import start_service


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(AgentPoolSettings, "agent_pool", "molt-agent-pool", argv)
    if settings is None:
        return
    from molt.agent_pool.service import serve

    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
