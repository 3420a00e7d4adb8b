"""The ``[rollout]`` table: the values every service of one run must agree on.

Declared once here and read by all four services (``settings.rollout``), so one recipe cannot
disagree with itself. Services started from separate files meet in the run's Redis hash
(``register``) and refuse to run when they disagree on a value both act on; the router, which has
no Redis, is recorded by its clients from ``GetRouterStatus`` (``molt.v1.RolloutSettings``). Keys
that used to live in a service's own table are listed in ``MOVED``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field

from molt.core.errors import ConfigError
from molt.v1 import common_pb2


class RolloutSettings(BaseModel):
    """How rollouts are sampled, grouped, paced and queued (the recipe's ``[rollout]`` table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(8, ge=1, description="Samples (episodes) per prompt, n; advantages are taken per group.")
    groups_per_step: int = Field(
        8, ge=1, description="Trajectory groups per optimizer step (the learner's batch; producers pace on it)."
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="Group k starts only once the policy version is k // groups_per_step - max_staleness, and "
        "the learner drops a sample whose oldest loss token is more versions old (unless [learner] "
        "drop_after_versions says otherwise).",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the learner divides logits by it.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass; < 1 is refused together with IS correction.")
    top_k: int = Field(-1, ge=-1, description="Top-k cut (-1: none); a cut is refused together with IS correction.")
    partial_rollout: bool = Field(
        True,
        description="A refit pauses the engines keeping in-flight requests, which resume under the new weights "
        "(one response can mix policy versions); false drains them before every refit.",
    )
    queue_max_length: int = Field(
        1024, ge=1, description="Bound of the trajectory queue (groups not yet acknowledged) every producer uses."
    )
    routing_replay: bool = Field(
        False,
        description="MoE policies: the engines capture the experts each token was routed to, the trajectories "
        "carry them and the learner's forwards use them (rollout routing replay, docs/moe.md).",
    )

    @property
    def pause_mode(self) -> Literal["keep", "drain"]:
        """The router's pause mode for a refit under these settings."""
        return "keep" if self.partial_rollout else "drain"

    def to_proto(self) -> common_pb2.RolloutSettings:
        return common_pb2.RolloutSettings(**self.model_dump())

    @classmethod
    def from_proto(cls, message: common_pb2.RolloutSettings) -> RolloutSettings:
        return cls(**{name: getattr(message, name) for name in cls.model_fields})


# Which [rollout] values each service acts on. Two services are compared on the values both act on:
# a router ignores group_size, so a router started with the default is no disagreement.
USED_BY: dict[str, tuple[str, ...]] = {
    "rollout-router": ("temperature", "top_p", "top_k", "partial_rollout", "routing_replay"),
    "agent-pool": ("group_size", "groups_per_step", "max_staleness", "queue_max_length"),
    "learner": (
        "group_size",
        "groups_per_step",
        "max_staleness",
        "temperature",
        "top_p",
        "top_k",
        "partial_rollout",
        "queue_max_length",
        "routing_replay",
    ),
    "weight-broadcaster": ("partial_rollout",),
}


def run_key(run_id: str) -> str:
    """The Redis hash where each service of a run records the [rollout] values it acts on."""
    return f"molt:{run_id}:rollout"


def disagreements(mine: Mapping[str, Any], theirs: Mapping[str, Any], me: str, peer: str) -> list[str]:
    """One line per value both services act on and hold differently, naming both values."""
    return [
        f"rollout.{name}: {me} has {mine[name]!r}, {peer} has {theirs[name]!r}"
        for name in RolloutSettings.model_fields
        if name in mine and name in theirs and mine[name] != theirs[name]
    ]


def register(client: redis.Redis, run_id: str, service: str, settings: RolloutSettings) -> None:
    """Records ``service``'s [rollout] values in the run's hash and compares them with every other
    service's there; raises ``ConfigError`` naming both values of each disagreement.

    Services of one run meet here whatever files they were started from and in whatever order: the
    later one refuses to run, and its entry is removed. A recorded entry outlives its process, so a
    service restarted with a changed table is compared with the ones it would disagree with.
    """
    mine = {name: getattr(settings, name) for name in USED_BY[service]}
    key = run_key(run_id)
    client.hset(key, service, json.dumps(mine))
    problems = []
    for raw_peer, raw in sorted(client.hgetall(key).items()):
        peer = raw_peer.decode() if isinstance(raw_peer, bytes) else str(raw_peer)
        if peer != service:
            problems += disagreements(mine, json.loads(raw), service, peer)
    if problems:
        client.hdel(key, service)  # a service that refuses does not run: nothing of it stays to compare with
        raise ConfigError(
            f"the services of run {run_id!r} disagree on the [rollout] table (recorded in Redis {key}); start "
            "every service of a run with the same [rollout] values (or give the run a new run_id):\n  "
            + "\n  ".join(problems)
        )


# Keys that moved into [rollout]: (service table, key path) -> the new place, said to the user
# (``molt.core.config`` refuses them, with the keys a service's own settings class says moved).
MOVED: dict[tuple[str, tuple[str, ...]], str] = {
    **{("learner", (key,)): f"[rollout] {key}" for key in ("group_size", "groups_per_step", "max_staleness")},
    **{("agent_pool", (key,)): f"[rollout] {key}" for key in ("group_size", "groups_per_step", "max_staleness")},
    ("agent_pool", ("queue_max_length",)): "[rollout] queue_max_length",
    **{("router", ("sampling", key)): f"[rollout] {key}" for key in ("temperature", "top_p", "top_k")},
    ("router", ("pause", "default_mode")): "[rollout] partial_rollout (true: keep, false: drain)",
    ("broadcaster", ("pause_mode",)): "[rollout] partial_rollout (true: keep, false: drain)",
}
