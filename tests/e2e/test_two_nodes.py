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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from molt.core.ports import free_port
from molt.core.processes import ChildProcess, ensure_ray_auth_token, log_tail
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


def cluster_args(run_dir: Path, tiny_model: Path, ray_address: str) -> list[str]:
    """``molt up recipes/cluster.toml`` shrunk to the CPU: one engine, one gloo learner rank, a few steps of
    the arithmetic Env. One CPU per node in the plan puts the engine on node 1, beside no learner."""
    sets = {
        "run.run_id": f'"{RUN_ID}"',
        "launcher.ray_address": f'"{ray_address}"',
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
        "agent_pool.prompts_path": '"recipes/data/arithmetic-train.jsonl"',
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
    molt = str(Path(sys.executable).parent / "molt")
    args = [molt, "up", str(REPO / "recipes/cluster.toml"), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


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


def records(path: Path, message: str) -> list[dict[str, object]]:
    """The JSON log records of ``path`` whose message is ``message``."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{message}"' in line:
            record = json.loads(line)
            if record.get("message") == message:
                found.append(record)
    return found


def test_cluster_recipe_places_the_engine_on_node_1_and_refits_across_nodes(
    tmp_path: Path, tiny_model: Path, two_nodes: str
) -> None:
    run_dir = tmp_path / "run"
    out = tmp_path / "molt-up.log"
    with out.open("wb") as sink:
        process = subprocess.Popen(
            cluster_args(run_dir, tiny_model, two_nodes), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT
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
    settings = json.loads((run_dir / "settings.json").read_text())
    assert [(p["service"], p["node"]) for p in settings["plan"] if p["cpus"]] == [("learner", 0), ("router", 1)]
    assert settings["services"]["router"]["engine"]["nodes"] == [1]  # the plan, as the router read it
    assert placed == {"engine": "1", "driver": "0"}
    ready = records(run_dir / "logs" / "router.log", "engines ready")
    assert ready[0]["data_channels"]["engine-0"].startswith(f"{WORKER_IP}:")  # type: ignore[index]

    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    published = records(run_dir / "logs" / "broadcaster.log", "refit published")
    assert [r["version"] for r in published] == list(range(STEPS + 1))  # version 0, then one per step
    assert all(r["probe_max_abs_diff"] is not None for r in published)  # probed: refit_probe_every = 1
    assert all(float(r["probe_max_abs_diff"]) < 1e-3 for r in published)  # type: ignore[arg-type]

    assert json.loads(ray_driver(two_nodes, LEFTOVERS_BODY)) == {"engine": False, "groups": []}
