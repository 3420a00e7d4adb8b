"""Detached engines outlive their router: a restarted router attaches to them and takes their state over.

Router A starts a detached engine on the session's Ray head, streams four requests, moves the
engine to policy version 3 and pauses it with the requests suspended in it, then dies (SIGKILL).
Router B attaches to the same engine by name. Starts two routers of its own, so it runs in the
slow stage.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from typing import Any

import grpc
import pytest

from molt.core.testing import RAY_ENV
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_ID = "detached-test"
IDS = [f"orphan-{i}" for i in range(4)]


def stream_request(request_id: str, seed: int) -> rollout_pb2.GenerateStreamRequest:
    return rollout_pb2.GenerateStreamRequest(
        request_id=request_id,
        prompt_token_ids=[258, 84, 82, 17, 18],
        sampling_params=common_pb2.SamplingParams(max_tokens=384, seed=seed),
    )


async def leave_requests_suspended(address: str) -> None:
    """Four streams under way, then version 3, then a keep pause that suspends whatever still runs."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=60)
        streams = [stub.GenerateStream(stream_request(request_id, i), timeout=300) for i, request_id in enumerate(IDS)]
        await asyncio.sleep(0.5)  # all four wait at the router's admission
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(policy_version=3), timeout=60)
        for stream in streams:
            assert (await stream.read()).policy_versions[0] == 3
        paused = await stub.PauseGeneration(
            rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=60
        )
        assert paused.policy_version == 3
        # Long samples: an early end-of-sequence may finish some, not all (else nothing is left to orphan).
        assert paused.suspended_request_count >= 1


async def take_over(address: str) -> tuple[rollout_pb2.GetRouterStatusResponse, list[list[int]], int]:
    """The attached router's status, then the orphans' ids again: they wait while paused, and after a
    ResumeGeneration (no version given) they run to their end. Returns the versions per request."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)

        async def run(request_id: str, seed: int) -> list[int]:
            versions: list[int] = []
            async for chunk in stub.GenerateStream(stream_request(request_id, seed), timeout=300):
                versions.extend(chunk.policy_versions)
            return versions

        runs = [asyncio.create_task(run(request_id, i)) for i, request_id in enumerate(IDS)]
        await asyncio.sleep(0.5)
        waiting = (await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)).waiting_request_count
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=60)
        return status, list(await asyncio.gather(*runs)), waiting


def placement_groups(ray_address: str) -> dict[str, str]:
    """Name -> state of the cluster's placement groups, read by a Ray driver of its own."""
    script = (
        "import json, ray\n"
        f"ray.init(address={ray_address!r}, logging_level='ERROR')\n"
        "print(json.dumps({g['name']: g['state'] for g in ray.util.placement_group_table().values()}))\n"
    )
    env = {**os.environ, **RAY_ENV}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_restarted_router_takes_over_detached_engines(ray_head: str, router_factory: Any) -> None:
    first, router_a = router_factory("a", run_id=RUN_ID, ray_address=ray_head, detached=True)
    try:
        asyncio.run(leave_requests_suspended(router_a.address))
    finally:
        first.stop(sig=signal.SIGKILL)  # no shutdown: the engine (not in A's session) keeps running
    # B does not detach its engines, so its shutdown ends the engine this test started.
    second, router_b = router_factory("b", run_id=RUN_ID, ray_address=ray_head)
    try:
        status, versions, waiting = asyncio.run(take_over(router_b.address))
    finally:
        second.stop()
    log = router_b.log_path.read_text(errors="replace")
    assert "attached to running engine" in log
    # The engine's state, not a fresh router's defaults: version 3, paused until told otherwise.
    assert status.paused and status.policy_version == 3
    assert waiting == len(IDS)  # the requests waited while paused instead of failing
    # A's requests were aborted when A's connection closed: their ids are free (no DUPLICATE_REQUEST_ID),
    # and only B's requests' tokens came out (each ran to its end under the version B resumed, 3).
    assert all(v and set(v) == {3} for v in versions), versions
    # B's shutdown ended the engine and freed its (detached) placement group.
    assert placement_groups(ray_head).get(f"molt-{RUN_ID}-engine-0") in (None, "REMOVED")
