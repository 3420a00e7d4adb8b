"""The HTTP front with the official, unmodified openai and anthropic SDKs, against a real router."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import grpc
import httpx
import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer

from molt.agent_pool.agents import AgentResult, ChatAgent, Prompt, load_agent
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.dataset import load_prompts
from molt.agent_pool.episodes import TurnLimits, chat_runner
from molt.agent_pool.front import ChatFront, start_front
from molt.agent_pool.pool import RolloutPool
from molt.agent_pool.prompts import PromptSource
from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.sessions import Session
from molt.algos.advantages import grpo
from molt.core.queue import TrajectoryQueue
from molt.core.testing import RedisServer, free_port
from molt.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate",
            "parameters": {"type": "object", "properties": {"e": {"type": "string"}}},
        },
    }
]


def with_front(router: Any, body: Callable[[ChatFront, str], Awaitable[T]]) -> T:
    async def main() -> T:
        client = RouterClient(router.address)
        info = await client.info()
        limits = TurnLimits(16, info.max_model_len, info.max_tokens_cap)
        front = ChatFront(AutoTokenizer.from_pretrained(router.model_path), client, limits, max_body_bytes=1 << 20)
        server, task, base_url = await start_front(front, f"127.0.0.1:{free_port()}")
        try:
            return await body(front, base_url)
        finally:
            server.should_exit = True
            await task
            await front.aclose()
            await client.close()

    return asyncio.run(main())


def openai_client(base_url: str, session: Session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/s/{session.id}/v1", api_key=session.key, max_retries=0)


def anthropic_client(base_url: str, session: Session) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"{base_url}/s/{session.id}", api_key=session.key, max_retries=0)


def test_openai_plain_logprobs_and_identical_retry(router: Any) -> None:
    async def body(front: ChatFront, base_url: str) -> None:
        session = front.open_session()
        client = openai_client(base_url, session)
        messages = [{"role": "user", "content": "2+2="}]
        reply = await client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, seed=1, logprobs=True, top_logprobs=2
        )
        (segment,) = session.transcript.segments
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(segment.logprobs, abs=1e-6)
        assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
        assert choice.message.content == session.transcript.reply_text(segment.response_ids)
        # The exact same request again (a client retry): same reply, nothing recorded.
        raw = {"model": "m", "messages": messages, "max_tokens": 6, "seed": 1, "logprobs": True, "top_logprobs": 2}
        async with httpx.AsyncClient() as http:
            again = await http.post(
                f"{base_url}/s/{session.id}/v1/chat/completions",
                json=raw,
                headers={"Authorization": f"Bearer {session.key}"},
            )
        assert again.status_code == 200 and again.json()["id"] == reply.id
        assert segment.turns == 1 and len(session.transcript.segments) == 1
        await client.close()

    with_front(router, body)


def test_openai_streaming_matches_the_recorded_tokens(router: Any) -> None:
    """A streamed reply's text is the recorded tokens' text; with logprobs, the chunks' logprobs are
    the recorded ones, in order, each chunk's with the text it came from."""

    async def body(front: ChatFront, base_url: str) -> None:
        session = front.open_session()
        client = openai_client(base_url, session)
        for logprobs in (False, True):
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"hi {logprobs}"}],
                max_tokens=12,
                stream=True,
                seed=3,
                **({"logprobs": True, "top_logprobs": 2} if logprobs else {}),
            )
            text, finishes, entries = "", [], []
            async for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    text += choice.delta.content or ""
                    finishes += [choice.finish_reason] if choice.finish_reason else []
                    assert (choice.logprobs is not None) == logprobs
                    if choice.logprobs and choice.logprobs.content:
                        entries += choice.logprobs.content
                        assert choice.delta.content or choice.finish_reason  # logprobs come with their text
            segment = session.transcript.segments[-1]
            assert text == session.transcript.reply_text(segment.response_ids)
            assert len(finishes) == 1 and segment.turns == 1 and all(segment.loss_mask)
            if logprobs:
                assert [e.logprob for e in entries] == pytest.approx(segment.logprobs, abs=1e-6)
                assert [e.token for e in entries] == [front.tokenizer.decode([t]) for t in segment.response_ids]
                assert all(len(e.top_logprobs) == 2 for e in entries)
        await client.close()

    with_front(router, body)


