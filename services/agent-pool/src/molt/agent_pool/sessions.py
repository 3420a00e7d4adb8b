"""A front session: one ChatAgent episode's conversation state, and how each of its turns is recorded.

Turns of one session are serialised by its lock. A turn is planned on the
session's transcript (token-exact capture), generated through the router and
committed only when generation succeeded. Replies are kept for identical
retries, which get the same reply and record nothing. ``max_tokens`` is an
upper bound: clamped to the router's cap and to the room left in the context.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response

from molt.agent_pool import chat_formats as fmt
from molt.agent_pool.episodes import TurnLimits
from molt.agent_pool.router_client import GenerationRequest, Sample
from molt.agent_pool.transcript import Transcript, TurnPlan
from molt.core.errors import InvalidInput, NotFound

CACHE_SIZE = 8  # replies a session keeps for identical retries: at most this many,
CACHE_BYTES = 16 * 1024 * 1024  # and at most this many bytes (streamed replies with top_logprobs are large)


@dataclass(frozen=True)
class Turn:
    """One requested generation, in internal form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    sample_count: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    logprobs: bool = False


@dataclass
class Session:
    """One episode's conversation state on the front."""

    id: str
    key: str
    transcript: Transcript
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cache: OrderedDict[str, bytes | list[str]] = field(default_factory=OrderedDict)  # JSON body or SSE lines
    turns: int = 0
    closed: bool = False  # the episode is over: nothing more is recorded
    streams: set[asyncio.Task[None]] = field(default_factory=set)  # its streamed turns' tasks, until they end

    async def plan(self, turn: Turn) -> TurnPlan:
        """The turn planned on the transcript, off the event loop (rendering and tokenizing a long
        conversation takes seconds that every other session would wait)."""
        return await asyncio.to_thread(self.transcript.plan, turn.messages, turn.tools)

    def generation_request(self, turn: Turn, plan: TurnPlan, limits: TurnLimits) -> GenerationRequest:
        """What the router is asked for this turn; refused when the conversation fills the context."""
        max_tokens = limits.budget(turn.max_tokens, len(plan.prompt_ids))
        if max_tokens < 1:
            raise InvalidInput(
                f"the conversation ({len(plan.prompt_ids)} tokens) fills the model's context ({limits.max_model_len})",
                reason="CONTEXT_FULL",
            )
        self.turns += 1
        return GenerationRequest(
            request_id=f"{self.id}-{self.turns}-{uuid.uuid4().hex[:8]}",
            session_id=self.id,
            prompt_ids=plan.prompt_ids,
            max_tokens=max_tokens,
            sample_count=turn.sample_count,
            stop_strings=turn.stop,
            seed=turn.seed,
            top_logprob_count=turn.top_logprobs,
            temperature=turn.temperature,
            top_p=turn.top_p,
            top_k=turn.top_k,
            min_p=turn.min_p,
            repetition_penalty=turn.repetition_penalty,
        )

    def reply(self, turn: Turn, sample: Sample, id_prefix: str = "call_") -> fmt.ParsedReply:
        """The sample's text, with tool calls parsed only when the request offered tools."""
        text = self.transcript.reply_text(sample.token_ids)
        return fmt.parse_reply(text, id_prefix) if turn.tools else fmt.ParsedReply(text)

    def commit(self, plan: TurnPlan, sample: Sample, reply: fmt.ParsedReply) -> None:
        """Records the turn in the transcript; refused once the episode is over."""
        if self.closed:
            raise NotFound(f"session {self.id!r} ended before this turn finished: not recorded")
        self.transcript.commit(
            plan, sample.token_ids, sample.logprobs, sample.versions, fmt.internal_reply(reply), sample.routing
        )

    def keep_reply(self, digest: str, reply: bytes | list[str]) -> None:
        """Keeps ``reply`` for an identical retry, dropping the oldest beyond CACHE_SIZE or CACHE_BYTES
        (a retry of a dropped one is a new turn)."""
        self.cache[digest] = reply

        def size(item: bytes | list[str]) -> int:
            return len(item) if isinstance(item, bytes) else sum(len(line) for line in item)

        while len(self.cache) > CACHE_SIZE or (
            len(self.cache) > 1 and sum(size(item) for item in self.cache.values()) > CACHE_BYTES
        ):
            self.cache.popitem(last=False)

    def remember(self, digest: str, reply: Any) -> Response:
        """The JSON response of a plain turn, serialised once: sent, and kept for an identical retry."""
        body = JSONResponse(reply).body
        self.keep_reply(digest, body)
        return Response(body, media_type="application/json")
