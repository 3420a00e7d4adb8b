"""Where every trajectory of a finished run went, read from its checkpoints and its Redis's append-only
file (the fault tests and ``bench/faults.py``).

- produced: every trajectory id the queue ever accepted;
- trained: the final checkpoint's consumed ids;
- dropped: trajectories dropped with a reason, less the duplicates (a second copy refused is not a
  trajectory of its own): those of groups skipped whole as the queue's Redis counted them (a skip is
  settled at once, so a learner that died after it and restarted from an older checkpoint does not
  have it), and the final checkpoint's other drops;
- remaining: trajectories still in the stream; dead: those in the dead letters (and dead_undecodable,
  letters whose payload cannot be read whole);
- lost: produced ids in none of those (excess: the opposite, more counted than produced);
- unknown: trained or remaining ids the queue never accepted;
- twice: ids two retained checkpoints record as trained at different steps, or in the stream twice.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from google.protobuf.message import DecodeError

from molt.core.processes import RedisServer
from molt.v1 import common_pb2


def account(run_dir: Path, run_id: str) -> dict[str, int]:
    """The counts above, for the run in ``run_dir`` (its redis-server must be stopped: this starts one on
    the same data, without the run's password, to read it)."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    states = [json.loads((c / "state.json").read_text()) for c in checkpoints]
    final = states[-1]
    trained = set(final["consumed"])
    dropped: dict[str, int] = final["dropped"]
    twice = {tid for a, b in itertools.pairwise(states) for tid, s in a["consumed"].items()
             if tid in b["consumed"] and b["consumed"][tid] != s}  # fmt: skip
    server = RedisServer(run_dir / "redis", appendonly=True)
    server.start()
    try:
        client = server.client()
        stream = f"molt:{run_id}:trajectories"
        remaining = [
            t.trajectory_id
            for _, fields in client.xrange(stream)
            for t in common_pb2.TrajectoryGroup.FromString(fields[b"group"]).trajectories
        ]
        produced = {m.decode() for m in client.smembers(f"molt:{run_id}:trajectory-ids")}
        dead, undecodable = _dead_letters(client.xrange(f"{stream}:dead"))
        skipped = {k.decode(): int(v) for k, v in client.hgetall(f"molt:{run_id}:trajectories-skipped").items()}
    finally:
        server.stop()
    # A refused step's trajectories are dead letters (settled at once, as skips are): counted there.
    in_steps = {r: n - final.get("skipped", {}).get(r, 0) for r, n in dropped.items() if r != "refused_step"}
    duplicates = in_steps.get("duplicate", 0) + skipped.get("duplicate", 0)
    dropped_total = sum(in_steps.values()) + sum(skipped.values()) - duplicates
    counted = len(trained) + len(set(remaining)) + dropped_total + dead
    return {
        "produced": len(produced),
        "trained": len(trained),
        "dropped": dropped_total,
        "duplicates_refused": duplicates,
        "remaining": len(remaining),
        "dead": dead,
        "dead_undecodable": undecodable,
        "lost": max(0, len(produced) - counted),
        "excess": max(0, counted - len(produced)),  # counted twice somewhere: as wrong as lost
        "unknown": len((trained | set(remaining)) - produced),
        "twice": len(twice) + (len(remaining) - len(set(remaining))),
        "steps": int(final["step"]),
    }


def _dead_letters(letters: list[tuple[bytes, dict[bytes, bytes]]]) -> tuple[int, int]:
    """Trajectories in the dead letters whose payload was kept whole, and letters that cannot say (a
    payload that never parsed, or one cut at ``DEAD_PAYLOAD_BYTES``)."""
    trajectories = undecodable = 0
    for _, fields in letters:
        try:
            if int(fields[b"bytes"]) != len(fields[b"group"]):
                raise DecodeError("cut")
            trajectories += len(common_pb2.TrajectoryGroup.FromString(fields[b"group"]).trajectories)
        except (DecodeError, KeyError, ValueError):
            undecodable += 1
    return trajectories, undecodable
