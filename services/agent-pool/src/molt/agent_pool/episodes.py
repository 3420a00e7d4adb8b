"""Runs one episode: an Env (molt drives the model) or a ChatAgent (its own loop via the HTTP front).

An episode ends when the Env says ``done``, after ``Env.max_turns`` turns, or
when the conversation no longer fits the model's context (finish "length").
``attempt`` bounds an episode in time and turns its failures into counted reasons:
the pool and the evaluator run every episode through it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from molt.agent_pool import metrics
from molt.agent_pool.agents import AgentResult, ChatAgent, Env, Message, Prompt
from molt.agent_pool.calls import AgentThread, has_plain_methods, within
from molt.agent_pool.router_client import GenerationRequest, RouterClient
from molt.agent_pool.tools import tool_schemas
from molt.agent_pool.transcript import Segment, Transcript
from molt.core.errors import Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Episode:
    """A finished episode: its segments (token-exact) and its reward."""

    rollout_id: str
    segments: list[Segment]
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    started: float = 0.0
    duration_s: float = 0.0


@dataclass(frozen=True)
class TurnLimits:
    """Per-turn generation budget, the model's context and the router's cap on a turn's max_tokens."""

    max_tokens: int
    max_model_len: int
    max_tokens_cap: int = 0  # 0: none known

    def budget(self, requested: int, prompt_len: int) -> int:
        """A turn's max_tokens: ``requested`` (0: ``max_tokens``) within the room the prompt leaves in the
        context and the router's cap; below 1 when the context is full."""
        room = self.max_model_len - prompt_len
        return min(requested or self.max_tokens, room, self.max_tokens_cap or room)


EpisodeRunner = Callable[[Prompt], Awaitable[Episode]]


class FrontSession(Protocol):
    """One session of the HTTP front as an episode uses it: its URL id, its key and its record."""

    id: str
    key: str
    transcript: Transcript


class ChatSessions(Protocol):
    """What a ChatAgent's episode needs of the HTTP front (``front.ChatFront``): a session per episode
    and the SDK HTTP clients every episode shares. Declared here so that this module, below the
    front, does not import it."""

    def open_session(self) -> FrontSession: ...

    def close_session(self, session_id: str) -> object: ...

    def sdk_http_clients(self, blocking: bool = False) -> tuple[Any, Any]: ...


FLOAT32_MAX = 3.4028234663852886e38