def test_tool_call_history_in_both_apis_extends_one_segment(router: Any) -> None:
    async def body(front: ChatFront, base_url: str) -> None:
        tokenizer = front.tokenizer
        session = front.open_session()
        client = openai_client(base_url, session)
        history: list[dict[str, Any]] = [{"role": "user", "content": "what is 2*3?"}]
        first = await client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4)
        history.append(first.choices[0].message.model_dump(exclude_none=True))
        history += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2*3"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "6"},
        ]
        await client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4)
        (segment,) = session.transcript.segments  # the second turn extended the first
        text = tokenizer.decode(segment.token_ids())
        assert '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>' in text
        assert "<tool_response>6</tool_response>" in text and segment.turns == 2
        await client.close()

        session = front.open_session()
        claude = anthropic_client(base_url, session)
        tools = [{"name": "calc", "description": "evaluate", "input_schema": {"type": "object"}}]
        convo: list[dict[str, Any]] = [{"role": "user", "content": "what is 2*3?"}]
        first_msg = await claude.messages.create(
            model="m", max_tokens=4, system="be brief", messages=convo, tools=tools
        )
        convo.append({"role": "assistant", "content": [b.model_dump() for b in first_msg.content]})
        convo += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"e": "2*3"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "6"}]},
        ]
        await claude.messages.create(model="m", max_tokens=4, system="be brief", messages=convo, tools=tools)
        (segment,) = session.transcript.segments
        text = tokenizer.decode(segment.token_ids())
        assert text.startswith("<|im_start|>system\nbe brief") and '"name": "calc"' in text
        assert "<tool_response>6</tool_response>" in text and segment.turns == 2
        await claude.close()

    with_front(router, body)


def test_anthropic_plain_and_streaming(router: Any) -> None:
    async def body(front: ChatFront, base_url: str) -> None:
        session = front.open_session()
        claude = anthropic_client(base_url, session)
        message = await claude.messages.create(
            model="m", max_tokens=10, system="sys", messages=[{"role": "user", "content": "hello"}]
        )
        assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens >= 1
        async with claude.messages.stream(
            model="m", max_tokens=10, system="sys", messages=[{"role": "user", "content": "again"}]
        ) as stream:
            streamed = "".join([text async for text in stream.text_stream])
            final = await stream.get_final_message()
        segments = session.transcript.segments
        assert len(segments) == 2  # the second request rewrote the history: a new segment
        texts = "".join(b.text for b in final.content if b.type == "text")
        assert streamed == texts == session.transcript.reply_text(segments[1].response_ids)
        assert "".join(b.text for b in message.content if b.type == "text") == session.transcript.reply_text(
            segments[0].response_ids
        )
        await claude.close()

    with_front(router, body)


