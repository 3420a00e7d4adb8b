"""Event-loop stall watch: logs when an asyncio loop has not run for a while, with what it was doing.

A heartbeat task on the loop stamps the time every ``beat_s``; a daemon thread checks the stamp.
When the loop has been silent longer than ``threshold_s`` the thread logs one warning with the
loop thread's current Python stack (a blocking call in a handler, an ``Env`` that does I/O
without awaiting, a large import), and when the loop runs again, how long the stall lasted. It
also notes when the watch thread itself woke late: then the whole process was held up (CPU
starvation, memory pressure, a C extension holding the GIL), not the loop alone. Every service
host runs one, and so does the router's engine actor.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from prometheus_client import Counter

log = logging.getLogger(__name__)

STALLS = Counter("molt_event_loop_stalls", "Times the service's asyncio event loop was silent past the threshold")


class StallWatch:
    def __init__(self, name: str, threshold_s: float = 1.0, beat_s: float = 0.05) -> None:
        self.name = name
        self.threshold_s = threshold_s
        self.beat_s = beat_s
        self.beat = time.monotonic()
        self.loop_thread = 0
        self.stalls = 0
        self.halted = threading.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts watching the running loop (call from inside it)."""
        self.loop_thread = threading.get_ident()
        self.beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat(), name=f"stallwatch-{self.name}")
        threading.Thread(target=self._watch, name=f"stallwatch-{self.name}", daemon=True).start()

    def stop(self) -> None:
        self.halted.set()
        if self._task is not None:
            self._task.cancel()

    async def _heartbeat(self) -> None:
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(self.beat_s)

    def _watch(self) -> None:
        period = self.beat_s * 2
        last_wake = time.monotonic()
        stalled_since: float | None = None
        while not self.halted.wait(period):
            now = time.monotonic()
            if now - last_wake - period > self.threshold_s:
                log.warning(
                    "%s: the stall watch itself woke %.2f s late: the whole process was held up",
                    self.name,
                    now - last_wake - period,
                    extra={"late_s": round(now - last_wake - period, 3)},
                )
            last_wake = now
            beat = self.beat
            if stalled_since is None and now - beat > self.threshold_s:
                stalled_since = beat
                self.stalls += 1
                STALLS.inc()
                frame = sys._current_frames().get(self.loop_thread)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
                log.warning(
                    "%s: event loop silent for %.2f s, in:\n%s",
                    self.name,
                    now - beat,
                    stack.rstrip(),
                    extra={"silent_s": round(now - beat, 3)},
                )
            elif stalled_since is not None and beat > stalled_since:
                log.warning(
                    "%s: event loop ran again after %.2f s",
                    self.name,
                    beat - stalled_since,
                    extra={"stall_s": round(beat - stalled_since, 3)},
                )
                stalled_since = None
