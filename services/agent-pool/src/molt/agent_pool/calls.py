"""How the pool calls an agent's code, and how it bounds an episode.

- An ``async`` method runs on the pool's event loop.
- A plain method runs on its episode's own thread (taken when the agent class has one; its
  constructor runs there too), one call at a time: a method that blocks stalls only its own
  episode, and state shared across episodes must be thread-safe. A thread is kept after its
  episode and handed to a later one (a fresh thread per episode costs a short episode dearly),
  so thread-local state can outlive its episode.
- An episode past its timeout, or stopped, is given up at once. Agent code still running then
  goes on (a thread cannot be stopped; async code may ignore its cancellation), counted in
  ``molt_agent_pool_agent_calls_overrunning`` and logged, without holding its group back. The
  threads are daemons, so a call that never returns does not keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from molt.agent_pool import metrics
from molt.agent_pool.agents import Env

log = logging.getLogger(__name__)
T = TypeVar("T")

CANCEL_GRACE_S = 1.0  # how long a cancelled episode may take to unwind before it is left to run on


def has_plain_methods(cls: type) -> bool:
    """Whether an agent class defines one of its methods (an Env's ``reset`` and ``step``, a ChatAgent's
    ``run``) as a plain function: its episodes then get a thread, where its constructor runs too."""
    names = ("reset", "step") if issubclass(cls, Env) else ("run",)
    return any(not inspect.iscoroutinefunction(getattr(cls, name)) for name in names)


@dataclass
class _Call:
    function: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = 0.0
    finished: bool = False
    overrunning: bool = False


IDLE_THREADS_KEPT = 256  # threads of ended episodes kept for later ones; beyond that they end


class AgentThread:
    """One episode's thread for its agent's plain methods, from the kept threads or new; ``close()`` hands
    it back once its last call has returned."""

    def __init__(self) -> None:
        self._worker: _Worker | None = None

    async def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``: awaited on the loop when it is a coroutine function, else run on the thread."""
        if inspect.iscoroutinefunction(function):
            return await function(*args)
        if self._worker is None:
            self._worker = _Worker.take()
        loop = asyncio.get_running_loop()
        call = _Call(function, args, loop, loop.create_future())
        self._worker.calls.put(call)
        try:
            value = await call.future
        except asyncio.CancelledError:
            with call.lock:
                if call.started and not call.finished:
                    call.overrunning = True
                    metrics.AGENT_CALLS_OVERRUNNING.inc()
            if call.overrunning:
                log.warning(
                    "an episode ended while its agent's plain method still runs; its thread goes on until it returns",
                    extra={"method": _name(function), "runningS": round(time.monotonic() - call.started, 3)},
                )
            raise
        return value

    def close(self) -> None:
        """The thread goes back to the kept ones after the calls already given to it (one that overruns
        its episode holds it until it returns); a later call takes another thread."""
        if self._worker is not None:
            self._worker.calls.put(None)
            self._worker = None


class _Worker:
    """A daemon thread that runs the calls put to it, one at a time, until a ``None`` hands it back."""

    idle: ClassVar[list[_Worker]] = []
    idle_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        threading.Thread(target=self._work, name="molt-agent", daemon=True).start()

    @classmethod
    def take(cls) -> _Worker:
        with cls.idle_lock:
            if cls.idle:
                return cls.idle.pop()
        return cls()

    def _work(self) -> None:
        while True:
            call = self.calls.get()
            if call is not None:
                _run(call)
                continue
            with self.idle_lock:  # its episode closed it, and every call it was given has returned
                if len(self.idle) >= IDLE_THREADS_KEPT:
                    return
                self.idle.append(self)


def _run(call: _Call) -> None:
    with call.lock:
        if call.future.cancelled():  # given up before it started: never run
            return
        call.started = time.monotonic()
    outcome = _outcome(call.function, call.args)
    with call.lock:
        call.finished = True
        overran = call.overrunning
    if overran:
        metrics.AGENT_CALLS_OVERRUNNING.dec()
        log.warning(
            "an agent's plain method returned after its episode ended",
            extra={"method": _name(call.function), "runningS": round(time.monotonic() - call.started, 3)},
        )
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for it
        call.loop.call_soon_threadsafe(_settle, call.future, outcome)


def _outcome(function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, exception)`` of a plain call, as an episode can take it."""
    try:
        result = function(*args)
    except StopIteration:  # an asyncio future refuses it (the call would never settle)
        return False, RuntimeError(f"the agent's {_name(function)} raised StopIteration")
    except Exception as exc:
        return False, exc
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: the episode fails, not the pool
        return False, RuntimeError(f"the agent's {_name(function)} raised {exc!r}")
    if inspect.isawaitable(result):  # on the loop it would run with the sync clients a plain method gets
        if inspect.iscoroutine(result):
            result.close()
        return False, TypeError(
            f"the agent's {_name(function)} is a plain method but returned an awaitable: declare it `async def`"
        )
    return True, result


def _settle(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if future.done():
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", repr(function))


_left_running: set[asyncio.Task[Any]] = set()  # tasks given up while they ignore cancellation (kept referenced)


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """Awaits ``awaitable`` for at most ``timeout_s`` (TimeoutError after it), and never longer.

    Unlike ``asyncio.wait_for``, a task that ignores its cancellation is not waited for: it gets
    ``CANCEL_GRACE_S`` to unwind, then it is left running (counted and logged) and the caller goes on.
    The same holds when the caller is cancelled.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await _give_up(task)
        raise
    if not done:
        await _give_up(task)
        raise TimeoutError
    return task.result()


async def _give_up(task: asyncio.Task[Any]) -> None:
    """Cancels ``task`` and waits ``CANCEL_GRACE_S`` for it to end; the grace runs out in full even when
    the caller is cancelled again meanwhile (it then stops waiting)."""
    task.cancel()
    grace = asyncio.ensure_future(asyncio.wait({task}, timeout=CANCEL_GRACE_S))
    grace.add_done_callback(lambda _: _after_grace(task))
    await asyncio.shield(grace)


def _after_grace(task: asyncio.Task[Any]) -> None:
    if not task.done():
        _leave_running(task)
    elif not task.cancelled():
        task.exception()  # retrieved: past its timeout, its outcome is not used


def _leave_running(task: asyncio.Task[Any]) -> None:
    metrics.AGENT_CALLS_OVERRUNNING.inc()
    _left_running.add(task)
    started = time.monotonic()
    log.warning("an episode ignored its cancellation for %.1f s; it is left running", CANCEL_GRACE_S)

    def finished(task: asyncio.Task[Any]) -> None:
        _left_running.discard(task)
        metrics.AGENT_CALLS_OVERRUNNING.dec()
        if not task.cancelled():
            task.exception()  # retrieved: it was counted when given up
        log.warning(
            "an episode left running after its cancellation ended",
            extra={"runningS": round(time.monotonic() - started + CANCEL_GRACE_S, 3)},
        )

    task.add_done_callback(finished)
