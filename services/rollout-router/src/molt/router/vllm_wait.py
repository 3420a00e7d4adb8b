"""How vLLM's own processes wait for each other: spin (vLLM's default) or sleep briefly.

vLLM's engine core and its worker hand every step over through a shared-memory
queue. A reader that has read within the last second does not block on it: it
spins, calling ``sched_yield`` until the next message (``SpinCondition.wait``).
So while the worker computes a step, the engine core spins on the result, and
while the engine core schedules, the worker spins on the next step: two
processes keep two CPUs busy. On a GPU machine that costs idle host cores. On a
CPU machine it takes the cores the model runs on: the spinning engine core
competes with its own worker, with the engine actor's output processing, the
router, and the learner training beside it (on 2 vCPUs it held other processes
off the CPUs for seconds; bench/RESULTS.md).

``sleep`` replaces the spin with sleeps of ``SLEEP_S`` (a sleeping reader wakes
within a fraction of a millisecond of the message; CPU steps take milliseconds).
After a second without messages vLLM's own idle wait (a blocking poll) takes
over as before.

This is a vLLM *general plugin* (entry point ``vllm.general_plugins``), which vLLM
loads in every process it starts: the engine core and each worker. It acts only
in processes whose environment has ``MOLT_VLLM_WAIT=sleep``, which the engine
actor sets before it builds its engine (``[router.engine] wait``); any other
vLLM in the same environment (a benchmark's raw engine) keeps vLLM's behaviour.
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
