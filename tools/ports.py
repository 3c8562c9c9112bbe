"""TCP ports for the servers kvpack's tools and tests start on 127.0.0.1, picked where nothing
else on the host is handed one.

A port taken by binding port 0 and closing the socket comes from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), from which every other ``bind(0)`` on the host
(vLLM's distributed init, gloo, a metrics server) and every outgoing connection take theirs too,
so on a busy host another process can hold it by the time the server binds it
(``Address already in use``). The ports picked here are below that range: the kernel gives them to
no one unasked, so only another explicit pick of the same port can race, one chance in
some ten thousand per pair of picks in flight at once.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
LOWEST_PICKED = 10000
"""The lowest port picked: well above the ports of common services (below 10000)."""

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
MIN_PICKABLE = 1000
"""Fewest ports below the ephemeral range for picking there; fewer: the kernel's own pick."""

TRIES = 200


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(first: int, count: int) -> bool:
    """Whether ports first..first+count-1 can each be bound on 127.0.0.1 now (a wildcard listener
    on one of them refuses that bind too)."""
    socks: list[socket.socket] = []
    try:
        for port in range(first, first + count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((HOST, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 now, below the kernel's
    ephemeral range (when at least `MIN_PICKABLE` ports lie between `LOWEST_PICKED` and it; else a
    port the kernel picks, for `count` 1). Raises RuntimeError when no such ports are found."""
    high = _ephemeral_low()
    if high - LOWEST_PICKED < MIN_PICKABLE:
        if count != 1:
            raise RuntimeError(f"no room below the ephemeral range (from {high}) for {count} ports")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            return int(s.getsockname()[1])
    pick = random.SystemRandom()
    for _ in range(TRIES):
        first = pick.randrange(LOWEST_PICKED, high - count + 1)
        if _free(first, count):
            return first
    raise RuntimeError(f"no {count} consecutive free ports in {LOWEST_PICKED}..{high - 1}")


def free_port() -> int:
    """One TCP port free on 127.0.0.1 now, picked as `free_ports` says."""
    return free_ports(1)
