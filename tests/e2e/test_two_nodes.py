"""``molt up recipes/cluster.toml`` on a Ray cluster of two nodes, shrunk to the CPU and the tiny model.

Two raylets on this machine stand for two machines: node 0 (the head, labelled ``molt/node=0``, this
machine's address) runs ``molt up``, the learner and the services; node 1 (a worker on 127.0.0.2,
labelled ``molt/node=1``) gets the engine, as the plan says. The head registers CPUs enough for the
engine too, so Ray left to itself would put it on node 0: only the plan's node, handed to the router
and turned into a label selector, sends it to node 1. Checked: Ray runs the engine actor on node 1
while the driver here is on node 0; every step was refitted across the nodes, each refit validated
(checksums and the probe) and published; the learner's steps advance; the run ends 0 and leaves no
engine or placement group in the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from molt.core.ports import free_port
from molt.core.processes import ChildProcess, ensure_ray_auth_token
from molt.core.service_logs import log_records, log_tail
from molt.core.testing import RAY_ENV, ray_driver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 3
RUN_ID = "e2e-two-nodes"
WORKER_IP = "127.0.0.2"  # a second loopback address: node 1's engine serves its data channel there
NODES_BODY = "print(json.dumps({n['NodeID']: n['Labels'].get('molt/node') for n in ray.nodes() if n['Alive']}))"


def ray_start(*args: str) -> list[str]:
    """``ray start --block`` with its side servers on free ports (their defaults may be taken here)."""
    ports = [f"{flag}={free_port()}" for flag in ("--dashboard-agent-listen-port", "--metrics-export-port")]
    return [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats", *ports, *args]


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[str]:
    """A Ray cluster of two labelled nodes (2 CPUs on node 0, 1 on node 1); its address. Ends both."""
    ensure_ray_auth_token(str(Path(sys.executable).parent / "ray"))
    temp_dir = Path(tempfile.mkdtemp(prefix="molt-ray-"))  # short: Ray's unix sockets live under it
    address = f"127.0.0.1:{free_port()}"
    head = ChildProcess(
        ray_start(
            "--head", f"--port={address.split(':')[1]}", "--num-cpus=2", "--num-gpus=0", "--labels=molt/node=0",
            "--include-dashboard=false", f"--temp-dir={temp_dir}", f"--ray-client-server-port={free_port()}",
        ),
        tmp_path / "ray-node-0.log", RAY_ENV, nice=10,
    )  # fmt: skip
    worker = ChildProcess(
        ray_start(f"--address={address}", f"--node-ip-address={WORKER_IP}", "--num-cpus=1", "--labels=molt/node=1"),
        tmp_path / "ray-node-1.log",
        RAY_ENV,
        nice=10,
    )
    try:
        head.spawn()
        deadline = time.monotonic() + 180
        while not (temp_dir / "ray_current_cluster").exists():
            assert time.monotonic() < deadline, log_tail(head.log_path)
            time.sleep(0.5)
        worker.spawn()
        while sorted(json.loads(ray_driver(address, NODES_BODY)).values()) != ["0", "1"]:
            assert time.monotonic() < deadline, log_tail(worker.log_path)
            time.sleep(1)
        yield address
    finally:
        worker.stop(timeout_s=10)
        head.stop(timeout_s=10)
        subprocess.run(["rm", "-rf", str(temp_dir)], check=False)


def cpu_sets(tiny_model: Path) -> list[str]:
    """The ``--set`` arguments shrinking recipes/cluster.toml to the CPU: one engine, one gloo learner rank,
    a few steps of the arithmetic Env. One CPU per node in the plan puts the engine on node 1, beside no
    learner."""
    sets = {
        "run.run_id": f'"{RUN_ID}"',
        "launcher.gpus_per_node": "0",
        "launcher.cpus_per_node": "1",
        "launcher.start_timeout_s": "600.0",
        "launcher.progress_every_s": "5.0",
        "rollout.group_size": "4",
        "rollout.groups_per_step": "2",
        "router.engine.model_path": f'"{tiny_model}"',
        "router.engine.engine_count": "1",
        "router.engine.max_model_len": "256",
        "router.engine.gpu_memory_utilization": "0.15",
        "router.engine.dtype": '"float32"',
        "router.sampling.max_tokens_default": "8",
        "router.sampling.max_tokens_cap": "16",
        "broadcaster.backend": '"gloo"',
        "learner.model_path": f'"{tiny_model}"',
        "learner.data_parallel_size": "1",
        "learner.micro_batch_tokens": "4096",
        "learner.compile": "false",
        "learner.max_steps": str(STEPS),
        "learner.optimizer.total_steps": str(STEPS),
        "agent_pool.agent": '"recipes/agents/arithmetic.py:ArithmeticEnv"',
        "agent_pool.data.path": '"recipes/data/arithmetic-train.jsonl"',
        "agent_pool.tokenizer_path": f'"{tiny_model}"',
        "agent_pool.groups_in_flight": "4",
        "agent_pool.max_concurrent_episodes": "16",
        "agent_pool.max_tokens": "8",
        "agent_pool.eval.enabled": "false",
        "agent_pool.http_listen": f'"127.0.0.1:{free_port()}"',
    }
    for key in ("router", "broadcaster", "learner", "agent_pool"):
        sets[f"{key}.listen"] = f'"127.0.0.1:{free_port()}"'
        sets[f"{key}.metrics_port"] = "0"
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


ENGINE_NODE_BODY = f"""
engine = ray.get_actor('molt-engine-0', namespace='molt-{RUN_ID}')
node = ray.get(engine.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)
labels = {{n['NodeID']: n['Labels'].get('molt/node') for n in ray.nodes() if n['Alive']}}
print(json.dumps({{'engine': labels[node], 'driver': labels[ray.get_runtime_context().get_node_id()]}}))
"""
LEFTOVERS_BODY = f"""
try:
    ray.get_actor('molt-engine-0', namespace='molt-{RUN_ID}')
    engine = True
