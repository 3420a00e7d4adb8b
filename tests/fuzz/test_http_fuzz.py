"""Property-based fuzzing of the agent-pool's HTTP front: OpenAI Chat Completions and Anthropic Messages.

Bodies are drawn by hypothesis: each API's fields with plausible values or any JSON in their place
(wrong types, huge ``n`` and ``max_tokens``, tool definitions that are not schemas, content that is
not text), and raw bodies: bytes that are not UTF-8, JSON nested deeper than any parser goes, bodies
over the front's size limit (declared, or streamed without a length), sent to a real session with its
key, with a wrong or no key, or to a session that does not exist. Every answer must be a success or a
4xx in the API's error shape (OpenAI ``{"error": {...}}``, Anthropic ``{"type": "error", ...}``),
never a 5xx; a refused request records nothing, an accepted one records one well-formed turn. Then a
pool episode replays refused bodies before a valid request and the queue receives only that turn.
Each test prints how many inputs it tried (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections import Counter
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx
import openai
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from transformers import AutoTokenizer

from molt.agent_pool.agents import AgentResult, ChatAgent, Prompt
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.dataset import load_prompts
from molt.agent_pool.episodes import TurnLimits, chat_runner
from molt.agent_pool.front import ChatFront, start_front
from molt.agent_pool.pool import RolloutPool
from molt.agent_pool.prompts import PromptSource
from molt.agent_pool.router_client import RouterClient
from molt.agent_pool.sessions import Session
from molt.core.queue import TrajectoryQueue
from molt.core.testing import free_port
from molt.core.trajectory import group_problems

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
MAX_BODY_BYTES = 64 * 1024  # the front's limit here: small, so that bodies past it are cheap to send
FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same inputs on every run: CI reproduces a failure
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
REPLAY_RUN = "fuzz-front"


@dataclass
class Front:
    """A ChatFront serving on a loop of its own thread, against the fuzz stack's router."""

    front: ChatFront
    base_url: str
    loop: asyncio.AbstractEventLoop
    vocab: int
    refused: dict[str, list[bytes]] = field(default_factory=lambda: {"openai": [], "anthropic": []})

    def run(self, work: Awaitable[T], timeout_s: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def open_session(self) -> Session:
        async def opened() -> Session:
            return self.front.open_session()

        return self.run(opened())

    def close_session(self, session: Session) -> None:
        async def closed() -> None:
            self.front.close_session(session.id)

        self.run(closed())


@pytest.fixture(scope="module")
def served(fuzz_stack: Any) -> Iterator[Front]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[ChatFront, Any, Any, str, int]:
        client = RouterClient(fuzz_stack.router)
        info = await client.info()
        limits = TurnLimits(8, info.max_model_len, info.max_tokens_cap)
        tokenizer = AutoTokenizer.from_pretrained(fuzz_stack.model_path)
        front = ChatFront(tokenizer, client, limits, max_body_bytes=MAX_BODY_BYTES)
        server, task, base_url = await start_front(front, f"127.0.0.1:{free_port()}")
        return front, server, task, base_url, info.vocab_size

    front, server, task, base_url, vocab = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    yield Front(front, base_url, loop, vocab)

    async def stop() -> None:
        server.should_exit = True
        await task
        await front.aclose()
        await front.router.close()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)


# -- bodies --------------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
EDGE_INTS = st.sampled_from([-1, 0, 1, 2, 16, 17, 20, 21, 64, 65, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30])


def deep(depth: int) -> Any:
    value: Any = "x"
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


def mostly(usual: SearchStrategy[Any], others: list[SearchStrategy[Any]], percent: int) -> SearchStrategy[Any]:
    """``usual`` in about ``percent`` % of the draws, else one of ``others``. (``st.one_of`` does not
    weigh its branches, and a branch with few values soon gives way to the ones with many.)"""
    return st.integers(0, 99).flatmap(lambda roll: usual if roll < percent else others[roll % len(others)])


def either(plausible: SearchStrategy[Any], *junk: SearchStrategy[Any]) -> SearchStrategy[Any]:
    """Mostly a field's plausible value (so that many requests get far); else ``junk`` or any JSON in
    its place: a wrong type, a structure 40 or 400 levels deep."""
    return mostly(plausible, [JSON, st.sampled_from([40, 400]).map(deep), *junk], 80)


