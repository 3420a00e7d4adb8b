"""molt up rides out services that stop answering without dying, and a partition.

In turn, during a shortened tiny-cpu run: the broadcaster, the agent-pool, the learner and the router
are SIGSTOPped for longer than the keep-alive deadline (``molt.core.serve.KEEPALIVE``) and then
SIGCONTed, and the agent-pool's connection to the router goes through a ``PartitionProxy`` that is cut
for as long (bytes swallowed, no reset: the peer learns of it only from keep-alives and deadlines).
A stall is not a death: nothing is restarted, the learner keeps its consumer name (its claim lapsed
while it was stopped, but nobody took it), the run reaches its last step, and every trajectory queued
is accounted for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from molt.core.partition_proxy import PartitionProxy
from molt.core.ports import free_port
from molt.core.run_accounting import account
from molt.core.service_logs import log_records, log_tail
from molt.core.testing import molt_up_command, newest_step, short_run_sets

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 36
HOLD_S = 20.0  # longer than the keep-alive deadline (15 s)
# In turn, at these steps: a service SIGSTOPped for HOLD_S, or "partition" (agent-pool -> router).
STALLS = (("broadcaster", 4), ("agent_pool", 10), ("partition", 16), ("learner", 22), ("router", 28))


def molt_up(run_dir: Path, tiny_model: Path, router_port: int, proxy_port: int) -> list[str]:
    sets = short_run_sets("stalls", run_dir, tiny_model, STEPS) | {
        "learner.checkpoint_every": "6",
        "router.listen": f'"127.0.0.1:{router_port}"',
        "agent_pool.router_address": f'"127.0.0.1:{proxy_port}"',
    }
    return molt_up_command(REPO / "recipes" / "tiny-cpu.toml", sets)


def stall(name: str, run_dir: Path, proxy: PartitionProxy) -> None:
    if name == "partition":
        proxy.cut()
        try:
            time.sleep(HOLD_S)
        finally:
            proxy.heal()
        return
    pid = int(json.loads((run_dir / "state.json").read_text())["processes"][name]["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(HOLD_S)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_stopped_services_and_a_partition_are_ridden_out(tmp_path: Path, tiny_model: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "molt-up.log"
    router_port = free_port()
    proxy = PartitionProxy(router_port)
    command = molt_up(run_dir, tiny_model, router_port, proxy.start())
    with out.open("wb") as sink:
        process = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 1200
            for name, step in STALLS:
                while newest_step(run_dir) < step:
                    assert process.poll() is None, log_tail(out, 60)
                    assert time.monotonic() < deadline, f"the run did not reach step {step}\n{log_tail(out, 60)}"
                    time.sleep(0.2)
                stall(name, run_dir, proxy)
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
    text = out.read_text()
    assert code == 0, log_tail(out, 80)
    assert json.loads((run_dir / "state.json").read_text())["restarts"] == {}, log_tail(out, 80)
    assert "restarting it" not in text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    published = [int(r["version"]) for r in log_records(run_dir / "logs" / "broadcaster.log", "refit published")]
    assert published == sorted(published) and published[-1] == STEPS
    counts = account(run_dir, "stalls")
    assert counts["steps"] == STEPS
    assert counts["lost"] == counts["unknown"] == counts["twice"] == counts["dead"] == 0, counts
    assert counts["produced"] == counts["trained"] + counts["dropped"] + counts["remaining"], counts
