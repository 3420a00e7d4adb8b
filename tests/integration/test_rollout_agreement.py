"""Services of one run started from separate files, as an operator would start them by hand: a
learner and an agent-pool whose [rollout] tables disagree meet in the run's Redis and the later one
refuses to start, naming both values. The router (no Redis of its own) is recorded by the pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from molt.core.rollout import run_key
from molt.core.testing import RedisServer, ServiceProcess, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
RUN = "agreement"


def learner_file(tmp_path: Path, name: str, model: Path, redis_url: str, rollout: str) -> tuple[Path, str]:
    address = f"127.0.0.1:{free_port()}"
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'[run]\nrun_id = "{RUN}"\nredis_url = "{redis_url}"\nrun_dir = "{tmp_path / name}"\n'
        f"[rollout]\n{rollout}\n"
        f'[learner]\nmodel_path = "{model}"\nlisten = "{address}"\nmetrics_port = 0\nrefit_every = 0\n'
        "max_steps = 1\npoll_s = 0.1\n"
    )
    return path, address


def pool_file(tmp_path: Path, router: Any, redis_url: str, rollout: str) -> Path:
    path = tmp_path / "pool.toml"
    path.write_text(
        f'[run]\nrun_id = "{RUN}"\nredis_url = "{redis_url}"\nrun_dir = "{tmp_path / "pool"}"\n'
        f"[rollout]\n{rollout}\n"
        f'[agent_pool]\nlisten = "127.0.0.1:{free_port()}"\nhttp_listen = "127.0.0.1:{free_port()}"\n'
        f'metrics_port = 0\nrouter_address = "{router.address}"\n'
        f'agent = "{REPO}/recipes/agents/arithmetic.py:ArithmeticEnv"\n'
        f'data = {{ path = "{REPO}/recipes/data/arithmetic-train.jsonl" }}\ntokenizer_path = "{router.model_path}"\n'
    )
    return path


def refused(module: str, config: Path) -> str:
    """Runs a service that must refuse to start; returns what it said."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--config", str(config)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-3000:]
    return done.stderr


def test_services_started_from_disagreeing_files_refuse_naming_both_values(
    tmp_path: Path, router: Any, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    temperature = f"temperature = {router.temperature}"
    config, address = learner_file(tmp_path, "learner", tiny_model, redis_server.url, f"group_size = 4\n{temperature}")
    learner = ServiceProcess(
        [sys.executable, "-m", "molt.learner", "--config", str(config)],
        address,
        tmp_path / "learner.log",
        service="molt.v1.LearnerService",
    )
    learner.start(timeout_s=240)
    try:
        said = refused("molt.agent_pool", pool_file(tmp_path, router, redis_server.url, "group_size = 2"))
    finally:
        learner.stop()
    assert "rollout.group_size: agent-pool has 2, learner has 4" in said
    recorded = redis_client.hgetall(run_key(RUN))
    assert sorted(recorded) == [b"learner", b"rollout-router"]  # the pool recorded the router, not itself

    # A learner restarted with another temperature than the engines sample at is refused before it trains.
    config, _ = learner_file(tmp_path, "learner-2", tiny_model, redis_server.url, "group_size = 4\ntemperature = 1.0")
    said = refused("molt.learner", config)
    assert f"rollout.temperature: learner has 1.0, rollout-router has {router.temperature}" in said
