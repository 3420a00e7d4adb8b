"""Detached engines outlive their router: a restarted router attaches to them and takes their state over.

Router A starts a detached engine on the test session's Ray head, streams four requests, moves
the engine to policy version 3 and pauses it with the requests suspended in it, then dies
(SIGKILL, its streams still open). Router B attaches to the same engine by name. Starts two
routers of its own, so it runs in the slow stage.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from molt.core.testing import ServiceProcess, ray_driver
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_ID = "detached-test"
NAMESPACE = f"molt-{RUN_ID}"
GROUP = f"{NAMESPACE}-engine-0"  # the engine's placement group
IDS = [f"orphan-{i}" for i in range(4)]
MAX_TOKENS = 384  # the test router's max_tokens_cap (tests/conftest.py)


def stream_request(request_id: str, seed: int) -> rollout_pb2.GenerateStreamRequest:
    return rollout_pb2.GenerateStreamRequest(
        request_id=request_id,
        prompt_token_ids=[258, 84, 82, 17, 18],
        sampling_params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, seed=seed),
    )


async def waiting_requests(stub: rollout_pb2_grpc.RolloutServiceStub, count: int, timeout_s: float = 60.0) -> int:
    """Polls the router until ``count`` requests wait at its admission (or ``timeout_s`` passed);
    returns how many wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
        if status.waiting_request_count == count or time.monotonic() > deadline:
            return int(status.waiting_request_count)
        await asyncio.sleep(0.1)


async def leave_requests_suspended(address: str, router: ServiceProcess) -> None:
    """Four streams under way, then version 3, then a keep pause that suspends whatever still runs;
    then router A dies with the streams open (so it sends no abort of its own)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=60)
        streams = [stub.GenerateStream(stream_request(request_id, i), timeout=300) for i, request_id in enumerate(IDS)]
        assert await waiting_requests(stub, len(IDS)) == len(IDS)
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(policy_version=3), timeout=60)
        for stream in streams:
            assert (await stream.read()).policy_versions[0] == 3
        paused = await stub.PauseGeneration(
            rollout_pb2.PauseGenerationRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=60
        )
        assert paused.policy_version == 3
        # Long samples: an early end-of-sequence may finish some, not all (else nothing is left to orphan).
        assert paused.suspended_request_count >= 1
        router.stop(sig=signal.SIGKILL)  # no shutdown: the engine (not in A's session) keeps running


async def take_over(address: str) -> tuple[rollout_pb2.GetRouterStatusResponse, int, list[tuple[list[int], int]]]:
    """The attached router's status; then the orphans' ids again, which wait while it is paused and run
    to their end after a ResumeGeneration (no version given). Returns per request (versions, finish)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        status = await stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)

        async def run(request_id: str, seed: int) -> tuple[list[int], int]:
            versions: list[int] = []
            finish = common_pb2.FINISH_REASON_UNSPECIFIED
            async for chunk in stub.GenerateStream(stream_request(request_id, seed), timeout=300):
                versions.extend(chunk.policy_versions)
                finish = chunk.finish_reason or finish
            return versions, finish

        runs = [asyncio.create_task(run(request_id, i)) for i, request_id in enumerate(IDS)]
        waiting = await waiting_requests(stub, len(IDS))
        await stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=60)
        return status, waiting, list(await asyncio.gather(*runs))


def group_state(ray_address: str) -> str | None:
    body = "print(json.dumps({g['name']: g['state'] for g in ray.util.placement_group_table().values()}))\n"
    return json.loads(ray_driver(ray_address, body)).get(GROUP)


def remove_leftovers(ray_address: str) -> None:
    """Kills the test's engine and frees its group if they are still there (a failed test must not leave
    them on the session's Ray head)."""
    body = (
        "from ray.util.placement_group import get_placement_group, remove_placement_group\n"
        f"try:\n    ray.kill(ray.get_actor('molt-engine-0', namespace={NAMESPACE!r}))\nexcept ValueError:\n    pass\n"
        f"try:\n    remove_placement_group(get_placement_group({GROUP!r}))\nexcept ValueError:\n    pass\n"
    )
    ray_driver(ray_address, body)


def test_a_restarted_router_takes_over_detached_engines(ray_head: str, router_factory: Callable[..., Any]) -> None:
    try:
        first, router_a = router_factory("a", run_id=RUN_ID, ray_address=ray_head, detached=True)
        asyncio.run(leave_requests_suspended(router_a.address, first))
        # B does not detach its engines, so its shutdown ends the engine this test started.
        second, router_b = router_factory("b", run_id=RUN_ID, ray_address=ray_head)
        try:
            status, waiting, results = asyncio.run(take_over(router_b.address))
        finally:
            second.stop()
        log = router_b.log_path.read_text(errors="replace")
        assert "attached to running engine" in log
        # The engine's state, not a fresh router's defaults: version 3, paused until told otherwise.
        assert status.paused and status.policy_version == 3
        assert waiting == len(IDS)  # the requests waited while paused instead of failing
        # A's requests were aborted when A's connection closed: their ids are free (no DUPLICATE_REQUEST_ID),
        # and each of B's requests ran to its own end under the version B resumed, 3, with no token of A's.
        for versions, finish in results:
            assert versions and set(versions) == {3} and len(versions) <= MAX_TOKENS, versions
            assert finish in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        # B's shutdown ended the engine and freed its (detached) placement group.
        assert group_state(ray_head) in (None, "REMOVED")
    finally:
        remove_leftovers(ray_head)
