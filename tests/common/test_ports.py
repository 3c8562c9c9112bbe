"""Ports for the servers the tools and tests start: below the kernel's ephemeral range, so no
``bind(0)`` or outgoing connection on the host takes one between the pick and the bind."""

from __future__ import annotations

import socket

from kvpack.tools import ports


def test_picked_ports_are_free_and_below_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    for count in (1, 16):
        first = ports.free_ports(count)
        assert ports.LOWEST_PICKED <= first and first + count <= low
        socks = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                socks.append(s)
                s.bind((ports.HOST, port))  # raises if taken
        finally:
            for s in socks:
                s.close()
