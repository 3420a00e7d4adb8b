"""``ServiceHost``'s refusal of requests that do not decode: INVALID_ARGUMENT, and the call after it served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from molt.core.serve import Registration, ServiceHost, error_info, grpc_errors
from molt.v1 import rollout_pb2, rollout_pb2_grpc

NOT_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (request_id, a string) holding bytes that are not UTF-8
CUT_SHORT = b"\x0a\x05ab"  # field 1 announces 5 bytes, 2 follow


class Router(rollout_pb2_grpc.RolloutServiceServicer):
    """One unary method and one streaming method, as molt's servicers write them."""

    @grpc_errors("test")
    async def AbortGeneration(
        self, request: rollout_pb2.AbortGenerationRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortGenerationResponse:
        return rollout_pb2.AbortGenerationResponse(aborted=request.request_id == "r")

    @grpc_errors("test")
    async def GenerateStream(
        self, request: rollout_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateStreamResponse]:
        yield rollout_pb2.GenerateStreamResponse(request_id=request.request_id)


async def calls(address: str) -> dict[str, grpc.StatusCode]:
    outcomes = {}
    async with grpc.aio.insecure_channel(address) as channel:
        attempts = {
            "unary": channel.unary_unary("/molt.v1.RolloutService/AbortGeneration"),
            "generator": channel.unary_stream("/molt.v1.RolloutService/GenerateStream"),
            "health": channel.unary_unary("/grpc.health.v1.Health/Check"),
            "health watch": channel.unary_stream("/grpc.health.v1.Health/Watch"),  # writes with context.write
        }
        for name, method in attempts.items():
            for kind, payload in (("not utf-8", NOT_UTF8), ("cut short", CUT_SHORT)):
                try:
                    reply = method(payload, timeout=10)
                    if isinstance(reply, grpc.aio.UnaryStreamCall):
                        _ = [item async for item in reply]
                    else:
                        await reply
                    outcomes[f"{name} {kind}"] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    outcomes[f"{name} {kind}"] = exc.code()
                    info = error_info(exc)
                    assert info is not None and info.reason == "UNDECODABLE_REQUEST", exc
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        reply = await stub.AbortGeneration(rollout_pb2.AbortGenerationRequest(request_id="r"), timeout=10)
        outcomes["unary valid"] = grpc.StatusCode.OK if reply.aborted else grpc.StatusCode.UNKNOWN
        stream = stub.GenerateStream(rollout_pb2.GenerateStreamRequest(request_id="s"), timeout=10)
        outcomes["generator valid"] = (
            grpc.StatusCode.OK if [m.request_id async for m in stream] == ["s"] else grpc.StatusCode.UNKNOWN
        )
        health = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            health_pb2.HealthCheckRequest.SerializeToString,
            health_pb2.HealthCheckResponse.FromString,
        )
        served = await health(health_pb2.HealthCheckRequest(), timeout=10)
        outcomes["health valid"] = (
            grpc.StatusCode.OK if served.status == health_pb2.HealthCheckResponse.SERVING else grpc.StatusCode.UNKNOWN
        )
    return outcomes


def test_requests_that_do_not_decode_get_invalid_argument() -> None:
    """Bytes that are not the method's message (a string that is not UTF-8, a field cut short) were
    answered UNKNOWN ("Unexpected DecodeError") by gRPC itself; now INVALID_ARGUMENT, for unary and
    streaming methods, molt's and the health service's alike, and valid calls are served as before."""

    async def main() -> dict[str, grpc.StatusCode]:
        host = ServiceHost(
            "test",
            "127.0.0.1:0",
            [Registration(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, Router(), "molt.v1.RolloutService")],
        )
        port = await host.start()
        try:
            return await calls(f"127.0.0.1:{port}")
        finally:
            await host.stop()

    outcomes = asyncio.run(main())
    refused = {name: code for name, code in outcomes.items() if "valid" not in name}
    assert len(refused) == 8 and set(refused.values()) == {grpc.StatusCode.INVALID_ARGUMENT}, outcomes
    assert {outcomes[f"{name} valid"] for name in ("unary", "generator", "health")} == {grpc.StatusCode.OK}
