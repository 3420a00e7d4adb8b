"""Entry point of ``molt-broadcaster``: settings -> ``service.launch`` (Ray + weight group -> WeightService)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from molt.broadcaster.config import BroadcasterSettings
from molt.core.cli import refuse_on_config_error, start_service


def main(argv: Sequence[str] | None = None) -> None:
    settings = start_service(BroadcasterSettings, "broadcaster", "molt-broadcaster", argv)
    if settings is None:
        return
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # see molt.router.__main__
    from molt.broadcaster.service import launch

    with refuse_on_config_error("molt-broadcaster"):
        launch(settings)


if __name__ == "__main__":
    main()
