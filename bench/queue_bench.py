"""Trajectory-queue throughput: molt's TrajectoryQueue versus raw redis-py, side by side in one run.

Both sides move the same TrajectoryGroup payloads through the same redis-server
and do the same protobuf work (serialize on put, parse on read):

- ours: ``TrajectoryQueue.put_many`` of a batch (structural check of every group; then, in two
  round trips on one connection, WATCH + XLEN + SMISMEMBER for the bound and the dedupe, and
  MULTI + SADD + XADDs + EXEC), ``read`` (the consumer-name check, one script; XREADGROUP + parse +
  check), ``ack`` (one script: the consumer-name check, XDEL + XACK);
- raw:  pipelined XADD of a batch, XREADGROUP of the batch, one XACK.

Each round runs both sides on the same fresh groups, in alternating order (raw first in even
rounds, ours first in odd ones), after a warm-up round; printed: the ratio of the medians and the
median of the per-round ratios.
Usage: ``uv run python bench/queue_bench.py [--groups 64] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import redis

from molt.core.queue import CONSUMER_GROUP, TrajectoryQueue
from molt.core.testing import RedisServer
from molt.v1 import common_pb2

VOCAB = 151_936  # a Qwen2/3-sized vocabulary: ids take 3 varint bytes


def make_groups(count: int, samples: int, prompt_tokens: int, response_tokens: int, run_id: str):
    rng = random.Random(0)
    groups = []
    for g in range(count):
        group = common_pb2.TrajectoryGroup(
            group_id=uuid.uuid4().hex, prompt_id=f"p{g}", run_id=run_id, sample_count=samples
        )
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
        for _ in range(samples):
            group.trajectories.add(
                trajectory_id=uuid.uuid4().hex,
                rollout_id=uuid.uuid4().hex,
                prompt_token_ids=prompt,
                response_token_ids=[rng.randrange(VOCAB) for _ in range(response_tokens)],
                rollout_logprobs=[-rng.random() * 5 for _ in range(response_tokens)],
                loss_mask=[True] * response_tokens,
                policy_versions=[7] * response_tokens,
                reward=rng.random(),
                finish_reason=common_pb2.FINISH_REASON_STOP,
                turn_count=1,
            )
        groups.append(group)
    return groups


def run_ours(client: redis.Redis, run_id: str, groups, batch: int) -> float:
    queue = TrajectoryQueue(client, run_id, max_length=len(groups) + 1, consumer="bench")
    started = time.perf_counter()
    for i in range(0, len(groups), batch):
        queue.put_many(groups[i : i + batch])
        entries = queue.read(count=batch)
        assert len(entries) == len(groups[i : i + batch])
        queue.ack([e.entry_id for e in entries])
    elapsed = time.perf_counter() - started
    queue.close()  # else its claim's renewal thread would run on through every later repetition
    return elapsed


def run_raw(client: redis.Redis, run_id: str, groups, batch: int) -> float:
    stream = f"raw:{run_id}"
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    started = time.perf_counter()
    for i in range(0, len(groups), batch):
        with client.pipeline(transaction=False) as pipe:
            for group in groups[i : i + batch]:
                pipe.xadd(stream, {"group": group.SerializeToString()})
            pipe.execute()
        reply = client.xreadgroup(CONSUMER_GROUP, "bench", {stream: ">"}, count=batch)
        entries = reply[0][1]
        parsed = [common_pb2.TrajectoryGroup.FromString(fields[b"group"]) for _, fields in entries]
        assert len(parsed) == len(groups[i : i + batch])
        client.xack(stream, CONSUMER_GROUP, *[eid for eid, _ in entries])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64, help="groups per round")
    parser.add_argument("--samples", type=int, default=8, help="trajectories per group")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="groups per read/ack (and per raw pipeline)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            client = server.client()
            ours, raw = [], []
            for r in range(args.rounds + 1):  # round 0 warms both up
                groups = make_groups(args.groups, args.samples, args.prompt_tokens, args.response_tokens, f"r{r}")
                times = {}
                for side in ("ours", "raw") if r % 2 else ("raw", "ours"):
                    client.flushall()
                    times[side] = (run_ours if side == "ours" else run_raw)(client, f"r{r}", groups, args.batch)
                if r:
                    ours.append(times["ours"])
                    raw.append(times["raw"])
            payload = sum(g.ByteSize() for g in groups)
        finally:
            server.stop()

    tokens = args.groups * args.samples * (args.prompt_tokens + args.response_tokens)
    response_tokens = args.groups * args.samples * args.response_tokens
    ours_rate, raw_rate = args.groups / statistics.median(ours), args.groups / statistics.median(raw)
    print(
        f"workload: {args.groups} groups x {args.samples} samples x ({args.prompt_tokens} prompt + "
        f"{args.response_tokens} response) tokens, vocab {VOCAB}, batch {args.batch}, "
        f"{args.rounds} rounds after a warm-up"
    )
    for name, rate in (("ours (put_many+read+ack)", ours_rate), ("raw redis-py (XADD/XREADGROUP/XACK)", raw_rate)):
        print(f"{name:37s} {rate:8.1f} groups/s {rate * tokens / args.groups:12.0f} tokens/s")
    paired = sorted(r / o for o, r in zip(ours, raw, strict=True))
    print(
        f"throughput ratio ours/raw: {ours_rate / raw_rate:.3f} (of the medians), {statistics.median(paired):.3f} "
        f"(median of {len(paired)} paired rounds, range {paired[0]:.2f}-{paired[-1]:.2f})  (goal >= 0.8)"
    )
    print(
        f"payload: {payload / tokens:.2f} bytes/token over all tokens, "
        f"{payload / response_tokens:.2f} bytes/response token  (goal <= 9)"
    )


if __name__ == "__main__":
    main()
