"""``free_port``: bindable, and outside the range outgoing connections take their ports from."""

from __future__ import annotations

import random
import socket

from molt.core.ports import PICKED_PORTS_FROM, ephemeral_ports, free_port


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low = ephemeral_ports()[0]
    ports = [free_port() for _ in range(50)]
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    if low - PICKED_PORTS_FROM >= 1000:  # this machine leaves room below its ephemeral range
        assert all(PICKED_PORTS_FROM <= port < low for port in ports)
    assert len(set(ports)) > 1


def test_a_taken_port_is_not_handed_out() -> None:
    """The port the next random draw names is held by a listening socket: free_port skips it."""
    random.seed(7)
    first = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        random.seed(7)  # the same draws again: the first names the held port
        assert free_port() != first
