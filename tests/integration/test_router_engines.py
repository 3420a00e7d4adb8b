"""molt's own router, from outside: how it drives its engines (not part of the RolloutService contract).

Uses the session's router (tests/conftest.py); an external RolloutService implementation has
neither molt's metrics nor its engine processes, so these tests do not apply to one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.integration]


@pytest.fixture
def own_router(router: Any) -> Any:
    if router.pid is None:
        pytest.skip("an external RolloutService: molt's metrics and engine processes do not apply")
    return router


def batch_histogram(metrics_url: str) -> tuple[float, float]:
    """(requests, Ray calls) of ``molt_router_submit_batch_requests`` so far."""
    text = requests.get(metrics_url, timeout=10).text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if family.name == "molt_router_submit_batch_requests"
    }
    return values["molt_router_submit_batch_requests_sum"], values["molt_router_submit_batch_requests_count"]


def test_a_burst_of_requests_reaches_the_engine_in_fewer_ray_calls(own_router: Any) -> None:
    before_requests, before_calls = batch_histogram(own_router.metrics_url)

    async def burst() -> list[rollout_pb2.GenerateResponse]:
        async with grpc.aio.insecure_channel(own_router.address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            return list(
                await asyncio.gather(
                    *(
                        stub.Generate(
                            rollout_pb2.GenerateRequest(
                                request_id=f"burst-{i}",
                                prompt_token_ids=[258, 84, 82, 17 + i % 10],
                                sampling_params=common_pb2.SamplingParams(max_tokens=4, seed=i),
                            ),
                            timeout=120,
                        )
                        for i in range(32)
                    )
                )
            )

    responses = asyncio.run(burst())
    assert all(len(r.completions[0].token_ids) > 0 for r in responses)
    after_requests, after_calls = batch_histogram(own_router.metrics_url)
    assert after_requests - before_requests == 32
    assert 1 <= after_calls - before_calls < 32, "every request went to the engine in a Ray call of its own"


def descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def test_cpu_engine_processes_are_told_to_sleep_instead_of_spinning(own_router: Any) -> None:
    waits = {}
    for pid in descendants(own_router.pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if name.startswith("VLLM::"):
            setting = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"MOLT_VLLM_WAIT=")]
            waits[name] = setting[0] if setting else None
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= set(waits), f"engine processes not found: {waits}"
    assert set(waits.values()) == {"sleep"}, waits
