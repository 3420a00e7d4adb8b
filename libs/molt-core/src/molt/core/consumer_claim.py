"""The claim on a consumer name of the trajectory queue: one live reader per name (docs/queue.md).

``molt:<run>:consumer:<name>`` holds a random token of the reader that has the name, with a TTL;
``...:taker``, without one, the token of the reader that took it last. A reader takes the name as it
starts (``take``: waiting, bounded, for a dead holder's claim to lapse), renews it from a thread of
its own and from every guarded call, and gives it up on ``release``. The queue's acknowledgements,
skips and dead letters are Lua scripts that begin with ``GUARD`` (``queue_settle.py``), run through
``run``: once another reader has taken the name they change nothing and raise ``ConsumerNameTaken``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script

from molt.core.errors import ConsumerNameTaken

log = logging.getLogger(__name__)

# KEYS[1]: the claim, KEYS[2]: its taker; ARGV[1]: this reader's token, ARGV[2]: the TTL in ms.
# Held: the claim is this token, or it lapsed and no reader took the name since (the taker is still
# this token), as after a Redis outage or a renewal starved past the TTL: nobody else can have read or
# settled under the name then, so the claim is set again. Not held: return -1 before any write.
GUARD = """
local holder = redis.call('GET', KEYS[1])
if holder ~= ARGV[1] then
  if holder or redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
"""

# Same keys and arguments: 0 once taken, else the holder's claim's remaining milliseconds.
TAKE_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[1])
  return 0
end
return redis.call('PTTL', KEYS[1])
"""

# Deletes both keys if this token holds the claim: the next reader takes the name at once, and this one
# cannot take it back through GUARD's lapsed-claim branch.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1], KEYS[2]) end
return 0
"""


class ConsumerClaim:
    """This reader's claim on consumer name ``name`` of run ``run_id``, lapsing ``ttl_s`` seconds after
    its last renewal."""

    def __init__(self, client: redis.Redis, run_id: str, name: str, ttl_s: float) -> None:
        self.client = client
        key = f"molt:{run_id}:consumer:{name}"
        self.keys = [key, f"{key}:taker"]
        self.name = name
        self.ttl_s = ttl_s
        self.token = uuid.uuid4().hex
        self._take = client.register_script(TAKE_SCRIPT)
        self._renew = client.register_script(GUARD + "return 1")
        self._release = client.register_script(RELEASE_SCRIPT)
        self._released = threading.Event()
        # The thread holds the claim weakly: a reader dropped without ``release`` stops being renewed once it
        # is collected, rather than renewing (and retrying against a Redis that went away) until exit.
        self._renewer = threading.Thread(
            target=_renew_until_released, args=(weakref.ref(self), self._released), name=f"claim-{name}", daemon=True
        )

    def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """``script`` (one beginning with ``GUARD``) with its own ``keys`` and ``args`` after the claim's; raises
        ``ConsumerNameTaken``, having changed nothing, when another reader holds the name."""
        reply = script(keys=[*self.keys, *keys], args=[self.token, int(self.ttl_s * 1000), *args])
        if reply == -1:
            raise ConsumerNameTaken(
                f"this reader no longer holds consumer name {self.name!r}: another reader took it after its "
                f"claim lapsed (this process stalled for over {self.ttl_s:g} s, or was closed); nothing was "
                "acknowledged",
                metadata={"consumer": self.name},
            )
        return reply

    def confirm(self) -> None:
        """Renews the claim; raises ``ConsumerNameTaken`` when another reader holds the name."""
        self.run(self._renew, [], [])

    def take(self) -> None:
        """Takes the name, then keeps it renewed. A holder that died lets its claim lapse within the TTL,
        and one alive renews it every third of the TTL: so a claim still held after the TTL and a quarter
        belongs to a live reader, and this one raises ``ConsumerNameTaken`` instead of waiting on."""
        bound = self.ttl_s * 1.25
        deadline = time.monotonic() + bound
        waited = False
        while (left_ms := int(self._take(keys=self.keys, args=[self.token, int(self.ttl_s * 1000)]))) != 0:
            now = time.monotonic()
            if now >= deadline:
                raise ConsumerNameTaken(
                    f"consumer name {self.name!r} is held by another live reader: it kept renewing its claim "
                    f"for {bound:g} s; stop that process (another learner of this run?) before starting this one",
                    metadata={"consumer": self.name},
                )
            if not waited:
                log.warning(
                    "consumer name %r is held by another reader; waiting up to %.0f s for its claim to lapse, "
                    "as a dead holder's does within %g s",
                    self.name,
                    bound,
                    self.ttl_s,
                )
                waited = True
            time.sleep(min(max(left_ms, 10) / 1000, deadline - now))
        if waited:
            log.warning("took over consumer name %r: its previous holder's claim lapsed", self.name)
        self._renewer.start()

    def release(self) -> None:
        """Stops renewing and gives the name up if this reader holds it; one that Redis cannot be told
        of is left to lapse."""
        self._released.set()
        if self._renewer.is_alive():
            self._renewer.join()
        try:
            self._release(keys=self.keys, args=[self.token])
        except redis.RedisError as exc:
            log.warning("could not release consumer name %r (its claim lapses): %s", self.name, exc)


def _renew_until_released(ref: weakref.ref[ConsumerClaim], released: threading.Event) -> None:
    """Renews every third of the TTL. A learner may spend minutes in one step, checkpoint or refit
    without a queue call, so the calls alone would let a live reader's claim lapse. A frozen
    (SIGSTOPped) or killed process stops this thread too, which is what lets its claim lapse. The claim
    is held only while it is renewed, not across the waits: a dropped reader is collected meanwhile."""
    claim = ref()
    every = claim.ttl_s / 3 if claim is not None else 0.0
    del claim
    while not released.wait(every):
        claim = ref()
        if claim is None:
            return
        try:
            claim.confirm()
        except ConsumerNameTaken as exc:
            log.warning("%s; the next queue call of this reader fails", exc.message)
            return
        except redis.RedisError as exc:  # an outage, waited out by the queue's callers: try again
            log.debug("could not renew the claim on consumer name %r: %s", claim.name, exc)
        finally:
            del claim
