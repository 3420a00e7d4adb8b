"""molt's own router, from outside: how it drives its engines (not part of the RolloutService contract).

Uses the session's router (tests/conftest.py); an external RolloutService implementation has
neither molt's metrics nor its engine processes, so these tests do not apply to one.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import struct
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from molt.router.data_channel import frame
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.integration]


@pytest.fixture
def own_router(router: Any) -> Any:
    if router.pid is None:
        pytest.skip("an external RolloutService: molt's metrics and engine processes do not apply")
    return router


def router_metrics(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def test_requests_released_together_reach_the_engine_in_one_message(own_router: Any) -> None:
    """Requests that arrive during a pause wait at admission; the resume releases them in one pass of
    the router's loop, so they reach the engine in one message of its data channel."""
    before = router_metrics(own_router.metrics_url)

    async def held_then_released() -> list[rollout_pb2.GenerateResponse]:
        async with grpc.aio.insecure_channel(own_router.address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest())
            await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP))
            calls = [
                asyncio.ensure_future(
                    stub.Generate(
                        rollout_pb2.GenerateRequest(
                            request_id=f"held-{i}",
                            prompt_token_ids=[258, 84, 82, 17 + i % 10],
                            sampling_params=common_pb2.SamplingParams(max_tokens=4, seed=i),
                        ),
                        timeout=120,
                    )
                )
                for i in range(32)
            ]
            for _ in range(600):  # until all 32 wait at admission
                if router_metrics(own_router.metrics_url)["molt_router_requests_waiting"] == 32:
                    break
                await asyncio.sleep(0.05)
            await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(policy_version=status.policy_version))
            return list(await asyncio.gather(*calls))

    responses = asyncio.run(held_then_released())
    assert all(len(r.completions[0].token_ids) > 0 for r in responses)
    after = router_metrics(own_router.metrics_url)
    key = "molt_router_submit_batch_requests"
    assert after[f"{key}_sum"] - before.get(f"{key}_sum", 0.0) == 32
    assert after[f"{key}_count"] - before.get(f"{key}_count", 0.0) == 1, "the released requests were not batched"


def test_cpu_engine_processes_sleep_instead_of_spinning(own_router: Any) -> None:
    """The engine actor tells its vLLM processes to sleep; vLLM loads molt's plugin in the engine core
    and in the worker, and each logs through vLLM's logger (which reaches the router's log) when it
    replaced the spin. The line names the process that wrote it."""
    log = own_router.log_path.read_text(errors="replace")
    applied = {
        match.group(1)
        for line in log.splitlines()
        if "readers sleep instead of spinning (MOLT_VLLM_WAIT=sleep)" in line
        and (match := re.search(r"\((EngineCore|VllmWorker)\S* pid=\d+\)", line))
    }
    assert applied == {"EngineCore", "VllmWorker"}, f"the plugin acted in {applied}; the log ends with:\n{log[-3000:]}"


def data_channels(log_path: Path) -> dict[str, str]:
    """Each engine's data-channel address, from the router's "engines ready" log line."""
    for line in log_path.read_text(errors="replace").splitlines():
        if '"engines ready"' in line:
            return dict(json.loads(line[line.index("{") :])["data_channels"])
    raise AssertionError("the router logged no 'engines ready' line")


def test_a_data_channel_connection_without_the_secret_is_closed(own_router: Any) -> None:
    """The engine's data channel takes pickled frames only after the secret the router got over Ray:
    a stranger's frame (here: a pickle) is refused before it is unpickled, the connection closed,
    and the router goes on serving."""
    host, port = data_channels(own_router.log_path)["engine-0"].rsplit(":", 1)

    async def send_unasked(data: bytes) -> bytes:
        """Connects, sends ``data`` instead of the secret, and returns what came back (b"": closed)."""
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(data)
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return rest

    assert asyncio.run(send_unasked(frame(pickle.dumps([("abort", "x")])))) == b""
    # A header that claims 1 GiB: closed before anything is read or allocated.
    assert asyncio.run(send_unasked(struct.pack("!I", 1 << 30))) == b""
    for _ in range(200):  # the engine actor's log reaches the router's through Ray, a little later
        if "closed a connection that lacked the secret" in own_router.log_path.read_text(errors="replace"):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the engine did not log the refused connection")

    async def one_request() -> rollout_pb2.GenerateResponse:
        async with grpc.aio.insecure_channel(own_router.address) as channel:
            return await rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
                rollout_pb2.GenerateRequest(
                    request_id="after-the-stranger",
                    prompt_token_ids=[258, 84, 82, 17],
                    sampling_params=common_pb2.SamplingParams(max_tokens=4, seed=1),
                ),
                timeout=60,
            )

    assert len(asyncio.run(one_request()).completions[0].token_ids) > 0
