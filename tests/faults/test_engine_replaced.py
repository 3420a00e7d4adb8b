"""One of two engines dies during a run: the router replaces it while the other serves.

A shortened ``molt up recipes/tiny-cpu.toml`` with two engines. Once it trains, engine-1's actor process
is SIGKILLed. The router starts a new engine-1 at version 0 and keeps it out of routing while engine-0
serves the current version; the broadcaster's next refit registers the new actor, loads and validates
the current weights into it (checksums and the probe), and the router's resume puts it back into
routing at that version. The status line and ``molt status`` show the replacement, and neither the
router nor the learner is restarted. How long a replacement takes depends on the machine (an engine
starts in tens of seconds on two loaded cores), so the run is long and the test stops it (SIGINT) once
a refit after the replacement was published.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt.core.auth import Access
from molt.core.service_logs import log_records, log_tail
from molt.core.testing import molt_up_command, newest_step, ray_driver, short_run_sets
from molt.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 400  # more than the test waits for: it stops the run
KILL_AT = 4


def molt_up(run_dir: Path, tiny_model: Path) -> list[str]:
    sets = short_run_sets("two-engines", run_dir, tiny_model, STEPS) | {
        "router.engine.engine_count": "2",
        "launcher.cpus_per_node": "3",
        "learner.checkpoint_every": "8",
        "learner.refit_probe_tokens": "8",
        "learner.refit_probe_every": "1",  # each refit also checks the engines' logprobs against the learner's
    }
    return molt_up_command(REPO / "recipes" / "tiny-cpu.toml", sets)


def engine_pid(run_dir: Path, engine_id: str) -> int:
    state = json.loads((run_dir / "state.json").read_text())
    body = (
        f"actor = ray.get_actor('molt-{engine_id}', namespace='molt-two-engines')\n"
        "print(ray.get(actor.__ray_call__.remote(lambda self: __import__('os').getpid())))"
    )
    return int(ray_driver(state["ray_address"], body))


def router_status(run_dir: Path) -> rollout_pb2.GetRouterStatusResponse:
    state = json.loads((run_dir / "state.json").read_text())
    access = Access((run_dir / "secrets" / "token").read_text().strip())
    with access.channel(state["processes"]["router"]["address"]) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=20)


def serving_again(router_log: Path) -> bool:
    records = log_records(router_log, "replaced engine holds the current weights; serving")
    return any(r.get("engine") == "engine-1" for r in records)


def test_a_dead_engine_is_replaced_validated_and_serves_at_the_current_version(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "molt-up.log"
    router_log = run_dir / "logs" / "router.log"
    molt = str(Path(sys.executable).parent / "molt")
    with out.open("wb") as sink:
        process = subprocess.Popen(molt_up(run_dir, tiny_model), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 1000
            while newest_step(run_dir) < KILL_AT:
                assert process.poll() is None and time.monotonic() < deadline, log_tail(out, 60)
                time.sleep(0.5)
            os.kill(engine_pid(run_dir, "engine-1"), signal.SIGKILL)
            while not serving_again(router_log):
                assert process.poll() is None and time.monotonic() < deadline, log_tail(out, 60)
                time.sleep(0.5)
            status = router_status(run_dir)
            shown = subprocess.run([molt, "status", "--run-dir", str(run_dir)], capture_output=True, text=True)
            broadcaster = run_dir / "logs" / "broadcaster.log"
            versions = len(log_records(broadcaster, "refit published"))
            while len(log_records(broadcaster, "refit published")) < versions + 2:  # refits go on with both
                assert process.poll() is None and time.monotonic() < deadline, log_tail(out, 60)
                time.sleep(0.5)
            process.send_signal(signal.SIGINT)
            code = process.wait(timeout=300)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
    text = out.read_text()
    assert code == 130, log_tail(out, 80)  # stopped by the test
    engines = {e.engine_id: e for e in status.engines}
    again = engines["engine-1"]
    assert again.healthy and again.serving and again.replacement_count == 1
    assert again.policy_version == status.policy_version > 0 == engines["engine-0"].replacement_count
    assert "engines replaced 1" in shown.stdout, shown.stdout + shown.stderr
    assert "replacing engine-1" in text or "engine-1 waits for a refit" in text  # the status line saw it
    assert "restarts:" not in text  # neither the router nor the learner was restarted

    died = [r for r in log_records(router_log, "engine died: its data channel closed") if r["engine"] == "engine-1"]
    message = "engine replaced; it serves once a refit loads the current weights"
    replaced = [r for r in log_records(router_log, message) if r["engine"] == "engine-1"]
    assert len(died) == len(replaced) == 1 and replaced[0]["version"] == 0
    rejoined = log_records(broadcaster, "engine actor replaced; registering it again")
    left = log_records(broadcaster, "engine dead or gone from the router; leaving the group")
    assert {r["engine"] for r in rejoined + left} == {"engine-1"}
    published = log_records(broadcaster, "refit published")
    assert all(r["probe_max_abs_diff"] is not None for r in published)  # every refit passed the probe too
    versions = [r["version"] for r in published]
    assert versions == sorted(versions) and versions[-1] > status.policy_version
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= versions[-1]
