"""A producer of your own against ``molt up --without agent_pool``: the outside-style pool
(``examples/custom_pool.py``: protos, grpc and redis only) reads every producer setting from the
learner's ``GetRunSettings`` and feeds the run; the learner trains its steps on those groups alone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from molt.core.ports import free_port
from molt.core.service_logs import log_tail
from molt.core.testing import RedisServer
from molt.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom_pool.py"
STEPS = 3


def prompts(tokenizer_path: Path, path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    lines = []
    for index, question in enumerate(["2+3=", "7-4=", "5+5="]):
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        lines.append({"id": f"q{index}", "prompt_token_ids": ids, "feedback_token_ids": []})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_molt_up_without_the_agent_pool_trains_on_an_outside_producer(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    run_id, run_dir = "e2e-custom-pool", tmp_path / "run"
    learner, router = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sets = {
        "run.run_id": f'"{run_id}"',
        "run.redis_url": f'"{redis_server.url}"',
        "router.engine.model_path": f'"{tiny_model}"',
        "learner.model_path": f'"{tiny_model}"',
        "launcher.build_tiny_model": "false",
        "launcher.sft_warmup": "false",
        "learner.max_steps": str(STEPS),
        "router.listen": f'"{router}"',
        "learner.listen": f'"{learner}"',
        "broadcaster.listen": f'"127.0.0.1:{free_port()}"',
    }
    args = [str(Path(sys.executable).parent / "molt"), "up", str(REPO / "recipes/tiny-cpu.toml")]
    args += ["--run-dir", str(run_dir), "--without", "agent_pool"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    prompts(tiny_model, tmp_path / "prompts.jsonl")
    out, pool_out = tmp_path / "molt-up.log", tmp_path / "pool.log"
    producer = [sys.executable, str(EXAMPLE), "--learner", learner, "--router", router, "--max-tokens", "8"]
    producer += ["--prompts", str(tmp_path / "prompts.jsonl"), "--token-file", str(run_dir / "secrets" / "token")]
    with out.open("wb") as sink, pool_out.open("wb") as pool_sink:
        run = subprocess.Popen(args, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        while not (run_dir / "secrets" / "token").exists():  # written first, before any service starts
            assert run.poll() is None, log_tail(out, 60)
            time.sleep(0.2)
        pool = subprocess.Popen(producer, stdout=pool_sink, stderr=subprocess.STDOUT)
        try:
            code = run.wait(timeout=1100)
        finally:
            pool.kill()
            pool.wait()
    assert code == 0, log_tail(out, 60) + "\n" + log_tail(pool_out, 30)
    assert "starting agent_pool" not in out.read_text()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    state = json.loads(sorted((run_dir / "checkpoints").glob("step-*"))[-1].joinpath("state.json").read_text())
    produced = {member.decode() for member in redis_client.smembers(f"molt:{run_id}:trajectory-ids")}
    assert state["consumed"] and set(state["consumed"]) <= produced  # trained on the outside producer's ids
    # The group size reached the producer over gRPC: the recipe's [rollout] group_size, nowhere in its flags.
    for _, fields in redis_client.xrange(f"molt:{run_id}:trajectories"):
        group = common_pb2.TrajectoryGroup.FromString(fields[b"group"])
        assert group.agent_name == "custom_pool_example" and len(group.trajectories) == 8
