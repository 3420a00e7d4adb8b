"""The data channel between the router and an engine actor: what travels on it, how, and the router's end.

A TCP connection per engine, opened by the router to the address the actor
gives over Ray (``EngineActor.channel``), with a secret the router sends first.
Frames are length-prefixed pickles, each carrying everything one side gathered
in one pass of its event loop, in order (so an abort never overtakes its
request): submissions and aborts go to the engine, chunks and failures come
back. ``EngineLinks`` is the router's end; the engine's end is in
``molt.router.engine_actor``, where it hands operations to the actor's requests.
Ray carries only the control calls (start, pause, resume, probe, the refit).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Literal

from molt.core.errors import Unavailable
from molt.router import metrics
from molt.router.sampling import Sampling

log = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30
SECRET_TIMEOUT_S = 10.0  # a connection must send the secret within this


@dataclass(frozen=True)
class Submission:
    """A request for the engine (with ``final_only``, each sample comes out once, finished)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    final_only: bool = False


@dataclass(frozen=True)
class Chunk:
    """Tokens one sample gained since its previous chunk, all sampled under ``policy_version``."""

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    top_logprobs: list[tuple[list[int], list[float]]]
    finish_reason: str | None  # "stop" | "length" | "abort" on the sample's last chunk
    stop_reason: str
    routing: bytes = b""  # on the last chunk with routing capture: a serialized molt.v1.ExpertRouting


@dataclass(frozen=True)
class Failure:
    """A request the engine could not serve (``refused``: would not start); ends its stream with this message."""

    message: str
    refused: bool = False


Output = tuple[str, Chunk | Failure]  # (request_id, what it produced)
Operation = tuple[Literal["submit"], Submission] | tuple[Literal["abort"], str]  # router -> engine, in order


@dataclass(frozen=True)
class ChannelAddress:
    """Where an engine's data channel listens, and the secret a connection must send first."""

    host: str
    port: int
    token: bytes


def keep_alive(writer: asyncio.StreamWriter, idle_s: int = 10, interval_s: int = 5, probes: int = 3) -> None:
    """TCP keep-alive on a data channel, both ends: a peer whose node vanished without closing the
    connection is noticed after ``idle_s + interval_s * probes`` seconds of silence (Linux options
    where present)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", probes)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The next frame's payload; raises ``asyncio.IncompleteReadError`` at the end of the stream."""
    (size,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    if size > max_bytes:
        raise ConnectionError(f"a frame of {size} bytes is over the limit of {max_bytes}")
    return await reader.readexactly(size)


class EngineLinks:
    """The router's ends of its engines' data channels, and the queue of each submission in flight.

    An engine whose channel closed (it died, or keep-alive gave up on it) is dropped, and every
    submission it held gets a ``Failure``."""

    def __init__(self) -> None:
        self.writers: dict[str, asyncio.StreamWriter] = {}  # per live engine
        self.outgoing: dict[str, list[Operation]] = {}  # per engine: what this pass of the loop gathered
        self.queues: dict[str, tuple[str, asyncio.Queue[Chunk | Failure]]] = {}  # by key: (engine, its outputs)
        self.pumps: list[asyncio.Task[None]] = []

    async def connect(self, engine_id: str, address: ChannelAddress) -> None:
        """Opens ``engine_id``'s channel, sends the secret and starts moving its outputs to their queues."""
        try:
            reader, writer = await asyncio.open_connection(address.host, address.port)
        except OSError as exc:
            raise Unavailable(
                f"cannot reach the data channel of {engine_id} at {address.host}:{address.port}: {exc}",
                reason="ENGINE_UNAVAILABLE",
            ) from exc
        keep_alive(writer)
        writer.write(frame(address.token))
        self.writers[engine_id] = writer
        self.pumps.append(asyncio.create_task(self._pump(engine_id, reader)))

    def is_live(self, engine_id: str) -> bool:
        return engine_id in self.writers

    def open_queue(self, key: str, engine_id: str) -> asyncio.Queue[Chunk | Failure]:
        """The queue the outputs of submission ``key`` (sent to ``engine_id``) arrive in."""
        queue: asyncio.Queue[Chunk | Failure] = asyncio.Queue()
        self.queues[key] = (engine_id, queue)
        return queue

    def close_queue(self, key: str) -> None:
        del self.queues[key]

    def send(self, engine_id: str, operation: Operation) -> None:
        """Queues a submission or an abort for ``engine_id``; what this pass of the event loop gathers
        goes out together, in order, once the pass is over."""
        operations = self.outgoing.get(engine_id)
        if operations is None:
            operations = self.outgoing[engine_id] = []
            asyncio.get_running_loop().call_soon(self._flush, engine_id)
        operations.append(operation)

    def _flush(self, engine_id: str) -> None:
        operations = self.outgoing.pop(engine_id)
        writer = self.writers.get(engine_id)
        if writer is None or writer.is_closing():
            self._fail_submissions(operations, Failure(f"{engine_id} is gone"))
            return
        try:
            payload = pickle.dumps(operations, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # cannot happen with molt's own dataclasses; fail the callers, never lose them
            log.exception("cannot encode a frame for the engine", extra={"engine": engine_id})
            self._fail_submissions(operations, Failure(f"the router could not send the request: {exc!r}"))
            return
        submissions = sum(operation[0] == "submit" for operation in operations)
        if submissions:
            metrics.SUBMIT_BATCH.observe(submissions)
        writer.write(frame(payload))

    def _fail_submissions(self, operations: list[Operation], failure: Failure) -> None:
        for operation in operations:
            if operation[0] == "submit" and (entry := self.queues.get(operation[1].request_id)) is not None:
                entry[1].put_nowait(failure)

    async def _pump(self, engine_id: str, reader: asyncio.StreamReader) -> None:
        """Moves an engine's outputs to the requests' queues until its channel closes (the engine died)."""
        try:
            while True:
                outputs: list[Output] = pickle.loads(await read_frame(reader))
                for key, item in outputs:
                    entry = self.queues.get(key)
                    if entry is not None:  # else the caller has left; its abort is on the way
                        entry[1].put_nowait(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # closed (the engine died), keep-alive timed out, or a frame we cannot read
            log.error("engine died: its data channel closed", extra={"engine": engine_id, "error": repr(exc)})
            if (writer := self.writers.pop(engine_id, None)) is not None:
                writer.close()
            metrics.ENGINES_UP.dec()
            for owner, queue in self.queues.values():
                if owner == engine_id:
                    queue.put_nowait(Failure(f"{engine_id} died"))

    def close(self) -> None:
        for task in self.pumps:
            task.cancel()
        for writer in self.writers.values():
            writer.close()
