"""Typed configuration shared by the molt services.

Each service declares one frozen settings class (``extra="forbid"``, a description per field,
which becomes its ``--help``). ``load_settings`` builds it from four layers, highest first: CLI
flags (``--engine.tensor_parallel_size 2``), environment variables
(``MOLT_ROUTER_ENGINE__TENSOR_PARALLEL_SIZE=2``), the service's table of a TOML recipe
(``[router]``) plus the shared ``[run]`` and ``[rollout]`` tables (``molt.core.rollout``), and
the defaults in the class. The merge happens here, in one place; validation errors name the key,
the value and the layer it came from. Nothing else in molt reads ``os.environ`` for settings.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource, EnvSettingsSource, PydanticBaseSettingsSource

from molt.core.errors import ConfigError
from molt.core.rollout import MOVED, RolloutSettings

# Top-level tables a recipe may have: the shared run and rollout tables, one per service, the launcher's.
SHARED_TABLES = ("run", "rollout")
RECIPE_TABLES = (*SHARED_TABLES, "router", "agent_pool", "learner", "broadcaster", "launcher")


class RunSettings(BaseModel):
    """What every service of one run shares (the recipe's ``[run]`` table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(
        "molt",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Run name; namespaces the Redis keys (molt:<run_id>:...).",
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis server holding the trajectory queue.")
    run_dir: Path = Field(Path("runs/molt"), description="Directory for logs, metrics and checkpoints of the run.")
    token_file: Path | None = Field(
        None,
        description="File (mode 0600) holding the run's bearer token: every gRPC server then refuses calls "
        "without it (UNAUTHENTICATED; the health check stays open) and every client sends it. molt up writes "
        "a fresh one per run; unset: no authentication (docs/security.md).",
    )
    tls_cert: Path | None = Field(None, description="PEM certificate the services serve gRPC with (TLS); with tls_key.")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert (mode 0600).")
    tls_ca: Path | None = Field(
        None,
        description="PEM CA: clients verify the services against it, and services then require client "
        "certificates it signed (mTLS). Unset with tls_cert set: clients trust tls_cert itself.",
    )
    redis_password_file: Path | None = Field(
        None,
        description="File (mode 0600) holding the Redis password (AUTH; the user is redis_url's). molt up's "
        "embedded Redis uses token_file, for an ACL user limited to the run's keys.",
    )


class ServiceSettings(BaseSettings):
    """Base of every service's settings: frozen, unknown keys refused.

    Only init values are read by pydantic itself; ``load_settings`` merges the
    layers explicitly so that the order is visible in one function.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")  # type: ignore[assignment]
    # Keys of this service's table that moved: key path -> the new place, said to the user when a
    # recipe, --set or the environment still sets one (the [rollout] moves are ``molt.core.rollout.MOVED``).
    MOVED_KEYS: ClassVar[Mapping[tuple[str, ...], str]] = {}

    run: RunSettings = Field(default_factory=RunSettings, description="Shared run settings (the [run] table).")
    rollout: RolloutSettings = Field(
        default_factory=RolloutSettings, description="What every service of the run agrees on (the [rollout] table)."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


S = TypeVar("S", bound=ServiceSettings)


def read_recipe(path: Path) -> dict[str, Any]:
    """Parses a TOML recipe and checks its top-level tables."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"recipe {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - set(RECIPE_TABLES))
    if unknown:
        raise ConfigError(f"recipe {path}: unknown table(s) {unknown}; allowed: {list(RECIPE_TABLES)}")
    return data


def with_shared_tables(section: str, tables: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's ``[section]`` table with the shared ``[run]`` and ``[rollout]`` tables inside it.

    A service table that holds a ``rollout`` table of its own (the learner's old ``[learner.rollout]``)
    is refused: those values are the shared table's now, and merging would hide one of the two.
    """
    own = dict(tables.get(section, {}))
    if "rollout" in own:
        raise ConfigError(
            f"invalid {section} settings: [{section}.rollout] moved to the top-level [rollout] table, "
            "which every service reads"
        )
    for name in SHARED_TABLES:
        if name in tables:
            own[name] = tables[name]
    return own


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def describe_error(error: Mapping[str, Any], layers: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """``  key = value (from <layer>): message`` for one pydantic error: the layer is the first (highest
    priority) of ``layers`` that holds the key."""
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(loc)
    # The highest-priority layer that holds the key is where the bad value came from.
    origin = next((name for name, layer in layers if _lookup(layer, loc) is not None), "defaults")
    value = json.dumps(error.get("input"), default=str)
    return f"  {key} = {value} (from {origin}): {error['msg']}"


def load_settings(
    cls: type[S],
    section: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[S, argparse.Namespace]:
    """Builds ``cls`` from CLI > env (``MOLT_<SECTION>_``) > recipe ``[section]`` > defaults.

    Returns the settings and the parsed launcher flags (``config``, ``dry_run``).
    Raises ``ConfigError`` naming every bad key, its value and the layer it came from.
    ``overrides``: the recipe tables ``molt up --set`` wrote into the recipe (already in it), so that
    a bad value from them is reported as coming from ``--set``.
    """
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    parser.add_argument("--config", type=Path, help=f"TOML recipe; its [run] and [{section}] tables are read")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved settings as JSON and exit")
    cli_source = CliSettingsSource(cls, root_parser=parser, cli_implicit_flags=True)
    namespace = parser.parse_args(list(argv) if argv is not None else None)
    cli = cli_source(parsed_args=namespace)()

    recipe: dict[str, Any] = {}
    if namespace.config is not None:
        tables = read_recipe(namespace.config)
        recipe = with_shared_tables(section, tables)
    env_source = EnvSettingsSource(
        cls, env_prefix=f"MOLT_{section.upper()}_", env_nested_delimiter="__", case_sensitive=False
    )
    if environ is not None:
        env_source.env_vars = {k.lower(): v for k, v in environ.items()}
    env = env_source()

    layers = [("command line", cli), ("environment", env), (f"recipe [{section}]", recipe)]
    if overrides:
        given = with_shared_tables(section, overrides)
        layers.insert(2, ("--set", given))  # the same values as the recipe's: only what errors name changes
    moves = {path: place for (table, path), place in MOVED.items() if table == section} | dict(cls.MOVED_KEYS)
    moved_keys(section, moves, layers, environ if environ is not None else os.environ)
    merged: dict[str, Any] = {}
    for _, layer in reversed(layers):
        merged = _merge(merged, layer)
    try:
        return cls(**merged), namespace
    except ValidationError as exc:
        details = "\n".join(describe_error(err, layers) for err in exc.errors())
        raise ConfigError(f"invalid {section} settings:\n{details}") from exc


def moved_keys(
    section: str,
    moves: Mapping[tuple[str, ...], str],
    layers: Sequence[tuple[str, Mapping[str, Any]]],
    environ: Mapping[str, str],
) -> None:
    """Raises ``ConfigError`` naming the new place of every key of ``moves`` found in ``layers`` (name,
    table) or as a ``MOLT_<SECTION>_...`` variable of ``environ`` (the environment source ignores names
    it does not know, so it cannot report them)."""
    found = []
    names = {name.upper() for name in environ}
    for path, place in moves.items():
        origins = [origin for origin, layer in layers if _lookup(layer, path) is not None]
        if f"MOLT_{section}_{'__'.join(path)}".upper() in names:
            origins.append("environment")
        found += [f"  {section}.{'.'.join(path)} (from {origin}) moved to {place}" for origin in origins]
    if found:
        header = f"invalid {section} settings: keys that moved, to set in their new place:"
        raise ConfigError("\n".join([header, *found]))


def _lookup(table: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = table
    for part in path:
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def dump_settings(settings: BaseModel) -> str:
    """The resolved settings as indented JSON (``--dry-run`` output, saved with each run)."""
    return settings.model_dump_json(indent=2)


def environ_snapshot() -> dict[str, str]:
    """The process environment, read once at start-up by ``__main__`` (never elsewhere)."""
    return dict(os.environ)
