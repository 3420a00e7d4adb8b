"""The start of every service's ``__main__``: settings, ``--dry-run``, logging.

Keeps each service's entry point to "config -> objects -> serve".
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

from molt.core.config import S, dump_settings, environ_snapshot, load_settings
from molt.core.errors import ConfigError
from molt.core.log import setup_logging
from molt.core.serve import ports_taken


def start_service(cls: type[S], section: str, prog: str, argv: Sequence[str] | None = None) -> S | None:
    """Loads the settings; prints them and returns None for ``--dry-run``; exits 2 on a config error."""
    with refuse_on_config_error(prog):
        settings, flags = load_settings(cls, section, argv, environ_snapshot(), prog=prog)
    if flags.dry_run:
        sys.stdout.write(dump_settings(settings) + "\n")
        return None
    setup_logging(prog, settings.run.run_id)
    if taken := ports_taken(settings):
        sys.stderr.write(f"{prog}: " + "; ".join(taken) + "\n")
        raise SystemExit(1)
    return settings


@contextlib.contextmanager
def refuse_on_config_error(prog: str) -> Iterator[None]:
    """Ends the process with exit 2 and the message on stderr when start-up raises ``ConfigError``:
    settings that cannot work, or a peer of the run that disagrees on the [rollout] table."""
    try:
        yield
    except ConfigError as exc:
        sys.stderr.write(f"{prog}: {exc.message}\n")
        raise SystemExit(2) from exc