def test_bad_requests_get_clear_4xx_and_record_nothing(router: Any) -> None:
    async def body(front: ChatFront, base_url: str) -> None:
        session = front.open_session()
        client = openai_client(base_url, session)
        create = client.chat.completions.create
        with pytest.raises(openai.BadRequestError, match="role 'robot'"):
            await create(model="m", messages=[{"role": "robot", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="has no content"):
            await create(model="m", messages=[{"role": "user"}])
        with pytest.raises(openai.BadRequestError, match="temperature is protected"):
            await create(model="m", messages=[{"role": "user", "content": "x"}], temperature=0.1)
        wrong_key = openai.AsyncOpenAI(base_url=f"{base_url}/s/{session.id}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong_key.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        unknown = openai.AsyncOpenAI(base_url=f"{base_url}/s/nosuch/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="unknown session"):
            await unknown.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        claude = anthropic_client(base_url, session)
        with pytest.raises(anthropic.BadRequestError, match="role must be"):
            await claude.messages.create(model="m", max_tokens=4, messages=[{"role": "system", "content": "x"}])
        assert session.transcript.segments == []  # nothing malformed was recorded
        ok = await create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=3)
        assert ok.choices[0].message.content is not None and len(session.transcript.segments) == 1
        for c in (client, wrong_key, unknown, claude):
            await c.close()

    with_front(router, body)


def test_concurrent_streamed_turns_of_one_session_take_turns(router: Any) -> None:
    """Two different follow-ups streamed at once on one session: the second waits until the first is
    committed, then, no longer extending the conversation the transcript holds, starts a segment of its
    own. (When the streamed turns ran outside the session's lock, both were planned on the same
    transcript and both appended to one segment: the later one's sampled tokens recorded after a context
    the engine never saw.)"""

    async def body(front: ChatFront, base_url: str) -> None:
        session = front.open_session()
        client = openai_client(base_url, session)
        first = [{"role": "user", "content": "1+1="}]
        reply = await client.chat.completions.create(model="m", messages=first, max_tokens=4, seed=1)
        history = [*first, {"role": "assistant", "content": reply.choices[0].message.content}]

        async def follow_up(text: str) -> str:
            messages = [*history, {"role": "user", "content": text}]
            stream = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=24, seed=2, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        await asyncio.gather(follow_up("2+2="), follow_up("3+3="))
        segments = session.transcript.segments
        assert [s.turns for s in segments] == [2, 1]
        for segment in segments:  # every sampled run sits right after the prompt it was sampled on
            assert len(segment.loss_mask) == len(segment.response_ids) == len(segment.logprobs)
        await client.close()

    with_front(router, body)


def test_a_turn_still_running_when_its_episode_ends_is_not_recorded(router: Any) -> None:
    """An agent that returns without waiting for its last request: the session closes and that turn,
    plain or streamed, is not added to the episode the pool has already taken."""

    async def body(front: ChatFront, base_url: str) -> None:
        for stream in (False, True):
            session = front.open_session()
            client = openai_client(base_url, session)
            messages = [{"role": "user", "content": "1+1="}]
            request = asyncio.create_task(
                client.chat.completions.create(model="m", messages=messages, max_tokens=64, seed=5, stream=stream)
            )
            while session.turns == 0:  # planned and sent to the router
                await asyncio.sleep(0.001)
            front.close_session(session.id)
            if stream:
                response = await request
                with contextlib.suppress(openai.APIError, httpx.HTTPError):
                    _ = [chunk async for chunk in response]
            else:
                with pytest.raises(openai.NotFoundError, match="ended before this turn finished"):
                    await request
            assert session.transcript.segments == [], stream
            await client.close()

    with_front(router, body)


def test_a_client_that_gives_up_on_a_plain_turn_leaves_nothing_recorded(router: Any) -> None:
    """A non-streamed turn whose client leaves (its own timeout) before the reply is ready: the front sees
    the disconnect, aborts the generation at the router and records nothing; the session goes on. (Before,
    the turn ran to its end and was recorded: a turn the agent never saw, trained on.)"""

    async def body(front: ChatFront, base_url: str) -> None:
        session = front.open_session()
        headers = {"authorization": f"Bearer {session.key}"}
        long_turn = {
            "model": "m",
            "messages": [{"role": "user", "content": "count:"}],
            "max_tokens": 384,  # the test router's max_tokens_cap
            "n": 4,
            "seed": 9,
        }
        async with httpx.AsyncClient(base_url=f"{base_url}/s/{session.id}/v1", headers=headers) as http:
            request = asyncio.create_task(http.post("/chat/completions", json=long_turn, timeout=60))
            while session.turns == 0:  # planned and sent to the router
                await asyncio.sleep(0.001)
            request.cancel()  # the client gives up: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await request
            started = time.monotonic()
            while session.lock.locked():  # the front's handler is still at it
                await asyncio.sleep(0.01)
            left_after = time.monotonic() - started
        assert session.transcript.segments == [], f"recorded a turn its client left ({left_after:.2f} s after)"
        async with grpc.aio.insecure_channel(router.address) as channel:
            status = await rollout_pb2_grpc.RolloutServiceStub(channel).GetRouterStatus(
                rollout_pb2.GetRouterStatusRequest(), timeout=30
            )
        assert status.in_flight_request_count == 0  # aborted at the router, not left to run
        client = openai_client(base_url, session)  # the session goes on
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=4
        )
        assert reply.choices[0].message.content is not None and len(session.transcript.segments) == 1
        await client.close()

    with_front(router, body)


