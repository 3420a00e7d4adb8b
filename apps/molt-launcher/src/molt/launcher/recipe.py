"""A recipe as the launcher sees it: ``--set`` overrides, the ``[launcher]`` table, each service's
resolved settings, and the effective recipe every service of a run is started with.

The launcher never re-implements a service's settings: it writes the recipe
(plus overrides and its own wiring) to TOML and loads each table through the
service's settings class and ``molt.core.config.load_settings``, as the service
itself will. The effective recipe is saved as ``<run_dir>/config.toml``, so any
service of the run can be restarted by hand with ``molt-<svc> --config`` on it.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from molt.agent_pool.config import AgentPoolSettings
from molt.broadcaster.config import BroadcasterSettings
from molt.core.config import (
    RECIPE_TABLES,
    ServiceSettings,
    describe_error,
    environ_snapshot,
    load_settings,
    read_recipe,
)
from molt.core.errors import ConfigError
from molt.learner.config import LearnerSettings
from molt.router.config import RouterSettings

# Recipe table -> (settings class, console script), in start order.
SERVICES: dict[str, tuple[type[ServiceSettings], str]] = {
    "router": (RouterSettings, "molt-router"),
    "broadcaster": (BroadcasterSettings, "molt-broadcaster"),
    "learner": (LearnerSettings, "molt-learner"),
    "agent_pool": (AgentPoolSettings, "molt-agent-pool"),
}


class LauncherSettings(BaseModel):
    """The recipe's ``[launcher]`` table: declared resources and how ``molt up`` runs the services."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, values: Any) -> Any:
        if isinstance(values, dict) and "learner_restarts" in values:
            raise ValueError(
                "[launcher] learner_restarts was replaced by [launcher] restarts, a budget for every service"
            )
        return values

    nodes: int = Field(1, ge=1, description="Nodes of the cluster the run uses (node 0 runs the launcher).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 = a CPU run (engines and ranks take CPUs).")
    colocate: bool = Field(
        False,
        description="The learner and the engines share the GPUs (one GPU: one learner rank and one engine): split "
        "the memory with [router.engine] gpu_memory_utilization; refits go through CUDA IPC, not NCCL.",
    )
    cpus_per_node: int = Field(2, ge=1, description="CPUs per node (the local Ray head gets this many).")
    ray_address: str | None = Field(
        None, description="Existing Ray cluster (host:port) for router and broadcaster; unset = start a local head."
    )
    ray_port: int = Field(0, ge=0, le=65535, description="Port of the local Ray head; 0 picks a free one.")
    without: tuple[Literal["agent_pool"], ...] = Field(
        (),
        description="Services the run leaves out: ['agent_pool'] runs the other three for a producer of your own "
        "(docs/custom-agent-pool.md), which reads the run's settings from the learner's GetRunSettings.",
    )
    embedded_redis: bool = Field(
        False, description="Start a local redis-server even when [run] redis_url is set (always done when unset)."
    )
    sft_warmup: bool = Field(False, description="Run `molt-learner --mode sft` on [learner.sft] first, then RL.")
    build_tiny_model: bool | Literal["moe"] = Field(
        False,
        description="Build the tiny model (molt-tiny-model) at the learner's model_path when it is missing; "
        '"moe": the tiny mixture-of-experts model (molt-tiny-model --moe).',
    )
    start_timeout_s: float = Field(900.0, gt=0, description="Longest wait for one service to become healthy.")
    stop_timeout_s: float = Field(60.0, gt=0, description="Grace after SIGTERM before a service is SIGKILLed.")
    agent_pool_stop_timeout_s: float = Field(
        600.0, gt=0, description="Grace for the agent-pool, which runs a final evaluation when stopped."
    )
    progress_every_s: float = Field(5.0, gt=0, description="Interval of the terminal status line, seconds.")
    restarts: int = Field(
        3,
        ge=0,
        description="Restarts molt up may make in the whole run, of any service or the embedded redis-server "
        "that dies (the learner: only when it exits with an error); each is logged, counted on the status line "
        "and in the end summary. The learner resumes from its newest checkpoint; the others rejoin the running "
        "job (docs/launcher.md). The Ray head is never restarted. 0: the run ends with the first death.",
    )
    restart_backoff_s: float = Field(
        2.0,
        ge=0,
        description="Wait before restarting a service, doubled with each restart of the same one (at most 60 s).",
    )
    rollout_nice: int | None = Field(
        None,
        ge=0,
        le=19,
        description="Scheduling niceness of the rollout side (the Ray head and so the engines, the router, the "
        "agent-pool, the broadcaster); unset = 10 on a CPU run, where the learner shares cores with them and "
        "they should fill the CPU time it leaves, not take it; 0 with GPUs. The Ray head stays at 0 with "
        "[learner] placement = 'ray' (its ranks are Ray workers too).",
    )


