"""The prompt order: every epoch visits every row once, in its own seeded order; the place kept is
the first prompt not yet consumed, in the run's Redis, and a restart continues from it."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import redis

from molt.agent_pool.dataset import PromptRows, load_prompts
from molt.agent_pool.prompts import PositionStore, PromptSource, position_key

RUN = "prompts"


def rows(tmp_path: Path, count: int) -> PromptRows:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"{n}+1", "answer": n + 1}) + "\n" for n in range(count)))
    return load_prompts(str(path), "train")


def take(source: PromptSource, count: int) -> list[str]:
    return [source.take()[1]["question"] for _ in range(count)]


def test_each_epoch_visits_every_row_once_in_its_own_seeded_order(tmp_path: Path) -> None:
    table = rows(tmp_path, 20)
    seen = take(PromptSource(table, shuffle=True, seed=7), 60)
    epochs = [seen[0:20], seen[20:40], seen[40:60]]
    assert all(sorted(epoch) == sorted(f"{n}+1" for n in range(20)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3  # reshuffled every epoch
    assert take(PromptSource(table, shuffle=True, seed=7), 60) == seen  # the seed fixes the order
    assert take(PromptSource(table, shuffle=True, seed=8), 20) != epochs[0]
    assert take(PromptSource(table, shuffle=False), 40) == [f"{n}+1" for n in range(20)] * 2


def test_the_place_moves_past_a_prompt_only_once_every_earlier_one_is_consumed(tmp_path: Path) -> None:
    source = PromptSource(rows(tmp_path, 5), shuffle=False)
    numbers = [source.take()[0] for _ in range(4)]
    assert numbers == [0, 1, 2, 3]
    assert not source.consumed(2) and not source.consumed(1)  # groups end out of order
    assert source.consumed(0) and source.resume_at == 3
    source.give_back(3)  # its group was cancelled by a stop
    assert source.take()[0] == 3  # taken again before any new prompt
    assert source.take()[0] == 4 and source.take()[0] == 5  # 5 is epoch 1, position 0
    source.consumed(4)
    source.give_back(4)  # consumed before its cancellation landed: not served twice
    assert source.take()[0] == 6


def test_the_place_is_kept_in_redis_and_a_new_source_continues_from_it(
    tmp_path: Path, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    table = rows(tmp_path, 5)

    def source(seed: int = 1) -> PromptSource:
        store = PositionStore(redis_client, RUN, "rows.jsonl", "train", len(table), shuffle=True, seed=seed)
        return PromptSource(table, shuffle=True, seed=seed, store=store)

    first = source()
    taken = [first.take() for _ in range(7)]  # into the second epoch
    for number, _ in taken[:6]:
        first.consumed(number)
    asyncio.run(first.save())
    kept = json.loads(redis_client.hget(position_key(RUN), "rows.jsonl@train") or "{}")
    assert kept == {"next": 6, "epoch": 1, "position": 1, "rows": 5, "shuffle": True, "seed": 1}
    again = source()  # a restarted pool: prompt 6 was taken but not consumed, so it is served again
    assert [again.take()[1]["id"] for _ in range(4)] == [taken[6][1]["id"]] + [first.take()[1]["id"] for _ in range(3)]
    caplog.set_level(logging.WARNING, logger="molt.agent_pool.prompts")
    assert source(seed=2).resume_at == 0  # counted over another order: from the beginning
    assert "counted over another order" in caplog.text
