"""A peer that stops answering without closing its connection: the calls to it fail within seconds
(HTTP/2 keepalive pings, ``molt.core.serve.KEEPALIVE``), not at their deadline.

The peer is a real gRPC server in a child process (``ServiceHost``, as every molt service is served)
frozen with SIGSTOP. Its RolloutService is a stand-in, named as such: its Generate only waits for
``max_tokens`` seconds, then answers with nothing; the fault under test is the frozen process, which
a real router would need a minute to start for."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from molt.agent_pool.router_client import GenerationRequest, RouterClient
from molt.core.errors import Unavailable
from molt.core.serve import KEEPALIVE_PING_S

pytestmark = pytest.mark.integration

STAND_IN = """
import asyncio
from molt.core.serve import Registration, ServiceHost
from molt.v1 import rollout_pb2, rollout_pb2_grpc


class WaitingRouter(rollout_pb2_grpc.RolloutServiceServicer):  # a stand-in: Generate waits, then answers
    async def Generate(self, request, context):
        await asyncio.sleep(request.sampling_params.max_tokens)
        return rollout_pb2.GenerateResponse()


async def main():
    name = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
    host = ServiceHost("stand-in", "127.0.0.1:0", [Registration(
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server, WaitingRouter(), name)])
    print(await host.start(), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_frozen_peer_fails_the_calls_to_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", STAND_IN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())

        async def main() -> tuple[float, Unavailable]:
            client = RouterClient(f"127.0.0.1:{port}", timeout_s=90)
            try:
                await client.generate(GenerationRequest("quiet", "s", [1, 2], max_tokens=1))  # a live peer answers
                frozen = asyncio.create_task(client.generate(GenerationRequest("frozen", "s", [1], max_tokens=80)))
                await asyncio.sleep(0.5)
                os.kill(child.pid, signal.SIGSTOP)
                started = time.monotonic()
                with pytest.raises(Unavailable) as failed:
                    await frozen
                return time.monotonic() - started, failed.value
            finally:
                os.kill(child.pid, signal.SIGCONT)
                await client.close()

        waited, error = asyncio.run(main())
        # Without pings the call would end at its 90 s deadline as DEADLINE_EXCEEDED (or never: the
        # stand-in answers after 80 s once resumed).
        assert "UNAVAILABLE" in error.message and waited < KEEPALIVE_PING_S * 6, (waited, error.message)
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
