"""The [rollout] agreement between services of one run, in a real Redis: values both act on are
compared, the later service refuses with both values named, and the wire form round-trips."""

from __future__ import annotations

import pytest
import redis

from molt.core.errors import ConfigError
from molt.core.rollout import RolloutSettings, register, run_key


def test_services_that_agree_on_what_they_share_both_register(redis_client: redis.Redis) -> None:
    """The router ignores group_size: a router at the default 8 beside a pool at 4 is no disagreement."""
    register(redis_client, "run", "rollout-router", RolloutSettings(temperature=0.8))
    register(redis_client, "run", "agent-pool", RolloutSettings(group_size=4))
    register(redis_client, "run", "learner", RolloutSettings(group_size=4, temperature=0.8))
    assert sorted(redis_client.hkeys(run_key("run"))) == [b"agent-pool", b"learner", b"rollout-router"]


def test_the_later_service_refuses_naming_both_values(redis_client: redis.Redis) -> None:
    register(redis_client, "run", "agent-pool", RolloutSettings(group_size=4, max_staleness=2))
    register(redis_client, "run", "rollout-router", RolloutSettings(temperature=0.8))
    with pytest.raises(ConfigError) as info:
        register(redis_client, "run", "learner", RolloutSettings(group_size=8, max_staleness=2, temperature=1.0))
    message = info.value.message
    assert "rollout.group_size: learner has 8, agent-pool has 4" in message
    assert "rollout.temperature: learner has 1.0, rollout-router has 0.8" in message
    assert "max_staleness" not in message  # the values that agree are not listed
    assert redis_client.hget(run_key("run"), "learner") is None  # the refused service left no entry


def test_runs_do_not_meet(redis_client: redis.Redis) -> None:
    register(redis_client, "a", "agent-pool", RolloutSettings(group_size=4))
    register(redis_client, "b", "learner", RolloutSettings(group_size=8))


def test_a_restarted_service_replaces_its_own_entry(redis_client: redis.Redis) -> None:
    register(redis_client, "run", "learner", RolloutSettings(group_size=8))
    register(redis_client, "run", "learner", RolloutSettings(group_size=4))
    register(redis_client, "run", "agent-pool", RolloutSettings(group_size=4))


def test_the_wire_form_round_trips() -> None:
    settings = RolloutSettings(group_size=3, top_k=5, temperature=0.5, partial_rollout=False, queue_max_length=7)
    assert RolloutSettings.from_proto(settings.to_proto()) == settings
    assert settings.pause_mode == "drain" and RolloutSettings().pause_mode == "keep"
