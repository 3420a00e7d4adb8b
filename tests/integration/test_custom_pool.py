"""Swapping the agent-pool: a separate program using only the gRPC contract and the queue schema feeds the learner.

``custom_pool_example.py`` runs as a subprocess against the real router and a
real Redis; it may import only the generated ``molt.v1`` stubs, grpc and redis
(checked at run time). The learner's consumer side then reads its groups
(``TrajectoryQueue``) and turns them into a training batch (``molt.learner.batch``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from transformers import AutoTokenizer

from molt.core.queue import TrajectoryQueue
from molt.core.testing import RedisServer
from molt.learner.batch import assemble, build_group
from molt.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).with_name("custom_pool_example.py")
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


def test_custom_pool_groups_are_accepted_by_the_learner(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(router.model_path)
    lines = prompts(tokenizer, tmp_path / "prompts.jsonl")
    args = ["--router", router.address, "--redis", redis_server.url, "--run", RUN]
    args += ["--prompts", str(tmp_path / "prompts.jsonl"), "--group-size", str(GROUP_SIZE), "--max-tokens", "8"]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(done.stdout.strip().splitlines()[-1])["entries"]
    assert len(written) == len(lines) and all(written)

    with grpc.insecure_channel(router.address) as channel:
        status = rollout_pb2_grpc.RolloutServiceStub(channel).GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
    queue = TrajectoryQueue(redis_client, RUN, consumer="learner-0")
    entries = queue.read(count=10)
    assert [e.entry_id for e in entries] == written and queue.stats().dead_letters == 0

    samples = []
    for entry, line in zip(entries, lines, strict=True):
        group = entry.group
        assert group.prompt_id == line["id"] and len(group.trajectories) == GROUP_SIZE
        outcome = build_group(
            group,
            vocab_size=status.vocab_size,
            current_version=status.policy_version,
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
    assert queue.ack(written) == len(written)
