"""The launcher's parts that run without an engine: recipe handling, process groups, Redis, Ray head,
state.json with ``molt status`` / ``molt down``, the reward figure and summary. Real processes only."""

from __future__ import annotations

import io
import json
import math
import os
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from molt.core.errors import ConfigError
from molt.core.processes import (
    ChildProcess,
    RedisServer,
    is_running,
    session_members,
    start_ticks,
)
from molt.core.service_logs import failure_cause
from molt.core.testing import free_port
from molt.launcher.cli import main as molt_main
from molt.launcher.plan import embedded_redis, plan_or_raise, preflight
from molt.launcher.progress import plot_rewards, summary
from molt.launcher.recipe import apply_sets, load_recipe, to_toml, wire
from molt.launcher.state import ProcessRecord, RunState, describe, down
from molt.launcher.supervise import Restarts, how_it_ended
from molt.launcher.up import Launch
from molt.learner.checkpoint import RunState as CheckpointState

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny-cpu.toml"

# A parent that starts a grandchild in a new process group of the same session, then waits.
PARENT_WITH_GRANDCHILD = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], process_group=0); "
    "print(c.pid, flush=True); time.sleep(600)"
)
IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
)


def wait_for_line(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip().splitlines()[0]
        time.sleep(0.05)
    raise AssertionError(f"{path} stayed empty")


def test_toml_round_trip() -> None:
    tables = {
        "run": {"run_id": "x", "run_dir": "runs/a b", "skip": None},
        "router": {
            "engine": {"model_path": 'm"odels/ü', "engine_args": {"enforce_eager": True, "odd key": 1.5e-7}},
            "sampling": {"temperature": 0.7, "top_k": -1},
        },
        "learner": {"optimizer": {"betas": [0.9, 0.95], "lr": math.inf}},
        "launcher": {},
    }
    parsed = tomllib.loads(to_toml(tables))
    del tables["run"]["skip"]  # TOML has no null: None values are left out
    assert parsed == tables


def test_set_overrides_parse_values_as_toml() -> None:
    tables = apply_sets(
        {"learner": {"max_steps": 80}},
        ["learner.max_steps=5", "learner.sft.epochs=2", "run.run_id=abc", "launcher.sft_warmup=false", "run.x=a b"],
    )
    assert tables["learner"] == {"max_steps": 5, "sft": {"epochs": 2}}
    assert tables["run"] == {"run_id": "abc", "x": "a b"}
    assert tables["launcher"] == {"sft_warmup": False}
    with pytest.raises(ConfigError, match="unknown table 'nope'"):
        apply_sets({}, ["nope.key=1"])
    with pytest.raises(ConfigError, match=r"expected table\.key=value"):
        apply_sets({}, ["learner.max_steps"])


def test_wiring_points_clients_at_servers_and_models_at_the_sft_output(tmp_path: Path) -> None:
    recipe = load_recipe(TINY, ["router.listen=0.0.0.0:6001", "broadcaster.listen=127.0.0.1:6004"])
    tables = wire(recipe, tmp_path, "redis://127.0.0.1:7/0", "127.0.0.1:9", [0])
    assert tables["agent_pool"]["router_address"] == "127.0.0.1:6001"
    assert tables["broadcaster"]["router_address"] == "127.0.0.1:6001"
    assert tables["learner"]["broadcaster_address"] == "127.0.0.1:6004"
    assert tables["router"]["ray_address"] == tables["broadcaster"]["ray_address"] == "127.0.0.1:9"
    assert "ray_address" not in tables["learner"]  # its ranks are local processes
    assert "nodes" not in tables["router"]["engine"]  # one node: Ray places the engines
    placed = wire(load_recipe(TINY, ["learner.placement=ray"]), tmp_path, None, "127.0.0.1:9", [0])
    assert placed["learner"]["ray_address"] == "127.0.0.1:9"
    assert tables["run"] == {**recipe.tables["run"], "run_dir": str(tmp_path), "redis_url": "redis://127.0.0.1:7/0"}
    sft = str(tmp_path / "sft-model")
    assert tables["router"]["engine"]["model_path"] == tables["learner"]["model_path"] == sft
    assert tables["agent_pool"]["tokenizer_path"] == sft
    assert recipe.tables["learner"]["model_path"] == "models/tiny"  # the recipe itself is untouched
    proxied = wire(load_recipe(TINY, ['agent_pool.router_address="127.0.0.1:7777"']), tmp_path, None, None, [0])
    assert proxied["agent_pool"]["router_address"] == "127.0.0.1:7777"  # the recipe's own wins
    assert proxied["broadcaster"]["router_address"] != "127.0.0.1:7777"


def test_ray_head_registers_the_learner_gpus_only_when_ray_places_its_ranks(tmp_path: Path) -> None:
    qwen = ROOT / "recipes" / "qwen3-4b-math.toml"
    local = load_recipe(qwen)
    placed = load_recipe(qwen, ["learner.placement=ray"])
    local_launch = Launch(local, plan_or_raise(local), tmp_path, io.StringIO())
    placed_launch = Launch(placed, plan_or_raise(placed), tmp_path, io.StringIO())
    learner = local_launch.plan.gpus("learner", 0)
    engines = local_launch.plan.gpus("router", 0)
    assert learner and engines and not set(learner) & set(engines)
    assert local_launch.ray_gpus() == engines
    assert placed_launch.ray_gpus() == tuple(sorted(learner + engines))


def test_rollout_side_runs_at_lower_priority_on_a_cpu_run(tmp_path: Path) -> None:
    """Unset: niceness 10 on a CPU run (the tiny recipe), 0 with GPUs; a set value wins. The Ray head keeps
    the default when Ray places the learner's ranks (they would inherit it)."""
    cases = {
        (TINY, ()): 10,
        (TINY, ("launcher.rollout_nice=3",)): 3,
        (ROOT / "recipes" / "qwen3-4b-math.toml", ()): 0,
    }
    for (path, sets), expected in cases.items():
        recipe = load_recipe(path, list(sets))
        assert Launch(recipe, plan_or_raise(recipe), tmp_path, io.StringIO()).rollout_nice() == expected


def test_a_child_started_with_nice_runs_at_that_niceness(tmp_path: Path) -> None:
    """``nice -n``: the command keeps its own pid (what stop and the run state track) and the niceness;
    where sessions are scheduling groups (autogroup), its session's group gets it too."""
    child = ChildProcess(
        [sys.executable, "-c", "import os, time; print(os.getpid(), os.nice(0), flush=True); time.sleep(600)"],
        tmp_path / "nice.log",
        nice=7,
    )
    process = child.spawn()
    try:
        pid, niceness = map(int, wait_for_line(child.log_path).split())
        assert pid == process.pid and niceness == os.nice(0) + 7
        autogroups = Path("/proc/sys/kernel/sched_autogroup_enabled")
        if autogroups.exists() and autogroups.read_text().strip() == "1":
            assert Path(f"/proc/{pid}/autogroup").read_text().split()[-1] == "7"
    finally:
        child.stop(timeout_s=10)


def test_redis_is_embedded_unless_a_url_is_given() -> None:
    assert embedded_redis(load_recipe(TINY))
    assert not embedded_redis(load_recipe(TINY, ["run.redis_url=redis://10.0.0.1:6379/0"]))
    assert embedded_redis(load_recipe(TINY, ["run.redis_url=redis://10.0.0.1:6379/0", "launcher.embedded_redis=true"]))


def test_stop_ends_the_whole_session(tmp_path: Path) -> None:
    """The leader exits on SIGTERM, its grandchild (another process group) would not: stop kills it too."""
    child = ChildProcess([sys.executable, "-c", PARENT_WITH_GRANDCHILD], tmp_path / "child.log")
    process = child.spawn()
    grandchild = int(wait_for_line(child.log_path))
    assert set(session_members(process.pid)) == {process.pid, grandchild}
    child.stop(timeout_s=10)
    assert not is_running(grandchild)
    assert session_members(process.pid) == []


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    child = ChildProcess([sys.executable, "-c", IGNORES_SIGTERM], tmp_path / "stubborn.log")
    process = child.spawn()
    wait_for_line(child.log_path)
    began = time.monotonic()
    code = child.stop(timeout_s=1)
    assert code == -9 and 1 <= time.monotonic() - began < 10
    assert not is_running(process.pid)


def test_embedded_redis_starts_and_stops(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    assert server.client().ping()
    assert server.process is not None
    pid = server.process.pid
    server.stop()
    assert not is_running(pid)


def test_status_and_down_end_a_run_whose_launcher_left_a_child(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stand-in launcher (a real process that exits on SIGTERM without cleaning up) and one recorded
    service child: `molt status` reports both, `molt down` stops the launcher and ends the child."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    service = ChildProcess([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "logs" / "router.log")
    service_process = service.spawn()
    service_pid = service_process.pid
    state = RunState(str(tmp_path), "recipe.toml", launcher.pid, start_ticks(launcher.pid), "2026-01-01T00:00:00+0000")
    state.processes["router"] = ProcessRecord(service_pid, start_ticks(service_pid), str(service.log_path))
    state.processes["learner"] = ProcessRecord(2**22 + 1, None, "gone.log")  # no such process
    state.save()

    lines = describe(RunState.load(tmp_path))
    assert "alive" in lines[1] and "router" in lines[2] and " alive " in lines[2]
    assert "not running" in lines[3]

    clean, killed = down(tmp_path, timeout_s=10)
    assert clean and killed == ["router"]
    assert launcher.wait(timeout=10) == -15
    assert not is_running(service_pid)
    assert RunState.load(tmp_path).phase == "stopped"
    assert service_process.wait(timeout=5) == -9  # ended by `down` (SIGKILL of its session)

    with pytest.raises(SystemExit) as exited:
        molt_main(["status", "--run-dir", str(tmp_path)])
    assert exited.value.code == 1  # nothing runs any more
    assert "not running" in capsys.readouterr().out


def test_reward_figure_and_summary(tmp_path: Path) -> None:
    with (tmp_path / "metrics.jsonl").open("w") as out:
        for step in range(1, 11):
            out.write(json.dumps({"step": step, "reward/mean": step / 20}) + "\n")
    evals = [
        {"policy_version": v, "mean_reward": r, "episodes": 124, "failed": 0, "time": 0.0}
        for v, r in ((0, 0.1), (10, 0.45))
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals) + '{"policy_ver')
    path = plot_rewards(tmp_path)
    assert path is not None and path.read_bytes().startswith(b"\x89PNG")
    text = summary(tmp_path, 754.0)
    assert "wall time: 12.6 min" in text
    assert "0.100 at version 0 -> 0.450 at version 10 (margin +0.350, 2 evaluations)" in text
    assert plot_rewards(tmp_path / "empty") is None


@pytest.mark.integration
def test_local_ray_head_starts_and_stops_without_leftovers(tmp_path: Path) -> None:
    recipe = load_recipe(TINY)
    launch = Launch(recipe, plan_or_raise(recipe), tmp_path, io.StringIO())
    (tmp_path / "logs").mkdir()
    address = launch._start_ray_head()
    head = launch.children["ray"]
    assert head.pid is not None
    leader = head.pid
    assert address.startswith("127.0.0.1:")
    assert len(session_members(leader)) > 2  # gcs, raylet, ... in the head's session
    assert RunState.load(tmp_path).processes["ray"].pid == leader
    head.stop(timeout_s=30)
    assert session_members(leader) == []


def test_preflight_names_what_this_machine_lacks(tiny_model: Path, tmp_path: Path) -> None:
    """Missing model and data, a port in use and a Redis that does not answer are each named before
    anything starts; a recipe that has all of it passes."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sets = [
            "launcher.build_tiny_model=false",
            "launcher.sft_warmup=false",
            f'router.engine.model_path="{tiny_model}"',
            f'learner.model_path="{tmp_path / "typo"}"',
            f'agent_pool.data.path="{tmp_path / "none.jsonl"}"',
            f"router.listen='127.0.0.1:{port}'",
            "learner.metrics_port=0",
            "run.redis_url='redis://127.0.0.1:1/0'",
        ]
        problems = preflight(load_recipe(TINY, sets))
    assert len(problems) == 4, problems
    assert "learner.model_path" in problems[0] and "no config.json" in problems[0]
    assert "agent_pool.data.path" in problems[1] and "does not exist" in problems[1]
    assert f"router.listen: port {port} is in use" in problems[2]
    assert "redis_url = 'redis://127.0.0.1:1/0' does not answer" in problems[3]
    built = load_recipe(TINY, ["launcher.sft_warmup=false", f'learner.model_path="{tmp_path / "tiny"}"'])
    (mismatch,) = [p for p in preflight(built) if "build_tiny_model" in p]
    assert "router.engine.model_path = 'models/tiny'" in mismatch
    ready = [f'{name}.model_path="{tiny_model}"' for name in ("learner", "router.engine")]
    ports = [
        f"{s}.{f}={v}"
        for s in ("router", "learner", "agent_pool", "broadcaster")
        for f, v in (("metrics_port", 0), ("listen", f"'127.0.0.1:{free_port()}'"))
    ]
    recipe = load_recipe(TINY, ["launcher.sft_warmup=false", "launcher.build_tiny_model=false", *ready, *ports])
    assert preflight(recipe) == []
    # A run directory whose newest checkpoint is damaged (a truncated file): named at once, with the way
    # out, instead of by the learner a minute later, after the engines started.
    for step in (1, 2):
        checkpoint = tmp_path / "run" / "checkpoints" / f"step-{step:08d}"
        checkpoint.mkdir(parents=True)
        for name in ("model.pt", "optimizer.pt", "extra_state.pt"):
            torch.save({"step": step}, checkpoint / name)
        (checkpoint / "state.json").write_text(CheckpointState(step=step, policy_version=step).to_json())
    assert preflight(recipe, tmp_path / "run") == []
    newest = tmp_path / "run" / "checkpoints" / "step-00000002" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    (problem,) = preflight(recipe, tmp_path / "run")
    assert problem.startswith("the learner cannot resume: ") and f"{newest} is unreadable" in problem
    assert "to resume from step-00000001 instead" in problem and "move step-00000002 aside" in problem


def test_failure_cause_picks_the_line_that_says_why(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    info = json.dumps({"level": "info", "message": "policy loaded"})
    error = json.dumps(
        {
            "level": "error",
            "message": "learner rank 0 failed",
            "exception": "Traceback...\n  x\nCheckpointError: step-3 is damaged",
        }
    )
    log.write_text(f"{info}\n{error}\n{info}\n")
    assert failure_cause(log) == "learner rank 0 failed: CheckpointError: step-3 is damaged"
    grpc_error = json.dumps(
        {
            "level": "error",
            "message": "learner rank 0 failed",
            "exception": "Traceback...\ngrpc.RpcError: <RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE"
            '\n\tdetails = "Socket closed"\n\tdebug_error_string = "UNAVAILABLE"\n>',
        }
    )
    log.write_text(f"{grpc_error}\n")  # a gRPC error's last line is a lone ">": its details say why
    assert failure_cause(log).endswith('grpc.RpcError: <RPC that terminated with: details = "Socket closed"')
    log.write_text(
        "Traceback (most recent call last):\n  File x\nOSError: Failed to bind to address 127.0.0.1:51151\nbye\n"
    )
    assert failure_cause(log) == "OSError: Failed to bind to address 127.0.0.1:51151"
    log.write_text("")
    assert failure_cause(log) == "" and failure_cause(tmp_path / "absent.log") == ""
    # A log whose last lines are routine records says nothing (the last one used to be shown as the cause),
    # and for a process killed by a signal its plain last line is only what it was doing.
    log.write_text(f"starting\n{info}\n{info}\n")
    assert failure_cause(log) == "starting" and failure_cause(log, last_line=False) == ""
    log.write_text(f"{info}\n")
    assert failure_cause(log) == ""
    assert how_it_ended(1) == "exited with 1"
    assert how_it_ended(-9).startswith("was killed by SIGKILL (killed from outside")
    assert how_it_ended(-15) == "was killed by SIGTERM"


def kill(server: RedisServer) -> int:
    assert server.process is not None
    server.process.kill()
    return server.process.wait()


def test_a_dead_embedded_redis_comes_back_with_its_entries_until_the_budget_is_spent(tmp_path: Path) -> None:
    """The launcher's own redis-server, killed: started again on its port and data directory, with what
    was written before (append-only file); killed once more with no restart left, the run ends naming it."""
    launch = Launch.__new__(Launch)  # only the part of the launch under test: its Redis and restarts
    launch.out, launch.restarts = io.StringIO(), Restarts(budget=1, backoff_s=0.0)
    launch.state = RunState.new(tmp_path, tmp_path / "recipe.toml")
    launch.redis = RedisServer(tmp_path / "redis", appendonly=True)
    launch.redis.start()
    port = launch.redis.port
    try:
        launch.redis.client().set("written-before", b"1")
        launch._restart_redis(kill(launch.redis))
        assert launch.redis.port == port and launch.redis.client().get("written-before") == b"1"
        assert "molt: redis was killed by SIGKILL" in launch.out.getvalue()
        assert json.loads((tmp_path / "state.json").read_text())["restarts"] == {"redis": 1}
        with pytest.raises(RuntimeError, match=r"redis was killed by SIGKILL .*\(no restart left\)"):
            launch._restart_redis(kill(launch.redis))
    finally:
        launch.redis.stop()


def test_a_torn_run_record_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text('{"run_id": "x", "proc')
    with pytest.raises(ConfigError, match=r"state.json is unreadable \(JSONDecodeError"):
        RunState.load(tmp_path)
    (tmp_path / "state.json").write_text('{"run_id": "x"}')
    with pytest.raises(ConfigError, match=r"state.json is unreadable \(TypeError"):
        RunState.load(tmp_path)


def test_a_bad_setting_is_one_line_naming_the_key_and_where_it_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(TINY, ["launcher.nodes='two'", "launcher.no_such_knob=1"])
    lines = info.value.message.splitlines()
    assert lines[0] == "invalid launcher settings:" and len(lines) == 3, lines
    assert lines[1].startswith('  nodes = "two" (from --set): Input should be a valid integer'), lines
    assert lines[2] == "  no_such_knob = 1 (from --set): Extra inputs are not permitted"
    # A service's bad value names --set when it came from there (it used to name the recipe), the recipe else.
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(TINY.read_text().replace("[learner]", "[learner]\nrefit_bucket_bytes = -1", 1))
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, ["learner.refit_timeout_s='fast'"])
    lines = info.value.message.splitlines()
    assert lines[0] == "invalid learner settings:" and len(lines) == 3, lines
    assert any(line.startswith('  refit_timeout_s = "fast" (from --set): ') for line in lines)
    assert any(line.startswith("  refit_bucket_bytes = -1 (from recipe [learner]): ") for line in lines)
