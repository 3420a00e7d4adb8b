"""A custom agent-pool: only the gRPC contract (``molt.v1`` stubs), grpc and redis.

It stands in for a producer written in any language (docs/custom-agent-pool.md walks through it).
It asks the learner for the run's producer settings (``GetRunSettings``: run id, Redis URL and keys,
group size, groups per step, staleness bound, queue bound), then for each prompt runs a group of
two-turn episodes through the rollout-router's ``RolloutService``:

1. generate a reply to the prompt (tokens in, sampled tokens + logprobs + versions out);
2. append the prompt's ``feedback_token_ids`` (an environment message: not trained on)
   and generate again, continuing from exactly the tokens the engine saw;

scores each episode, builds one ``molt.v1.TrajectoryGroup`` and queues it on the run's Redis stream
with the documented atomic put (docs/queue.md), paced on the policy version as the agent-pool is.

Prompts: a JSONL file of ``{"id": str, "prompt_token_ids": [int], "feedback_token_ids": [int]}``
(a real pool would apply the model's chat template to get them).
Usage: ``python examples/custom_pool.py --learner HOST:PORT --router HOST:PORT --prompts FILE
--token-file RUN_DIR/secrets/token``. Every call carries the run's token as ``authorization: Bearer``
metadata (docs/security.md); a run's embedded Redis takes the same token as its password
(``--redis-password-file``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field

import grpc
import redis

from molt.v1 import common_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

AUTH: list[tuple[str, str]] = []  # the run's token as call metadata, once read (--token-file)
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
    return stub.Generate(request, timeout=300, metadata=AUTH).completions[0]


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


def put(client: redis.Redis, run: learner_pb2.GetRunSettingsResponse, group: common_pb2.TrajectoryGroup) -> str:
    """Queues the group atomically within the run's bound; waits while the queue is full, never drops."""
    script = client.register_script(PUT)
    keys = [run.trajectory_stream_key, run.seen_set_key]
    while True:
        ids = [t.trajectory_id for t in group.trajectories]
        reply = script(keys=keys, args=[run.rollout.queue_max_length, group.SerializeToString(), *ids])
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


def run_settings(learner: str, timeout_s: float = 300.0) -> learner_pb2.GetRunSettingsResponse:
    """The learner's producer-facing settings, waiting for it to serve."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(learner) as channel:
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        while True:
            try:
                return stub.GetRunSettings(learner_pb2.GetRunSettingsRequest(), timeout=10, metadata=AUTH)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


def wait_for_version(
    stub: rollout_pb2_grpc.RolloutServiceStub, index: int, rollout: common_pb2.RolloutSettings
) -> None:
    """Group ``index`` starts once the policy version is index // groups_per_step - max_staleness, so the
    learner, training it in its slot, finds it at most max_staleness versions old (docs/queue.md)."""
    needed = index // rollout.groups_per_step - rollout.max_staleness
    while stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30, metadata=AUTH).policy_version < needed:
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learner", required=True, help="LearnerService address host:port (the run's settings)")
    parser.add_argument("--router", required=True, help="RolloutService address host:port")
    parser.add_argument("--prompts", required=True, help="JSONL prompt token ids")
    parser.add_argument("--token-file", help="the run's token ([run] token_file); every call sends it")
    parser.add_argument("--redis-password-file", help="the run's Redis password (molt up's own Redis: the token)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-groups", type=int, default=0, help="stop after this many groups; 0: cycle forever")
    args = parser.parse_args()
    if args.token_file:
        with open(args.token_file) as token:
            AUTH.append(("authorization", f"Bearer {token.read().strip()}"))
    password = None
    if args.redis_password_file:
        with open(args.redis_password_file) as secret:
            password = secret.read().strip()
    run = run_settings(args.learner)
    size = run.rollout.group_size
    client = redis.Redis.from_url(run.redis_url, password=password)
    with open(args.prompts) as lines:
        prompts = [json.loads(raw) for raw in lines]
    entries = []
    with grpc.insecure_channel(args.router) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for index in itertools.count():
            if args.max_groups and index >= args.max_groups:
                break
            line = prompts[index % len(prompts)]
            wait_for_version(stub, index, run.rollout)
            episodes = [run_episode(stub, line, args.max_tokens) for _ in range(size)]
            entries.append(put(client, run, build_group(run.run_id, str(line["id"]), episodes, size)))
    print(json.dumps({"run_id": run.run_id, "entries": entries}))  # noqa: T201 (the program's output)


if __name__ == "__main__":
    main()
