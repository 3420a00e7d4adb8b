"""The run's secret as ``molt up`` sets it up (docs/security.md).

One token per run, in ``<run_dir>/secrets/token`` (mode 0600, directory 0700) unless the recipe names
its own ``[run] token_file``. The effective recipe (``config.toml``) holds the file's path, never the
token, so a service restarted by hand with that config authenticates as the launcher's children do.
The embedded redis-server takes the same token as the password of its one ACL user.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from molt.core.auth import Access, read_secret, write_token
from molt.core.config import RunSettings
from molt.core.processes import RedisServer
from molt.launcher.recipe import Recipe

TOKEN = Path("secrets") / "token"


def run_token(recipe: Recipe, run_dir: Path) -> Path:
    """The run's token file: the recipe's ``[run] token_file``, else a fresh token at ``run_dir/secrets/token``."""
    given = recipe.learner.run.token_file
    if given is not None:
        read_secret(given, "[run] token_file")  # refused now, not by the first service a minute later
        return given
    path = run_dir / TOKEN
    write_token(path)
    return path


def embedded_redis_server(run_dir: Path, token_file: Path, run_id: str) -> RedisServer:
    """The run's own redis-server: AOF on (a restarted one comes back with every entry), and one ACL
    user whose password is the run's token, limited to the run's keys."""
    password = read_secret(token_file, "[run] token_file").decode().strip()
    return RedisServer(run_dir / "redis", appendonly=True, password=password, key_prefix=f"molt:{run_id}:")


def run_access(config_path: Path) -> Access:
    """What a client of a running run needs (``molt status``), from the run's ``config.toml``."""
    try:
        run = tomllib.loads(config_path.read_text()).get("run", {})
    except (OSError, tomllib.TOMLDecodeError):
        return Access()
    return Access.of(RunSettings(**run))
