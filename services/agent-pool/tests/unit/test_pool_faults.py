"""The pool's accounting under faults, against a real Redis queue: a full queue holds a finished group
(never drops it) and a stop meanwhile writes nothing behind the counts; episodes that all fail make the
producer back off; rewards and messages an agent returns are checked; abstract agents are refused.

The episodes come from a stand-in runner (no router): what is tested is the pool around them."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from molt.agent_pool.agents import Prompt, load_agent
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.dataset import load_prompts
from molt.agent_pool.episodes import Episode, _messages, _reward
from molt.agent_pool.pool import RolloutPool
from molt.agent_pool.prompts import PromptSource
from molt.agent_pool.transcript import Segment
from molt.core.queue import TrajectoryQueue
from molt.core.testing import free_port, nest_rollout

REPO = Path(__file__).resolve().parents[4]
RUN = "pool-faults"


def make_settings(tmp_path: Path, tiny_model: Path, **overrides: Any) -> AgentPoolSettings:
    values: dict[str, Any] = {
        "run": {"run_id": RUN, "run_dir": str(tmp_path)},
        "agent": f"{REPO}/recipes/agents/arithmetic.py:ArithmeticEnv",
        "data": {"path": f"{REPO}/recipes/data/arithmetic-train.jsonl"},
        "tokenizer_path": tiny_model,
        "group_size": 2,
        "groups_in_flight": 1,
        "metrics_port": 0,
    }
    return AgentPoolSettings(**nest_rollout(values | overrides))


def prompts(settings: AgentPoolSettings) -> PromptSource:
    return PromptSource(load_prompts(settings.data.path, settings.data.split))


async def one_episode(prompt: Prompt) -> Episode:
    segment = Segment([1, 2], [3, 4], [-0.5, -0.5], [True, True], [0, 0], turns=1)
    return Episode(rollout_id=str(time.monotonic_ns()), segments=[segment], reward=1.0)


def test_a_full_queue_holds_a_group_and_a_stop_writes_nothing_behind_the_counts(
    tmp_path: Path, tiny_model: Path, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(tmp_path, tiny_model)
    queue = TrajectoryQueue(redis_client, RUN, max_length=1)
    reader = TrajectoryQueue(redis_client, RUN, consumer="reader")
    caplog.set_level(logging.WARNING, logger="molt.agent_pool.pool")

    async def main() -> tuple[int, ...]:
        pool = RolloutPool(settings, one_episode, prompts(settings), queue, lambda: 10**6)
        pool.start(max_groups=1)
        await asyncio.wait_for(pool.wait_idle(), 30)  # the first group fills the queue
        pool.start(max_groups=1)
        await asyncio.sleep(1.5)  # the second waits for room
        held = (pool.stats.queued_groups, pool.stats.in_flight_groups)
        (entry,) = reader.read(count=1)
        reader.ack([entry.entry_id])
        await asyncio.wait_for(pool.wait_idle(), 30)
        pool.start(max_groups=1)  # a third, blocked too, then the pool is stopped
        await asyncio.sleep(1.2)
        await pool.stop(drain=False)
        await asyncio.sleep(1.5)
        return *held, pool.stats.queued_groups, pool.stats.unqueued_groups

    held_queued, held_in_flight, queued, unqueued = asyncio.run(main())
    assert (held_queued, held_in_flight) == (1, 1)  # not dropped: still in flight, waiting
    assert queued == 2 and unqueued == 1 and redis_client.xlen(queue.keys.stream) == 1
    assert any("the trajectory queue is full" in r.getMessage() for r in caplog.records)


def test_groups_whose_episodes_all_fail_make_the_producer_back_off(
    tmp_path: Path, tiny_model: Path, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(tmp_path, tiny_model)

    async def broken(prompt: Prompt) -> Episode:
        raise RuntimeError("agent bug")

    async def main() -> tuple[float, RolloutPool]:
        pool = RolloutPool(settings, broken, prompts(settings), TrajectoryQueue(redis_client, RUN), lambda: 0)
        started = time.monotonic()
        pool.start(max_groups=4)
        await asyncio.wait_for(pool.wait_idle(), 30)
        return time.monotonic() - started, pool

    caplog.set_level(logging.WARNING, logger="molt.agent_pool.pool")
    elapsed, pool = asyncio.run(main())
    assert pool.stats.failed_episodes == {"exception": 8} and pool.stats.filtered_groups == {"no_episodes": 4}
    backoffs = [r for r in caplog.records if "every episode of the last" in r.getMessage()]
    assert len(backoffs) == 3 and elapsed >= 0.25 + 0.5 + 1.0


def test_rewards_and_messages_an_agent_returns_are_checked(tmp_path: Path) -> None:
    assert _reward(1, "run()") == 1.0 and _reward(-2.5, "run()") == -2.5
    for bad in (math.nan, math.inf, 1e308, "0.7", None, True):
        with pytest.raises((TypeError, ValueError), match=r"run\(\) returned"):
            _reward(bad, "run()")
    assert _messages([{"role": "user", "content": "x"}], "reset()") == [{"role": "user", "content": "x"}]
    with pytest.raises(TypeError, match=r"reset\(\) must give a list of messages"):
        _messages("hello", "reset()")
    agent = tmp_path / "half.py"
    agent.write_text(
        "from molt.agent_pool.agents import Env\nclass Half(Env):\n    def reset(self, prompt):\n        return []\n"
    )
    with pytest.raises(ValueError, match=r"is abstract: it does not implement step"):
        load_agent(f"{agent}:Half")
    with pytest.raises(ValueError, match="is abstract"):
        load_agent("molt.agent_pool.agents:Env")


def test_a_second_start_paces_from_the_queue_as_it_finds_it(
    tmp_path: Path, tiny_model: Path, redis_client: redis.Redis
) -> None:
    """Two groups queued and unread, then a second StartRollouts: the backlog counts them once (they are
    not also this production's own started groups), so the next group's index is 2, not 4."""
    settings = make_settings(tmp_path, tiny_model, groups_per_step=1, max_staleness=100)

    async def main() -> tuple[int, int]:
        queue = TrajectoryQueue(redis_client, RUN)
        pool = RolloutPool(settings, one_episode, prompts(settings), queue, lambda: 10**6)
        pool.start(max_groups=2)
        await asyncio.wait_for(pool.wait_idle(), 30)
        redis_client.xgroup_create(queue.keys.stream, "learner", id="0", mkstream=True)
        pool.start(max_groups=1)
        await asyncio.wait_for(pool.wait_idle(), 30)
        return pool.stats.backlog_groups, pool.trainable_index

    backlog, index = asyncio.run(main())
    assert backlog == 2 and index == 3  # the backlog, then the one group this production started


def test_pacing_reads_that_redis_does_not_answer_are_logged_once_and_slowed(
    tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens at the queue's address (a Redis gone): the staleness gate's reads fail, each one
    slowed to a try a second, and one warning says so (it was ~20 lines a second)."""
    settings = make_settings(tmp_path, tiny_model)
    gone = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    caplog.set_level(logging.WARNING, logger="molt.agent_pool.pool")

    async def main() -> tuple[list[int | None], float]:
        pool = RolloutPool(settings, one_episode, prompts(settings), TrajectoryQueue(gone, RUN), int)
        started = time.monotonic()
        reads = [await pool._learner_skipped() for _ in range(3)]
        return reads, time.monotonic() - started

    reads, elapsed = asyncio.run(main())
    assert reads == [None, None, None] and elapsed >= 3.0
    warnings = [r for r in caplog.records if "cannot read the learner's skipped groups" in r.getMessage()]
    assert len(warnings) == 1


def test_a_pool_with_a_share_of_the_step_paces_on_its_share(
    tmp_path: Path, tiny_model: Path, redis_client: redis.Redis
) -> None:
    """groups_per_step 4, staleness 0, a share of 2 (another producer starts the other 2): at version 0
    the pool starts its 2 groups of step 1 and waits; with the whole step it would start all 4."""

    async def started(**share: int) -> int:
        redis_client.flushall()  # each production on an empty queue (no backlog from the other)
        settings = make_settings(tmp_path, tiny_model, groups_per_step=4, max_staleness=0, **share)
        queue = TrajectoryQueue(redis_client, RUN)
        pool = RolloutPool(settings, one_episode, prompts(settings), queue, lambda: 0)
        pool.start(max_groups=8)
        await asyncio.sleep(2.0)
        count = pool.stats.started_groups
        await pool.stop(drain=False)
        return count

    assert asyncio.run(started(groups_per_step_share=2)) == 2
    assert asyncio.run(started()) == 4