def _reward(value: object, where: str) -> float:
    """A reward as the queue carries it (float32): a real, finite number, or TypeError/ValueError
    naming what the agent returned (the episode then fails as "exception", logged)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where} returned a reward of type {type(value).__name__}; it must be a number")
    if not abs(value) <= FLOAT32_MAX:  # NaN fails this too
        raise ValueError(f"{where} returned the reward {value!r}; it must be finite (and fit a float32)")
    return float(value)


def _messages(value: object, where: str) -> list[Message]:
    if not isinstance(value, list | tuple) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise TypeError(f"{where} must give a list of messages (dicts with a 'role'), got {type(value).__name__}")
    return list(value)


async def make_agent(cls: type[T], thread: AgentThread) -> T:
    """A fresh agent for one episode, made on the episode's thread when the class has a plain method
    (so its plain methods find what the constructor made on their own thread)."""
    return await thread.call(cls) if has_plain_methods(cls) else cls()


async def run_env_episode(
    env_cls: type[Env], prompt: Prompt, transcript: Transcript, router: RouterClient, limits: TurnLimits
) -> Episode:
    """Plays a fresh ``env_cls`` on ``prompt`` through the router; the reward is the sum of the step rewards."""
    thread = AgentThread()
    try:
        return await _play(await make_agent(env_cls, thread), thread, prompt, transcript, router, limits)
    finally:
        thread.close()


async def _play(
    env: Env, thread: AgentThread, prompt: Prompt, transcript: Transcript, router: RouterClient, limits: TurnLimits
) -> Episode:
    rollout_id = uuid.uuid4().hex
    started, wall = time.time(), time.monotonic()
    messages = _messages(await thread.call(env.reset, prompt), "reset()")
    reward, finish = 0.0, "length"
    for turn in range(env.max_turns):
        plan = transcript.plan(messages, tool_schemas(env.tools))
        cap = limits.max_tokens if env.max_tokens is None else min(env.max_tokens, limits.max_tokens)
        budget = limits.budget(cap, len(plan.prompt_ids))
        if budget < 1:
            break  # the conversation filled the context: the episode ends as truncated
        request = GenerationRequest(f"{rollout_id}-{turn}", rollout_id, plan.prompt_ids, max_tokens=budget)
        (sample,) = await router.generate(request)
        text = transcript.reply_text(sample.token_ids)
        reply: Message = {"role": "assistant", "content": text}
        transcript.commit(plan, sample.token_ids, sample.logprobs, sample.versions, reply, sample.routing)
        result = await thread.call(env.step, text)
        reward += _reward(result.reward, "step()")
        if result.done:
            finish = sample.finish_reason or "stop"
            break
        messages = [*messages, reply, *_messages(result.observation or [], "step()'s observation")]
    return Episode(
        rollout_id=rollout_id,
        segments=[s for s in transcript.segments if s.turns],
        reward=reward,
        finish_reason=finish,
        started=started,
        duration_s=time.monotonic() - wall,
    )


async def run_chat_episode(agent_cls: type[ChatAgent], prompt: Prompt, front: ChatSessions, base_url: str) -> Episode:
    """Runs the user's own loop against a fresh front session; the session's transcript is the episode.

    An ``async def run`` gets ``openai.AsyncOpenAI`` and ``anthropic.AsyncAnthropic`` clients; a plain
    ``def run`` runs on the episode's thread and gets ``openai.OpenAI`` and ``anthropic.Anthropic``.
    """
    import anthropic  # the official SDKs: a ChatAgent gets real clients, not look-alikes
    import openai

    thread = AgentThread()
    session = front.open_session()
    started, wall = time.time(), time.monotonic()
    # The SDK clients ride on the front's shared HTTP clients; closing those is the front's business.
    blocking = not inspect.iscoroutinefunction(agent_cls.run)
    openai_http, anthropic_http = front.sdk_http_clients(blocking)
    openai_client, anthropic_client = (
        (openai.OpenAI, anthropic.Anthropic) if blocking else (openai.AsyncOpenAI, anthropic.AsyncAnthropic)
    )
    try:
        agent = await make_agent(agent_cls, thread)
        client = openai_client(base_url=f"{base_url}/s/{session.id}/v1", api_key=session.key, http_client=openai_http)
        agent.anthropic = anthropic_client(
            base_url=f"{base_url}/s/{session.id}", api_key=session.key, http_client=anthropic_http
        )
        result = await thread.call(agent.run, client, prompt)
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        if exc.status_code == 503:  # the front could not reach the router: counted as such, not as a bug
            raise Unavailable(f"the front answered 503: {exc.message}", reason="ROUTER_UNAVAILABLE") from exc
        raise
    finally:
        front.close_session(session.id)
        thread.close()
    if isinstance(result, AgentResult):
        reward, components = _reward(result.reward, "run()"), dict(result.reward_components)
    else:
        reward, components = _reward(result, "run()"), {}
    return Episode(
        rollout_id=uuid.uuid4().hex,
        segments=[s for s in session.transcript.segments if s.turns],
        reward=reward,
        reward_components=components,
        started=started,
        duration_s=time.monotonic() - wall,
    )


def env_runner(env_cls: type[Env], tokenizer: object, router: RouterClient, limits: TurnLimits) -> EpisodeRunner:
    """Episodes of ``env_cls``, each with a fresh transcript."""

    async def run(prompt: Prompt) -> Episode:
        return await run_env_episode(env_cls, prompt, Transcript(tokenizer), router, limits)

    return run


def chat_runner(agent_cls: type[ChatAgent], front: ChatSessions, base_url: str) -> EpisodeRunner:
    """Episodes of ``agent_cls``, each in a fresh session of the front at ``base_url``."""

    async def run(prompt: Prompt) -> Episode:
        return await run_chat_episode(agent_cls, prompt, front, base_url)

    return run


async def attempt(
    runner: EpisodeRunner, prompt: Prompt, timeout_s: float, purpose: str
) -> tuple[Episode | None, str | None]:
    """Runs one episode: ``(episode, None)``, or ``(None, reason)`` when it failed (logged, counted).

    Cancellation is counted as "stopped" and re-raised. Past ``timeout_s`` the episode is given up
    at once, even when the agent ignores its cancellation (``calls.within``).
    """
    metrics.EPISODES_STARTED.labels(purpose).inc()
    try:
        episode = await within(runner(prompt), timeout_s)
    except TimeoutError:
        return None, _failed("timeout", purpose, prompt, None)
    except asyncio.CancelledError:
        _failed("stopped", purpose, prompt, None)
        raise
    except Unavailable as exc:
        return None, _failed("router_unavailable", purpose, prompt, exc)
    except Exception as exc:  # the agent's own code raised: a failed episode, logged with traceback
        return None, _failed("exception", purpose, prompt, exc)
    if not episode.segments:
        return None, _failed("no_tokens", purpose, prompt, None)
    metrics.EPISODES_FINISHED.labels(purpose).inc()
    return episode, None


def _failed(reason: str, purpose: str, prompt: Prompt, exc: BaseException | None) -> str:
    metrics.EPISODES_FAILED.labels(purpose, reason).inc()
    log.warning(
        "episode failed", exc_info=exc, extra={"reason": reason, "purpose": purpose, "prompt_id": prompt.get("id")}
    )
    return reason
