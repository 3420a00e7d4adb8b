"""A custom agent-pool in ~150 lines: only the gRPC contract (``molt.v1`` stubs), grpc and redis.

It stands in for a producer written in any language (docs/custom-agent-pool.md
walks through it). For each prompt it runs ``--group-size`` two-turn episodes
through the rollout-router's ``RolloutService``:

1. generate a reply to the prompt (tokens in, sampled tokens + logprobs + versions out);
2. append the prompt's ``feedback_token_ids`` (an environment message: not trained on)
   and generate again, continuing from exactly the tokens the engine saw;

then scores each episode, builds one ``molt.v1.TrajectoryGroup`` and queues it
on the run's Redis stream with the documented atomic put (docs/queue.md).

Prompts: a JSONL file of ``{"id": str, "prompt_token_ids": [int], "feedback_token_ids": [int]}``
(a real pool would apply the model's chat template to get them).
Usage: ``python custom_pool_example.py --router HOST:PORT --redis URL --run RUN --prompts FILE``.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import dataclass, field

import grpc
import redis

from molt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

# The put script of docs/queue.md. KEYS: stream, seen-ids set. ARGV: max_length, payload, trajectory ids...
PUT = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return {'full'} end
local ids = {}
for i = 3, #ARGV do ids[#ids + 1] = ARGV[i] end
local seen = redis.call('SMISMEMBER', KEYS[2], unpack(ids))
local dups = {}
for i = 1, #seen do if seen[i] == 1 then dups[#dups + 1] = ids[i] end end
if #dups > 0 then return {'dup', unpack(dups)} end
redis.call('SADD', KEYS[2], unpack(ids))
return {'ok', redis.call('XADD', KEYS[1], '*', 'group', ARGV[2])}
"""


@dataclass
class Episode:
    """One episode's tokens: the prompt, then everything after it with a loss mask."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: int = common_pb2.FINISH_REASON_STOP
    turns: int = 0

    def add_sampled(self, completion: rollout_pb2.Completion) -> None:
        """The engine's sampled ids, stored as returned (never re-encoded from text)."""
        self.response += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += completion.policy_versions
        self.mask += [True] * len(completion.token_ids)
        self.finish = completion.finish_reason
        self.turns += 1

    def add_inserted(self, token_ids: list[int]) -> None:
        """Environment tokens: loss mask false, logprob 0, the version of the turn before them."""
        self.response += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(token_ids)
        self.mask += [False] * len(token_ids)


def score(episode: Episode) -> float:
    """A stand-in grader: the share of sampled tokens with an even id (deterministic, varies per sample)."""
    sampled = [t for t, m in zip(episode.response, episode.mask, strict=True) if m]
    return sum(t % 2 == 0 for t in sampled) / max(1, len(sampled))


def generate(
    stub: rollout_pb2_grpc.RolloutServiceStub, prompt: list[int], max_tokens: int, session: str
) -> rollout_pb2.Completion:
    """One sample; protected sampling settings (temperature, top_p, ...) are left to the router."""
    request = rollout_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        session_id=session,  # same session = same engine: prefix-cache hits on the next turn
        prompt_token_ids=prompt,
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens),
    )
    return stub.Generate(request, timeout=300).completions[0]


def run_episode(stub: rollout_pb2_grpc.RolloutServiceStub, line: dict, max_tokens: int) -> Episode:
    session = uuid.uuid4().hex
    episode = Episode(prompt=list(line["prompt_token_ids"]))
    episode.add_sampled(generate(stub, episode.prompt, max_tokens, session))
    if line.get("feedback_token_ids"):
        episode.add_inserted(list(line["feedback_token_ids"]))
        episode.add_sampled(generate(stub, episode.prompt + episode.response, max_tokens, session))
    return episode


def build_group(run: str, prompt_id: str, episodes: list[Episode], group_size: int) -> common_pb2.TrajectoryGroup:
    group = common_pb2.TrajectoryGroup(
        group_id=uuid.uuid4().hex,
        prompt_id=prompt_id,
        run_id=run,
        agent_name="custom_pool_example",
        sample_count=group_size,
        failed_sample_count=group_size - len(episodes),
    )
    group.create_time.GetCurrentTime()
    for episode in episodes:
        group.trajectories.add(
            trajectory_id=uuid.uuid4().hex,
            rollout_id=uuid.uuid4().hex,  # one per episode; every segment of an episode would share it
            segment_index=0,
            prompt_token_ids=episode.prompt,
            response_token_ids=episode.response,
            rollout_logprobs=episode.logprobs,
            loss_mask=episode.mask,
            policy_versions=episode.versions,
            reward=score(episode),
            finish_reason=episode.finish,
            turn_count=episode.turns,
        )
    return group


def put(client: redis.Redis, run: str, group: common_pb2.TrajectoryGroup, max_length: int) -> str:
    """Queues the group atomically; waits while the queue is full, never drops."""
    script = client.register_script(PUT)
    keys = [f"molt:{run}:trajectories", f"molt:{run}:trajectory-ids"]
    while True:
        ids = [t.trajectory_id for t in group.trajectories]
        reply = script(keys=keys, args=[max_length, group.SerializeToString(), *ids])
        status = reply[0].decode()
        if status == "ok":
            return reply[1].decode()
        if status == "full":
            time.sleep(0.5)
            continue
        duplicates = {d.decode() for d in reply[1:]}  # "dup": re-send without them
        kept = [t for t in group.trajectories if t.trajectory_id not in duplicates]
        del group.trajectories[:]
        group.trajectories.extend(kept)
        if not kept:
            return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", required=True, help="RolloutService address host:port")
    parser.add_argument("--redis", required=True, help="redis://host:port/db")
    parser.add_argument("--run", required=True, help="the run id ([run] run_id)")
    parser.add_argument("--prompts", required=True, help="JSONL prompt token ids")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=1024, help="the queue's bound")
    args = parser.parse_args()
    client = redis.Redis.from_url(args.redis)
    entries = []
    with grpc.insecure_channel(args.router) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        with open(args.prompts) as lines:
            for raw in lines:
                line = json.loads(raw)
                episodes = [run_episode(stub, line, args.max_tokens) for _ in range(args.group_size)]
                group = build_group(args.run, str(line["id"]), episodes, args.group_size)
                entries.append(put(client, args.run, group, args.max_length))
    print(json.dumps({"entries": entries}))  # noqa: T201 (the program's output)


if __name__ == "__main__":
    main()
