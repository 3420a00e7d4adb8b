"""How the pool calls agent code (``calls.py``): plain methods on their episode's own thread, async ones
on the loop; an episode past its timeout is given up even when its code does not let go.

Blocking is shown with barriers and events, not timings: a test that would pass only if the calls ran
side by side waits on a barrier that every call must reach."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from molt.agent_pool import metrics
from molt.agent_pool.agents import Env, Prompt, StepResult
from molt.agent_pool.calls import AgentThread, _Worker, has_plain_methods, within
from molt.agent_pool.episodes import make_agent


def overrunning() -> float:
    return metrics.AGENT_CALLS_OVERRUNNING._value.get()


class Recorder(Env):
    """Plain methods that note the thread they ran on; ``step`` waits at a shared barrier."""

    barrier: threading.Barrier

    def __init__(self) -> None:
        self.threads = {"init": threading.get_ident()}

    def reset(self, prompt: Prompt) -> list[dict[str, Any]]:
        self.threads["reset"] = threading.get_ident()
        return [{"role": "user", "content": "x"}]

    def step(self, action: str) -> StepResult:
        self.threads["step"] = threading.get_ident()
        self.barrier.wait()  # only returns once every episode's step is running at the same time
        return StepResult(reward=1.0, done=True)


class AsyncEnv(Env):
    async def reset(self, prompt: Prompt) -> list[dict[str, Any]]:
        return [{"role": "user", "content": str(threading.get_ident())}]

    async def step(self, action: str) -> StepResult:
        return StepResult(done=True)


def test_plain_methods_run_side_by_side_each_episode_on_one_thread_of_its_own() -> None:
    episodes = 4
    Recorder.barrier = threading.Barrier(episodes, timeout=30)

    async def episode() -> Recorder:
        thread = AgentThread()
        try:
            env = await make_agent(Recorder, thread)
            await thread.call(env.reset, {})
            await thread.call(env.step, "")
            return env
        finally:
            thread.close()

    async def main() -> list[Recorder]:
        return await asyncio.gather(*(episode() for _ in range(episodes)))

    envs = asyncio.run(main())
    main_thread = threading.get_ident()
    for env in envs:
        assert len(set(env.threads.values())) == 1, env.threads  # constructor, reset and step: one thread
    assert len({env.threads["step"] for env in envs} | {main_thread}) == episodes + 1
    assert has_plain_methods(Recorder) and not has_plain_methods(AsyncEnv)


def test_async_methods_stay_on_the_loop_and_errors_come_back_as_they_were() -> None:
    async def main() -> tuple[str, int]:
        thread = AgentThread()
        env = await make_agent(AsyncEnv, thread)
        (message,) = await thread.call(env.reset, {})

        def broken(x: int) -> int:
            raise KeyError(x)

        def exits() -> None:
            raise SystemExit(3)

        with pytest.raises(KeyError):
            await thread.call(broken, 1)
        with pytest.raises(RuntimeError, match="raised SystemExit"):  # an agent's exit fails its episode only
            await thread.call(exits)
        with pytest.raises(RuntimeError, match="raised StopIteration"):  # a future refuses StopIteration itself
            await asyncio.wait_for(thread.call(next, iter(())), 10)

        async def later() -> int:
            return 1

        def plain_returning_a_coroutine() -> Any:
            return later()

        with pytest.raises(TypeError, match="declare it `async def`"):  # would run on the loop with sync clients
            await thread.call(plain_returning_a_coroutine)
        thread.close()
        return message["content"], threading.get_ident()

    content, loop_thread = asyncio.run(main())
    assert content == str(loop_thread)


def test_a_plain_call_past_its_timeout_is_given_up_and_counted_until_it_returns() -> None:
    release = threading.Event()
    before = overrunning()

    async def main() -> None:
        thread = AgentThread()
        with pytest.raises(TimeoutError):
            await within(thread.call(release.wait), 0.2)
        assert overrunning() == before + 1  # still blocked in its thread
        release.set()
        for _ in range(200):
            if overrunning() == before:
                break
            await asyncio.sleep(0.01)
        thread.close()

    asyncio.run(main())
    assert overrunning() == before


def test_an_ended_episodes_thread_serves_a_later_episode_but_not_while_its_call_overruns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_Worker, "idle", [])  # none kept from other tests: this test's threads only
    release = threading.Event()
    before = overrunning()

    async def handed_back(thread: AgentThread) -> None:
        worker = thread._worker
        thread.close()
        for _ in range(500):  # the thread returns itself to the kept ones once its last call has returned
            if worker in _Worker.idle:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the closed episode's thread was not kept")

    async def episode_thread() -> threading.Thread:
        thread = AgentThread()
        ran_on: threading.Thread = await thread.call(threading.current_thread)
        await handed_back(thread)
        return ran_on

    async def main() -> tuple[threading.Thread, ...]:
        first = await episode_thread()
        second = await episode_thread()  # the first one's thread, handed back (the same Thread object)
        stuck = AgentThread()
        stuck_on = await stuck.call(threading.current_thread)
        try:
            with pytest.raises(TimeoutError):
                await within(stuck.call(release.wait), 0.2)
            stuck.close()  # its episode ended; the thread is still in release.wait
            during = AgentThread()
            during_on = await within(during.call(threading.current_thread), 5)  # not queued behind the overrun
            during.close()
        finally:
            release.set()
        for _ in range(200):
            if overrunning() == before:
                break
            await asyncio.sleep(0.01)
        return first, second, stuck_on, during_on

    first, second, stuck, during = asyncio.run(main())
    assert first is second
    assert during is not stuck
    assert overrunning() == before


def test_async_code_that_ignores_cancellation_does_not_hold_the_caller() -> None:
    before = overrunning()
    outcome: dict[str, Any] = {}

    async def stubborn(gate: asyncio.Event) -> str:
        while True:
            try:
                await gate.wait()
                return "done"
            except asyncio.CancelledError:
                outcome["cancelled"] = outcome.get("cancelled", 0) + 1  # swallowed: the agent carries on

    async def main() -> None:
        gate = asyncio.Event()
        with pytest.raises(TimeoutError):
            await within(stubborn(gate), 0.1)  # asyncio.wait_for would wait here for as long as it runs
        assert overrunning() == before + 1 and outcome["cancelled"] == 1
        gate.set()
        await asyncio.sleep(0.05)
        assert overrunning() == before

        # The caller cancelled (a stop) while its episode ignores that: the stop goes through too.
        gate2 = asyncio.Event()
        task = asyncio.create_task(within(stubborn(gate2), 60))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert overrunning() == before + 1
        gate2.set()
        await asyncio.sleep(0.05)

        # Cancelled again during the grace: the caller stops waiting at once, and code that does unwind
        # within the grace is not counted as left running.
        async def slow_to_unwind() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                await asyncio.shield(asyncio.sleep(0.3))

        task = asyncio.create_task(within(slow_to_unwind(), 0.05))
        await asyncio.sleep(0.1)  # in the grace now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert overrunning() == before  # still in its grace: not counted (it was, at once)
        await asyncio.sleep(1.2)
        assert overrunning() == before

    asyncio.run(main())
    assert overrunning() == before
