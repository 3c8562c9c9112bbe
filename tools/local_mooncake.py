"""Where the installed Mooncake package keeps its binaries, to start a local cluster.

Operator tools (``kvpack soak``, benchmarks) and the test fixtures start a
``mooncake_master`` and a ``mooncake_client`` segment holder on loopback; the
product never does (it only connects to a cluster)."""

from __future__ import annotations

from pathlib import Path


def mooncake_binaries() -> tuple[str, str] | None:
    """Paths of (mooncake_master, mooncake_client) shipped in the installed
    Mooncake package, or None when it is not installed or lacks them."""
    try:
        import mooncake
    except ImportError:
        return None
    pkg = Path(mooncake.__file__).parent
    master, client = pkg / "mooncake_master", pkg / "mooncake_client"
    if not (master.is_file() and client.is_file()):
        return None
    return str(master), str(client)
