"""Token-exact capture of one episode: the token ids the engine saw and sampled, turn by turn.

Each turn's prompt is rendered with the chat template once. A turn *extends* the
current segment only when the earlier messages are a prefix of the new ones and the
template renders the old conversation as a prefix of the new rendering; then only the
new text is tokenized and appended (loss mask 0) after the previous prompt and the
engine's sampled ids (loss mask 1). Otherwise (the agent rewrote its context, the
template rewrites history, the tool list changed) the segment is sealed and a new one
starts from the full rendering. Sampled ids are stored as the engine returned them,
never re-encoded from text. A turn is planned first and committed only once its
generation succeeded, so a failed or retried request leaves no trace.

With ``[rollout] routing_replay`` every turn's reply carries the experts the engine routed the
turn's prompt and sampled tokens to; a segment keeps, for each of its tokens, the routing of the
first request that computed it (``expert_routing.first_wins``: a later turn recomputes the
conversation so far, possibly under newer weights). A turn without routing leaves the segment
without any (the learner then drops it as ``no_routing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from molt.agent_pool.agents import Message
from molt.core import expert_routing


@dataclass
class Segment:
    """One trajectory segment: a prompt and everything after it."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    routing: np.ndarray | None = None  # [len(token_ids()), layers, top_k] while every turn carried routing
    routed_turns: int = 0  # turns whose routing is merged into ``routing``

    def add_routing(self, routing: np.ndarray | None) -> None:
        """Merges the latest turn's routing (over this segment's tokens, the turn's included). A turn
        without routing (or with routing of another length) leaves the segment without any for good."""
        if routing is None or len(routing) != len(self.token_ids()) or self.routed_turns != self.turns - 1:
            self.routing = None
            return
        self.routing = expert_routing.first_wins(self.routing, routing)
        self.routed_turns += 1

    @property
    def full_routing(self) -> np.ndarray | None:
        """The segment's routing when every turn carried some, else None."""
        return self.routing if self.turns and self.routed_turns == self.turns else None

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, ids: list[int], logprobs: list[float], versions: list[int], sampled: bool) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.loss_mask += [sampled] * len(ids)


@dataclass(frozen=True)
class TurnPlan:
    """The next turn's prompt, not yet part of the transcript (``commit`` adds it after generation succeeds)."""

    prompt_ids: list[int]
    inserted_ids: list[int]  # appended to the current segment (loss mask 0); unused for a new segment
    new_segment: bool
    messages: list[Message]
    tools: list[dict[str, Any]] | None


class Transcript:
    """The token record of one episode, possibly several segments."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.segments: list[Segment] = []
        self.messages: list[Message] = []  # the conversation, our replies included, as of the last turn
        self.tools: list[dict[str, Any]] | None = None
        self.version = 0  # policy version of the latest sampled token (given to inserted tokens)

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def plan(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> TurnPlan:
        """The token ids to send for the next turn of ``messages``: extending the segment, or a new one."""
        rendered = self.render(messages, tools, generation_prompt=True)
        delta = self._delta(messages, tools, rendered) if self.segments else None
        if delta is None:
            return TurnPlan(self.encode(rendered), [], True, list(messages), tools)
        inserted = self.encode(delta)
        return TurnPlan(self.segments[-1].token_ids() + inserted, inserted, False, list(messages), tools)

    def _delta(self, messages: list[Message], tools: list[dict[str, Any]] | None, rendered: str) -> str | None:
        """The text to append, or None when the new turn does not extend the current segment."""
        old = self.messages
        if tools != self.tools or messages[: len(old)] != old:
            return None
        old_rendered = self.render(old, tools, generation_prompt=False)
        if not rendered.startswith(old_rendered):
            return None
        # Prefer continuing from what the engine actually saw (keeps template text that follows the
        # sampled stop token, such as a newline); fall back to the template's own rendering of the
        # old conversation when the reply was re-serialised differently (e.g. tool-call JSON spacing).
        seen = self.tokenizer.decode(self.segments[-1].token_ids(), skip_special_tokens=False)
        if rendered.startswith(seen):
            return rendered[len(seen) :]
        return rendered[len(old_rendered) :]

    def commit(
        self,
        plan: TurnPlan,
        token_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        reply: Message,
        routing: np.ndarray | None = None,
    ) -> None:
        """Adds a generated turn: the planned prompt, the engine's sampled ids (loss mask 1) and the reply;
        ``routing``: the experts the request routed its prompt and sampled ids to (when captured)."""
        if plan.new_segment:
            self.segments.append(Segment(prompt_ids=plan.prompt_ids))
        segment = self.segments[-1]
        inserted = plan.inserted_ids
        segment.append(inserted, [0.0] * len(inserted), [self.version] * len(inserted), sampled=False)
        segment.append(list(token_ids), list(logprobs), list(versions), sampled=True)
        segment.turns += 1
        segment.add_routing(routing)
        if versions:
            self.version = versions[-1]
        self.messages = [*plan.messages, reply]
        self.tools = plan.tools

    def reply_text(self, token_ids: list[int]) -> str:
        """The reply's text as the agent sees it: control tokens (end of turn) removed."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