def test_refusals_come_before_a_stream_starts_and_malformed_fields_get_400(router: Any) -> None:
    """A streamed request the router refuses gets an HTTP error (not a 200 and a cut stream); a field of
    the wrong type gets 400 naming it (not a 500); a body over the front's limit gets 413; max_tokens
    above the router's cap is clamped to it, as an upper bound should be. Nothing refused is recorded."""

    async def body(front: ChatFront, base_url: str) -> None:
        session = front.open_session()
        client = openai_client(base_url, session)
        claude = anthropic_client(base_url, session)
        too_long = [{"role": "user", "content": "7+" * 2000}]
        with pytest.raises(openai.BadRequestError, match="fills the model's context"):
            await client.chat.completions.create(model="m", messages=too_long, stream=True)
        with pytest.raises(anthropic.BadRequestError, match="fills the model's context"):
            await claude.messages.create(model="m", max_tokens=4, messages=too_long, stream=True)
        url = f"{base_url}/s/{session.id}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {session.key}"}
        user = [{"role": "user", "content": "x"}]
        bad = {
            "max_tokens": {"messages": user, "max_tokens": "abc"},
            "stop": {"messages": user, "stop": 5},
            "seed": {"messages": user, "seed": 1.5},
            "stream": {"messages": user, "stream": "yes"},
            "tools": {"messages": user, "tools": [1]},
            "tool_calls[0]": {"messages": [*user, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
            "top_logprobs": {"messages": user, "top_logprobs": 3},
        }
        async with httpx.AsyncClient(timeout=60) as http:
            for field, request in bad.items():
                reply = await http.post(url, json={"model": "m", **request}, headers=headers)
                assert reply.status_code == 400 and field in reply.json()["error"]["message"], (field, reply.text)
            big = await http.post(
                url, json={"model": "m", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}, headers=headers
            )
            assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large", big.text
            # The router's refusals, in the request's terms: its field names, not the router's.
            for request, field in (({"n": 100}, "n 100"), ({"temperature": 0.25}, "temperature is protected")):
                reply = await http.post(url, json={"model": "m", "messages": user, **request}, headers=headers)
                message = reply.json()["error"]["message"]
                assert reply.status_code == 400 and field in message and "sampl" not in message, message
        assert session.transcript.segments == []
        capped = await client.chat.completions.create(model="m", messages=user, max_tokens=100_000, seed=3)
        assert capped.usage.completion_tokens <= front.limits.max_tokens_cap
        for c in (client, claude):
            await c.close()

    with_front(router, body)


class Compacting(ChatAgent):
    """Two turns; the second rewrites the history (a summary replaces the first exchange)."""

    async def run(self, client: Any, prompt: Prompt) -> AgentResult:
        first = [{"role": "user", "content": f"{prompt['question']}="}]
        await client.chat.completions.create(model="m", messages=first, max_tokens=4)
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "summary: asked a sum. Answer now:"}], max_tokens=4
        )
        return AgentResult(reward=float(len(prompt["question"]) % 2))


class ExistingBlockingAgent(ChatAgent):
    """An agent that exists as blocking code: the sync SDKs, and a wait until every episode of its group is
    running at once (which a plain ``run`` on the pool's event loop could never reach)."""

    together = threading.Barrier(2, timeout=60)

    def run(self, client: Any, prompt: Prompt) -> AgentResult:
        assert isinstance(client, openai.OpenAI) and isinstance(self.anthropic, anthropic.Anthropic)
        self.together.wait()
        question = [{"role": "user", "content": f"{prompt['question']}="}]
        reply = client.chat.completions.create(model="m", messages=question, max_tokens=4, logprobs=True)
        answer = reply.choices[0].message.content or ""
        again = self.anthropic.messages.create(
            model="m",
            max_tokens=4,
            messages=[*question, {"role": "assistant", "content": answer}, {"role": "user", "content": "sure?"}],
        )
        assert again.usage.output_tokens >= 1
        return AgentResult(reward=float(len(reply.choices[0].logprobs.content)))  # the first turn's sampled tokens


