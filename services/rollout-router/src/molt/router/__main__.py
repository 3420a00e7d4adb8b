"""Entry point of ``molt-router``: settings -> ``service.launch`` (Ray + engines -> RolloutService until SIGTERM)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from molt.core.cli import start_service
from molt.router.config import RouterSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(RouterSettings, "router", "molt-router", argv)
    if settings is None:
        return
    # Ray's `uv run` hook would start every worker through `uv run` and upload the working
    # directory; molt's workers share this interpreter, so turn it off before Ray is imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    from molt.router.service import launch

    launch(settings)


if __name__ == "__main__":
    main()
