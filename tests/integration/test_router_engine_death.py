"""An engine that dies: molt's own router fails its requests with UNAVAILABLE and stays up.

Starts a router of its own (the test kills its engine), so it runs in the slow stage.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from typing import Any

import grpc
import pytest

from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_dead_engines_requests_fail_and_the_router_stays_up(router_of_its_own: Any) -> None:
    address, log_path = router_of_its_own.address, router_of_its_own.log_path

    def request(request_id: str, seed: int) -> dict[str, object]:
        return {
            "request_id": request_id,
            "prompt_token_ids": [258, 84, 82, 17],
            "sampling_params": common_pb2.SamplingParams(max_tokens=384, seed=seed),
        }

    async def main() -> tuple[list[grpc.StatusCode | None], grpc.StatusCode, float, Any]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            # Eight long samples, so that some are still running when the engine dies (the tiny model can
            # sample its end-of-sequence token early in any one of them).
            streams = [
                stub.GenerateStream(rollout_pb2.GenerateStreamRequest(**request(f"long-{i}", i)), timeout=120)
                for i in range(8)
            ]
            for stream in streams:
                assert (await stream.read()).token_ids  # generating
            found = re.search(r"\(EngineActor pid=(\d+)\)", log_path.read_text(errors="replace"))
            assert found, "no line of the engine actor in the router's log"
            os.kill(int(found.group(1)), signal.SIGKILL)
            ends: list[grpc.StatusCode | None] = []  # None: finished before the kill
            for stream in streams:
                try:
                    while await stream.read() != grpc.aio.EOF:
                        pass
                    ends.append(None)
                except grpc.aio.AioRpcError as exc:
                    ends.append(exc.code())
            started = time.monotonic()
            try:
                await stub.Generate(rollout_pb2.GenerateRequest(**request("later", 0)), timeout=60)
                raise AssertionError("a request to the dead engine succeeded")
            except grpc.aio.AioRpcError as exc:
                later = exc.code()
            status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)  # still serving
            return ends, later, time.monotonic() - started, status

    ends, later, later_s, status = asyncio.run(main())
    assert [(e.engine_id, e.healthy) for e in status.engines] == [("engine-0", False)]  # reported as it is
    assert grpc.StatusCode.UNAVAILABLE in ends and set(ends) <= {None, grpc.StatusCode.UNAVAILABLE}, ends
    assert later == grpc.StatusCode.UNAVAILABLE
    assert later_s < 30  # fails at once, does not wait for a deadline
    assert "engine died: its data channel closed" in log_path.read_text(errors="replace")
