"""molt up keeps the run going while its services die: the agent-pool, the broadcaster, the router (its
engine dies with it), the embedded redis-server and then the router's new engine alone are SIGKILLed
in turn during a shortened tiny-cpu run.

Each is restarted by the launcher (``[launcher] restarts``) and rejoins: the learner registers with the
new broadcaster, the broadcaster finds the router's new engine (``engine actor replaced``), the learner
publishes its weights to that engine, which came back at version 0, and the redis-server comes back
from its append-only file. A router whose only engine died starts a new one in its place
(``[router] replace_dead_engines``), at version 0, and the same rejoining follows.
The learner itself is never restarted. Afterwards the run's Redis is read back from that file: every
trajectory queued is trained (in the final checkpoint), dropped with a counted reason, or still in the
stream, none twice, and no dead letter.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from molt.core.run_accounting import account
from molt.core.service_logs import log_records, log_tail
from molt.core.testing import molt_up_command, newest_step, short_run_sets

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 40
# In turn, at these steps; "engine" is the router's engine actor process (the router stays up).
KILLS = (("agent_pool", 5), ("broadcaster", 12), ("router", 20), ("redis", 28), ("engine", 34))


def molt_up(run_dir: Path, tiny_model: Path) -> list[str]:
    sets = short_run_sets("faults", run_dir, tiny_model, STEPS) | {
        "launcher.restarts": "5",
        "launcher.restart_backoff_s": "1",
        "learner.checkpoint_every": "10",
    }
    return molt_up_command(REPO / "recipes" / "tiny-cpu.toml", sets)


def test_every_service_killed_in_turn_is_restarted_and_the_run_finishes(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    out = tmp_path / "molt-up.log"
    with out.open("wb") as sink:
        process = subprocess.Popen(molt_up(run_dir, tiny_model), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 1200
            # Not before every service is up: a learner can make steps while the agent-pool still starts.
            while (
                not (run_dir / "state.json").exists()
                or json.loads((run_dir / "state.json").read_text())["phase"] != "running"
            ):
                assert process.poll() is None and time.monotonic() < deadline, log_tail(out, 60)
                time.sleep(0.2)
            for name, step in KILLS:
                while newest_step(run_dir) < step:
                    assert process.poll() is None, log_tail(out, 60)
                    assert time.monotonic() < deadline, f"the run did not reach step {step}\n{log_tail(out, 60)}"
                    time.sleep(0.2)
                os.kill(pid_of(name, run_dir), signal.SIGKILL)
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
    text = out.read_text()
    assert code == 0, log_tail(out, 80)
    assert "restarts: agent_pool 1, broadcaster 1, router 1, redis 1" in text
    assert "router has no live engine left" not in text  # the router replaced the engine itself
    router_log = run_dir / "logs" / "router.log"
    assert len(log_records(router_log, "engine replaced; it serves once a refit loads the current weights")) == 1
    assert json.loads((run_dir / "state.json").read_text())["restarts"] == {
        "agent_pool": 1,
        "broadcaster": 1,
        "router": 1,
        "redis": 1,
    }
    assert "learner was killed" not in text and "learner exited with 1" not in text

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    published = [int(r["version"]) for r in log_records(run_dir / "logs" / "broadcaster.log", "refit published")]
    # Never backwards, and past every fault. A version may come twice: the learner publishing its
    # weights again for engines that came back at version 0 sends them under the version they are.
    assert published == sorted(published) and published[-1] == STEPS
    # After the router's restart and after the engine's replacement, the broadcaster finds a new actor
    # under the old name; it may first have left the group as dead (a refit came while the engine was
    # gone), and the new actor is then registered as new rather than as a replacement.
    broadcaster = run_dir / "logs" / "broadcaster.log"
    replaced = len(log_records(broadcaster, "engine actor replaced; registering it again"))
    left = len(log_records(broadcaster, "engine dead or gone from the router; leaving the group"))
    assert replaced + left == 2 and replaced >= 1, (replaced, left)
    check_accounting(run_dir)


def pid_of(name: str, run_dir: Path) -> int:
    """A service's pid from the run's record; "engine": the router's newest engine actor, from its log."""
    if name != "engine":
        return int(json.loads((run_dir / "state.json").read_text())["processes"][name]["pid"])
    found = re.findall(r"\(EngineActor pid=(\d+)\)", (run_dir / "logs" / "router.log").read_text(errors="replace"))
    assert found, "no line of the engine actor in the router's log"
    return int(found[-1])


def check_accounting(run_dir: Path) -> None:
    """Every trajectory queued is trained, dropped with a counted reason, or still in the stream, none
    twice, none lost and none dead-lettered (``molt.core.run_accounting``)."""
    counts = account(run_dir, "faults")
    assert counts["steps"] == STEPS
    assert counts["lost"] == counts["unknown"] == counts["twice"] == counts["dead"] == 0, counts
    assert counts["produced"] == counts["trained"] + counts["dropped"] + counts["remaining"], counts
