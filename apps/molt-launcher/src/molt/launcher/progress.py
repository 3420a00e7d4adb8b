"""What a run is doing, read from its services and files: the status line, the reward figure, the summary.

Sources: LearnerService ``GetLearnerStatus`` (step, version, last step's metrics),
RolloutService ``GetRouterStatus`` (engines, in-flight requests, pause),
AgentPoolService ``GetAgentPoolStatus``, WeightService ``GetPolicyVersion``,
the queue's stats (``molt.core.queue``), ``<run_dir>/metrics.jsonl`` (the
learner's, one line per step) and ``<run_dir>/eval.jsonl`` (the agent-pool's
held-out evaluations). Every RPC has a short deadline; a service that does not
answer is reported as such, never waited on.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis

from molt.core.auth import Access
from molt.core.queue import TrajectoryQueue
from molt.learner.metrics import read_history
from molt.v1 import (
    agent_pool_pb2,
    agent_pool_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)

RPC_TIMEOUT_S = 2.0


@dataclass
class Snapshot:
    """One look at a run; None = not known (the service did not answer)."""

    step: int | None = None
    max_steps: int = 0
    learner_version: int | None = None
    reward: float | None = None
    tokens_per_s: float | None = None
    staleness: float | None = None
    learner_idle_s: float | None = None
    queue_depth: int | None = None
    dead_letters: int | None = None
    router_version: int | None = None
    engines_healthy: str | None = None
    engines_replacing: list[str] = field(default_factory=list)  # dead, a new one starting in their place
    engines_waiting: list[str] = field(default_factory=list)  # replaced, out of routing until a refit
    engine_replacements: int = 0
    in_flight: int | None = None
    paused: bool | None = None
    episodes: int | None = None
    failed_episodes: int | None = None
    broadcaster_version: int | None = None
    published_step: int | None = None  # the learner step whose weights the broadcaster published last
    refit_failure: str = ""  # why a failed refit holds the engines paused (the broadcaster's word); "" = none
    last_eval: dict[str, Any] | None = None
    unreachable: list[str] = field(default_factory=list)


def _ask(
    snap: Snapshot, access: Access, addresses: dict[str, str], name: str, make_stub: Any, method: str, request: Any
) -> Any:
    """``name``'s reply to ``method``; None when it is not in ``addresses`` or does not answer (then
    it is listed as unreachable)."""
    if name not in addresses:
        return None
    with access.channel(addresses[name]) as channel:
        try:
            return getattr(make_stub(channel), method)(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError:
            snap.unreachable.append(name)
            return None


def gather(
    addresses: dict[str, str], redis_url: str, run_id: str, run_dir: Path, max_steps: int, access: Access | None = None
) -> Snapshot:
    """Asks every service at ``addresses`` (keys: router, learner, agent_pool, broadcaster) and the queue,
    with the run's token (``access``)."""
    access = access or Access()
    snap = Snapshot(max_steps=max_steps)
    learner = learner_pb2.GetLearnerStatusRequest()
    reply = _ask(snap, access, addresses, "learner", learner_pb2_grpc.LearnerServiceStub, "GetLearnerStatus", learner)
    if reply is not None:
        metrics = dict(reply.last_step_metrics)
        snap.step, snap.learner_version = int(reply.step), int(reply.policy_version)
        snap.reward = metrics.get("reward/mean")
        snap.tokens_per_s = metrics.get("tokens_per_s")
        snap.staleness = metrics.get("staleness/mean")
        if reply.HasField("last_step_time"):
            snap.learner_idle_s = max(0.0, time.time() - reply.last_step_time.ToDatetime().timestamp())
    router = rollout_pb2.GetRouterStatusRequest()
    reply = _ask(snap, access, addresses, "router", rollout_pb2_grpc.RolloutServiceStub, "GetRouterStatus", router)
    if reply is not None:
        snap.router_version = int(reply.policy_version)
        snap.in_flight = int(reply.in_flight_request_count)
        snap.paused = bool(reply.paused)
        snap.engines_healthy = f"{sum(e.healthy for e in reply.engines)}/{len(reply.engines)}"
        snap.engines_replacing = [e.engine_id for e in reply.engines if e.replacing]
        snap.engines_waiting = [e.engine_id for e in reply.engines if e.healthy and not e.serving]
        snap.engine_replacements = sum(e.replacement_count for e in reply.engines)
    pool = agent_pool_pb2.GetAgentPoolStatusRequest()
    reply = _ask(
        snap, access, addresses, "agent_pool", agent_pool_pb2_grpc.AgentPoolServiceStub, "GetAgentPoolStatus", pool
    )
    if reply is not None:
        snap.episodes = int(reply.completed_episode_count)
        snap.failed_episodes = int(sum(reply.failed_episode_counts.values()))
    version = weights_pb2.GetPolicyVersionRequest()
    reply = _ask(
        snap, access, addresses, "broadcaster", weights_pb2_grpc.WeightServiceStub, "GetPolicyVersion", version
    )
    if reply is not None:
        snap.broadcaster_version = int(reply.policy_version.version)
        snap.published_step = int(reply.policy_version.learner_step)
        snap.refit_failure = reply.refit_failure
    _queue_stats(snap, access, redis_url, run_id)
    evals = read_evals(run_dir / "eval.jsonl")
    snap.last_eval = evals[-1] if evals else None
    return snap


