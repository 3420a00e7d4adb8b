"""A loopback TCP proxy that the fault tests and ``bench/faults.py`` place between two services and cut.

``cut()`` is a partition as a peer sees one: connections through the proxy stop carrying bytes (they
are dropped without a word to either side: no reset, no FIN), and new ones are accepted and then
held, silent. ``heal()`` lets new connections through again and closes the held ones. gRPC's
keep-alive pings are what tell the client its peer is gone (``molt.core.serve.KEEPALIVE``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class PartitionProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>`` in a thread of its own."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.cut_now = False
        self.held: list[asyncio.StreamWriter] = []  # connections accepted while cut, or cut in flight
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="partition-proxy", daemon=True)

    def start(self) -> int:
        """Starts serving; returns the proxy's port."""
        self.thread.start()
        self.ready.wait(10)
        return self.port

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_now:
            self.held.append(writer)  # accepted, never answered: a black hole
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()  # the target is down: as the target itself would, refuse
            return
        pair = (writer, up_writer)
        await asyncio.gather(self._pump(reader, up_writer, pair), self._pump(up_reader, writer, pair))

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, pair: Any) -> None:
        try:
            while data := await source.read(65536):
                if self.cut_now:  # the partition swallows what is in flight, and the connection goes quiet
                    self.held.extend(pair)
                    await asyncio.Event().wait()
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not self.cut_now:
                sink.close()

    def cut(self) -> None:
        self.loop.call_soon_threadsafe(setattr, self, "cut_now", True)

    def heal(self) -> None:
        def heal() -> None:
            self.cut_now = False
            for writer in self.held:
                writer.close()
            self.held.clear()

        self.loop.call_soon_threadsafe(heal)
