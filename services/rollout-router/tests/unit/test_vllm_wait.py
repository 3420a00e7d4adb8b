"""The vLLM plugin that makes vLLM's shared-memory queue readers sleep instead of spin.

Runs a real vLLM ``MessageQueue`` (the queue between vLLM's engine core and its
workers) with a reader thread in this process.
"""

from __future__ import annotations

import threading
import time
from importlib.metadata import entry_points
from typing import Any

import pytest
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition

from molt.router import vllm_wait

WAIT_S = 0.5


@pytest.fixture
def restore_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts vLLM's own ``SpinCondition.wait`` back after the test."""
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)


def read_after_a_pause() -> tuple[list[Any], float]:
    """A reader takes one message, then waits ``WAIT_S`` for the next (inside vLLM's one-second busy
    window); returns what it read and the CPU seconds its thread used while waiting."""
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    got: list[Any] = []
    cpu: list[float] = []

    def reader_side() -> None:
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader.wait_until_ready()
        got.append(reader.dequeue(timeout=10))
        started = time.thread_time()
        got.append(reader.dequeue(timeout=10))
        cpu.append(time.thread_time() - started)

    thread = threading.Thread(target=reader_side)
    thread.start()
    writer.wait_until_ready()
    writer.enqueue({"step": 1})
    time.sleep(WAIT_S)
    writer.enqueue({"step": 2})
    thread.join(timeout=30)
    assert not thread.is_alive()
    return got, cpu[0]


def test_the_plugin_is_registered_with_vllm() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("molt_wait") == "molt.router.vllm_wait:register"


def test_without_the_setting_vllm_keeps_spinning(restore_vllm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_wait.ENV, raising=False)
    spin_wait = SpinCondition.wait
    vllm_wait.register()
    assert SpinCondition.wait is spin_wait
    monkeypatch.setenv(vllm_wait.ENV, "spin")
    vllm_wait.register()
    assert SpinCondition.wait is spin_wait


def test_sleeping_reader_gets_every_message_and_leaves_the_cpu(
    restore_vllm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_wait.ENV, "sleep")
    vllm_wait.register()
    vllm_wait.register()  # idempotent: vLLM may load plugins again in one process
    assert getattr(SpinCondition.wait, "molt_sleeps", False)
    got, cpu_s = read_after_a_pause()
    assert got == [{"step": 1}, {"step": 2}]
    # vLLM's spin would burn most of the wait (sched_yield on a free CPU); sleeping uses a small part.
    assert cpu_s < 0.3 * WAIT_S, f"the reader used {cpu_s:.3f} s of CPU while waiting {WAIT_S} s"


def test_an_unknown_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_wait.ENV, "nap")
    with pytest.raises(ValueError, match="'spin' or 'sleep'"):
        vllm_wait.register()