def _queue_stats(snap: Snapshot, access: Access, redis_url: str, run_id: str) -> None:
    client = access.redis(redis_url, socket_timeout=RPC_TIMEOUT_S, socket_connect_timeout=RPC_TIMEOUT_S)
    try:
        stats = TrajectoryQueue(client, run_id).stats()
        snap.queue_depth, snap.dead_letters = stats.depth, stats.dead_letters
    except redis.RedisError:
        snap.unreachable.append("redis")
    finally:
        client.close()


def _num(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def status_line(snap: Snapshot, elapsed_s: float, previous: Snapshot | None = None) -> str:
    """One terminal line: step, versions, reward, throughput, queue, staleness, eval, alerts. With the
    ``previous`` line's snapshot, failed episodes and dead letters are an alert only while they grow
    (the run's totals stay on the line, plainly, once the cause is gone)."""
    steps = f"{_num(snap.step, 'd')}/{snap.max_steps}" if snap.max_steps else _num(snap.step, "d")
    parts = [
        f"[{elapsed_s / 60:5.1f} min] step {steps}",
        f"version {_num(snap.learner_version, 'd')} (router {_num(snap.router_version, 'd')})",
        f"reward {_num(snap.reward, '.3f')}",
        f"{_num(snap.tokens_per_s, ',.0f')} tok/s",
        f"queue {_num(snap.queue_depth, 'd')}",
        f"staleness {_num(snap.staleness, '.2f')}",
        f"in-flight {_num(snap.in_flight, 'd')}",
    ]
    if snap.last_eval is not None:
        parts.append(f"eval {snap.last_eval['mean_reward']:.3f}@v{snap.last_eval['policy_version']}")
    # The engines serve the last step's weights: a learner that stops answering now is finishing (final
    # checkpoint, exit), not in trouble. (Steps, not versions: after a learner restarted behind the
    # engines the versions run ahead of the steps.)
    done = bool(snap.max_steps) and snap.published_step is not None and snap.published_step >= snap.max_steps
    if done and "learner" in snap.unreachable:
        parts.append("learner finishing")
    alerts = [f"{name} not answering" for name in snap.unreachable if not (done and name == "learner")]
    healthy, _, engines = (snap.engines_healthy or "").partition("/")
    if healthy != engines:
        replacing = f" (replacing {', '.join(snap.engines_replacing)})" if snap.engines_replacing else ""
        alerts.append(f"engines live {snap.engines_healthy}{replacing}")
    if snap.engine_replacements:
        waiting = f"; {', '.join(snap.engines_waiting)} waits for a refit" if snap.engines_waiting else ""
        parts.append(f"engines replaced {snap.engine_replacements}{waiting}")
    if snap.refit_failure and snap.paused is not False:
        # Its first line: a Ray error spans many (the actor's id, pid, namespace, ...), the log has them all.
        reason = snap.refit_failure.splitlines()[0][:200]
        alerts.append(f"engines paused by a failed refit ({reason}) until a refit validates")
    elif snap.paused:  # a refit in progress (one that fails or times out is reported above), not an alert
        parts.append("router paused (refit)")
    for total, before, what in (
        (snap.failed_episodes, previous.failed_episodes if previous else None, "failed episodes"),
        (snap.dead_letters, previous.dead_letters if previous else None, "dead letters"),
    ):
        if not total:
            continue
        if before is None:  # no earlier line to compare with (molt status)
            alerts.append(f"{total} {what}")
        elif total > before:
            alerts.append(f"{total} {what} (+{total - before} since the last line)")
        else:
            parts.append(f"{total} {what}")
    if snap.learner_idle_s is not None and snap.learner_idle_s > 120:
        alerts.append(f"learner idle {snap.learner_idle_s:.0f} s")
    return " | ".join(parts) + (f" | ALERT: {'; '.join(alerts)}" if alerts else "")


def read_evals(path: Path) -> list[dict[str, Any]]:
    """The agent-pool's held-out evaluations, in file order (lines that do not parse are skipped:
    the writer may be mid-line)."""
    evals = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "policy_version" in record and "mean_reward" in record:
                evals.append(record)
    return evals


def plot_rewards(run_dir: Path) -> Path | None:
    """Draws ``<run_dir>/reward.png``: train reward per learner step and held-out eval reward per
    policy version (the learner step that produced it, unless a learner restarted behind the engines
    renumbered the versions: docs/refit.md) on one axis. Returns None without data."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    history = read_history(run_dir / "metrics.jsonl")
    steps = sorted(s for s, r in history.items() if "reward/mean" in r)
    evals = read_evals(run_dir / "eval.jsonl")
    if not steps and not evals:
        return None
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    if steps:
        mean = [history[s]["reward/mean"] for s in steps]
        axes.plot(steps, mean, label="train reward (mean per step)", alpha=0.8)
    if evals:
        axes.plot(
            [e["policy_version"] for e in evals],
            [e["mean_reward"] for e in evals],
            "o-",
            label="held-out eval reward (per policy version)",
        )
    axes.set_xlabel("learner step / policy version")
    axes.set_ylabel("episode reward")
    axes.legend(loc="best")
    figure.tight_layout()
    path = run_dir / "reward.png"
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp)
    plt.close(figure)
    os.replace(tmp, path)
    return path


def summary(run_dir: Path, wall_s: float) -> str:
    """The end-of-run lines: wall time, eval reward at the first and last evaluated versions, margin."""
    lines = [f"wall time: {wall_s / 60:.1f} min ({wall_s:.0f} s)"]
    evals = read_evals(run_dir / "eval.jsonl")
    if not evals:
        lines.append("held-out eval: no evaluation recorded (eval.jsonl is empty or missing)")
    else:
        first, last = evals[0], evals[-1]
        lines.append(
            f"held-out eval: {first['mean_reward']:.3f} at version {first['policy_version']} -> "
            f"{last['mean_reward']:.3f} at version {last['policy_version']} "
            f"(margin {last['mean_reward'] - first['mean_reward']:+.3f}, {len(evals)} evaluations)"
        )
    history = read_history(run_dir / "metrics.jsonl")
    if history:
        lines.append(f"learner steps recorded: {max(history)}")
    return "\n".join(lines)
