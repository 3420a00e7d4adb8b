"""``<run_dir>/state.json``: what a running ``molt up`` started, for ``molt status`` and ``molt down``.

The launcher rewrites the file (atomically) after every start and stop. Each
process is recorded with its pid and start time (``/proc`` ticks), so a pid
reused by an unrelated process is never mistaken for ours, and with its
session id = pid (every child is started in its own session), which
``molt down`` uses to end whatever a crashed launcher left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from molt.core.errors import ConfigError
from molt.core.processes import health_status, is_running, kill_session, start_ticks

STATE_FILE = "state.json"


@dataclass
class ProcessRecord:
    """One child of the launcher (its own session leader)."""

    pid: int
    ticks: int | None
    log: str
    address: str | None = None  # gRPC address for status RPCs, if it serves
    health_service: str = ""

    def alive(self) -> bool:
        return is_running(self.pid, self.ticks)


@dataclass
class RunState:
    """The launcher's record of one run."""

    run_dir: str
    recipe: str
    launcher_pid: int
    launcher_ticks: int | None
    started_at: str
    phase: str = "starting"  # starting | sft | running | stopping | stopped | failed
    redis_url: str = ""
    run_id: str = "molt"
    max_steps: int = 0
    ray_address: str | None = None
    ray_temp_dir: str | None = None
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # piece -> times molt up restarted it

    @classmethod
    def new(cls, run_dir: Path, recipe: Path) -> RunState:
        pid = os.getpid()
        return cls(
            str(run_dir),
            str(recipe),
            pid,
            start_ticks(pid),
            time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )

    def save(self) -> None:
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, run_dir: Path) -> RunState:
        path = run_dir / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: no `molt up` has used this run directory")
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            data["processes"] = {k: ProcessRecord(**v) for k, v in data.get("processes", {}).items()}
            return cls(**data)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from exc

    def launcher_alive(self) -> bool:
        return is_running(self.launcher_pid, self.launcher_ticks)

    def addresses(self) -> dict[str, str]:
        """gRPC addresses of the recorded services that serve one."""
        return {name: p.address for name, p in self.processes.items() if p.address}


def describe(state: RunState) -> list[str]:
    """``molt status``'s per-process lines: alive or not, and the health check of those that serve."""
    lines = [
        f"run {state.run_id} in {state.run_dir} (recipe {state.recipe}), started {state.started_at}, "
        f"phase {state.phase}",
        f"  launcher     pid {state.launcher_pid:<8} {'alive' if state.launcher_alive() else 'not running'}",
    ]
    for name, record in state.processes.items():
        alive = record.alive()
        health = health_status(record.address, record.health_service) if alive and record.address else ""
        lines.append(
            f"  {name:<12} pid {record.pid:<8} {'alive' if alive else 'not running':<12} {health:<12} log {record.log}"
        )
    if state.restarts:
        lines.append("  restarted    " + ", ".join(f"{name} {count}" for name, count in state.restarts.items()))
    return lines


def stop_leftovers(state: RunState) -> list[str]:
    """SIGKILLs the session of every recorded process that is still alive; returns their names."""
    ended = []
    for name, record in state.processes.items():
        if record.alive():
            kill_session(record.pid)
            ended.append(name)
    return ended


def down(run_dir: Path, timeout_s: float) -> tuple[bool, list[str]]:
    """Stops the run: SIGTERM to the launcher (it stops its services in order), waits up to
    ``timeout_s``, then ends anything recorded that is still alive. Returns (the launcher stopped
    in time, names of processes that had to be killed afterwards)."""
    state = RunState.load(run_dir)
    clean = True
    if state.launcher_alive():
        os.kill(state.launcher_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while state.launcher_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if state.launcher_alive():
            clean = False
            os.kill(state.launcher_pid, signal.SIGKILL)
        state = RunState.load(run_dir)  # the launcher recorded what it stopped
    killed = stop_leftovers(state)
    if killed or not clean:
        state.phase = "stopped"
        state.save()
    return clean, killed
