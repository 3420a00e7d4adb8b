"""How vLLM's own processes wait for each other: spin (vLLM's default) or sleep briefly.

vLLM's engine core and worker hand every step over through a shared-memory queue, and a reader
that read within the last second spins on it (``sched_yield``). On a CPU machine the spinning
processes take the cores the model, the router and the learner run on; ``sleep`` replaces the
spin with sleeps of ``SLEEP_S``, and after a second without messages vLLM's own blocking poll
takes over as before (docs/cpu.md).

A vLLM *general plugin* (entry point ``vllm.general_plugins``), loaded in every process vLLM
starts; it acts only where ``MOLT_VLLM_WAIT=sleep``, which the engine actor sets
(``[router.engine] wait``), so any other vLLM in the environment keeps vLLM's behaviour.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger("vllm.plugins.molt_wait")  # under vLLM's logger: its processes print that one

ENV = "MOLT_VLLM_WAIT"
SLEEP_S = 50e-6


def register() -> None:
    """vLLM plugin entry point: replaces the spin with short sleeps where ``MOLT_VLLM_WAIT=sleep``."""
    mode = os.environ.get(ENV, "spin")
    if mode == "spin":
        return
    if mode != "sleep":
        raise ValueError(f"{ENV} must be 'spin' or 'sleep', not {mode!r}")
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition.wait, "molt_sleeps", False):
        return  # vLLM loads plugins once per process, but a test may call this again
    spin_wait = condition.wait
    names = set(condition.__init__.__code__.co_names) | set(spin_wait.__code__.co_names)
    if not {"last_read", "busy_loop_s", "sched_yield"} <= names:
        log.warning("vLLM's SpinCondition changed shape; its waits keep spinning (%s ignored)", ENV)
        return
    if os.environ.get("VLLM_USE_SPINLOOP_EXT", "0") == "1":
        log.warning("VLLM_USE_SPINLOOP_EXT=1: vLLM's readers spin in its extension first, which %s leaves alone", ENV)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(SLEEP_S)  # where vLLM would sched_yield and come straight back
        else:
            spin_wait(self, timeout_ms)  # idle for a second: vLLM's blocking poll

    wait.molt_sleeps = True  # type: ignore[attr-defined]
    condition.wait = wait  # type: ignore[method-assign]
    log.info("molt: vLLM's shared-memory queue readers sleep instead of spinning (%s=sleep)", ENV)
