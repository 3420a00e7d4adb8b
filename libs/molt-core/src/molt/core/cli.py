"""The start of every service's ``__main__``: settings, ``--dry-run``, logging.

Keeps each service's entry point to "config -> objects -> serve".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from molt.core.config import S, dump_settings, environ_snapshot, load_settings
from molt.core.errors import ConfigError
from molt.core.log import setup_logging
from molt.core.serve import ports_taken


def start_service(cls: type[S], section: str, prog: str, argv: Sequence[str] | None = None) -> S | None:
    """Loads the settings; prints them and returns None for ``--dry-run``; exits 2 on a config error."""
    try:
        settings, flags = load_settings(cls, section, argv, environ_snapshot(), prog=prog)
    except ConfigError as exc:
        sys.stderr.write(f"{prog}: {exc.message}\n")
        raise SystemExit(2) from exc
    if flags.dry_run:
        sys.stdout.write(dump_settings(settings) + "\n")
        return None
    setup_logging(prog, settings.run.run_id)
    if taken := ports_taken(settings):
        sys.stderr.write(f"{prog}: " + "; ".join(taken) + "\n")
        raise SystemExit(1)
    return settings