def run_chat_pool(
    router: Any, redis_url: str, client: redis.Redis, agent: type[ChatAgent], groups: int, tmp_path: Path
) -> RolloutPool:
    settings = AgentPoolSettings(
        run={"run_id": "front-test", "redis_url": redis_url},
        router_address=router.address,
        agent=f"{REPO}/recipes/agents/openai_agent.py:OpenAIArithmetic",
        data={"path": f"{REPO}/recipes/data/arithmetic-train.jsonl"},
        tokenizer_path=router.model_path,
        rollout={"group_size": 2},
        max_tokens=8,
        metrics_port=0,
    )

    async def body(front: ChatFront, base_url: str) -> RolloutPool:
        pool = RolloutPool(
            settings,
            chat_runner(agent, front, base_url),
            PromptSource(load_prompts(settings.data.path, "train")),
            TrajectoryQueue(client, "front-test"),
            lambda: 0,
        )
        pool.start(max_groups=groups)
        await asyncio.wait_for(pool.wait_idle(), 300)
        return pool

    return with_front(router, body)


def test_sdk_agents_and_compaction_through_the_pool(
    tmp_path: Path, router: Any, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    queue = TrajectoryQueue(redis_client, "front-test", consumer="check")
    for spec in (
        "openai_agent.py:OpenAIArithmetic",
        "anthropic_agent.py:AnthropicArithmetic",
        "openai_sync_agent.py:BlockingOpenAIArithmetic",
    ):
        agent = load_agent(f"{REPO}/recipes/agents/{spec}")
        assert issubclass(agent, ChatAgent)
        pool = run_chat_pool(router, redis_server.url, redis_client, agent, 1, tmp_path)
        assert pool.stats.queued_groups == 1 and not pool.stats.failed_episodes, spec
        (entry,) = queue.read(count=10)
        assert len(entry.group.trajectories) == 2 and all(t.loss_mask[0] for t in entry.group.trajectories)
        queue.ack([entry.entry_id])

    pool = run_chat_pool(router, redis_server.url, redis_client, ExistingBlockingAgent, 1, tmp_path)
    assert pool.stats.queued_groups == 1 and not pool.stats.failed_episodes
    (entry,) = queue.read(count=10)
    for trajectory in entry.group.trajectories:  # both turns of each episode, one segment, sampled tokens kept
        assert trajectory.turn_count == 2 and sum(trajectory.loss_mask) > trajectory.reward >= 1
    queue.ack([entry.entry_id])

    pool = run_chat_pool(router, redis_server.url, redis_client, Compacting, 1, tmp_path)
    (entry,) = queue.read(count=10)
    trajectories = list(entry.group.trajectories)
    assert len(trajectories) == 4  # two episodes, two segments each
    by_rollout: dict[str, list[Any]] = {}
    for t in trajectories:
        by_rollout.setdefault(t.rollout_id, []).append(t)
    assert sorted(len(v) for v in by_rollout.values()) == [2, 2]
    for segments in by_rollout.values():
        assert [s.segment_index for s in segments] == [0, 1] and len({s.reward for s in segments}) == 1
    # The group estimator counts each episode once: 4 segments give the advantages of 2 episodes.
    ids = {rid: i for i, rid in enumerate(by_rollout)}
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    per_segment = grpo(
        rewards, torch.zeros(4, dtype=torch.long), torch.tensor([ids[t.rollout_id] for t in trajectories])
    )
    per_episode = grpo(
        torch.tensor([by_rollout[r][0].reward for r in ids], dtype=torch.float64),
        torch.zeros(2, dtype=torch.long),
        torch.arange(2),
    )
    for t, advantage in zip(trajectories, per_segment, strict=True):
        assert advantage == pytest.approx(float(per_episode[ids[t.rollout_id]]))
