"""Routed-expert capture: the router's throughput with ``[rollout] routing_replay`` on vs off, one run.

Two ``molt-router`` processes serve the same tiny MoE (``molt-tiny-model --moe``) with the same engine
settings: eager, prefix caching off (what capture needs, given to the "off" side too, so that only
the capture differs), vLLM sleeping between steps. The "on" side captures every token's experts in
the engine worker, takes each finished sample's routing and returns it with the reply. The same
unary requests (the RL loop's path: ``--requests`` prompts of 14 to 37 tokens, ``--max-tokens`` each,
per-request seeds, so both sides sample the same tokens) go to each side in alternating rounds (off,
on, then on, off, ...) after a warm-up round each, with a pause between rounds so that only one
engine works at a time. Printed: median tokens/s per side, the ratio of the medians and the median of
the per-round ratios, and the bytes of routing per token (prompt + sampled) the "on" side returned.
Usage: ``uv run python bench/moe_capture.py [--rounds 6] [--requests 32] [--max-tokens 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from benchlib import start_router

from molt.core.tiny_model import build
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


def prompts(count: int) -> list[list[int]]:
    return [[258, 84, 82, 68, 81, 198, *[17 + (i * 7 + j) % 10 for j in range(8 + i % 24)]] for i in range(count)]


async def one_round(address: str, work: list[list[int]], max_tokens: int, tag: str) -> tuple[float, int, int, int]:
    """Sends every request at once; (wall seconds, sampled tokens, routed tokens, routing bytes)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)

        async def one(i: int, prompt: list[int]) -> tuple[int, int, int]:
            params = common_pb2.SamplingParams(max_tokens=max_tokens, seed=i)
            reply = await stub.Generate(
                rollout_pb2.GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params),
                timeout=600,
            )
            (completion,) = reply.completions
            routing = completion.routed_experts
            routed = len(prompt) + len(completion.token_ids) if routing.ids else 0
            return len(completion.token_ids), routed, len(routing.ids)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(work)))
        wall = time.perf_counter() - started
    return wall, sum(r[0] for r in results), sum(r[1] for r in results), sum(r[2] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between rounds (an engine's tail)")
    args = parser.parse_args()
    work = prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = build(workdir / "tiny-moe", moe=True, arch="qwen3")
        routers, addresses = {}, {}
        for side, replay in (("off", False), ("on", True)):
            (workdir / side).mkdir()
            routers[side], addresses[side] = start_router(
                workdir / side,
                model,
                run_id=f"moe-capture-{side}",
                context=1024,
                temperature=1.0,
                max_tokens_cap=args.max_tokens,
                wait="sleep",
                gpu_memory_utilization=0.1,
                engine_args={"enable_prefix_caching": False},
                rollout={"routing_replay": replay},
            )
        try:
            rates: dict[str, list[float]] = {"off": [], "on": []}
            routed = routing_bytes = 0
            order = ["off", "on"]
            for round_index in range(args.rounds + 1):  # round 0: warm-up, not counted
                for side in order if round_index % 2 else order[::-1]:
                    wall, tokens, tokens_routed, size = asyncio.run(
                        one_round(addresses[side], work, args.max_tokens, f"{side}-{round_index}")
                    )
                    if round_index:
                        rates[side].append(tokens / wall)
                        routed += tokens_routed
                        routing_bytes += size
                    time.sleep(args.gap)
        finally:
            for router in routers.values():
                router.stop()
    for side in ("off", "on"):
        low, high = min(rates[side]), max(rates[side])
        print(f"capture {side:3s} {statistics.median(rates[side]):8.0f} tokens/s (rounds {low:.0f}-{high:.0f})")
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    print(
        f"on / off: {statistics.median(rates['on']) / statistics.median(rates['off']):.3f} (ratio of medians), "
        f"{statistics.median(ratios):.3f} (median of per-round ratios, {min(ratios):.3f}-{max(ratios):.3f})"
    )
    print(f"routing returned: {routing_bytes / max(routed, 1):.2f} bytes per token over {routed} tokens")


if __name__ == "__main__":
    main()
