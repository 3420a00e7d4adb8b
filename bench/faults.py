"""Faults injected into a live CPU run, one after another, and every trajectory group accounted for.

Each run is ``molt up recipes/tiny-cpu.toml`` (no SFT warm-up, its embedded Redis with an append-only
file), with the agent-pool's connection to the router through ``molt.core.partition_proxy.PartitionProxy``. In
turn, each fault of ``FAULTS`` is injected, at a moment its trigger waits for: *mid-step* (as soon as
a step is recorded), *mid-refit* (as soon as the router logs a pause: the broadcaster's refit has
begun) or *mid-checkpoint* (as soon as a step the learner checkpoints after is recorded). Run ``r``
shifts every fault's trigger by ``r``, so three runs put each fault at each moment. After a fault the
bench waits until the broadcaster published a newer version and the learner made more steps: the
run *survived* it. After the last fault and a few more steps it stops the run (SIGINT: the learner
ends with a checkpoint) and accounts for every trajectory the queue accepted
(``molt.core.run_accounting``: trained, dropped with a reason, still in the stream, or dead-lettered;
lost and trained twice are what must stay 0).

Episodes that failed (their requests ended by a fault) never reach the queue; the status line's count
is printed. Last line: ``faults: injected=N survived=N lost=0 twice=0``.

Usage: ``uv run python bench/faults.py [--runs 3] [--keep]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molt.core.partition_proxy import PartitionProxy
from molt.core.run_accounting import account

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "faults-bench"
CHECKPOINT_EVERY = 5
TRIGGERS = ("mid-step", "mid-refit", "mid-checkpoint")
HOLD_S = 30.0  # a stopped process, or the partition, lasts longer than the keep-alive deadline (15 s)
RECOVERY_S = 420.0


@dataclass(frozen=True)
class Fault:
    name: str
    target: str  # a service, "redis", "engine" or "proxy"
    action: str  # "kill", "stop" (SIGSTOP, HOLD_S, SIGCONT) or "partition"


FAULTS = (
    Fault("SIGKILL agent-pool", "agent_pool", "kill"),
    Fault("SIGKILL learner", "learner", "kill"),
    Fault("SIGKILL broadcaster", "broadcaster", "kill"),
    Fault("SIGSTOP agent-pool", "agent_pool", "stop"),
    Fault("partition agent-pool -> router", "proxy", "partition"),
    Fault("SIGSTOP broadcaster", "broadcaster", "stop"),
    Fault("SIGKILL router", "router", "kill"),
    Fault("SIGKILL redis-server", "redis", "kill"),
    Fault("SIGKILL engine", "engine", "kill"),
)


class Run:
    """One ``molt up`` under faults."""

    def __init__(self, root: Path, model: Path) -> None:
        from molt.core.ports import free_port
        from molt.core.testing import molt_up_command, short_run_sets

        self.dir = root / "run"
        self.out = root / "molt-up.log"
        router_port = free_port()
        self.proxy = PartitionProxy(router_port)
        proxy_port = self.proxy.start()
        sets = short_run_sets(RUN_ID, self.dir, model, 100_000) | {  # the bench stops the run
            "launcher.restarts": "20",
            "launcher.restart_backoff_s": "1",
            "learner.checkpoint_every": str(CHECKPOINT_EVERY),
            "router.listen": f'"127.0.0.1:{router_port}"',
            "agent_pool.router_address": f'"127.0.0.1:{proxy_port}"',
        }
        args = molt_up_command(REPO / "recipes" / "tiny-cpu.toml", sets)
        self.sink = self.out.open("wb")
        self.process = subprocess.Popen(args, cwd=REPO, stdout=self.sink, stderr=subprocess.STDOUT)

    def alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"molt up exited with {self.process.returncode}:\n{tail(self.out)}")

    def running(self) -> bool:
        path = self.dir / "state.json"
        return path.exists() and json.loads(path.read_text()).get("phase") == "running"

    def step(self) -> int:
        from molt.core.testing import newest_step

        return newest_step(self.dir)

    def published(self) -> int:
        from molt.core.service_logs import log_records

        records = log_records(self.dir / "logs" / "broadcaster.log", "refit published")
        return max((int(r["version"]) for r in records), default=0)

    def pauses(self) -> int:
        path = self.dir / "logs" / "router.log"
        return path.read_text(errors="replace").count('"message": "paused"') if path.exists() else 0

    def wait(self, what: str, ready: Any, timeout_s: float, poll_s: float = 0.05) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f} s\n{tail(self.out)}")
            time.sleep(poll_s)

    def pid(self, target: str) -> int:
        if target == "engine":
            found = re.findall(
                r"\(EngineActor pid=(\d+)\)", (self.dir / "logs" / "router.log").read_text("utf-8", "replace")
            )
            return int(found[-1])
        return int(json.loads((self.dir / "state.json").read_text())["processes"][target]["pid"])

    def trigger(self, moment: str) -> None:
        """Returns at the moment ``moment`` (``TRIGGERS``) comes next."""
        if moment == "mid-refit":
            pauses = self.pauses()
            self.wait("a refit", lambda: self.pauses() > pauses, 300, poll_s=0.02)
        elif moment == "mid-checkpoint":
            due = (self.step() // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY
            self.wait(f"step {due}", lambda: self.step() >= due, 300, poll_s=0.02)
        else:
            step = self.step()
            self.wait("a step", lambda: self.step() > step, 300, poll_s=0.02)

    def inject(self, fault: Fault) -> None:
        if fault.action == "partition":
            self.proxy.cut()
            time.sleep(HOLD_S)
            self.proxy.heal()
            return
        pid = self.pid(fault.target)
        if fault.action == "kill":
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(HOLD_S)
        finally:
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=600)
        self.sink.close()
        return code


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def recovered(run: Run, version: int, step: int) -> Any:
    """A newer version published, and three more steps made, than at the fault."""
    return lambda: run.published() > version and run.step() >= step + 3


def one_run(index: int, model: Path, keep: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"molt-faults-{index}-"))
    run = Run(root, model)
    started = time.monotonic()
    results = []
    try:
        # Faults go into a running run: not before every service served (the learner may train on the
        # agent-pool's first groups while the launcher still waits for its health check, and a service
        # that dies before it serves ends the start-up, as a bad config would).
        run.wait("every service serving", run.running, 900, poll_s=0.5)
        run.wait("the first step", lambda: run.step() >= 2, 900, poll_s=0.5)
        for position, fault in enumerate(FAULTS):
            moment = TRIGGERS[(position + index) % len(TRIGGERS)]
            run.trigger(moment)
            step, version, at = run.step(), run.published(), time.monotonic()
            run.inject(fault)
            try:
                run.wait("recovery", recovered(run, version, step), RECOVERY_S, 0.5)
                survived = True
            except TimeoutError:
                survived = False
            took = time.monotonic() - at
            results.append((fault.name, moment, step, survived, took))
            print(f"  run {index} fault {fault.name:<32} {moment:<15} at step {step:>4}: "
                  f"{'survived' if survived else 'NOT SURVIVED'} in {took:5.0f} s", flush=True)  # fmt: skip
            if not survived:
                break
        final = run.step()
        run.wait("the last steps", lambda: run.step() >= final + 3, RECOVERY_S, 0.5)
    finally:
        code = run.stop()
    failed = re.findall(r"(\d+) failed episodes", run.out.read_text(errors="replace"))
    counts = account(run.dir, RUN_ID)
    print(f"  run {index}: exit {code} after {time.monotonic() - started:.0f} s; {counts}; "
          f"failed episodes {failed[-1] if failed else 0}", flush=True)  # fmt: skip
    if not keep:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return {"results": results, "counts": counts, "code": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep each run's directory")
    args = parser.parse_args()
    from molt.core.tiny_model import build

    model = Path(tempfile.mkdtemp(prefix="molt-faults-model-")) / "tiny"
    build(model)
    injected = survived = lost = twice = 0
    for index in range(args.runs):
        outcome = one_run(index, model, args.keep)
        injected += len(outcome["results"])
        survived += sum(r[3] for r in outcome["results"])
        lost += outcome["counts"]["lost"] + outcome["counts"]["unknown"]
        twice += outcome["counts"]["twice"]
    print(f"faults: injected={injected} survived={survived} lost={lost} twice={twice}")


if __name__ == "__main__":
    main()