NUMBERS = either(st.integers(1, 20), EDGE_INTS, st.floats())
STOPS = either(st.lists(st.text(min_size=1, max_size=4), max_size=2), st.just([""]))


def schema() -> SearchStrategy[Any]:
    """Tool parameters: a JSON Schema, or anything else."""
    return either(st.fixed_dictionaries({"type": st.just("object")}, optional={"properties": JSON, "required": JSON}))


def content() -> SearchStrategy[Any]:
    part = st.fixed_dictionaries({"type": either(st.just("text")), "text": either(st.text(max_size=30))})
    return either(st.one_of(st.text(max_size=40), st.lists(part, max_size=2)))


def openai_bodies() -> SearchStrategy[dict[str, Any]]:
    roles = either(st.sampled_from(["user", "user", "system", "developer", "assistant", "tool"]), st.just("robot"))
    call = st.fixed_dictionaries(
        {"id": either(st.text(max_size=8)), "type": st.just("function")},
        optional={"function": either(st.fixed_dictionaries({"name": either(st.text()), "arguments": JSON}))},
    )
    message = st.fixed_dictionaries(
        {"role": roles, "content": content()},
        optional={"tool_calls": either(st.lists(call, max_size=2)), "tool_call_id": JSON},
    )
    function = st.fixed_dictionaries({"name": either(st.text(max_size=8))}, optional={"parameters": schema()})
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": either(function)})
    return st.fixed_dictionaries(
        {"model": either(st.just("m")), "messages": either(st.lists(message, min_size=1, max_size=3))},
        optional={
            "tools": either(st.lists(tool, max_size=2)),
            "n": NUMBERS,
            "max_tokens": NUMBERS,
            "max_completion_tokens": NUMBERS,
            "stream": either(st.booleans()),
            "logprobs": either(st.booleans()),
            "top_logprobs": NUMBERS,
            "seed": NUMBERS,
            "stop": either(st.text(min_size=1, max_size=4), STOPS),
            "temperature": either(st.just(1.0), st.floats()),
            "frequency_penalty": either(st.just(0), st.floats()),
            "stream_options": either(st.fixed_dictionaries({"include_usage": st.booleans()})),
        },
    )


def anthropic_bodies() -> SearchStrategy[dict[str, Any]]:
    block = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": either(st.text(max_size=30))}),
        st.fixed_dictionaries(
            {"type": st.just("tool_use"), "id": JSON, "name": either(st.text(max_size=8)), "input": either(JSON)}
        ),
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": JSON, "content": content()}),
        JSON,
    )
    roles = either(st.sampled_from(["user", "user", "assistant"]), st.just("system"))
    message = st.fixed_dictionaries(
        {"role": roles, "content": either(st.one_of(st.text(max_size=40), st.lists(block, max_size=3)))}
    )
    tool = st.fixed_dictionaries({"name": either(st.text(max_size=8))}, optional={"input_schema": schema()})
    return st.fixed_dictionaries(
        {
            "model": either(st.just("m")),
            "max_tokens": NUMBERS,
            "messages": either(st.lists(message, min_size=1, max_size=3)),
        },
        optional={
            "system": content(),
            "tools": either(st.lists(tool, max_size=2)),
            "stream": either(st.booleans()),
            "stop_sequences": STOPS,
            "temperature": either(st.just(1.0), st.floats()),
            "top_k": either(st.just(-1), NUMBERS),
        },
    )


def raw_bodies(api: str) -> SearchStrategy[bytes]:
    """Request bodies as bytes: the API's fields (plausible or not), and what no JSON encoder writes."""
    fields = (openai_bodies() if api == "openai" else anthropic_bodies()).map(lambda b: json.dumps(b).encode())
    not_utf8 = st.binary(min_size=1, max_size=8).map(
        lambda junk: b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "' + junk + b'"}]}'
    )
    nested = st.sampled_from([900, 990, 1000, 5000, 200_000]).map(
        lambda d: b'{"model": "m", "max_tokens": 4, "messages": ' + b"[" * d + b"]" * d + b"}"
    )
    others = [
        st.binary(max_size=64),  # garbage, mostly not UTF-8
        not_utf8,
        nested,
        JSON.map(lambda v: json.dumps(v).encode()),  # JSON, mostly not an object
        st.just(b'{"model": "m", "pad": "' + b"x" * MAX_BODY_BYTES + b'"}'),  # over the limit
    ]
    return mostly(fields, others, 75)


