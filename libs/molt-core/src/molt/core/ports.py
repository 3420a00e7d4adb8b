"""Free TCP ports for services molt starts itself (tests, ``molt up``, the learner's rendezvous).

A port is picked below the kernel's ephemeral range where there is room, so
that no outgoing connection takes it before the service binds it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PICKED_PORTS_FROM = 20000  # above Ray's default worker ports (10002-19999)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a service started a moment later.

    Picked at random between 20000 and the kernel's ephemeral range when that gap is wide: a port
    the kernel hands out (bind to port 0) lies inside the ephemeral range, from which every
    outgoing connection (Ray's, gRPC's, Redis clients') also takes its local port, so it could be
    taken again before the service binds it. Falls back to the kernel's choice otherwise."""
    below = ephemeral_ports()[0]
    for _ in range(64 if below - PICKED_PORTS_FROM >= 1000 else 0):
        port = random.randrange(PICKED_PORTS_FROM, below)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default if unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