@dataclass(frozen=True)
class Recipe:
    """A recipe after ``--set``: its tables, launcher settings and each service's resolved settings."""

    path: Path
    tables: dict[str, Any]
    launcher: LauncherSettings
    services: dict[str, ServiceSettings]  # the services the run starts, in start order

    @property
    def router(self) -> RouterSettings:
        return self.services["router"]  # type: ignore[return-value]

    @property
    def learner(self) -> LearnerSettings:
        return self.services["learner"]  # type: ignore[return-value]

    @property
    def agent_pool(self) -> AgentPoolSettings | None:
        """None when the run leaves the agent-pool out (``[launcher] without``)."""
        return self.services.get("agent_pool")  # type: ignore[return-value]

    @property
    def broadcaster(self) -> BroadcasterSettings:
        return self.services["broadcaster"]  # type: ignore[return-value]

    def sft_output(self, run_dir: Path) -> Path | None:
        """Where the SFT warm-up of a run in ``run_dir`` writes its model (the learner's rule), or None
        when the recipe asks for no warm-up."""
        sft = self.learner.sft
        if not self.launcher.sft_warmup or sft is None:
            return None
        return sft.output_dir or run_dir / "sft-model"


def parse_set(assignment: str) -> tuple[list[str], Any]:
    """``table.key.sub=value`` -> (path, value); the value is read as TOML (``2``, ``true``, ``"x"``,
    ``[1, 2]``) and kept as a plain string when it is not valid TOML."""
    key, sep, raw = assignment.partition("=")
    path = [part.strip() for part in key.split(".")]
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(f"--set {assignment!r}: expected table.key=value, e.g. learner.max_steps=5")
    if path[0] not in RECIPE_TABLES:
        raise ConfigError(f"--set {assignment!r}: unknown table {path[0]!r}; allowed: {list(RECIPE_TABLES)}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def apply_sets(tables: Mapping[str, Any], assignments: Sequence[str]) -> dict[str, Any]:
    """A deep copy of ``tables`` with each ``--set`` applied in order."""
    result: dict[str, Any] = json.loads(json.dumps(tables, default=str))
    for assignment in assignments:
        path, value = parse_set(assignment)
        node = result
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {assignment!r}: {part!r} is a value, not a table")
            node = child
        node[path[-1]] = value
    return result


def resolve_services(
    tables: Mapping[str, Any], sets: Mapping[str, Any] | None = None, without: Sequence[str] = ()
) -> dict[str, ServiceSettings]:
    """Each started service's settings from ``tables`` (all but ``without``), loaded exactly as
    ``molt-<svc> --config`` loads them (environment included); a ``ConfigError`` names the service,
    key, value and where it came from (``sets``: the tables the ``--set`` assignments alone make)."""
    with tempfile.TemporaryDirectory(prefix="molt-recipe-") as tmp:
        path = Path(tmp) / "recipe.toml"
        path.write_text(to_toml(tables))
        environ = environ_snapshot()
        return {
            section: load_settings(cls, section, ["--config", str(path)], environ, prog=script, overrides=sets)[0]
            for section, (cls, script) in SERVICES.items()
            if section not in without
        }


def load_recipe(path: Path, assignments: Sequence[str] = ()) -> Recipe:
    """Reads ``path``, applies ``--set`` assignments and resolves the launcher and service settings."""
    tables = apply_sets(read_recipe(path), assignments)
    sets = apply_sets({}, assignments)
    try:
        launcher = LauncherSettings(**tables.get("launcher", {}))
    except ValidationError as exc:  # one line per bad key, as the services' settings say it
        layers = [("--set", sets.get("launcher", {})), (f"recipe {path} [launcher]", tables.get("launcher", {}))]
        details = "\n".join(describe_error(err, layers) for err in exc.errors())
        raise ConfigError(f"invalid launcher settings:\n{details}") from exc
    return Recipe(path, tables, launcher, resolve_services(tables, sets, launcher.without))


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a model (a save_pretrained layout: its config.json)."""
    return (path / "config.json").is_file()


def connect_address(listen: str) -> str:
    """The address a local client dials for a ``listen`` address (a wildcard host becomes loopback)."""
    host, _, port = listen.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("", "0.0.0.0", "[::]", "::") else listen


def wire(
    recipe: Recipe,
    run_dir: Path,
    redis_url: str | None,
    ray_address: str | None,
    engine_nodes: list[int],
    token_file: Path | None = None,
) -> dict[str, Any]:
    """The effective recipe of a run: ``recipe``'s tables plus the launcher's wiring - the run
    directory, the run's token file (the embedded Redis's password too), the embedded Redis, the Ray
    cluster, each client pointed at the address its server
    listens on, the planned node of each engine on a cluster of several nodes, and (with the SFT
    warm-up) every model path pointed at the SFT output."""
    tables = apply_sets(recipe.tables, ())
    for name in ("run", *recipe.services):
        tables.setdefault(name, {})
    tables["run"]["run_dir"] = str(run_dir)
    if token_file is not None:
        tables["run"]["token_file"] = str(token_file)
    if redis_url is not None:
        tables["run"]["redis_url"] = redis_url
        if token_file is not None:
            tables["run"]["redis_password_file"] = str(token_file)
    if ray_address is not None:
        tables["router"]["ray_address"] = ray_address
        tables["broadcaster"]["ray_address"] = ray_address
        if recipe.learner.placement == "ray":
            tables["learner"]["ray_address"] = ray_address
    if recipe.launcher.nodes > 1:  # one node: Ray's own choice is the plan
        tables["router"].setdefault("engine", {})["nodes"] = engine_nodes
    # A client address the recipe sets itself wins: something of the user's may sit in between (a proxy).
    router = connect_address(recipe.router.listen)
    tables["broadcaster"].setdefault("router_address", router)
    broadcaster = connect_address(recipe.broadcaster.listen)
    tables["learner"].setdefault("broadcaster_address", broadcaster)
    if recipe.launcher.colocate:
        tables["broadcaster"]["backend"] = "cuda_ipc"
    if recipe.agent_pool is not None:
        tables["agent_pool"].setdefault("router_address", router)
        tables["agent_pool"].setdefault("broadcaster_address", broadcaster)
    sft_output = recipe.sft_output(run_dir)
    if sft_output is not None:
        tables["router"].setdefault("engine", {})["model_path"] = str(sft_output)
        tables["learner"]["model_path"] = str(sft_output)
        if recipe.agent_pool is not None:
            tables["agent_pool"]["tokenizer_path"] = str(sft_output)
    return tables


# -- TOML writing (tomllib only reads) ----------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def to_toml(tables: Mapping[str, Any]) -> str:
    """TOML text for nested tables of plain values (None values are left out: TOML has no null)."""
    lines: list[str] = []

    def emit(prefix: str, table: Mapping[str, Any]) -> None:
        values = {k: v for k, v in table.items() if not isinstance(v, Mapping) and v is not None}
        subtables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
        if prefix and (values or not subtables):
            lines.append(f"\n[{prefix}]")
        lines.extend(f"{_key(k)} = {_value(v)}" for k, v in values.items())
        for name, sub in subtables.items():
            emit(f"{prefix}.{_key(name)}" if prefix else _key(name), sub)

    emit("", tables)
    return "\n".join(lines).lstrip("\n") + "\n"