@dataclass(frozen=True, repr=False)
class Request:
    api: str
    caller: str  # "session" (its own key), "wrong key", "no key", "unknown session"
    key: bytes  # the key sent, unless the caller is the session: any bytes a header may hold, not ASCII too
    body: bytes
    chunked: bool  # sent without a Content-Length

    def __repr__(self) -> str:  # short: hypothesis prints a failing example, and a body may be 64 KiB
        body = self.body if len(self.body) <= 300 else self.body[:300] + b"...(%d bytes)" % len(self.body)
        return f"Request({self.api!r}, {self.caller!r}, key={self.key!r}, body={body!r}, chunked={self.chunked})"


def requests(api: str) -> SearchStrategy[Request]:
    callers = mostly(st.just("session"), [st.sampled_from(["wrong key", "no key", "unknown session"])], 80)
    keys = st.one_of(st.just(b"nope"), st.binary(min_size=1, max_size=12).map(lambda k: b"k" + k.translate(HEADER)))
    return st.builds(Request, st.just(api), callers, keys, raw_bodies(api), st.booleans())


HEADER = bytes.maketrans(bytes(range(32)) + b"\x7f", b"_" * 33)  # a header value holds no control characters


def send(http: httpx.Client, served: Front, session: Session, request: Request) -> httpx.Response:
    session_id = "nosuch" if request.caller == "unknown session" else session.id
    key = {"session": session.key.encode(), "unknown session": session.key.encode(), "no key": b""}.get(
        request.caller, request.key
    )
    header = {"openai": "authorization", "anthropic": "x-api-key"}[request.api]
    headers = {header: b"Bearer " + key if request.api == "openai" else key} if key else {}
    body = request.body
    content: Any = iter([body[: len(body) // 2], body[len(body) // 2 :]]) if request.chunked else body
    url = f"{served.base_url}/s/{session_id}{PATHS[request.api]}"
    return http.post(url, content=content, headers={**headers, "content-type": b"application/json"})


def recorded(session: Session) -> int:
    return sum(segment.turns for segment in session.transcript.segments)


def check_answer(api: str, response: httpx.Response) -> None:
    """A success, or a 4xx in the API's error shape."""
    status = response.status_code
    assert status in (200, 400, 401, 404, 413), (status, response.text[:500])
    if status == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            text = response.text
            assert '"type": "error"' not in text and '{"error"' not in text, text[-500:]
            assert text.rstrip().endswith("[DONE]" if api == "openai" else '{"type": "message_stop"}'), text[-300:]
        else:
            reply = response.json()
            assert reply["choices"] if api == "openai" else reply["type"] == "message", reply
        return
    error = response.json()
    if api == "anthropic":
        assert error["type"] == "error" and set(error) == {"type", "error"}, error
    else:
        assert set(error) == {"error"} and error["error"]["code"] == status, error
    assert isinstance(error["error"]["message"], str) and isinstance(error["error"]["type"], str), error


def check_transcript(served: Front, session: Session, before: int, response: httpx.Response) -> None:
    """A refused request recorded nothing; an accepted one at most its turn, well-formed."""
    after = recorded(session)
    assert after == before if response.status_code != 200 else after <= before + 1, (before, after, response.text)
    for segment in session.transcript.segments:
        assert len(segment.response_ids) == len(segment.logprobs) == len(segment.loss_mask) == len(segment.versions)
        assert all(0 <= t < served.vocab for t in segment.token_ids())
        assert all(math.isfinite(v) for v in segment.logprobs)


def fuzz_front(served: Front, api: str, examples: int) -> Counter[str]:
    codes: Counter[str] = Counter()
    with httpx.Client(timeout=120) as http:

        def body(sent: list[Request]) -> None:
            session = served.open_session()  # up to two requests: the second meets what the first recorded
            try:
                for index, request in enumerate(sent):
                    before = recorded(session)
                    response = send(http, served, session, request)
                    codes[f"{request.caller} {response.status_code}"] += 1
                    check_answer(api, response)
                    check_transcript(served, session, before, response)
                    refused = response.status_code == 400 and request.caller == "session"
                    if refused and index == 0 and len(served.refused[api]) < 40:  # refused on a fresh session
                        served.refused[api].append(request.body)
            finally:
                served.close_session(session)

        settings(FUZZ, max_examples=examples)(given(st.lists(requests(api), min_size=1, max_size=2))(body))()
    total = sum(codes.values())
    print(f"fuzz {api} front: {total} inputs {dict(sorted(codes.items()))}")  # noqa: T201 (shown with -s)
    assert total > 0 and codes.get("session 200", 0) > 0
    return codes


def test_openai_front(served: Front) -> None:
    fuzz_front(served, "openai", 400)


def test_anthropic_front(served: Front) -> None:
    fuzz_front(served, "anthropic", 400)


# Bodies refused on any session; the replay adds those the fuzz tests before it saw refused.
REFUSED = [
    ("openai", b'{"model": "m", "messages": [{"role": [], "content": "x"}]}'),
    ("openai", b'{"model": "m", "n": 100, "messages": [{"role": "user", "content": "x"}]}'),
    ("openai", b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}'),
    ("anthropic", b'{"model": "m", "max_tokens": 4, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("anthropic", b'{"model": "m", "max_tokens": 4, "messages": [{"role": "assistant", "content": "x"}]}'),
]


class Replaying(ChatAgent):
    """Sends the bodies the fuzz saw refused, on its own session, then one valid request."""

    bodies: ClassVar[list[tuple[str, bytes]]] = []

    async def run(self, client: Any, prompt: Prompt) -> AgentResult:
        headers = {"authorization": f"Bearer {client.api_key}", "x-api-key": client.api_key}
        async with httpx.AsyncClient(timeout=120) as http:
            for api, body in self.bodies:
                url = str(client.base_url.join(PATHS[api].removeprefix("/v1/")))
                refused = await http.post(url, content=body, headers=headers)
                assert refused.status_code == 400, refused.text
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"{prompt['question']}="}], max_tokens=4
        )
        return AgentResult(reward=float(bool(reply.choices[0].message.content)))


def test_refused_bodies_reach_no_trajectory(served: Front, fuzz_stack: Any) -> None:
    """Episodes that send every refused body before one valid request: the queued group holds that
    one turn per episode, well-formed; and the official SDK still gets an answer on a new session."""
    Replaying.bodies = [*REFUSED, *((api, body) for api in PATHS for body in served.refused[api])]
    settings_ = AgentPoolSettings(
        run={"run_id": REPLAY_RUN, "redis_url": fuzz_stack.redis_url},
        router_address=fuzz_stack.router,
        agent=f"{REPO}/recipes/agents/openai_agent.py:OpenAIArithmetic",
        data={"path": f"{REPO}/recipes/data/arithmetic-train.jsonl"},
        tokenizer_path=fuzz_stack.model_path,
        rollout={"group_size": 2},
        max_tokens=8,
        metrics_port=0,
    )
    client = redis.Redis.from_url(fuzz_stack.redis_url)

    async def produce() -> RolloutPool:
        pool = RolloutPool(
            settings_,
            chat_runner(Replaying, served.front, served.base_url),
            PromptSource(load_prompts(settings_.data.path, "train")),
            TrajectoryQueue(client, REPLAY_RUN),
            lambda: 0,
        )
        pool.start(max_groups=1)
        await asyncio.wait_for(pool.wait_idle(), 300)
        return pool

    try:
        pool = served.run(produce())
        entries = TrajectoryQueue(client, REPLAY_RUN, consumer="check").read(count=10)
    finally:
        client.close()
    assert pool.stats.queued_groups == 1 and not pool.stats.failed_episodes, pool.stats
    (entry,) = entries
    assert not group_problems(entry.group, REPLAY_RUN)
    for trajectory in entry.group.trajectories:
        assert trajectory.turn_count == 1 and all(0 <= t < served.vocab for t in trajectory.response_token_ids)
    print(f"fuzz replay: {len(Replaying.bodies)} refused bodies per episode, none recorded")  # noqa: T201

    session = served.open_session()
    sdk = openai.OpenAI(base_url=f"{served.base_url}/s/{session.id}/v1", api_key=session.key, max_retries=0)
    reply = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=4)
    assert reply.choices[0].message.content is not None and recorded(session) == 1
    sdk.close()
    served.close_session(session)