except ValueError:
    engine = False
groups = [g['name'] for g in ray.util.placement_group_table().values() if g['state'] != 'REMOVED']
print(json.dumps({{'engine': engine, 'groups': groups}}))
"""


def started(run_dir: Path) -> dict[str, object]:
    """The processes ``molt up`` has started so far (``state.json``; the router first, each once the one
    before it serves)."""
    try:
        return json.loads((run_dir / "state.json").read_text())["processes"]
    except FileNotFoundError:  # not written yet (it is replaced whole, never seen half-written)
        return {}


def check_planned_refitted_and_stepped(run_dir: Path) -> None:
    """The plan put the learner on node 0 and the engine on node 1, and the router was handed that node;
    every step was refitted (version 0 first), each refit validated with the probe; the steps advanced."""
    settings = json.loads((run_dir / "settings.json").read_text())
    assert [(p["service"], p["node"]) for p in settings["plan"] if p["cpus"]] == [("learner", 0), ("router", 1)]
    assert settings["services"]["router"]["engine"]["nodes"] == [1]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    published = log_records(run_dir / "logs" / "broadcaster.log", "refit published")
    assert [r["version"] for r in published] == list(range(STEPS + 1))  # version 0, then one per step
    assert all(r["probe_max_abs_diff"] is not None for r in published)  # probed: refit_probe_every = 1
    assert all(float(r["probe_max_abs_diff"]) < 1e-3 for r in published)  # type: ignore[arg-type]


def test_cluster_recipe_places_the_engine_on_node_1_and_refits_across_nodes(
    tmp_path: Path, tiny_model: Path, two_nodes: str
) -> None:
    run_dir = tmp_path / "run"
    out = tmp_path / "molt-up.log"
    with out.open("wb") as sink:
        process = subprocess.Popen(
            [
                *(str(Path(sys.executable).parent / "molt"), "up", str(REPO / "recipes/cluster.toml")),
                *("--run-dir", str(run_dir), "--set", f'launcher.ray_address="{two_nodes}"', *cpu_sets(tiny_model)),
            ],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        try:
            while "broadcaster" not in started(run_dir):  # the router is healthy: its engine serves
                assert process.poll() is None, log_tail(out, 60)
                time.sleep(0.5)
            placed = json.loads(ray_driver(two_nodes, ENGINE_NODE_BODY))
            code = process.wait(timeout=600)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
    assert code == 0, log_tail(out, 60)
    assert placed == {"engine": "1", "driver": "0"}
    ready = log_records(run_dir / "logs" / "router.log", "engines ready")
    assert ready[0]["data_channels"]["engine-0"].startswith(f"{WORKER_IP}:")  # type: ignore[index]
    check_planned_refitted_and_stepped(run_dir)
    assert json.loads(ray_driver(two_nodes, LEFTOVERS_BODY)) == {"engine": False, "groups": []}


SLURM_CONF = """ClusterName=molt-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
NodeName=n0 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n0_port} CPUs=2 State=UNKNOWN
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
PartitionName=molt Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
# A stand-in for uv, named as such: the script runs `uv run --frozen CMD`, which would sync the environment
# again; the test's environment is the synced one, so CMD runs from it as it is.
UV_STAND_IN = f"""#!/bin/bash
[ "$1" = run ] && [ "$2" = --frozen ] || {{ echo "uv stand-in: only 'uv run --frozen'" >&2; exit 97; }}
cmd=$3; shift 3
exec {Path(sys.executable).parent}/"$cmd" "$@"
"""


