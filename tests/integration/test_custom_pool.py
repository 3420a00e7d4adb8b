"""Swapping the agent-pool: a separate program using only the gRPC contract and the queue schema feeds the learner.

``examples/custom_pool.py`` runs as a subprocess against the real router, a real learner and a real
Redis; it may import only the generated ``molt.v1`` stubs, grpc and redis (checked at run time), and
it takes every producer setting from the learner (``GetRunSettings``): the group size below is set
in the learner's file only. The learner trains a step on its groups; the test then reads them from
the stream and checks the learner's view of them (``molt.learner.batch``) token for token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from transformers import AutoTokenizer

from molt.core.queue import TrajectoryQueue
from molt.core.testing import RedisServer, ServiceProcess, free_port
from molt.learner.batch import assemble, build_group
from molt.v1 import common_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_pool.py"
RUN = "custom-pool-test"
GROUP_SIZE = 3
# Runs the example as its own program, then fails if it pulled in any of molt's internals.
RUNNER = """
import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
internal = sorted(m for m in sys.modules if m.startswith("molt.") and not m.startswith("molt.v1"))
sys.exit(f"the custom pool imported molt internals: {internal}" if internal else 0)
"""


def start_learner(tmp_path: Path, model: Path, redis_url: str) -> tuple[ServiceProcess, str]:
    """A learner of the run that trains a step on every 2 groups and never checkpoints in the test (so
    the groups it trained on stay in the stream, delivered and not yet acknowledged)."""
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "learner.toml"
    config.write_text(
        f'[run]\nrun_id = "{RUN}"\nredis_url = "{redis_url}"\nrun_dir = "{tmp_path / "run"}"\n'
        f"[rollout]\ngroup_size = {GROUP_SIZE}\ngroups_per_step = 2\nmax_staleness = 0\npartial_rollout = false\n"
        f'[learner]\nmodel_path = "{model}"\nlisten = "{address}"\nmetrics_port = 0\nrefit_every = 0\n'
        "max_steps = 2\ncheckpoint_every = 100\npoll_s = 0.1\n"
        '[learner.algorithm.importance_sampling]\nlevel = "off"\n'
    )
    learner = ServiceProcess(
        [sys.executable, "-m", "molt.learner", "--config", str(config)],
        address,
        tmp_path / "learner.log",
        service="molt.v1.LearnerService",
    )
    learner.start(timeout_s=240)
    return learner, address


def learner_status(address: str) -> learner_pb2.GetLearnerStatusResponse:
    with grpc.insecure_channel(address) as channel:
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        return stub.GetLearnerStatus(learner_pb2.GetLearnerStatusRequest(), timeout=10)


def prompts(tokenizer: Any, path: Path) -> list[dict[str, Any]]:
    """Token ids a custom pool would get from the model's chat template, plus an environment message."""
    lines = []
    for index, question in enumerate(["2+3=", "7-4="]):
        messages = [
            {"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": question},
        ]
        prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        feedback = tokenizer.encode(
            "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
        lines.append({"id": f"q{index}", "prompt_token_ids": prompt, "feedback_token_ids": feedback})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


def test_custom_pool_groups_are_trained_on_by_the_learner(
    tmp_path: Path,
    router_of_its_own: Any,
    tiny_model: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
) -> None:
    # A router of its own, at version 0 like the new learner: the session's router may have been moved
    # on by earlier tests, and a learner behind the engines drops their samples as future_version.
    router = router_of_its_own
    tokenizer = AutoTokenizer.from_pretrained(router.model_path)
    lines = prompts(tokenizer, tmp_path / "prompts.jsonl")
    learner, address = start_learner(tmp_path, tiny_model, redis_server.url)
    try:
        args = ["--learner", address, "--router", router.address, "--prompts", str(tmp_path / "prompts.jsonl")]
        args += ["--max-tokens", "8", "--max-groups", str(len(lines))]
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        written = json.loads(done.stdout.strip().splitlines()[-1])["entries"]
        assert len(written) == len(lines) and all(written)
        deadline = time.monotonic() + 120
        while (status := learner_status(address)).step < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert status.step == 1 and status.consumed_trajectory_count == len(lines) * GROUP_SIZE
        assert status.dead_letter_count == 0 and not status.skipped_group_counts
        # Trained on, not yet acknowledged (no checkpoint yet): still in the stream to read back.
        stream = redis_client.xrange(f"molt:{RUN}:trajectories")
        assert [entry_id.decode() for entry_id, _ in stream] == written
        assert TrajectoryQueue(redis_client, RUN).stats().dead_letters == 0
    finally:
        learner.stop()

    with grpc.insecure_channel(router.address) as channel:
        router_status = rollout_pb2_grpc.RolloutServiceStub(channel).GetRouterStatus(
            rollout_pb2.GetRouterStatusRequest()
        )

    samples = []
    for (_, fields), line in zip(stream, lines, strict=True):
        group = common_pb2.TrajectoryGroup.FromString(fields[b"group"])
        assert group.prompt_id == line["id"] and len(group.trajectories) == GROUP_SIZE
        outcome = build_group(
            group,
            vocab_size=router_status.vocab_size,
            current_version=router_status.policy_version,
            max_staleness=0,
            consumed=set(),
            needs_groups=True,
        )
        assert not outcome.dropped and len(outcome.samples) == GROUP_SIZE
        for trajectory, sample in zip(group.trajectories, outcome.samples, strict=True):
            assert list(trajectory.prompt_token_ids) == line["prompt_token_ids"] and trajectory.turn_count == 2
            response = list(trajectory.response_token_ids)
            mask = list(trajectory.loss_mask)
            # The environment message sits between the two sampled turns, masked out.
            start = mask.index(False)
            assert response[start : start + len(line["feedback_token_ids"])] == line["feedback_token_ids"]
            assert not any(mask[start : start + len(line["feedback_token_ids"])]) and mask[0] and mask[-1]
            # The learner's next-token view: the policy's tokens and their logprobs, nothing else.
            prompt_length = len(line["prompt_token_ids"])
            assert sample.input_ids.tolist() == line["prompt_token_ids"] + response
            assert sample.loss_mask[prompt_length - 1 :].tolist() == mask
            assert sample.loss_tokens == sum(mask)
            logprobs = torch.tensor(list(trajectory.rollout_logprobs))
            assert torch.equal(sample.rollout_logprobs[prompt_length - 1 :], logprobs)
            sampled = torch.tensor(mask)
            assert (logprobs[sampled] <= 0).all() and logprobs[sampled].sum() < 0 and (logprobs[~sampled] == 0).all()
        samples += outcome.samples

    batch = assemble(samples)
    assert batch.group_ids.tolist() == [0] * GROUP_SIZE + [1] * GROUP_SIZE
    assert batch.rollout_ids.tolist() == list(range(2 * GROUP_SIZE))
