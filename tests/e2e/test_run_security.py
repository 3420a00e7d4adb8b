"""A run's services let in only the holders of its token, over mutual TLS, and the token stays in its file.

One shortened ``molt up recipes/tiny-cpu.toml`` on its embedded Redis, with ``[run] tls_cert``,
``tls_key`` and ``tls_ca`` set (a CA made for the test, one certificate for every service and client):
every service, the launcher's status calls and the services' calls to each other speak mutual TLS.
While it runs, every service is called over TLS without the token, and with another run's: a method
that would change something if it ran (pause the engines, refit, stop the learner, stop the rollouts)
is refused with UNAUTHENTICATED; the health check answers any TLS client of the CA; the same services
answer the run's token. A client without TLS, or without a certificate of the run's CA, fails the
handshake (UNAVAILABLE), health check included. The embedded Redis refuses a client without the
password. The run then reaches its last step, so none of the refused calls took effect. Afterwards
every file of the run directory but the token's own is scanned for the token.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from molt.core.auth import Access
from molt.core.service_logs import log_tail
from molt.core.testing import molt_up_command, short_run_sets, tls_certificate
from molt.v1 import (
    agent_pool_pb2,
    agent_pool_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 6
# Per service: a call that would change the run (refused), then a read-only one (answered with the token).
CALLS: dict[str, tuple[Any, tuple[str, Any], tuple[str, Any]]] = {
    "router": (
        rollout_pb2_grpc.RolloutServiceStub,
        ("PauseGeneration", rollout_pb2.PauseGenerationRequest()),
        ("GetRouterStatus", rollout_pb2.GetRouterStatusRequest()),
    ),
    "broadcaster": (
        weights_pb2_grpc.WeightServiceStub,
        ("RefitWeights", weights_pb2.RefitWeightsRequest(request_id="intruder")),
        ("GetPolicyVersion", weights_pb2.GetPolicyVersionRequest()),
    ),
    "learner": (
        learner_pb2_grpc.LearnerServiceStub,
        ("StopLearner", learner_pb2.StopLearnerRequest()),
        ("GetLearnerStatus", learner_pb2.GetLearnerStatusRequest()),
    ),
    "agent_pool": (
        agent_pool_pb2_grpc.AgentPoolServiceStub,
        ("StopRollouts", agent_pool_pb2.StopRolloutsRequest()),
        ("GetAgentPoolStatus", agent_pool_pb2.GetAgentPoolStatusRequest()),
    ),
}


def molt_up(run_dir: Path, tiny_model: Path, tls: dict[str, Path]) -> list[str]:
    sets = short_run_sets("guarded", run_dir, tiny_model, STEPS) | {
        **{f"run.{name}": f'"{path}"' for name, path in tls.items() if name.startswith("tls_")},
        "learner.checkpoint_every": "3",
    }
    return molt_up_command(REPO / "recipes" / "tiny-cpu.toml", sets)


def code_of(access: Access, address: str, stub: Any, method: str, request: Any) -> str:
    with access.channel(address) as channel:
        try:
            getattr(stub(channel), method)(request, timeout=20)
        except grpc.RpcError as exc:
            return str(exc.code().name)  # type: ignore[attr-defined]
    return "OK"


def probe(run_dir: Path, token: str, tls: dict[str, Path]) -> None:
    """The calls of the module docstring, on the running services."""
    state = json.loads((run_dir / "state.json").read_text())
    pem = {name: path.read_bytes() for name, path in tls.items()}
    right = Access(token, pem["tls_cert"], pem["tls_key"], pem["tls_ca"])
    outsiders = (replace(right, token=None), replace(right, token="another-runs-token"))
    stranger = replace(right, cert=pem["stranger_cert"], key=pem["stranger_key"])  # the run's token, not its CA
    for name, (stub, (change, request), (read, query)) in CALLS.items():
        address = state["processes"][name]["address"]
        for outsider in outsiders:
            assert code_of(outsider, address, stub, change, request) == "UNAUTHENTICATED", name
            assert code_of(outsider, address, stub, read, query) == "UNAUTHENTICATED", name
        assert code_of(right, address, stub, read, query) == "OK", name
        assert code_of(Access(token), address, stub, read, query) == "UNAVAILABLE", name  # no TLS
        assert code_of(stranger, address, stub, read, query) == "UNAVAILABLE", name  # the handshake fails
        with outsiders[0].channel(address) as channel:  # the health check needs no token
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    anonymous = redis.Redis.from_url(state["redis_url"].replace("molt@", ""), socket_timeout=5)
    with anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()


def certificates(directory: Path) -> dict[str, Path]:
    """The run's CA and one certificate it signed, for 127.0.0.1 (``[run]`` settings by name), and a
    stranger's self-signed one (``stranger_cert``, ``stranger_key``)."""
    directory.mkdir()
    _, ca_path, ca_key, ca = tls_certificate(directory, "ca")
    key_path, cert_path, _, _ = tls_certificate(directory, "molt", (ca_key, ca))
    stranger_key, stranger_cert, _, _ = tls_certificate(directory, "stranger")
    run = {"tls_cert": cert_path, "tls_key": key_path, "tls_ca": ca_path}
    return run | {"stranger_cert": stranger_cert, "stranger_key": stranger_key}


def test_only_the_runs_token_over_mutual_tls_is_let_in_and_it_stays_in_its_file(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir = tmp_path / "run"
    out = tmp_path / "molt-up.log"
    tls = certificates(tmp_path / "tls")
    with out.open("wb") as sink:
        process = subprocess.Popen(molt_up(run_dir, tiny_model, tls), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while not (run_dir / "metrics.jsonl").exists():  # every service serves, and a step was made
                assert process.poll() is None and time.monotonic() < deadline, log_tail(out, 60)
                time.sleep(0.5)
            token_file = run_dir / "secrets" / "token"
            assert token_file.stat().st_mode & 0o777 == 0o600
            token = token_file.read_text().strip()
            probe(run_dir, token, tls)
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
    assert code == 0, log_tail(out, 80)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    config = (run_dir / "config.toml").read_text()
    assert f'token_file = "{token_file}"' in config
    scanned = [path for path in run_dir.rglob("*") if path.is_file() and path != token_file]
    holding = [str(path) for path in scanned if token.encode() in path.read_bytes()]
    assert not holding, f"the run's token is in {holding}"
    assert len(scanned) > 20 and token.encode() not in out.read_bytes()