@pytest.fixture
def local_slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Debian's Slurm on this machine: a controller and two node daemons (n0, n1) of a private config on
    free ports; the environment its commands need. Ends the daemons."""
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("needs Debian's slurm-wlm (.ci/run installs it) and root (slurmd runs job steps as root)")
    home = Path(tempfile.mkdtemp(prefix="molt-slurm-"))  # short: Slurm's sockets and Ray's live under it
    ports = {"ctld_port": free_port(), "n0_port": free_port(), "n1_port": free_port()}
    (home / "slurm.conf").write_text(SLURM_CONF.format(dir=home, **ports))
    (home / "bin").mkdir()
    (home / "bin" / "uv").write_text(UV_STAND_IN)
    (home / "bin" / "uv").chmod(0o755)
    env = {"SLURM_CONF": str(home / "slurm.conf"), "PATH": f"{home / 'bin'}:{os.environ['PATH']}"}
    daemons = [
        ChildProcess(["slurmctld", "-D", "-i"], tmp_path / "slurmctld.log", env),
        *(ChildProcess(["slurmd", "-D", "-N", node], tmp_path / f"slurmd-{node}.log", env) for node in ("n0", "n1")),
    ]
    try:
        for daemon in daemons:
            daemon.spawn()
        deadline = time.monotonic() + 120
        while True:
            sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env={**os.environ, **env}, capture_output=True)
            if sinfo.stdout.decode().split() == ["n0", "idle", "n1", "idle"]:
                break
            assert time.monotonic() < deadline, sinfo.stdout + sinfo.stderr + log_tail(tmp_path / "slurmctld.log")
            time.sleep(1)
        yield {**env, "MOLT_TEST_SLURM_HOME": str(home)}
    finally:
        for daemon in reversed(daemons):
            daemon.stop(timeout_s=30)
        subprocess.run(["rm", "-rf", str(home)], check=False)


def test_slurm_script_runs_the_cluster_recipe_on_two_slurm_nodes(
    tmp_path: Path, tiny_model: Path, local_slurm: dict[str, str]
) -> None:
    """``sbatch --wait recipes/slurm/molt.sbatch`` on two Slurm nodes of this machine, the cluster recipe
    shrunk as above passed through to ``molt up``: the job's Ray cluster has both nodes, the run trains,
    refits and ends 0, and the job leaves no Ray process behind. Both raylets have this machine's address
    here, so their side servers take free ports (RAY_START_ARGS)."""
    home = Path(local_slurm["MOLT_TEST_SLURM_HOME"])
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        **local_slurm,
        "RAY_PORT": str(free_port()),
        "RUN_DIR": str(run_dir),
        "RAY_START_ARGS": f"--temp-dir={home / 'ray'} --dashboard-agent-listen-port=0",
    }
    out = tmp_path / "job.out"
    args = ["sbatch", "--wait", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", "--time=00:15:00"]
    args += [f"--output={out}", str(REPO / "recipes/slurm/molt.sbatch"), *cpu_sets(tiny_model)]
    job = subprocess.run(args, cwd=REPO, env=env, capture_output=True, timeout=840)
    assert job.returncode == 0, job.stderr.decode()[-2000:] + log_tail(out, 60)
    assert "molt: Ray cluster up: 2 of 2 nodes" in out.read_text()
    check_planned_refitted_and_stepped(run_dir)
    leftovers = subprocess.run(["pgrep", "-f", str(home / "ray")], capture_output=True)
    assert leftovers.stdout == b"", "the job left Ray processes running"
