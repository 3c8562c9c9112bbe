"""`kvpack proxy`: a client that hangs up mid-request leaves no traceback in the log.

A readiness probe or a benchmark client that stops resets its connection; the
proxy printed socketserver's "Exception occurred during processing of request"
with a ConnectionResetError traceback for each. The proxy runs as a user starts
it (`python -m kvpack.cli proxy`), on 127.0.0.1, stopped with Ctrl-C (SIGINT).
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import time

from kvpack.tools.ports import free_port


def _reset(port: int, first_bytes: bytes) -> None:
    """Connect, send `first_bytes`, then close with RST (SO_LINGER 0)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if first_bytes:
            s.sendall(first_bytes)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_clients_that_hang_up_leave_no_traceback() -> None:
    port, dead = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpack.cli",
            "proxy",
            "--prefill",
            f"http://127.0.0.1:{dead}",
            "--decode",
            f"http://127.0.0.1:{dead}",
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.1)
        for first in (
            b"",
            b"GET /health HTTP/1.1\r\n",
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{",
        ):
            _reset(port, first)
        with socket.create_connection(
            ("127.0.0.1", port), timeout=5
        ) as s:  # still serving: an upstream error, answered
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.") and b" 502 " in reply.split(b"\r\n", 1)[0], reply[:200]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert "Traceback" not in err and "Exception occurred" not in err, err[-3000:]
