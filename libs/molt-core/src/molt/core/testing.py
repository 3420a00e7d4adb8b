"""Test support shared by every molt test suite (loaded as the pytest plugin ``molt.core.testing``).

``RedisServer`` (a real ``redis-server`` on a free loopback port) and
``ServiceProcess`` (a molt service as a child process, ready at its health
check) live in ``molt.core.processes`` and are re-exported here; both end
exactly the processes they started. Fixtures: one Redis server per session plus a flushed database per
test, the tiny model built once per session, and a Ray head of the session's own (``ray_head``, its
address; clients need ``RAY_ENV``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis

from molt.core.ports import free_port
from molt.core.processes import RedisServer, ServiceProcess, start_ray_head
from molt.core.rollout import RolloutSettings
from molt.core.tiny_model import build
from molt.v1 import common_pb2

__all__ = [
    "RAY_ENV",
    "RedisServer",
    "ServiceProcess",
    "free_port",
    "molt_up_command",
    "nest_rollout",
    "newest_step",
    "ray_driver",
    "ray_head",
    "redis_client",
    "redis_server",
    "scrape",
    "short_run_sets",
    "tiny_model",
    "tiny_moe_model",
    "tls_certificate",
]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A service's Prometheus metrics on ``port``: (sample name, sorted labels) -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# `ray start` turns token auth on; clients send the token (~/.ray/auth_token) only in token mode.
# Ray's `uv run` hook would start every worker through `uv run`; molt's share this interpreter.
RAY_ENV = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_AUTH_MODE": "token"}


def ray_driver(ray_address: str, body: str) -> str:
    """Runs ``body`` in a Ray driver of its own connected to ``ray_address`` (the test process stays out of
    Ray); returns its last output line."""
    script = f"import json, ray\nray.init(address={ray_address!r}, logging_level='ERROR')\n{body}"
    env = {**os.environ, **RAY_ENV}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the test session."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the session's server, on a database flushed before each test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model and tokenizer (seed 0), built once per test session."""
    return build(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE model (``molt-tiny-model --moe``, seed 0), built once per test session."""
    return build(tmp_path_factory.mktemp("models") / "tiny-moe", seed=0, arch="qwen3", moe=True)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head of the session's own with 4 CPUs (``ray start --block``: stopping it stops the cluster)."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    log = tmp_path_factory.mktemp("ray") / "ray.log"
    head, address, temp_dir = start_ray_head(ray_cli, log, num_cpus=4, env=RAY_ENV, timeout_s=300)
    yield address
    head.stop(timeout_s=60)
    shutil.rmtree(temp_dir, ignore_errors=True)


def nest_rollout(values: Mapping[str, Any], base: RolloutSettings | None = None) -> dict[str, Any]:
    """Settings values written flat (``group_size=2``) with the ``[rollout]`` keys among them gathered into
    ``values["rollout"]`` over ``base``: a ``RolloutSettings``, so the result suits a settings class and
    ``model_copy(update=...)`` alike."""
    rest = {key: value for key, value in values.items() if key not in RolloutSettings.model_fields}
    flat = {key: value for key, value in values.items() if key in RolloutSettings.model_fields}
    given = rest.pop("rollout", {})
    if not flat and not given and base is None:
        return rest
    given = given.model_dump() if isinstance(given, RolloutSettings) else dict(given)
    rest["rollout"] = RolloutSettings(**{**(base.model_dump() if base else {}), **given, **flat})
    return rest


def trajectory_group(
    samples: int = 2, tokens: int = 4, run_id: str = "test-run", prompt_id: str = "p"
) -> common_pb2.TrajectoryGroup:
    """A well-formed group of ``samples`` trajectories of ``tokens`` response tokens each (queue tests)."""
    group = common_pb2.TrajectoryGroup(
        group_id=uuid.uuid4().hex, prompt_id=prompt_id, run_id=run_id, sample_count=samples
    )
    for i in range(samples):
        group.trajectories.add(
            trajectory_id=uuid.uuid4().hex,
            rollout_id=uuid.uuid4().hex,
            prompt_token_ids=[1, 2, 3],
            response_token_ids=list(range(tokens)),
            rollout_logprobs=[-0.5] * tokens,
            loss_mask=[True] * tokens,
            policy_versions=[0] * tokens,
            reward=float(i),
            finish_reason=common_pb2.FINISH_REASON_STOP,
            turn_count=1,
        )
    return group


def molt_up_command(recipe: Path, sets: Mapping[str, str]) -> list[str]:
    """``molt up RECIPE`` with ``sets`` (``--set key=value``), every service's listen address, metrics port
    and the HTTP front on a free loopback port unless ``sets`` names it (a run beside another one)."""
    services = ("router", "broadcaster", "learner", "agent_pool")
    ports = {f"{name}.listen": f'"127.0.0.1:{free_port()}"' for name in services}
    ports |= {f"{name}.metrics_port": str(free_port()) for name in services}
    ports["agent_pool.http_listen"] = f'"127.0.0.1:{free_port()}"'
    args = [str(Path(sys.executable).parent / "molt"), "up", str(recipe)]
    for key, value in {**ports, **sets}.items():
        args += ["--set", f"{key}={value}"]
    return args


def short_run_sets(run_id: str, run_dir: Path, model: Path, steps: int) -> dict[str, str]:
    """``--set`` values of a shortened tiny-recipe run on ``model`` (already built): no SFT warm-up, no
    evaluation, a status line every 2 s, ``steps`` learner steps, its own run id and directory."""
    return {
        "run.run_id": f'"{run_id}"',
        "run.run_dir": f'"{run_dir}"',
        "router.engine.model_path": f'"{model}"',
        "learner.model_path": f'"{model}"',
        "agent_pool.tokenizer_path": f'"{model}"',
        "launcher.sft_warmup": "false",
        "launcher.build_tiny_model": "false",
        "launcher.progress_every_s": "2",
        "learner.max_steps": str(steps),
        "agent_pool.eval.enabled": "false",
    }


def newest_step(run_dir: Path) -> int:
    """The newest learner step a run's ``metrics.jsonl`` records (0 before the first; a line being
    written is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def tls_certificate(directory: Path, name: str, issuer: tuple[Any, Any] | None = None) -> tuple[Path, Path, Any, Any]:
    """A key (0600) and certificate for 127.0.0.1 in ``directory``, signed by ``issuer`` (key, certificate)
    or by itself (a CA). Returns the key's path, the certificate's, and both as objects."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_key, signer = issuer if issuer else (key, None)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer.subject if signer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    cert = builder.sign(signer_key, hashes.SHA256())
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.pem"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path, key, cert
