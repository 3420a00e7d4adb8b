"""sessions: the replies a session keeps for identical retries (bounded in count and in bytes), and the
tool calls it parses from a reply only when the request offered tools."""

from __future__ import annotations

import asyncio
from pathlib import Path

from transformers import AutoTokenizer

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.front import ChatFront
from molt.agent_pool.router_client import RouterClient, Sample
from molt.agent_pool.sessions import CACHE_BYTES, CACHE_SIZE, Session, Turn
from molt.agent_pool.transcript import Transcript

CALL = '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>'


def test_the_retry_cache_keeps_the_newest_replies_within_its_count_and_bytes() -> None:
    session = Session("s", "k", Transcript(None))
    for i in range(CACHE_SIZE + 3):
        session.keep_reply(f"small-{i}", b"{}")
    assert list(session.cache) == [f"small-{i}" for i in range(3, CACHE_SIZE + 3)]
    third = CACHE_BYTES // 3
    for i in range(3):  # streamed replies: lists of SSE lines
        session.keep_reply(f"big-{i}", ["x" * third])
    assert "big-0" in session.cache and sum(1 for d in session.cache if d.startswith("small")) <= CACHE_SIZE - 3
    session.keep_reply("big-3", ["x" * third])  # four thirds: the oldest big one goes, with the small ones
    assert [d for d in session.cache if d.startswith("big")] == ["big-1", "big-2", "big-3"]
    session.keep_reply("huge", ["x" * (2 * CACHE_BYTES)])  # over the bound alone: kept, alone
    assert list(session.cache) == ["huge"]


# -- the front parses tool calls only when the request offered tools ----------------------------------


def test_tool_calls_are_parsed_only_when_tools_were_offered(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer.encode(f"sure {CALL}", add_special_tokens=False)

    async def replies() -> tuple[fmt.ParsedReply, fmt.ParsedReply]:
        router = RouterClient("127.0.0.1:9")  # never called: parsing needs no generation
        front = ChatFront(tokenizer, router, TurnLimits(8, 512))
        session = front.open_session()
        offered = Turn(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}], max_tokens=8)
        plain = Turn(messages=[{"role": "user", "content": "x"}], tools=None, max_tokens=8)
        sample = Sample(token_ids=ids)
        result = session.reply(offered, sample, "toolu_"), session.reply(plain, sample)
        await router.close()
        return result

    with_tools, without_tools = asyncio.run(replies())
    assert [c.name for c in with_tools.tool_calls] == ["calc"] and with_tools.text == "sure"
    assert without_tools.tool_calls == [] and without_tools.text == f"sure {CALL}"
